"""Memory anatomy on recorded runs: the parts add up to the measured total, the KV pool's used part is
KV usage x pool bytes, and no part is drawn where its input was not measured."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from cancelwatch.analysis.anatomy import KV_FREE, KV_USED, OTHER, WEIGHTS, memory_anatomy
from cancelwatch.analysis.capacity import capacity, capacity_figure
from cancelwatch.analysis.facts import VIEW_METRICS, kv_pool
from cancelwatch.analysis.timeline import timeline_figure, trace_name
from cancelwatch.analysis.traces import GiB, metric_traces
from cancelwatch.analysis.verdicts import judge_run
from bench.synthetic import write_synthetic_run
from cancelwatch.runstore.reader import load_run

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "dashboard" / "sample" / "sample.db"


@pytest.fixture(scope="module")
def gappy(tmp_path_factory):
    """A synthetic GPU run whose scheduler source has 6 gaps while NVML keeps sampling."""
    path = tmp_path_factory.mktemp("anatomy") / "syn.db"
    write_synthetic_run(path, duration_s=120, cancels=8, leak_every=0, gaps=6, filler_series=0)
    return load_run(path, "latest", metrics=VIEW_METRICS)


def test_the_parts_add_up_to_the_measured_total_at_every_sample():
    run = load_run(SAMPLE, "latest")
    (a,) = memory_anatomy(run)
    assert a.kind == "process" and a.pool_bytes == kv_pool(run, "t0")["bytes"] == 256 * 2**20
    whole = np.vstack([a.parts[p] for p in a.parts])
    measured = ~np.isnan(whole).any(axis=0)
    assert measured.mean() > 0.95  # the sample run's KV and RSS samples match almost everywhere
    assert np.abs(whole[:, measured].sum(axis=0) - a.total[measured]).max() <= 1.0  # bytes
    assert np.array_equal(a.parts[KV_USED] + a.parts[KV_FREE], np.where(measured, a.pool_bytes, np.nan),
                          equal_nan=True)


def test_the_used_part_is_kv_usage_times_the_pool_bytes_at_the_nearest_kv_sample():
    run = load_run(SAMPLE, "latest")
    (a,) = memory_anatomy(run)
    (kv,) = [k for k in metric_traces(run, "kv_cache_usage_ratio") if k.target == "t0"]
    for i in range(0, len(a.t), 37):
        if np.isnan(a.parts[KV_USED][i]):
            continue
        j = int(np.argmin(np.abs(kv.t - a.t[i])))
        assert abs(kv.t[j] - a.t[i]) <= 0.025  # the same tick
        assert a.parts[KV_USED][i] == round(kv.v[j] * a.pool_bytes)
    # the cancels moved the used part: it was not flat the way the total is
    assert np.nanmax(a.parts[KV_USED]) > 60 * 2**20 and np.nanmin(a.parts[KV_USED]) == 0
    assert (np.nanmax(a.total) - np.nanmin(a.total)) / np.nanmax(a.total) < 0.05


def test_a_gap_in_the_kv_samples_stays_a_gap_in_the_pool_split(gappy):
    (a,) = memory_anatomy(gappy)
    assert a.kind == "nvml" and WEIGHTS not in a.parts and "weights" in " ".join(a.notes)
    gaps = gappy.gaps[gappy.gaps["source"] == "vllm"]
    assert len(gaps) == 6
    for g in gaps.itertuples():
        inside = (a.t >= g.t_s - 1e-6) & (a.t < g.end_t_s - 1e-6)  # the missed ticks
        assert inside.any()
        assert np.isnan(a.parts[KV_USED][inside]).all() and np.isnan(a.parts[KV_FREE][inside]).all()
        assert not np.isnan(a.total[inside]).any()  # NVML measured on: the total stands
        assert not np.isnan(a.parts[OTHER][inside]).any()


def test_the_timeline_stacks_the_parts_under_the_total_line(gappy):
    fig = timeline_figure(gappy, judge_run(gappy))
    by_name = {trace_name(t): t for t in fig.data}
    total = by_name["gpu gpu 0 used"]
    stack = [by_name[f"gpu gpu 0 {p}"] for p in (OTHER, KV_USED, KV_FREE)]
    assert all(t.stackgroup == "anatomy gpu gpu 0" for t in stack) and total.stackgroup is None
    # readable without colour: each part has its own fill pattern or is the plain bottom layer
    assert {t.fillpattern.shape for t in stack} == {None, "/", "."}
    x = np.asarray(total.x, dtype=float)
    y = np.asarray(total.y, dtype=float)
    parts = np.vstack([np.asarray(t.y, dtype=float) for t in stack])
    assert all(np.array_equal(np.asarray(t.x, dtype=float), x) for t in stack)
    ok = ~np.isnan(parts).any(axis=0)
    assert ok.sum() > 100
    assert np.abs(parts[:, ok].sum(axis=0) - y[ok]).max() * GiB <= 1.0
    assert "reserved memory" in fig.layout.annotations[0].text


def test_the_capacity_drawing_splits_each_pool_into_its_p95_peak_and_free_parts(gappy):
    sample = load_run(SAMPLE, "latest")
    caps = [("sample", capacity(sample, 2048)), ("synthetic", capacity(gappy, 1000))]
    fig = capacity_figure(caps)
    bars = {t.name: t for t in fig.data}
    assert list(bars) == ["used at p95", "peak above p95", "free at peak"]
    assert {t.marker.pattern.shape for t in fig.data} == {"/", "x", "."}  # readable without colour
    for i, (_, c) in enumerate(caps):
        parts = [bars[name].x[i] for name in bars]
        assert abs(sum(parts) - c["pool_tokens"]) <= 2  # three rounded parts of one pool
        assert parts[0] == round(c["p95_kv"] * c["pool_tokens"]) and parts[2] == c["headroom_tokens"]
        assert f"room for {c['headroom_requests']} more request(s) of {c['context_len']} tokens" in \
            fig.layout.annotations[i].text
    assert capacity(sample, 2048)["headroom_requests"] == capacity(sample, 2048)["headroom_tokens"] // 2048
