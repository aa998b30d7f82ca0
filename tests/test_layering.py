"""The house rules, checked on every import of every module.

Imports point down: cancelwatch/dashboard/notebooks -> analysis -> runstore <- collectors, and no module
imports itself back through others (an import inside a function counts: it hides a circle, it does not
break it). `runstore`
(the run format) imports neither side; collectors never import analysis; nothing imports the CLI or
the dashboard. Inside collectors, the four rooms: sources, engines and cancels stand on their own,
recording puts sources and engines together; no engine launcher imports another (they share the
lifecycle). Hardware (pynvml) lives in one module, SQL in runstore.
"""

from __future__ import annotations

import ast
import json
import re
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import pytest

from cancelwatch import PARTS  # the parts installed under cancelwatch., top-level folders here

ROOT = Path(__file__).resolve().parents[1]
PROJECT = ("cancelwatch", "collectors", "runstore", "analysis", "dashboard", "notebooks", "bench")
ROOMS = ("sources", "recording", "cancels", "engines")
# above the rooms: the table of engine families, the one module of collectors that reads every room
ABOVE_ROOMS = ("families.py",)

# package (or collectors room) -> what it must not import (project packages and outside modules)
FORBIDDEN = {
    "runstore": {"collectors", "analysis", "cancelwatch", "dashboard", "notebooks", "bench", "httpx", "pynvml",
                 "psutil", "streamlit", "tritonclient"},
    "analysis": {"collectors", "cancelwatch", "dashboard", "notebooks", "bench", "streamlit", "httpx", "pynvml",
                 "psutil", "tritonclient"},
    "collectors": {"analysis", "cancelwatch", "dashboard", "notebooks", "bench", "streamlit"},
    "collectors.sources": {"collectors.recording", "collectors.cancels", "collectors.engines", "collectors.families"},
    "collectors.engines": {"collectors.sources", "collectors.recording", "collectors.cancels", "collectors.families"},
    "collectors.cancels": {"collectors.sources", "collectors.recording", "collectors.engines", "collectors.families"},
    "collectors.recording": {"collectors.cancels", "collectors.families"},
    # the dashboard and the notebooks read runs: they never sample or drive. The dashboard may start the
    # command line in a subprocess (dashboard/recording.py), which writes the run; it never imports it
    "dashboard": {"collectors", "cancelwatch", "notebooks", "httpx", "pynvml", "psutil", "tritonclient"},
    "notebooks": {"collectors", "cancelwatch", "dashboard", "httpx", "pynvml", "psutil", "tritonclient"},
}
# the engine launchers: each holds what is its family's alone; what they all need (state file, start, wait
# healthy, stop) is collectors/engines/lifecycle.py, so that a new family copies nothing and imports no other
LAUNCHERS = ("collectors.engines.vllm_server", "collectors.engines.triton_server")
SQL = re.compile(r"\b(INSERT\s+(OR\s+\w+\s+)?INTO|SELECT\s+.+?\s+FROM|UPDATE\s+\w+\s+SET|CREATE\s+(TABLE|INDEX)|"
                 r"DELETE\s+FROM|VACUUM)\b", re.IGNORECASE | re.DOTALL)


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def part_of(name: str) -> str:
    """A module's name in the house: `cancelwatch.analysis.x` (its name installed) is `analysis.x`, the folder
    it lives in here."""
    head, _, rest = name.partition(".")
    return rest if head == "cancelwatch" and rest.split(".")[0] in PARTS else name


# code in a string that runs elsewhere: a `python -c` script, a `-m` module, a command line
IN_TEXT = re.compile(rf"(?:^|[\s;,(\"'])(?:from\s+|import\s+(?:[\w.]+(?:\s+as\s+\w+)?\s*,\s*)*|-m\s+)"
                     rf"({'|'.join(PARTS)})(?=[.\s])", re.M)


def bare_parts(tree: ast.AST) -> set[str]:
    """The parts a tree imports by their bare name (`from analysis.x import y`), not as cancelwatch.analysis: in its
    import statements, in code it hands on as text (`python -c`, `-m analysis.x`), and as the module of a `-m`
    in a command line it builds (["-m", "collectors.x"])."""
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and not n.level and n.module}
    texts = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
    names |= {m.group(1) for text in texts for m in IN_TEXT.finditer(text)}
    for seq in (n for n in ast.walk(tree) if isinstance(n, (ast.List, ast.Tuple))):
        items = [e.value if isinstance(e, ast.Constant) else None for e in seq.elts]
        names |= {b for a, b in zip(items, items[1:]) if a == "-m" and isinstance(b, str)}
    return {name.split(".")[0] for name in names} & set(PARTS)


def imported_modules(path: Path, root: Path) -> set[str]:
    """Every module a file imports, relative imports resolved, `from a import b` counted as a and a.b, each by
    its name in the house (part_of)."""
    tree = ast.parse(path.read_text())
    package = module_name(path, root).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package[: len(package) - node.level + 1], *([base] if base else [])])
            names.add(base)
            names |= {f"{base}.{a.name}" for a in node.names}
    return {part_of(name) for name in names}


