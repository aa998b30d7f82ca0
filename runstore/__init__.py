"""The run format, shared by the collectors (writers) and analysis (readers), importing neither.

schema (the SQLite tables), records (what a run is made of, units in docstrings), event_kinds (the
kinds of event a run holds, and what each one's data holds), writer, reader,
errors, paths (the store-folder guard), compact (a store as one plain file). No SQL lives elsewhere.
"""
