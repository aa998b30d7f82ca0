"""The event kinds a run holds are one table (runstore/event_kinds.py: EVENT_KINDS), held to the source
that writes them, both ways, and to the README's "What a run holds".

The writers are found by reading the source with `ast`, not by running it:
- a write is a call of `EventRecord(kind, ...)` or of a wrapper around it: a function whose kind
  parameter reaches such a call (the drivers' `event`, `event_record`), found to a fixpoint;
- a kind given as a string at the write is the kind written, the call's keywords (less the wrapper's own
  parameters) the data fields, with the keys of a dict literal passed as `**name` or as `data`, and
  those the wrapper adds itself (`data.setdefault("metrics_target", ...)`);
- a kind the write takes from a variable (an engine log's parsed line) is what the module's `KINDS`
  table holds (its values, for a dict) or the firsts of a literal `for kind, ... in (("x", ...), ...)`
  loop; the fields are the keys of the `data` dict literal. A write whose kind cannot be read off the
  source that way fails the test: name the kinds in such a table.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from cancelwatch.runstore.event_kinds import DRIVER, ENGINE_LOG, EVENT_KINDS, RUNNER, TAP, TRITON_DRIVER, TRITON_LOG, WATCH, EventKind
from cancelwatch.runstore.records import EventRecord

ROOT = Path(__file__).resolve().parents[1]
WRITERS = ("collectors", "cancelwatch")  # the packages that write runs
SYNTHETIC = ("bench",)  # runs built in one go for benchmarks: their kinds must be known, they write none of their own
RECORD = "EventRecord"
# the README's words for the writers
README_WRITERS = {"scenario runner": RUNNER, "driver": DRIVER, "Triton driver": TRITON_DRIVER,
                  "engine log": ENGINE_LOG, "Triton log": TRITON_LOG, "tap": TAP,
                  "watch": WATCH}


@dataclass
class Write:
    kind: str
    module: str
    line: int
    fields: set[str] = field(default_factory=set)


@dataclass
class Scan:
    writes: list[Write] = field(default_factory=list)
    unresolved: list[str] = field(default_factory=list)  # "module:line": a kind not readable off the source

    def kinds(self, modules_under: tuple[str, ...] = WRITERS) -> dict[str, set[str]]:
        """kind -> the modules (under `modules_under`) that write it."""
        out: dict[str, set[str]] = {}
        for w in self.writes:
            if w.module.split(".")[0] in modules_under:
                out.setdefault(w.kind, set()).add(w.module)
        return out

    def fields(self, modules_under: tuple[str, ...] = WRITERS) -> dict[str, set[str]]:
        """kind -> the data fields written with it (under `modules_under`)."""
        out: dict[str, set[str]] = {}
        for w in self.writes:
            if w.module.split(".")[0] in modules_under:
                out.setdefault(w.kind, set()).update(w.fields)
        return out


@dataclass
class _Wrapper:
    kind_at: int  # index of the kind among the call's positional arguments (self not counted)
    params: set[str]  # its own named parameters: not data
    adds: set[str]  # data fields it adds to every event written through it


def _called(call: ast.Call) -> str | None:
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None


def _arg(call: ast.Call, at: int, name: str) -> ast.expr | None:
    for kw in call.keywords:
        if kw.arg == name:
            return kw.value
    return call.args[at] if len(call.args) > at else None


def _str(node: ast.expr | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _dict_keys(node: ast.AST | None) -> set[str]:
    """The string keys of every dict literal in `node` (`{} if x else {"a": ...}` gives a)."""
    keys = set()
    for n in ast.walk(node) if node is not None else ():
        if isinstance(n, ast.Dict):
            keys |= {k for k in map(_str, n.keys) if k is not None}
    return keys


_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef)


def _params(fn: ast.AST) -> list[str]:
    if not isinstance(fn, _DEFS):
        return []  # the module's own top level
    names = [a.arg for a in (*fn.args.posonlyargs, *fn.args.args)]
    return names[1:] if names[:1] in (["self"], ["cls"]) else names


def _scopes(tree: ast.Module):
    """(scope, its name, the calls in its own body): the module's top level and every function; a
    nested function's calls are its own, a lambda's belong to the scope it is written in."""
    for scope in ast.walk(tree):
        if isinstance(scope, (ast.Module, *_DEFS)):
            calls, todo = [], list(ast.iter_child_nodes(scope))
            while todo:
                n = todo.pop()
                if isinstance(n, _DEFS):
                    continue
                if isinstance(n, ast.Call):
                    calls.append(n)
                todo.extend(ast.iter_child_nodes(n))
            yield scope, getattr(scope, "name", None), calls


def _kind_of(call: ast.Call, wrappers: dict[str, _Wrapper]) -> ast.expr | None:
    name = _called(call)
    if name == RECORD:
        return _arg(call, 0, "kind")
    if name in wrappers:
        return _arg(call, wrappers[name].kind_at, "kind")
    return None


def _find_wrappers(trees: dict[str, ast.AST]) -> dict[str, _Wrapper]:
    """Functions that pass their kind parameter on to a write, to a fixpoint (a wrapper of a wrapper)."""
    wrappers: dict[str, _Wrapper] = {}
    grew = True
    while grew:
        grew = False
        for tree in trees.values():
            for fn, name, calls in _scopes(tree):
                params = _params(fn)
                for call in calls:
                    kind = _kind_of(call, wrappers)
                    if not (isinstance(kind, ast.Name) and kind.id in params):
                        continue
                    inner = wrappers.get(_called(call))
                    adds = set(inner.adds) if inner else _dict_keys(_arg(call, 4, "data"))
                    adds |= {k for c in calls if _called(c) == "setdefault" for k in [_str(_arg(c, 0, "key"))] if k}
                    known = wrappers.get(name)
                    w = _Wrapper(params.index(kind.id), set(params) | (known.params if known else set()),
                                 adds | (known.adds if known else set()))
                    if known != w:
                        wrappers[name], grew = w, True
    return wrappers


def _table_kinds(tree: ast.Module) -> set[str]:
    """What a module names as the kinds it writes through a variable: its `KINDS` table, or the firsts
    of a literal `for kind, ... in (("x", ...), ...)` loop."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "KINDS" for t in node.targets):
            v = node.value
            items = v.values if isinstance(v, ast.Dict) else getattr(v, "elts", [])
            out |= {s for s in map(_str, items) if s}
        if (isinstance(node, ast.For) and isinstance(node.target, ast.Tuple) and node.target.elts
                and isinstance(node.target.elts[0], ast.Name) and node.target.elts[0].id == "kind"
                and isinstance(node.iter, (ast.Tuple, ast.List))):
            out |= {s for e in node.iter.elts if isinstance(e, (ast.Tuple, ast.List)) and e.elts
                    for s in [_str(e.elts[0])] if s}
    return out


