"""Runs with bursts (--burst-hz): samples at 20 Hz with 100 Hz stretches. Statistics over time must not
count the bursts' extra samples as extra time, and the timeline must not break its lines at every
baseline interval (the median interval of such a run can be the burst's)."""

from __future__ import annotations

import time

import numpy as np

from cancelwatch.analysis.capacity import capacity, time_with_waiting
from cancelwatch.analysis.timeline import _breaks
from cancelwatch.analysis.traces import metric_traces
from cancelwatch.runstore.reader import load_run
from cancelwatch.runstore.records import Sample, ScrapeRecord
from cancelwatch.runstore.writer import StoreWriter, create_run, open_store

T0 = 1_000_000_000_000


def write_burst_run(path, seconds=20.0, bursts=((2.0, 6.0), (8.0, 12.0), (14.0, 18.0))):
    """KV usage 0.9 inside the bursts, 0.1 outside; waiting 1 inside, 0 outside."""
    con = open_store(path)
    rid = create_run(con, name="bursty", targets=[{"label": "t0", "url": "http://127.0.0.1:9"}], engine={},
                     settings={"hz": 20.0, "burst_hz": 100.0, "burst_window_s": 4.0}, wall_ns=time.time_ns(),
                     mono_ns=T0)
    writer = StoreWriter(con, rid)
    t = np.arange(0, seconds, 0.01)
    inside = np.zeros(len(t), dtype=bool)
    for a, b in bursts:
        inside |= (t >= a) & (t < b)
    keep = inside | (np.round(t * 100).astype(int) % 5 == 0)  # every 50 ms outside, every 10 ms inside
    for i, (ti, hot) in enumerate(zip(t[keep], inside[keep])):
        mono = T0 + int(ti * 1e9)
        samples = [Sample("vllm", "kv_cache_usage_ratio", 0.9 if hot else 0.1, (), mono, mono),
                   Sample("vllm", "requests_waiting", 1.0 if hot else 0.0, (), mono, mono),
                   Sample("vllm", "requests_running", 1.0, (), mono, mono)]
        writer.put(ScrapeRecord("vllm", "t0", i, mono, mono, 1_000_000, True, samples))
    writer.close()
    con.close()
    return load_run(path, "latest")


def test_statistics_over_time_weigh_each_sample_by_the_time_it_stands_for(tmp_path):
    run = write_burst_run(tmp_path / "b.db")
    kv = run.series("kv_cache_usage_ratio")
    share_of_samples = float((kv["value"] > 0.5).mean())
    assert share_of_samples > 0.7  # by count, the bursts dominate: ~1200 of ~1360 samples
    waiting_s, observed_s = time_with_waiting(run, "t0")
    assert abs(observed_s - 20.0) < 0.2, observed_s
    assert abs(waiting_s - 12.0) < 0.2, waiting_s  # 3 bursts x 4 s, not ~88 % of the run
    cap = capacity(run, 2048, "t0")
    assert cap["p95_kv"] == 0.9  # 60 % of the time at 0.9: the p95 is 0.9 either way
    assert abs(cap["waiting_share"] - 0.6) < 0.02


def test_the_p95_is_time_weighted(tmp_path):
    # 0.9 for 0.8 s of 20 s (4 %): by count that is ~27 % of the samples, by time under 5 %
    run = write_burst_run(tmp_path / "b.db", bursts=((10.0, 10.8),))
    cap = capacity(run, 2048, "t0")
    assert cap["p95_kv"] == 0.1, cap["p95_kv"]
    assert cap["peak_kv"] == 0.9


def test_the_timeline_breaks_only_at_real_silences(tmp_path):
    run = write_burst_run(tmp_path / "b.db")
    (tr,) = metric_traces(run, "kv_cache_usage_ratio")
    assert float(np.median(np.diff(tr.t))) < 0.02  # the median interval is the burst's
    assert len(_breaks(run, tr)) == 0  # yet no 50 ms baseline interval is a silence
