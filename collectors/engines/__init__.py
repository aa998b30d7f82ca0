"""Engines cancelwatch starts itself: the embedded vLLM (CPU build), its tiny model, and the relay app for in-process cancels."""
