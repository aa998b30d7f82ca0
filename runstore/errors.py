"""The one error of the run store, for readers and writers alike."""


class StoreError(Exception):
    """A store or run that cannot be read or written; the message names the fix."""


class NoRunsYet(StoreError):
    """A store that holds no run yet: a new one, or one a recorder is creating this instant."""
