"""Where a store named from outside (a page, a URL) may be opened from: only inside the store folder."""

from __future__ import annotations

import os
from pathlib import Path

from cancelwatch.runstore.reader import StoreError

DEFAULT_STORE = "runs/cancelwatch.db"
# the folder the `cancelwatch` package is imported from: the repository, or site-packages once installed (this file
# is then cancelwatch/runstore/paths.py there)
IMPORT_ROOT = next((p for p in Path(__file__).resolve().parents if (p / "cancelwatch" / "__init__.py").is_file()),
                   Path(__file__).resolve().parents[1])


def working_root() -> Path:
    """Where a command the page or a notebook starts runs: the repository in a checkout, else the user's working
    directory (installed, the package's folders are no place for a run's files)."""
    return IMPORT_ROOT if (IMPORT_ROOT / "runstore" / "__init__.py").is_file() else Path.cwd()


def store_dir() -> Path:
    """The folder stores are read from: $CANCELWATCH_STORE_DIR, else ./runs."""
    return Path(os.environ.get("CANCELWATCH_STORE_DIR") or "runs").resolve()


def store_in_dir(name: str, root: Path | None = None) -> Path:
    """Resolve a store path given by a user; StoreError unless it is a .db file inside `root`.

    Relative paths are taken from the working directory and, failing that, from `root` itself
    ('cancelwatch.db' and 'runs/cancelwatch.db' both work). Symbolic links are resolved first, so
    a link inside the folder cannot point outside it.
    """
    root = (root or store_dir()).resolve()
    text = (name or "").strip()
    if not text or "\x00" in text:
        raise StoreError("give a store file inside the store folder, e.g. runs/cancelwatch.db")
    # the text comes from a URL: shown escaped when it holds a line break, so the refusal stays one line
    shown = text if text.isprintable() else repr(text)
    try:
        p = Path(text).expanduser()  # RuntimeError for '~nosuchuser/...'
        candidates = [p] if p.is_absolute() else [Path.cwd() / p, root / p]
        for c in candidates:
            resolved = c.resolve()
            if resolved.is_relative_to(root):
                if resolved.suffix != ".db":
                    raise StoreError(f"{shown} is not a .db run store: pick one of the .db files in {root}")
                resolved.is_file()  # OSError for a name too long: the page asks this next
                return resolved
    except (OSError, RuntimeError) as exc:  # both found by tests/test_fuzz.py, from a URL's ?store=
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc).rstrip(".")
        raise StoreError(f"{shown[:200]} cannot be a store file ({reason}): pick one of the .db files in {root}") \
            from None
    raise StoreError(f"{shown} is outside the store folder {root}: pick a store inside it "
                     "(or start the dashboard with CANCELWATCH_STORE_DIR set to another folder)")


def stores_in_dir(root: Path | None = None) -> list[Path]:
    root = (root or store_dir()).resolve()
    return sorted(p for p in root.glob("*.db") if p.is_file()) if root.is_dir() else []
