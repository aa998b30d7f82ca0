"""Scripted cancels: the scenarios, the driver that runs them and keeps the ledger, the HTTP request modes, bounded load."""
