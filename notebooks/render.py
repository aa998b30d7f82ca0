"""Execute a notebook with papermill and render it to HTML without code cells, plotly embedded."""

from __future__ import annotations

import ast
import os
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import nbformat
import papermill as pm
from nbconvert import HTMLExporter

from cancelwatch.runstore.paths import working_root

ROOT = working_root()
NOTEBOOKS = Path(__file__).resolve().parent


class NotebookError(Exception):
    """A notebook that cannot be run or that ended in an error cell; the message is one line."""


def available() -> list[str]:
    return sorted(p.stem for p in NOTEBOOKS.glob("*.ipynb"))


def coerce(value: str):
    """'2048' -> 2048, '0.5' -> 0.5, anything else stays a string (papermill passes Python values)."""
    try:
        out = ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return value
    return out if isinstance(out, (int, float, bool, list, tuple)) else value


def error_line(nb) -> str | None:
    """The first error output of an executed notebook, as 'Name: message'."""
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error":
                return f"{out.get('ename')}: {out.get('evalue')}"
    return None


@contextmanager
def _kernel_stderr_aside():
    """The kernel is a child process that writes to the stderr it inherits: its shutdown chatter
    (tornado and zmq tracebacks, seen now and then) would otherwise land under the command's one-line
    error. While a notebook runs, fd 2 points at a scratch file, which is dropped afterwards."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as scratch:
        os.dup2(scratch.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)


def render(name: str, parameters: dict, html_out: Path, ipynb_out: Path | None = None, timeout_s: int = 600) -> Path:
    """Run notebooks/NAME.ipynb with `parameters` from the project root, write HTML (inputs hidden).

    The HTML is written even when a cell fails (it then shows the one error cell); NotebookError
    says what failed."""
    src = NOTEBOOKS / f"{name}.ipynb"
    if not src.is_file():
        raise NotebookError(f"no notebook {name!r}: choose one of {', '.join(available())}")
    out_nb = ipynb_out or html_out.with_suffix(".ipynb")
    failed = None
    try:
        with _kernel_stderr_aside():
            pm.execute_notebook(str(src), str(out_nb), parameters=parameters, cwd=str(ROOT), kernel_name="python3",
                                progress_bar=False, log_output=False, execution_timeout=timeout_s,
                                extra_arguments=["--IPKernelApp.log_level=ERROR"])
    except pm.PapermillExecutionError as exc:
        failed = f"{exc.ename}: {exc.evalue}"
    nb = nbformat.read(str(out_nb), as_version=4)
    # papermill's own banner cells repeat the error with a link; the error cell itself says it
    nb.cells = [c for c in nb.cells if "papermill-error-cell-tag" not in c.get("metadata", {}).get("tags", [])]
    exporter = HTMLExporter(template_name="lab", template_file=str(NOTEBOOKS / "offline.html.j2"),
                            exclude_input=True, exclude_input_prompt=True, exclude_output_prompt=True)
    body, _ = exporter.from_notebook_node(nb)
    html_out.write_text(body)
    if ipynb_out is None:
        out_nb.unlink(missing_ok=True)
    failed = failed or error_line(nb)
    if failed:
        raise NotebookError(failed)
    return html_out
