"""The dashboard's URL parameters (`?store=runs/cancelwatch.db&run=latest`), read in one place.

Anyone can type a URL: whatever it holds gives a selection (the store field's first text, the run
to show) and, for what was not taken, a one-line message; never an exception. The store text is
checked afterwards, like anything typed into the field, by runstore.paths.store_in_dir; a run id is
looked up in the store, never used as a path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from cancelwatch.runstore.paths import DEFAULT_STORE

# SQLite's INTEGER PRIMARY KEY is a signed 64-bit integer: a larger id cannot name a run
MAX_RUN_ID = 2**63 - 1


@dataclass(frozen=True)
class UrlSelection:
    store: str  # the store field's initial text (checked by store_in_dir like typed text)
    run: str  # "latest" or a run id in decimal digits
    message: str | None = None  # one line: what in the URL was not taken, and what is shown instead


def shown(value: str, limit: int = 80) -> str:
    """A URL value as it may appear in a one-line message: quoted, escaped, cut short."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def read_url_params(params: Mapping[str, str]) -> UrlSelection:
    """The selection a URL asks for. `params` is st.query_params (the last value of a repeated key)."""
    store = params.get("store", DEFAULT_STORE)
    run = params.get("run", "latest").strip()
    if run == "latest":
        return UrlSelection(store, "latest")
    # ASCII digits only: int() would also take '1_0', '٣' or '+1', which are not how ids are written
    # (and short: int() refuses more than 4300 digits with a ValueError)
    if run.isascii() and run.isdigit() and len(run) <= 19 and 1 <= int(run) <= MAX_RUN_ID:
        return UrlSelection(store, str(int(run)))
    return UrlSelection(store, "latest", f"run must be an integer id or 'latest', not {shown(run)}; "
                                         "showing the latest run")
