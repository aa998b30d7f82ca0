"""The run store's schema and its read side, shared by collectors (writers) and analysis (readers)."""