def scan(files: dict[str, Path]) -> Scan:
    """Every event write in `files` (module name -> path)."""
    trees = {m: ast.parse(p.read_text(), filename=str(p)) for m, p in files.items()}
    wrappers = _find_wrappers(trees)
    out = Scan()
    for module, tree in trees.items():
        for fn, name, calls in _scopes(tree):
            params, assigned = set(_params(fn)), {}
            for n in ast.walk(fn):
                if isinstance(n, ast.Assign):
                    for t in n.targets:
                        if isinstance(t, ast.Name):
                            assigned.setdefault(t.id, set()).update(_dict_keys(n.value))
            for call in calls:
                kind = _kind_of(call, wrappers)
                if kind is None or (isinstance(kind, ast.Name) and kind.id in params and name in wrappers):
                    continue  # not a write, or a wrapper passing its caller's kind on
                w = wrappers.get(_called(call))
                if w is not None:
                    fields = {kw.arg for kw in call.keywords if kw.arg and kw.arg not in w.params} | w.adds
                    fields |= {k for kw in call.keywords if kw.arg is None and isinstance(kw.value, ast.Name)
                               for k in assigned.get(kw.value.id, ())}
                else:
                    fields = _dict_keys(_arg(call, 4, "data"))
                if _str(kind) is not None:
                    out.writes.append(Write(_str(kind), module, call.lineno, fields))
                    continue
                named = _table_kinds(tree)
                if not named:
                    out.unresolved.append(f"{module}:{call.lineno}")
                out.writes += [Write(k, module, call.lineno, fields) for k in sorted(named)]
    return out


def source_files(packages: tuple[str, ...]) -> dict[str, Path]:
    out = {}
    for pkg in packages:
        for p in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(p.relative_to(ROOT).with_suffix("").parts)
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def problems(found: Scan, table: dict[str, EventKind]) -> list[str]:
    """What the source and the table disagree on, one line each (empty: they agree)."""
    out = [f"{where}: the kind written here is not readable off the source" for where in found.unresolved]
    written, fields, every_field = found.kinds(), found.fields(), found.fields(WRITERS + SYNTHETIC)
    for kind in sorted(found.kinds(WRITERS + SYNTHETIC)):
        if kind not in table:
            where = sorted(f"{w.module}:{w.line}" for w in found.writes if w.kind == kind)
            out.append(f"{kind}: written ({', '.join(where)}) but not in EVENT_KINDS")
    for kind, entry in sorted(table.items()):
        if set(entry.written_by) != written.get(kind, set()):
            out.append(f"{kind}: EVENT_KINDS says written by {sorted(entry.written_by)}, the source by "
                       f"{sorted(written.get(kind, set()))}")
        undocumented = every_field.get(kind, set()) - set(entry.fields)
        if undocumented:
            out.append(f"{kind}: data fields written but not in EVENT_KINDS: {sorted(undocumented)}")
        unwritten = set(entry.fields) - fields.get(kind, set())
        if unwritten:
            out.append(f"{kind}: data fields in EVENT_KINDS that nothing writes: {sorted(unwritten)}")
    return out


@pytest.fixture(scope="module")
def project_scan() -> Scan:
    return scan(source_files(WRITERS + SYNTHETIC))


