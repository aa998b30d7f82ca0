"""Golden parser tests on real /metrics bodies recorded from the embedded engine (vLLM 0.32, CPU), and
the vLLM source reading them over a loopback socket (tests/fixture_server.py): full and filtered scrapes."""

from __future__ import annotations

from urllib.parse import parse_qs, urlsplit

import pytest

from cancelwatch.collectors.sources.base import ParseError
from cancelwatch.collectors.sources.vllm import (
    ALIASES,
    LineMemo,
    VllmMetricsSource,
    cache_config,
    model_names,
    parse_vllm_metrics,
)
from tests.conftest import FIXTURES

V032 = FIXTURES / "vllm" / "0.32"


def values(samples, metric):
    return {s.labels: s.value for s in samples if s.metric == metric}


def one(samples, metric):
    vals = values(samples, metric)
    assert len(vals) == 1, f"{metric}: {vals}"
    return next(iter(vals.values()))


@pytest.mark.parametrize(
    "fixture, running, waiting, kv",
    [("idle.txt", 0, 0, 0.0), ("loaded.txt", 4, 2, 0.7619047619047619), ("after_cancel.txt", 0, 2, 0.0)],
)
def test_golden_scheduler_values(fixture, running, waiting, kv):
    samples = parse_vllm_metrics((V032 / fixture).read_text(), 11, 22)
    assert one(samples, "requests_running") == running
    assert one(samples, "requests_waiting") == waiting
    assert one(samples, "kv_cache_usage_ratio") == pytest.approx(kv)
    assert all(s.wall_ns == 11 and s.mono_ns == 22 and s.source == "vllm" for s in samples)
    # every series keeps vLLM's labels (cache_config_info carries no model_name in 0.32)
    assert {dict(s.labels).get("model_name") for s in samples if s.metric != "vllm:cache_config_info"} == {"tiny"}
    assert one(samples, "requests_running") == values(samples, "requests_running")[(("engine", "0"), ("model_name", "tiny"))]


def test_loaded_counters_and_label_sets():
    samples = parse_vllm_metrics((V032 / "loaded.txt").read_text(), 0, 0)
    assert one(samples, "prefix_cache_hits_tokens_total") == 5760.0
    assert one(samples, "prefix_cache_queries_tokens_total") == 17000.0
    finished = {dict(k)["finished_reason"]: v for k, v in values(samples, "requests_finished_total").items()}
    assert finished == {"stop": 0.0, "length": 12.0, "abort": 0.0, "error": 0.0, "repetition": 0.0}
    reasons = {dict(k)["reason"] for k in values(samples, "vllm:num_requests_waiting_by_reason")}
    assert reasons == {"capacity", "deferred"}
    names = {s.metric for s in samples}
    # buckets and _created are dropped; _sum/_count of histograms kept; nothing but vLLM series
    assert not any(n.endswith(("_bucket", "_created")) for n in names)
    assert "vllm:time_to_first_token_seconds_count" in names
    assert all(n.startswith("vllm:") or "vllm:" + n not in names for n in names)
    assert not any(n.startswith("python_") or n.startswith("process_") for n in names)
    # the old and new KV name never both appear
    assert "vllm:kv_cache_usage_perc" not in names and "vllm:gpu_cache_usage_perc" not in names


def test_cache_config_becomes_metadata():
    samples = parse_vllm_metrics((V032 / "idle.txt").read_text(), 0, 0)
    cfg = cache_config(samples)
    assert cfg["num_gpu_blocks"] == "64"
    assert cfg["block_size"] == "128"
    assert cfg["kv_cache_size_tokens"] == "8192"
    assert cfg["enable_prefix_caching"] == "True"
    assert "engine" not in cfg and "model_name" not in cfg
    assert model_names(samples) == ["tiny"]


def test_old_style_body_lands_on_the_same_series():
    samples = parse_vllm_metrics((FIXTURES / "vllm" / "0.10-style.txt").read_text(), 0, 0)
    assert one(samples, "kv_cache_usage_ratio") == pytest.approx(0.42)
    assert one(samples, "prefix_cache_queries_tokens_total") == 4096.0
    assert one(samples, "prefix_cache_hits_tokens_total") == 1024.0
    assert one(samples, "requests_running") == 3.0
    assert cache_config(samples)["num_gpu_blocks"] == "2048"
    assert not any(s.metric.startswith("python_") for s in samples)


