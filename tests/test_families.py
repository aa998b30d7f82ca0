"""Every target of a run records its engine family, and analysis judges the run by it: runs from before
targets said so are read by their engine facts; a family this cancelwatch does not know is one line,
never a vLLM story."""

from __future__ import annotations

import json
import shutil
import sqlite3
from contextlib import closing

import pytest

from cancelwatch.analysis.facts import run_facts
from cancelwatch.analysis.verdicts import TRITON, VLLM, UnknownFamily, family_of, judge_run, report_document
from cancelwatch.runstore.reader import load_run
from tests.conftest import FIXTURES, ROOT, cli
from tests.fixture_server import MetricsFixtureServer
from tests.test_dashboard import app

SAMPLE = ROOT / "dashboard" / "sample" / "sample.db"
TRITON_RUN = FIXTURES / "triton" / "suite_run.db"
LOADED = FIXTURES / "vllm" / "0.32" / "loaded.txt"


def test_a_recorded_target_says_its_family(tmp_path):
    store = tmp_path / "cw.db"
    with MetricsFixtureServer(LOADED) as server:
        res = cli("sample", "--target", f"lab={server.url}", "--duration", "1.5", "--hz", "10", "--nvml", "off",
                  "--store", str(store))
    assert res.returncode == 0, res.stdout + res.stderr
    run = load_run(store, "latest")
    assert [(t["label"], t["family"]) for t in run.info["targets"]] == [("lab", VLLM)]
    assert family_of(run) == VLLM
    assert run_facts(run)["family"] == VLLM and run_facts(run)["targets"][0]["family"] == VLLM
    doc = json.loads(cli("report", "latest", "--json", "--store", str(store)).stdout)
    assert doc["family"] == VLLM


@pytest.mark.parametrize("store, family", [(SAMPLE, VLLM), (TRITON_RUN, TRITON)])
def test_runs_from_before_targets_said_so_are_read_by_their_engine_facts(store, family):
    run = load_run(store, "latest")
    assert not any("family" in t for t in run.info["targets"])  # written before families were recorded
    assert family_of(run) == family
    verdicts = judge_run(run)
    assert verdicts and all(v.evidence.rule for v in verdicts)
    assert report_document(run, verdicts=verdicts)["family"] == family


def with_families(tmp_path, *families: str):
    """The shipped sample, its latest run's targets relabelled to `families` (one target each)."""
    store = tmp_path / "cw.db"
    shutil.copy(SAMPLE, store)
    run = load_run(store, "latest")
    base = run.info["targets"][0]
    targets = [{**base, "label": f"t{i}", "family": f} for i, f in enumerate(families)]
    with closing(sqlite3.connect(store)) as db:
        db.execute("UPDATE runs SET targets = ? WHERE id = ?", (json.dumps(targets), run.id))
        db.commit()
    return store, run.id


def test_an_unknown_family_is_one_line_in_the_analysis_the_cli_and_the_page(tmp_path, monkeypatch):
    store, run_id = with_families(tmp_path, "sglang")
    run = load_run(store, "latest")
    with pytest.raises(UnknownFamily, match=f"run {run_id} was recorded on engine family 'sglang'.*read it with"):
        judge_run(run)
    with pytest.raises(UnknownFamily):
        run_facts(run)
    res = cli("report", "latest", "--store", str(store))
    assert res.returncode != 0
    said = [line for line in (res.stdout + res.stderr).splitlines() if line.strip()]
    assert len(said) == 1 and "'sglang'" in said[0] and "read it with" in said[0], said
    assert "vLLM" not in said[0] and "released" not in res.stdout  # never judged as vLLM
    at = app(tmp_path, monkeypatch, store="cw.db", run="latest")
    assert not at.exception, [e.value for e in at.exception]
    assert any("'sglang'" in e.value for e in at.error), [e.value for e in at.error]


def test_a_run_of_two_families_is_one_line(tmp_path):
    store, _ = with_families(tmp_path, VLLM, TRITON)
    with pytest.raises(UnknownFamily, match="mixes engine families .*record each family into a run of its own"):
        judge_run(load_run(store, "latest"))
    # one known family named on every target is judged as before
    (tmp_path / "one").mkdir()
    store, _ = with_families(tmp_path / "one", VLLM, VLLM)
    assert family_of(load_run(store, "latest")) == VLLM
    assert judge_run(load_run(store, "latest"))


