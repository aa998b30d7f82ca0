"""Which store a notebook opens: the one it was given, or, on a fresh clone where the default store does not
exist yet, the sample run shipped with cancelwatch (labelled SAMPLE), as the dashboard does."""

from __future__ import annotations

import os
from pathlib import Path

from cancelwatch.runstore.paths import DEFAULT_STORE

ROOT = Path(__file__).resolve().parents[1]
# the dashboard's sample run (dashboard/sample/sample.db, recorded by `make sample-run`)
SAMPLE_STORE = ROOT / "dashboard" / "sample" / "sample.db"
SAMPLE_NOTE = ("**SAMPLE RUN**: there is no run store at `{default}` yet, so this notebook shows the sample run "
               "shipped with cancelwatch (recorded from the embedded engine). Record your own with `make demo`, "
               "or set `store` in the parameters cell.")


def choose_store(store: str | os.PathLike) -> tuple[str, bool]:
    """(the store to read, whether it is the shipped sample).

    A store given by name is read as given (a missing one ends in the notebook's one-line error). The
    default, `runs/cancelwatch.db`, is looked up in the store folder ($CANCELWATCH_STORE_DIR, else the
    project's runs/: JupyterLab starts a notebook's kernel in notebooks/, the command line in the project
    root); when it is not there, the sample run stands in."""
    if str(store) != DEFAULT_STORE:
        return str(store), _is_sample(store)
    folder = Path(os.environ.get("CANCELWATCH_STORE_DIR") or ROOT / Path(DEFAULT_STORE).parent)
    default = folder / Path(DEFAULT_STORE).name
    if default.is_file():
        return str(default), False
    return str(SAMPLE_STORE), True


def _is_sample(store) -> bool:
    try:
        return Path(store).resolve() == SAMPLE_STORE.resolve()
    except OSError:
        return False


def sample_note(store: str | os.PathLike = DEFAULT_STORE) -> str:
    """The SAMPLE label a notebook shows on top of its output (Markdown)."""
    return SAMPLE_NOTE.format(default=store)
