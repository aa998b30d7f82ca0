"""Triton's cancellation contract, against the real tritonserver (2.51, CPU, from the nvidia-pytriton wheel)
serving cancelwatch's models: every scenario's expected verdict with the evidence named, queued told
apart from executing by the server's evidence, stream-wide cancels that harm no neighbour, no silent
resubmit, and one-line errors for a bad gRPC URL, a missing model and an unreachable metrics port."""

from __future__ import annotations

import json
import time

import psutil
import pytest

from cancelwatch.collectors.cancels.triton_driver import SUITE, TRITON_SCENARIOS
from cancelwatch.collectors.engines import lifecycle, triton_server
from cancelwatch.runstore.reader import load_run
from tests.conftest import cli, free_port, free_triton_port, wait_gone

pytestmark = pytest.mark.triton


@pytest.fixture(scope="module")
def triton_run(triton, triton_home, tmp_path_factory):
    store = tmp_path_factory.mktemp("triton") / "cw.db"
    t0 = time.monotonic()
    res = cli("record", "--target", f"grpc://{triton.urls['grpc']}", "--scenario", "triton", "--store", str(store),
              home=triton_home, timeout=400)
    elapsed = time.monotonic() - t0
    print(f"triton suite: {elapsed:.1f} s")
    rep = cli("report", "latest", "--json", "--store", str(store))
    return res, json.loads(rep.stdout), load_run(store, "latest"), elapsed, store


def by_scenario(doc, name):
    return [c for c in doc["cancels"] if c["scenario"] == name]


def test_every_triton_scenario_gives_its_expected_verdict_with_evidence_named(triton_run):
    res, doc, run, elapsed, _ = triton_run
    assert res.returncode == 0, res.stdout + res.stderr
    assert doc["engine"] == "triton" and doc["status"] == "completed" and doc["neighbours_ok"] is True
    assert {c["scenario"] for c in doc["cancels"]} == set(SUITE)
    for c in doc["cancels"]:
        expected = TRITON_SCENARIOS[c["scenario"]].expect
        ev, src = c["evidence"], c["timepoint_sources"]
        assert c["verdict"] == expected, c
        assert ev["expected"] == expected and ev["engine_log"] == "read"
        assert src["user_stop"]["source"] == "client"
        assert src["app_received"] == {"source": None, "reason": "no app on this path"}
        if expected == "released":
            # never the client's CANCELLED: the model's own line, or the core's CANCELED count
            assert src["engine_abort"]["source"] in ("engine_log", "samples"), c
            assert src["left_scheduler"]["source"] == "samples"
            assert c["timepoints"]["engine_abort"] >= c["timepoints"]["user_stop"] - 0.05
            assert c["latencies_ms"]["engine_abort->left_scheduler_ms"] is not None
            assert c["timepoints"]["reusable"] is not None, f"{c['scenario']}: the probe was not served"
        elif c["scenario"] == "triton_hoard":
            # the model's own word (its cancel line) and its active gauge said released; its buffer did not
            assert src["engine_abort"]["source"] == "engine_log" and ev["rule"] == "model_kept_buffer", c
            assert ev["buffer_kept_bytes"] >= 4 << 20, ev  # at least half the 8 MiB the request held
        else:
            assert c["timepoints"]["engine_abort"] is None and ev["kept_running_ms"] > 0
    (http,) = by_scenario(doc, "triton_http_timeout")
    assert http["evidence"]["rule"] == "http_carries_no_cancel", http
    (deaf,) = by_scenario(doc, "triton_deaf")
    assert deaf["evidence"]["rule"] == "backend_does_not_poll", deaf
    # the client saw its own end at once in both: that is not what the verdict rests on
    ledger = run.ledger.set_index("request_id")
    assert ledger.loc[deaf["request_id"], "reason"].startswith("client saw")
    assert ledger.loc[http["request_id"], "terminal_state"] == "cancelled"
    print(f"triton suite wall time: {elapsed:.1f} s (target <= 180 s)")


