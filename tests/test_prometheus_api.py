"""The importer's pure parts: times and steps as a user types them, the chunking under Prometheus's
11,000-points limit, and how range-query results land on the run's grid (current names win, MiB become
bytes, a missing step stays missing)."""

from __future__ import annotations

import numpy as np
import pytest

from cancelwatch.collectors.recording.prometheus_import import _gaps, _place, _selector
from cancelwatch.collectors.sources.prometheus_api import MAX_POINTS, PrometheusHistory, parse_duration, parse_time

NOW = 1_796_000_000.0


@pytest.mark.parametrize("text, seconds", [("500ms", 0.5), ("15s", 15), ("1m", 60), ("2h", 7200), ("7d", 604800)])
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["15", "15x", "-1m", "0s", "m"])
def test_bad_durations_name_the_form(text):
    with pytest.raises(ValueError, match="15s, 1m, 2h or 7d"):
        parse_duration(text)


def test_times():
    assert parse_time("now", NOW) == NOW and parse_time("now-2h", NOW) == NOW - 7200
    assert parse_time("1796000000.5", NOW) == 1796000000.5
    # ISO 8601 without a zone is UTC
    assert parse_time("2026-11-30T00:00:00Z", NOW) == parse_time("2026-11-30T00:00:00", NOW) == 1795996800.0
    assert parse_time("2026-11-30T01:00:00+01:00", NOW) == parse_time("2026-11-30T00:00:00Z", NOW)
    with pytest.raises(ValueError, match="not a time"):
        parse_time("yesterday", NOW)


def test_chunks_cover_the_window_on_one_grid_under_the_limit():
    prom = PrometheusHistory("http://127.0.0.1:1")
    chunks = prom.chunks(0.0, 7 * 86400.0, 15.0)
    assert chunks[0][0] == 0.0 and chunks[-1][1] == 7 * 86400.0
    for lo, hi in chunks:
        assert (hi - lo) / 15.0 + 1 <= MAX_POINTS and lo % 15.0 == 0
    for (_, hi), (lo, _) in zip(chunks, chunks[1:]):
        assert lo == hi + 15.0  # no step twice, none left out


def test_selector_merges_the_match():
    assert _selector("vllm:num_requests_running", '{job="vllm"}') == 'vllm:num_requests_running{job="vllm"}'
    assert _selector("DCGM_FI_DEV_FB_USED", "") == "DCGM_FI_DEV_FB_USED"


def test_results_land_on_the_grid_current_names_win_and_mib_become_bytes():
    grid = 100.0 + np.arange(5) * 15.0
    blocks, ranks = {}, {}
    labels = {"__name__": "x", "instance": "10.0.0.5:8000", "job": "vllm", "model_name": "m", "engine": "0"}
    _place({"metric": labels, "values": [[100, "0.5"], [130, "0.7"]]}, "vllm:gpu_cache_usage_perc", "vllm",
           grid, 15.0, blocks, ranks)
    _place({"metric": labels, "values": [[115, "0.6"], [145, "0.8"]]}, "vllm:kv_cache_usage_perc", "vllm",
           grid, 15.0, blocks, ranks)
    _place({"metric": labels, "values": [[100, "0.1"]]}, "vllm:gpu_cache_usage_perc", "vllm", grid, 15.0,
           blocks, ranks)  # the old name again, after the current one: ignored
    (series,) = blocks[("vllm", "10.0.0.5:8000")].values()
    np.testing.assert_array_equal(series, [np.nan, 0.6, np.nan, 0.8, np.nan])  # only the current name's points
    (key,) = blocks[("vllm", "10.0.0.5:8000")]
    assert key == ("kv_cache_usage_ratio", (("engine", "0"), ("model_name", "m")))
    _place({"metric": {"gpu": "0", "UUID": "GPU-1", "Hostname": "node-a", "instance": "x:9400"},
            "values": [[100, "81920"]]}, "DCGM_FI_DEV_FB_USED", "gpu", grid, 15.0, blocks, ranks)
    ((metric, lab), values), = blocks[("dcgm", "node-a")].items()
    assert metric == "gpu_memory_used_bytes" and dict(lab) == {"gpu": "0", "uuid": "GPU-1"}
    assert values[0] == 80 * 1024**3


def test_missing_steps_are_gaps():
    grid = np.arange(10) * 1.0
    present = np.array([1, 1, 0, 0, 0, 1, 1, 1, 0, 0], dtype=bool)
    gaps = _gaps("vllm", "r", grid, present, 1.0)
    assert [g.ticks for g in gaps] == [3, 2]
    assert gaps[0].start_mono_ns == 2_000_000_000 and gaps[0].end_mono_ns == 5_000_000_000
