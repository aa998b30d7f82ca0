"""Every target of a run records its engine family, and analysis judges the run by it: runs from before
targets said so are read by their engine facts; a family this cancelwatch does not know is one line,
never a vLLM story."""

from __future__ import annotations

import json
import shutil
import sqlite3
from contextlib import closing

import pytest

from analysis.facts import run_facts
from analysis.verdicts import TRITON, VLLM, UnknownFamily, family_of, judge_run, report_document
from runstore.reader import load_run
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