@pytest.mark.parametrize("target, option, value, why", [
    ("grpc://127.0.0.1:9", "--burst-hz", "100", "do not raise the sampling rate"),
    ("grpc://127.0.0.1:9", "--api-key-env", "MY_KEY", "no API key"),
    ("grpc://127.0.0.1:9", "--relay-url", "http://127.0.0.1:9", "relay app serves vLLM's AsyncLLM"),
    ("grpc://127.0.0.1:9", "--prometheus", "http://127.0.0.1:9", "replica discovery"),
    ("http://127.0.0.1:9", "--http-url", "http://127.0.0.1:9", "Triton's HTTP endpoint"),
    ("grpc://127.0.0.1:9", "--burst-window", "5s", "do not raise the sampling rate"),
    ("grpc://127.0.0.1:9", "--job", "myjob", "replica discovery"),
    ("grpc://127.0.0.1:9", "--engine-log-tz", "UTC", "stamps its log in UTC"),
])
def test_a_record_option_that_does_not_apply_to_the_family_is_refused_in_one_line(tmp_path, target, option, value,
                                                                                    why):
    """Before, Triton's record dropped --burst-hz and --api-key-env in silence. Refused before anything is sent
    (port 9 answers nothing: a refusal that reached for it would say so instead)."""
    store = tmp_path / "cw.db"
    res = cli("record", "--target", target, option, value, "--store", str(store))
    said = [line for line in (res.stdout + res.stderr).splitlines() if line.strip()]
    assert res.returncode == 2, said
    assert len(said) == 1 and option in said[0] and why in said[0] and "leave it out" in said[0], said
    assert not store.exists()  # nothing was recorded


@pytest.mark.parametrize("command, args, why", [
    ("sample", ["--duration", "1"], "sampling alone reads vLLM's /metrics"),
    ("canary", ["--rounds", "1"], "the canary's rounds are vLLM's HTTP scenarios"),
])
def test_a_command_that_does_not_apply_to_the_family_is_refused_in_one_line(tmp_path, command, args, why):
    """sample and canary pick the target's family from collectors/families.py like record: a Triton target
    is refused before anything is sent or stored (port 9 answers nothing)."""
    store = tmp_path / "cw.db"
    res = cli(command, "--target", "grpc://127.0.0.1:9", *args, "--store", str(store))
    said = [line for line in (res.stdout + res.stderr).splitlines() if line.strip()]
    assert res.returncode == 2, said
    assert len(said) == 1 and f"{command} does not apply to a {TRITON} target" in said[0] and why in said[0], said
    assert not store.exists()


def family_literals(root, families) -> list[str]:
    """Every string literal equal to a family's name in the project's Python (modules and notebook code
    cells), outside collectors/families.py, that family's own modules (its entry's `modules`) and tests."""
    import ast

    own = {name: set(f.modules) | {"collectors/families.py"} for name, f in families.items()}
    found = []

    def scan(where: str, text: str, rel: str) -> None:
        try:
            tree = ast.parse(text)
        except SyntaxError:  # a notebook cell of shell magics; the module tests parse every .py
            return
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value in own and rel not in own[node.value]:
                found.append(f"{where}:{node.lineno}: {node.value!r}")

    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.split("/")[0] in ("tests", "tests_engine") or any(p.startswith(".") for p in rel.split("/")):
            continue
        scan(rel, path.read_text(), rel)
    for nb in sorted(root.glob("notebooks/*.ipynb")):
        rel = nb.relative_to(root).as_posix()
        for i, cell in enumerate(json.loads(nb.read_text())["cells"]):
            if cell["cell_type"] == "code":
                scan(f"{rel} cell {i}", "".join(cell["source"]), rel)
    return found


def test_no_family_name_is_written_outside_its_own_modules_and_the_table():
    """A family's name spelled out in shared code is where a third family would silently get vLLM's (or
    Triton's) behaviour: shared code reads the name from the family's constants or the table."""
    from cancelwatch.collectors.families import FAMILIES

    assert set(FAMILIES) == {VLLM, TRITON}
    for f in FAMILIES.values():
        missing = [m for m in f.modules if not (ROOT / m).is_file()]
        assert not missing, f"{f.name}'s entry names modules that are not there: {missing}"
    assert family_literals(ROOT, FAMILIES) == []