def test_new_name_wins_when_both_are_sent():
    body = (
        'vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.5\n'
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n'
        'vllm:gpu_prefix_cache_hits_total{engine="0",model_name="m"} 7.0\n'
    )
    samples = parse_vllm_metrics(body, 0, 0)
    assert one(samples, "kv_cache_usage_ratio") == 0.25
    assert one(samples, "prefix_cache_hits_tokens_total") == 7.0


@pytest.mark.parametrize(
    "body, message",
    [
        ("vllm:num_requests_running{engine=\"0\"} 1.0\nvllm:num_requests_wai", "truncated"),
        ("<html>502 Bad Gateway</html>\n", "no vllm: series"),
        ("vllm:num_requests_running{engine=\"0\" 1.0\n", "unparseable"),
        ("vllm:num_requests_running{engine=\"0\"} one\n", "unparseable"),
        ("", "truncated"),
    ],
)
def test_bad_bodies_raise_parse_errors(body, message):
    with pytest.raises(ParseError, match=message):
        parse_vllm_metrics(body, 0, 0)


def test_memo_gives_the_same_samples():
    memo = LineMemo()
    for name in ("idle.txt", "loaded.txt", "after_cancel.txt", "loaded.txt"):
        text = (V032 / name).read_text()
        assert sorted(parse_vllm_metrics(text, 1, 2, memo=memo), key=repr) == sorted(
            parse_vllm_metrics(text, 1, 2), key=repr
        )


def series(samples) -> dict:
    return {(s.metric, s.labels): s.value for s in samples}


def test_the_source_reads_a_full_body_then_only_the_names_it_keeps(metrics_server):
    body = (V032 / "loaded.txt").read_text()
    server = metrics_server(body)
    src = VllmMetricsSource(server.url, "t0")
    try:
        assert src.check() is None
        got = [src.sample(2 * i, 2 * i + 1) for i in range(3)]
    finally:
        src.close()
    want = series(parse_vllm_metrics(body, 0, 0))
    # between full bodies only the series the analysis reads are asked for (each scrape costs the API
    # server CPU in proportion to the names asked), with the same values as in the full body
    fast = {k: v for k, v in want.items() if k[0] in {a for a, _ in ALIASES.values()}}
    assert len(fast) >= 9 and len(want) > 3 * len(fast)
    assert [series(g) for g in got] == [want, fast, fast]
    # the preflight and the first sample read full bodies; then the filtered route, twice
    assert [urlsplit(p).path for p in server.paths] == ["/metrics", "/metrics", "/metrics/", "/metrics/"]
    asked = set(parse_qs(urlsplit(server.paths[2]).query)["name[]"])
    assert "vllm:num_requests_running" in asked and "vllm:kv_cache_usage_perc" in asked
    assert asked <= set(ALIASES), asked - set(ALIASES)
    assert server.paths[3] == server.paths[2]


def test_a_404_on_the_filtered_scrape_falls_back_to_full_bodies(metrics_server):
    """A server without the filterable /metrics/ route: one filtered request, then full bodies only,
    and sampling goes on with the same series."""
    body = (V032 / "loaded.txt").read_text()
    server = metrics_server(body, filtered=404)
    src = VllmMetricsSource(server.url, "t0")
    try:
        got = [src.sample(2 * i, 2 * i + 1) for i in range(4)]
    finally:
        src.close()
    want = series(parse_vllm_metrics(body, 0, 0))
    assert [series(g) for g in got] == [want] * 4
    assert all(s.wall_ns == 2 and s.mono_ns == 3 for s in got[1])  # the second sample is its own scrape
    paths = [urlsplit(p) for p in server.paths]
    assert [(p.path, bool(p.query)) for p in paths] == [("/metrics", False), ("/metrics/", True),
                                                         ("/metrics", False), ("/metrics", False),
                                                         ("/metrics", False)]
    assert "vllm:num_requests_running" in parse_qs(paths[1].query)["name[]"]