def test_every_kind_written_is_in_the_table_and_every_entry_is_written(project_scan):
    assert problems(project_scan, EVENT_KINDS) == []
    # the scan saw the writers it must see: the drivers' wrapper calls and both engine logs' variable kinds
    written = project_scan.kinds()
    assert {DRIVER, TRITON_DRIVER} <= written["user_stop"]
    assert written["scenario_start"] == {RUNNER}  # the steps every family shares, written once
    assert written["engine_added"] == {ENGINE_LOG, TRITON_LOG}
    assert written["engine_finished"] == {TRITON_LOG}


def test_a_planted_writer_of_an_unknown_kind_is_caught(project_scan, tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text(
        "from cancelwatch.runstore.records import EventRecord\n"
        "def stop(driver, rid):\n"
        "    driver.event('engine_vanished', rid, scenario='decode')\n"  # through the drivers' wrapper
        "    driver.event('user_stop', rid, scenario='decode', new_field=1)\n"  # a known kind, a new field
        "    return EventRecord(kind='made_up', wall_ns=0, mono_ns=0)\n"
        "def parsed(line):\n"
        "    return EventRecord(kind=line.split()[0], wall_ns=0, mono_ns=0)\n")  # no table names its kinds
    files = {**source_files(WRITERS + SYNTHETIC), "collectors.planted": planted}
    found = problems(scan(files), EVENT_KINDS)
    assert any(p.startswith("engine_vanished: written (collectors.planted:3)") for p in found), found
    assert any(p.startswith("made_up: written (collectors.planted:5)") for p in found), found
    assert "user_stop: data fields written but not in EVENT_KINDS: ['new_field']" in found
    assert "collectors.planted:7: the kind written here is not readable off the source" in found
    # and the other way: an entry nothing writes, a field nothing writes
    ghost = EventKind("engine_ghost", (DRIVER,), "never", "", (("x", "never"),))
    stale = EventKind("probe_sent", EVENT_KINDS["probe_sent"].written_by, "", "",
                      (*EVENT_KINDS["probe_sent"].data, ("gone", "no longer written")))
    found = problems(project_scan, {**EVENT_KINDS, "engine_ghost": ghost, "probe_sent": stale})
    assert "engine_ghost: EVENT_KINDS says written by ['collectors.cancels.driver'], the source by []" in found
    assert "probe_sent: data fields in EVENT_KINDS that nothing writes: ['gone']" in found


def _readme_kinds() -> dict[str, tuple[set[str], set[str]]]:
    """kind -> (writers, data fields) as docs/run-format.md ("What a run holds") lists them under `events`."""
    section = (ROOT / "docs" / "run-format.md").read_text()
    events = section.split("- `events`:", 1)[1].split("\n- `", 1)[0]
    out = {}
    for item in re.split(r"\n  - ", events)[1:]:
        item = " ".join(item.split("\n\n")[0].split())
        m = re.match(r"(?P<kinds>(?:`\w+`(?:, )?)+) \((?P<by>[^)]*)\): .*? Data: (?P<data>.*)$", item)
        assert m, f"a README event item not as `kind` (writers): what. Data: `field`, ...: {item}"
        writers = {README_WRITERS[w] for w in m.group("by").split(", ")}
        for kind in re.findall(r"`(\w+)`", m.group("kinds")):
            out[kind] = (writers, set(re.findall(r"`(\w+)`", m.group("data"))))
    return out


def test_the_readme_lists_the_tables_kinds_with_their_writers_and_data():
    listed = _readme_kinds()
    assert set(listed) == set(EVENT_KINDS)
    for kind, entry in EVENT_KINDS.items():
        assert listed[kind] == (set(entry.written_by), set(entry.fields)), kind


def test_the_event_record_and_the_writer_point_at_the_table():
    from cancelwatch.runstore import writer

    assert "runstore/event_kinds.py: EVENT_KINDS" in EventRecord.__doc__
    assert "EVENT_KINDS" in writer.__doc__


def test_the_writer_flags_an_unknown_kind_and_keeps_the_event(tmp_path, caplog):
    from cancelwatch.runstore.reader import load_run
    from cancelwatch.runstore.writer import create_run, open_store, write_events

    con = open_store(tmp_path / "s.db")
    rid = create_run(con, name="t", targets=[], engine={}, settings={}, wall_ns=1, mono_ns=1)
    with caplog.at_level("WARNING", logger="cancelwatch.runstore"):
        write_events(con, rid, [EventRecord("user_stop", 2, 2, "r1", {"scenario": "decode"}),
                                EventRecord("not_a_kind_of_ours", 3, 3, "r1", {"a": 1})])
        con.commit()
    assert [r.getMessage() for r in caplog.records if "not_a_kind_of_ours" in r.getMessage()], caplog.text
    assert not [r for r in caplog.records if "'user_stop'" in r.getMessage()]
    con.close()
    assert list(load_run(tmp_path / "s.db", rid).events["kind"]) == ["user_stop", "not_a_kind_of_ours"]