def _log_kinds(run, rid):
    ev = run.events
    return list(ev[ev["request_id"] == rid]["kind"])


def test_queued_and_executing_are_told_apart_by_server_evidence(triton_run):
    _, doc, run, _, _ = triton_run
    (queued,) = by_scenario(doc, "triton_queued")
    (executing,) = by_scenario(doc, "triton_executing")
    # queued: the core dropped it (CANCELED +1) and the model never saw it
    assert queued["phase_at_cancel"] == "queued" and queued["evidence"]["server_phase"] == "queued"
    assert queued["evidence"]["canceled_failures_delta"] >= 1
    assert queued["timepoint_sources"]["engine_abort"]["source"] == "samples"
    assert "engine_added" not in _log_kinds(run, queued["request_id"])
    # executing: the model started it and logged that it saw the cancel; its active gauge fell
    assert executing["phase_at_cancel"] == "executing" and executing["evidence"]["server_phase"] == "executing"
    assert executing["timepoint_sources"]["engine_abort"]["source"] == "engine_log"
    kinds = _log_kinds(run, executing["request_id"])
    assert "engine_added" in kinds and "engine_aborted" in kinds and "engine_finished" not in kinds
    assert "canceled_failures_delta" not in executing["evidence"]


def test_stream_wide_cancels_every_request_of_its_stream_and_no_neighbour(triton_run):
    _, doc, run, _, _ = triton_run
    cancels = by_scenario(doc, "triton_stream_wide")
    assert len(cancels) == TRITON_SCENARIOS["triton_stream_wide"].targets == 2
    assert all(c["verdict"] == "released" for c in cancels)
    assert len({c["timepoints"]["user_stop"] for c in cancels}) == 1  # one stop_stream call
    ledger = run.ledger[run.ledger["scenario"] == "triton_stream_wide"]
    (nb,) = ledger[ledger["role"] == "neighbour"].to_dict("records")
    assert nb["terminal_state"] == "completed" and nb["chunks"] == nb["max_tokens"]  # on its own stream, it ran on
    targets = ledger[ledger["role"] == "target"]
    assert (targets["terminal_state"] == "cancelled").all()
    assert doc["neighbours_ok"] is True


def test_no_silent_resubmit_and_the_run_says_what_it_tested(triton_run):
    _, doc, run, _, _ = triton_run
    counts = {r["model"]: r for r in doc["server_requests"]}
    assert set(counts) == {"generator", "generator_deaf", "generator_hoard", "slow"}
    for r in counts.values():
        assert r["ok"] and r["server_counted"] == r["sent"], r
    assert [t["family"] for t in run.info["targets"]] == ["triton"] and doc["family"] == "triton"
    facts = run.info["engine"]["targets"]["t0"]
    assert facts["version"] == "Triton 2.51.0" and facts["client"].startswith("tritonclient 2.")
    assert facts["backend"] == "python" and facts["protocols"] == ["grpc", "http"]
    assert facts["models"]["generator"]["versions"] == ["1"]
    sent = run.events[run.events["kind"] == "request_sent"]
    data = [json.loads(d) for d in sent["data"]]
    assert len(sent) == sum(r["sent"] for r in counts.values())
    assert all(d["call_object"] and d["protocol"] in ("grpc", "http") and d["model"] for d in data)
    assert {d["protocol"] for d in data} == {"grpc", "http"}


