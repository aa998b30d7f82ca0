"""The cancelwatch command line, on top of collectors (recording) and analysis (verdicts, reports)."""