def bare_imports(root: Path) -> list[str]:
    """Every file (code, tests, benchmarks, the notebooks' cells) that imports a part by its bare name: installed,
    no such name exists, and beside cancelwatch.<part> the same module would load twice."""
    bad = []
    for path in sorted(p for folder in (*PROJECT, "tests", "tests_engine", "deploy") for p in root.joinpath(folder).rglob("*.py")):
        if path.resolve() == Path(__file__).resolve():
            continue  # this file's own trees hold bare imports on purpose (test_a_bad_import_is_caught)
        if found := bare_parts(ast.parse(path.read_text())):
            bad.append(f"{path.relative_to(root)} imports {sorted(found)} by a bare name: import cancelwatch.<part>")
    for path in sorted(root.joinpath("notebooks").glob("*.ipynb")):
        cells = ["".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
        if found := set().union(*(bare_parts(ast.parse(c)) for c in cells)):
            bad.append(f"{path.relative_to(root)} imports {sorted(found)} by a bare name: import cancelwatch.<part>")
    return bad


def hits(imported: set[str], forbidden: set[str]) -> set[str]:
    return {f for f in forbidden if any(m == f or m.startswith(f + ".") for m in imported)}


def violations(root: Path) -> list[str]:
    bad = []
    for owner, forbidden in FORBIDDEN.items():
        folder = root.joinpath(*owner.split("."))
        for path in sorted(folder.rglob("*.py")):
            found = hits(imported_modules(path, root), forbidden)
            if found:
                bad.append(f"{path.relative_to(root)} imports {sorted(found)}")
    bad += launcher_imports(root) + bare_imports(root)
    for path in sorted(root.joinpath("collectors").glob("*")):
        if path.name not in (*ROOMS, *ABOVE_ROOMS, "__init__.py", "__pycache__"):
            bad.append(f"{path.relative_to(root)} is outside the four rooms of collectors/ ({', '.join(ROOMS)})")
    for package in PROJECT:
        if package == "runstore":
            continue
        for path in sorted(root.joinpath(package).rglob("*.py")):
            if hits(imported_modules(path, root), {"sqlite3", "adbc_driver_sqlite", "adbc_driver_manager"}) or \
                    SQL.search(path.read_text()):
                bad.append(f"{path.relative_to(root)} holds SQL or a database driver: the run format is runstore's")
    return bad


def launcher_imports(root: Path) -> list[str]:
    """Each launcher that imports another launcher, naming it."""
    bad = []
    for launcher in LAUNCHERS:
        path = root.joinpath(*launcher.split(".")).with_suffix(".py")
        found = hits(imported_modules(path, root), set(LAUNCHERS) - {launcher}) if path.exists() else set()
        if found:
            bad.append(f"{path.relative_to(root)} imports {sorted(found)}: launchers share "
                       "collectors/engines/lifecycle.py, never each other")
    return bad


def test_no_engine_launcher_imports_another():
    # a launcher renamed or moved would pass unseen
    assert [m for m in LAUNCHERS if not ROOT.joinpath(*m.split(".")).with_suffix(".py").exists()] == []
    assert launcher_imports(ROOT) == []


def import_circles(root: Path) -> list[str]:
    """The first import circle among the project's modules (every import, those inside functions too), as
    `a -> b -> a`; none: []."""
    files = {module_name(p, root): p for package in PROJECT for p in sorted(root.joinpath(package).rglob("*.py"))}
    graph = {name: {m for m in imported_modules(p, root) if m in files and m != name} for name, p in files.items()}
    try:
        tuple(TopologicalSorter(graph).static_order())
    except CycleError as exc:
        return [" -> ".join(reversed(exc.args[1]))]
    return []


def test_no_module_imports_itself_back():
    assert import_circles(ROOT) == []


@pytest.mark.parametrize("a_imports", ["from cancelwatch.analysis.b import g",
                                       "def f():\n    from cancelwatch.analysis.b import g"])
def test_a_circle_is_caught_even_behind_a_function(tmp_path, a_imports):
    for package in PROJECT:
        (tmp_path / package).mkdir()
    (tmp_path / "analysis" / "__init__.py").write_text("")
    (tmp_path / "analysis" / "a.py").write_text(a_imports + "\n")
    (tmp_path / "analysis" / "b.py").write_text("from cancelwatch.analysis.c import h\ndef g():\n    pass\n")
    (tmp_path / "analysis" / "c.py").write_text("import cancelwatch.analysis.a\ndef h():\n    pass\n")
    (tmp_path / "analysis" / "d.py").write_text("from .c import h\n")  # beside the circle, not in it
    (found,) = import_circles(tmp_path)
    modules = found.split(" -> ")
    assert modules[0] == modules[-1] and set(modules) == {"analysis.a", "analysis.b", "analysis.c"}, found


def test_imports_point_down_and_collectors_keep_their_rooms():
    assert violations(ROOT) == []


def test_nvml_is_quarantined():
    users = [str(p.relative_to(ROOT)) for p in sorted(ROOT.rglob("*.py"))
             if ".venv" not in p.parts and p.parts[len(ROOT.parts)] in PROJECT
             and hits(imported_modules(p, ROOT), {"pynvml"})]
    assert users == ["collectors/sources/nvml.py"]


@pytest.mark.parametrize("where, line, says", [
    ("runstore/bad.py", "from cancelwatch.collectors.sources.base import Source", "collectors"),
    ("collectors/sources/bad.py", "from cancelwatch.analysis.verdicts import judge_run", "analysis"),
    ("collectors/sources/bad.py", "from ..recording import sampler", "collectors.recording"),
    ("collectors/engines/bad.py", "import cancelwatch.collectors.cancels.driver", "collectors.cancels"),
    ("collectors/engines/triton_server.py", "from cancelwatch.collectors.engines.vllm_server import stop", "collectors.engines.vllm_server"),
    ("collectors/engines/vllm_server.py", "def f():\n    from . import triton_server", "collectors.engines.triton_server"),
    ("analysis/bad.py", "import httpx", "httpx"),
    ("dashboard/bad.py", "from cancelwatch.cli import app", "cancelwatch"),
    ("collectors/stray.py", "", "outside the four rooms"),
    ("collectors/recording/bad.py", "from cancelwatch.collectors.families import FAMILIES", "collectors.families"),
    ("analysis/bad.py", "rows = con.execute('SELECT id FROM runs')", "SQL"),
    ("bench/bad.py", "import sqlite3", "SQL"),
    ("bench/bad.py", "from runstore.reader import load_run", "by a bare name"),
    ("tests/test_bad.py", "import analysis.verdicts as v", "by a bare name"),
    ("bench/bad.py", "SCRIPT = 'import dataclasses, collectors.recording.session as s'", "by a bare name"),
    ("collectors/engines/bad.py", "cmd = [python, '-m', 'collectors.engines.relay_app']", "by a bare name"),
    ("tests/test_bad.py", "DOC = 'python -m analysis.verdicts.reference > docs/rules.md'", "by a bare name"),
])
def test_a_bad_import_is_caught(tmp_path, where, line, says):
    """The checker itself can fail: a tree with one bad file gives exactly one violation naming it."""
    for package in (*PROJECT, "tests"):
        (tmp_path / package).mkdir()
    for room in ROOMS:
        (tmp_path / "collectors" / room).mkdir()
        (tmp_path / "collectors" / room / "__init__.py").write_text("")
    (tmp_path / where).write_text(line + "\n")
    (found,) = violations(tmp_path)
    assert where in found and says in found


MAX_FUNCTION_LINES = 80  # a function past this holds several steps that want names of their own


def function_lengths(path: Path) -> list[tuple[int, str]]:
    """(lines, name) of every function in a file, a nested function counted on its own, not in its parent."""
    out = []

    def visit(node, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                inner = [c for c in ast.walk(child) if c is not child and isinstance(c, (ast.FunctionDef, ast.AsyncFunctionDef))]
                outermost = [c for c in inner if not any(d is not c and d.lineno <= c.lineno and c.end_lineno <= d.end_lineno
                                                         for d in inner)]
                own = child.end_lineno - child.lineno + 1 - sum(c.end_lineno - c.lineno + 1 for c in outermost)
                out.append((own, prefix + child.name))
                visit(child, prefix + child.name + ".")
            else:
                visit(child, prefix + (child.name + "." if isinstance(child, ast.ClassDef) else ""))

    visit(ast.parse(path.read_text()), "")
    return out


def test_no_function_of_analysis_or_collectors_is_80_lines_long():
    long_ones = [f"{p.relative_to(ROOT)}:{name} ({n} lines)" for package in ("analysis", "collectors")
                 for p in sorted(ROOT.joinpath(package).rglob("*.py")) for n, name in function_lengths(p)
                 if n >= MAX_FUNCTION_LINES]
    assert long_ones == []


VERDICT_FUNCTION_LINES = 60  # the rules read as the model and its causes: each step of a verdict has a name


def test_no_function_of_the_verdict_rules_is_over_60_lines():
    rules = sorted(ROOT.joinpath("analysis", "verdicts").rglob("*.py"))
    long_ones = [f"{p.relative_to(ROOT)}:{name} ({n} lines)" for p in rules for n, name in function_lengths(p)
                 if n > VERDICT_FUNCTION_LINES]
    assert long_ones == []


def test_a_nested_function_counts_on_its_own(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(50))
    inner = "\n".join(f"        y{i} = {i}" for i in range(50))
    (tmp_path / "m.py").write_text(f"def outer():\n{body}\n    def inner():\n{inner}\n    return inner\n")
    assert sorted(function_lengths(tmp_path / "m.py")) == [(51, "outer.inner"), (52, "outer")]