def test_report_html_protocol_and_dashboard_work_on_a_triton_run(triton_run, tmp_path, monkeypatch):
    _, doc, run, _, store = triton_run
    html, md = tmp_path / "r.html", tmp_path / "p.md"
    res = cli("report", "latest", "--store", str(store), "--html", str(html), "--protocol", str(md))
    assert res.returncode == 0, res.stderr
    text = md.read_text()
    assert "embedded Triton" in text and "Triton 2.51.0" in text
    assert "leaked as their scenario is built to show" in text
    assert "stop_stream(cancel_requests=True)" in text and "vLLM is not covered" in text
    page = html.read_text()
    assert "Triton 2.51.0" in page and "HTTP carries no cancel" in page
    for nb in ("vram_plateau", "capacity_review"):  # exit 1 would mean an error cell
        res = cli("notebook", nb, "--run", "latest", "--store", str(store), "--html", str(tmp_path / f"{nb}.html"),
                  timeout=300)
        assert res.returncode == 0, res.stdout + res.stderr
    from streamlit.testing.v1 import AppTest

    from tests.test_dashboard import APP, ROOT

    monkeypatch.setenv("CANCELWATCH_STORE_DIR", str(store.parent))
    monkeypatch.chdir(ROOT)
    at = AppTest.from_file(APP, default_timeout=180)
    at.query_params["store"] = str(store)
    at.run()
    assert not at.exception, at.exception
    heads = [s.value for s in at.subheader]
    assert f"Cancels ({len(doc['cancels'])})" in heads
    table = next(d.value for d in at.dataframe if "verdict" in d.value.columns)
    assert list(table["verdict"]) == [c["verdict"] for c in doc["cancels"]]
    shown = " ".join(m.value for m in at.markdown)
    assert "the server keeps its processes" in shown


def test_bad_grpc_url_missing_model_and_dead_metrics_port_are_one_line_errors(triton, tmp_path):
    store = tmp_path / "cw.db"
    dead = free_port()
    bad_grpc = cli("record", "--target", f"grpc://127.0.0.1:{dead}", "--metrics-url", triton.urls["metrics"],
                   "--scenario", "triton_executing", "--store", str(store))
    assert "gRPC" in bad_grpc.stderr and "fix --target" in bad_grpc.stderr, bad_grpc.stderr
    dead_metrics = cli("record", "--target", f"grpc://{triton.urls['grpc']}", "--metrics-url",
                       f"http://127.0.0.1:{dead}", "--http-url", triton.url, "--scenario", "triton_executing",
                       "--store", str(store))
    assert "--metrics-url" in dead_metrics.stderr, dead_metrics.stderr
    no_port = cli("record", "--target", "grpc://nohost", "--scenario", "triton", "--store", str(store))
    assert "grpc://HOST:PORT" in no_port.stderr, no_port.stderr
    for r in (bad_grpc, dead_metrics, no_port):
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not store.exists()  # refused before any run was made


def test_a_server_without_the_scenarios_model_is_refused_before_anything_is_sent(tmp_path):
    home = tmp_path / "home"
    state = triton_server.start(home, port=free_triton_port(), models=("generator",))
    try:
        store = tmp_path / "cw.db"
        res = cli("record", "--target", f"grpc://{state.urls['grpc']}", "--scenario", "triton_queued",
                  "--store", str(store), home=home)
        assert res.returncode == 2, res.stdout + res.stderr
        assert "model 'slow' is not ready" in res.stderr and len(res.stderr.strip().splitlines()) == 1
        assert not store.exists()
    finally:
        pids = lifecycle.engine_pids(state)
        lifecycle.stop(home, state.port)
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def test_engine_up_status_down_for_triton(tmp_path):
    home = tmp_path / "home"
    port = free_triton_port()
    up = cli("engine", "up", "--engine", "triton", "--port", str(port), home=home, timeout=180)
    assert up.returncode == 0, up.stderr
    assert f"grpc 127.0.0.1:{port + 1}" in up.stdout and f"metrics http://127.0.0.1:{port + 2}" in up.stdout
    state = lifecycle.read_state(home, port)
    pids = lifecycle.engine_pids(state)
    assert len(pids) >= 4  # tritonserver and a python-backend stub per model
    status = cli("engine", "status", home=home)
    assert status.returncode == 0 and "triton" in status.stdout and "healthy" in status.stdout
    busy = cli("engine", "up", "--engine", "triton", "--port", str(port), home=home)
    assert busy.returncode == 2 and "already runs" in busy.stderr
    down = cli("engine", "down", "--port", str(port), home=home)
    assert down.returncode == 0 and str(port) in down.stdout
    left = wait_gone(pids)
    assert not left, f"processes left after engine down: {left}"
