"""cancelwatch: does a cancelled LLM request really leave the engine? The command line lives here; the parts it
stands on are subpackages: cancelwatch.collectors (recording), cancelwatch.runstore (the run format),
cancelwatch.analysis (verdicts, reports), cancelwatch.dashboard and cancelwatch.notebooks (they read runs).

Installed, each part is a folder of this package and nothing else lands top-level. In the repository the parts
keep the top-level folders the design names, and this package's path reaches them there: one name,
`cancelwatch.analysis`, is one module either way (imported under two names, a module would load twice).
Nothing else is imported here: the engine's own venv runs the relay through this package."""

from pathlib import Path as _Path

PARTS = ("analysis", "collectors", "dashboard", "notebooks", "runstore")

_here = _Path(__file__).resolve().parent
if not (_here / "analysis").is_dir() and all((_here.parent / part / "__init__.py").is_file() for part in PARTS):
    __path__.append(str(_here.parent))  # noqa: F821 - a package's own __path__