def test_the_family_literal_check_can_fail(tmp_path):
    from cancelwatch.collectors.families import FAMILIES

    (tmp_path / "collectors" / "recording").mkdir(parents=True)
    (tmp_path / "collectors" / "recording" / "shared.py").write_text(f'SOURCE = "{VLLM}"\nOTHER = "vllm:x"\n')
    (tmp_path / "collectors" / "sources").mkdir()
    (tmp_path / "collectors" / "sources" / "triton.py").write_text(f'FAMILY = "{TRITON}"\nWRONG = "{VLLM}"\n')
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text(f'X = "{VLLM}"\n')
    (tmp_path / "notebooks").mkdir()
    (tmp_path / "notebooks" / "n.ipynb").write_text(json.dumps({"cells": [
        {"cell_type": "code", "source": ["!make demo\n"]},
        {"cell_type": "code", "source": [f"run = pick('{TRITON}')\n"]}]}))
    assert family_literals(tmp_path, FAMILIES) == [
        "collectors/recording/shared.py:1: 'vllm'", "collectors/sources/triton.py:2: 'vllm'",
        "notebooks/n.ipynb cell 1:1: 'triton'"]


def test_engine_status_names_each_engines_family_from_its_launcher(tmp_path):
    """`engine status` asks the table which launcher owns each state file: a Triton's says triton, a vLLM's
    vllm, and one written before state files held a kind is a vLLM's. The pids are gone: each is dead."""
    from dataclasses import asdict

    from cancelwatch.collectors.engines import lifecycle, triton_server, vllm_server

    gone = 2**22 + 12345  # above the kernel's pid_max default: no such process
    common = dict(pid=gone, log_path="x.log", model="m", served_model_name="tiny", command=["x"], started_wall_ns=1)
    lifecycle.write_state(tmp_path, lifecycle.EngineState(port=8000, url="http://127.0.0.1:8000", kind=vllm_server.KIND,
                                                          **common))
    lifecycle.write_state(tmp_path, lifecycle.EngineState(port=8100, url="http://127.0.0.1:8100",
                                                          kind=triton_server.KIND, urls={"grpc": "127.0.0.1:8101",
                                                          "metrics": "http://127.0.0.1:8102"}, **common))
    legacy = {k: v for k, v in asdict(lifecycle.EngineState(port=8200, url="http://127.0.0.1:8200", **common)).items()
              if k not in ("kind", "urls", "cgroup")}
    (tmp_path / "engine-8200.json").write_text(json.dumps(legacy))
    # a kind no launcher here writes (a newer cancelwatch's family): said as it is, never judged healthy
    lifecycle.write_state(tmp_path, lifecycle.EngineState(port=8300, url="http://127.0.0.1:8300", kind="sglang",
                                                          **common))
    res = cli("engine", "status", home=tmp_path)
    lines = res.stdout.splitlines()
    assert res.returncode == 1, res.stdout + res.stderr  # none alive
    assert [line.split()[0] for line in lines] == [VLLM, TRITON, VLLM, "sglang"], lines
    assert "grpc 127.0.0.1:8101" in lines[1] and all(" dead " in line for line in lines), lines


@pytest.mark.parametrize("command, args, said_part", [
    ("record", ["--target", "grpc://u:secret@127.0.0.1:9"], "user:password@ in --target does not apply to a triton"),
    ("record", ["--target", "http://127.0.0.1:9", "--burst-window", "5s"], "--burst-window works only with --burst-hz"),
    ("record", ["--target", "http://127.0.0.1:9", "--job", "myjob"], "--job works only with --prometheus"),
    ("sample", ["--target", "http://127.0.0.1:9", "--job", "myjob"], "--job works only with --prometheus"),
])
def test_an_option_that_would_do_nothing_is_refused_in_one_line(tmp_path, command, args, said_part):
    """Given alone, these did nothing at all (credentials Triton never gets, a burst window with no burst, a
    scrape job with no Prometheus to ask): refused before anything is sent, never dropped in silence."""
    store = tmp_path / "cw.db"
    res = cli(command, *args, "--store", str(store))
    said = [line for line in (res.stdout + res.stderr).splitlines() if line.strip()]
    assert res.returncode == 2 and len(said) == 1 and said_part in said[0], said
    assert "secret" not in said[0] and not store.exists()
