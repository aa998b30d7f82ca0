"""What each optional install adds, and the one line a command says where its extra is missing. The base
install records, samples, watches, reports, runs the canary and the matrix and imports from Prometheus; the
page, the notebooks and the Triton client are extras (pyproject.toml, [project.optional-dependencies])."""

from __future__ import annotations

from importlib.util import find_spec

# extra -> (the modules it brings that a command imports, what they are for). report --html asks for the
# [dashboard] extra's plotly and tsdownsample where it runs (cancelwatch/report_commands.py); the Triton family's
# extra is named in its own driver (collectors/cancels/triton_driver.py): a family's name is written in its modules
EXTRAS = {
    "notebooks": (("papermill", "nbconvert", "nbformat", "plotly", "tsdownsample"), "the notebooks"),
}


def lacking(extra: str, modules: tuple[str, ...], what: str) -> str | None:
    """The one line that says how to add `extra`, where one of its `modules` is not installed; None where all are."""
    absent = [m for m in modules if find_spec(m) is None]
    if not absent:
        return None
    return (f"{what} need {', '.join(absent)}, which this install lacks: pip install 'cancelwatch[{extra}]' "
            "(or 'cancelwatch[all]')")


def missing(extra: str) -> str | None:
    """lacking() for an extra of the table."""
    return lacking(extra, *EXTRAS[extra])
