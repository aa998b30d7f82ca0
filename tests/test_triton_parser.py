"""Triton's /metrics and its models' log lines, read from recorded output of the real tritonserver 2.51
(tests/fixtures/triton: idle, loaded with 2 streams and 5 slow requests, after one queued cancel). The
golden files hold every parsed (name, labels, value); the hand-read numbers below come from the bodies."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cancelwatch.collectors.sources.base import ParseError
from cancelwatch.collectors.sources.prom_text import LineMemo
from cancelwatch.collectors.sources.triton import TritonMetricsSource, parse_triton_metrics
from cancelwatch.collectors.sources.triton_log import TritonLogSource, parse_triton_line

FIX = Path(__file__).resolve().parent / "fixtures" / "triton"
BODIES = ("metrics_idle", "metrics_loaded", "metrics_after_cancel")


def parsed(name: str, memo: LineMemo | None = None) -> list:
    samples = parse_triton_metrics((FIX / f"{name}.txt").read_text(), 1, 2, memo=memo)
    return sorted(([s.metric, dict(s.labels), s.value] for s in samples), key=lambda x: (x[0], json.dumps(x[1])))


def value(name: str, metric: str, **labels) -> float:
    hits = [v for m, lab, v in parsed(name) if m == metric and lab == labels]
    assert len(hits) == 1, (metric, labels, hits)
    return hits[0]


@pytest.mark.parametrize("name", BODIES)
def test_golden(name):
    golden = json.loads((FIX / f"{name}.golden.json").read_text())
    assert parsed(name) == golden
    assert parsed(name, LineMemo()) == golden  # the memo changes nothing


def test_idle_server_counts_nothing_running_or_waiting():
    assert value("metrics_idle", "requests_running") == 0 and value("metrics_idle", "requests_waiting") == 0
    models = {lab["model"] for m, lab, _ in parsed("metrics_idle") if m == "triton_request_success_total"}
    assert models == {"generator", "generator_deaf", "slow"}


def test_loaded_server_sums_pending_and_the_models_active_gauges():
    # two generator streams running, one slow request executing and four behind it in the core's queue
    assert value("metrics_loaded", "triton_pending_requests", model="slow", version="1") == 4
    assert value("metrics_loaded", "model_active_requests", model="generator") == 2
    assert value("metrics_loaded", "model_active_requests", model="slow") == 1
    assert value("metrics_loaded", "requests_waiting") == 4 and value("metrics_loaded", "requests_running") == 3
    assert value("metrics_loaded", "model_steps_total", model="generator") == 22
    assert value("metrics_loaded", "model_buffer_bytes", model="generator") == 2 * 8 << 20


def test_after_a_queued_cancel_the_core_counts_it_canceled():
    body = "metrics_after_cancel"
    assert value(body, "triton_request_failure_total", model="slow", reason="CANCELED", version="1") == 1
    assert value(body, "triton_request_success_total", model="slow", version="1") == 4
    assert value(body, "triton_request_success_total", model="generator", version="1") == 2
    assert value(body, "requests_running") == 0 and value(body, "requests_waiting") == 0


@pytest.mark.parametrize("body, why", [
    ("nv_inference_count{model=\"slow\",version=\"1\"} 4", "truncated"),
    ("vllm:num_requests_running{engine=\"0\"} 1.0\n", "nv_inference_"),
    ("nv_inference_count{model=\"slow\" 4\n", "unparseable"),
    ("<html>502 Bad Gateway</html>\n", "nv_inference_"),
])
def test_bad_bodies_raise_one_line_parse_errors(body, why):
    with pytest.raises(ParseError, match=why) as exc:
        parse_triton_metrics(body, 0, 0)
    assert "\n" not in str(exc.value)


def test_the_source_reads_a_served_body_and_names_the_fix_when_it_is_not_triton(metrics_server):
    server = metrics_server(FIX / "metrics_loaded.txt")
    src = TritonMetricsSource(server.url, "t0")
    try:
        assert src.check() is None
        got = {(s.metric, s.labels): s.value for s in src.sample(5, 6)}
        assert got[("requests_waiting", ())] == 4
    finally:
        src.close()
    vllm = metrics_server("vllm:num_requests_running{engine=\"0\"} 1.0\n")
    src = TritonMetricsSource(vllm.url, "t0")
    try:
        problem = src.check()
        assert "--metrics-url" in problem and "\n" not in problem
    finally:
        src.close()


LOG = FIX / "server_log.txt"


def test_model_lines_become_request_events_with_microseconds():
    lines = LOG.read_text().splitlines()
    got = [parse_triton_line(line, 2026) for line in lines]
    assert got[:3] == [None, None, None]  # the server's own lines are not request lines
    kinds = [g[0] for g in got[3:]]
    assert kinds.count("engine_added") == kinds.count("engine_finished") == 6
    kind, rid, model, wall_ns, detail = got[3]
    assert (kind, rid, model, detail) == ("engine_added", "fx-slow-0", "slow", "started ms=800 poll=true")
    assert wall_ns % 1_000_000_000 == 588_560_000  # .588560 s: the microseconds are kept


def test_the_log_source_follows_the_file_and_waits_for_whole_lines(tmp_path):
    path = tmp_path / "triton.log"
    lines = LOG.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:4]) + lines[4][:30])  # the fifth line still being written
    src = TritonLogSource(str(path), target="t0", from_start=True)
    assert src.check() is None
    src.sample(0, 0)
    first = src.take_events()
    assert [e.request_id for e in first] == ["fx-slow-0"]
    with path.open("a") as f:
        f.write(lines[4][30:] + "".join(lines[5:]))
    samples = {s.metric: s.value for s in src.sample(0, 0)}
    rest = src.take_events()
    assert len(first) + len(rest) == 12 and samples["engine_log_requests_added_total"] == 6
    assert rest[0].request_id == "fx-gen-0" and rest[0].data["model"] == "generator"
    missing = TritonLogSource(str(tmp_path / "none.log"), target="t0")
    assert "tritonserver's log" in missing.check()
