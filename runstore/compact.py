"""Copy a run store into a compact, self-contained file (no WAL): `python -m cancelwatch.runstore.compact SRC DEST`."""

from __future__ import annotations

import sqlite3
import sys
from pathlib import Path


def compact(src: Path, dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_suffix(".tmp")
    tmp.unlink(missing_ok=True)
    con = sqlite3.connect(f"file:{src.resolve()}?mode=ro", uri=True)
    try:
        con.execute("VACUUM INTO ?", (str(tmp),))
    finally:
        con.close()
    out = sqlite3.connect(tmp)
    out.execute("PRAGMA journal_mode=DELETE")
    out.close()
    tmp.replace(dest)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m cancelwatch.runstore.compact SRC.db DEST.db")
    compact(Path(sys.argv[1]), Path(sys.argv[2]))
