"""The one error of the run store, for readers and writers alike."""


class StoreError(Exception):
    """A store or run that cannot be read or written; the message names the fix."""
