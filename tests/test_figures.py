"""The figures and tables in analysis/: downsampling keeps every cancel, gaps break lines, capacity
and the per-cancel table hold the run's own numbers, and the HTML report works offline."""

from __future__ import annotations

import math
import re
from html import escape
from pathlib import Path

import numpy as np
import pytest

from cancelwatch.analysis.cancel_table import LATENCY_COLUMNS, cancel_table
from cancelwatch.analysis.capacity import capacity
from cancelwatch.analysis.compare import compare_runs
from cancelwatch.analysis.anatomy import cancel_summary
from cancelwatch.analysis.explain import memory_story, pick_story_cancel
from cancelwatch.analysis.facts import VIEW_METRICS, kv_pool, run_facts
from cancelwatch.analysis.timeline import timeline_figure, trace_name
from cancelwatch.analysis.verdicts import judge_run
from bench.synthetic import write_synthetic_run
from cancelwatch.runstore.reader import load_run
from tests.conftest import cli

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "dashboard" / "sample" / "sample.db"


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    """Ten minutes at 20 Hz with 40 cancels (every 10th leaks), 6 sampling gaps, NVML on."""
    path = tmp_path_factory.mktemp("syn") / "syn.db"
    write_synthetic_run(path, duration_s=600, cancels=40, leak_every=10, gaps=6, filler_series=5)
    run = load_run(path, "latest", metrics=VIEW_METRICS)
    return path, run, judge_run(run)


def test_synthetic_verdicts_are_what_was_written(synthetic):
    _, _, verdicts = synthetic
    got = [v.verdict for v in verdicts]
    assert got == ["leaked" if (i + 1) % 10 == 0 else "released" for i in range(40)]


def test_downsampling_keeps_every_cancel_and_bounds_each_trace(synthetic):
    _, run, verdicts = synthetic
    fig = timeline_figure(run, verdicts, max_points=300)
    cancel_x = {round(x, 6) for t in fig.data if t.name and t.name.startswith("cancel: ") for x in t.x if x is not None}
    for v in verdicts:
        for p, t in v.timepoints.items():
            if t is not None:
                assert round(t, 6) in cancel_x, (v.request_id, p)
    stops = sorted(s.x0 for s in fig.layout.shapes if s.type == "line")
    assert stops == sorted(v.timepoints["user_stop"] for v in verdicts)
    for t in fig.data:
        if t.name and not t.name.startswith("cancel: ") and t.x is not None and len(t.x) > 1:
            assert len(t.x) <= 300 + 20, (t.name, len(t.x))  # the budget plus the gap breaks
    # downsampling keeps the extremes: the KV peak of the full series is still drawn
    kv = next(t for t in fig.data if trace_name(t) == "KV usage t0")
    full = run.samples[run.samples["metric"] == "kv_cache_usage_ratio"]["value"].max()
    assert math.isclose(np.nanmax(np.asarray(kv.y, dtype=float)), 100 * full, rel_tol=1e-9)


def test_gaps_are_drawn_as_gaps(synthetic):
    _, run, verdicts = synthetic
    fig = timeline_figure(run, verdicts)
    kv = next(t for t in fig.data if trace_name(t) == "KV usage t0")
    y = np.asarray(kv.y, dtype=float)
    x = np.asarray(kv.x, dtype=float)
    starts = run.gaps[run.gaps["source"] == "vllm"]["t_s"].to_numpy()
    assert len(starts) == 6
    for s in starts:
        i = int(np.argmin(np.abs(x - s)))
        assert np.isnan(y[i]), f"no break at the gap at {s:.2f} s"
    # and nothing of the gap was filled in: no KV point inside a gap
    for g in run.gaps.itertuples():
        inside = (x > g.t_s + 1e-9) & (x < g.end_t_s - 1e-9) & ~np.isnan(y)
        assert not inside.any()
    shaded = [s for s in fig.layout.shapes if s.type == "rect"]
    assert len(shaded) == 6


def test_memory_band_is_nvml_when_the_run_has_it(synthetic, tmp_path):
    _, run, verdicts = synthetic
    fig = timeline_figure(run, verdicts)
    assert "NVML" in fig.layout.annotations[0].text
    names = [trace_name(t) for t in fig.data]
    assert "gpu gpu 0 used" in names and "gpu gpu 0 + reserved by the driver" in names
    path = tmp_path / "cpu.db"
    write_synthetic_run(path, duration_s=60, cancels=3, nvml=False, filler_series=0, gaps=0)
    run2 = load_run(path, "latest", metrics=VIEW_METRICS)
    fig2 = timeline_figure(run2, judge_run(run2))
    assert "engine process memory" in fig2.layout.annotations[0].text
    assert "engine process memory" in [trace_name(t) for t in fig2.data]


def test_capacity_and_table_hold_the_runs_numbers(synthetic):
    _, run, verdicts = synthetic
    cap = capacity(run, 2048)
    assert cap["pool_tokens"] == 8192 and cap["pool_bytes"] == 8192 * 32768 and cap["max_concurrency"] == 4
    kv = run.samples[run.samples["metric"] == "kv_cache_usage_ratio"]["value"]
    assert math.isclose(cap["peak_kv"], kv.max()) and math.isclose(cap["p95_kv"], kv.quantile(0.95))
    # the synthetic target waits 0.1 s per 15 s cycle
    assert 0.002 < cap["waiting_share"] < 0.012
    assert cap["preemptions"] == 0
    assert capacity(run, 1000)["max_concurrency"] == 8
    with pytest.raises(ValueError):
        capacity(run, 0)
    table = cancel_table(run, verdicts)
    assert len(table) == 40 and list(table.columns[5:10]) == LATENCY_COLUMNS
    released = table[table["verdict"] == "released"]
    assert released["user stop → engine abort (ms)"].round(1).eq(1.0).all()
    assert released["user stop → app received (ms)"].isna().all()  # no app on this path
    assert released["evidence"].str.contains("engine abort: engine log").all()
    assert (released["engine abort → left scheduler (ms)"] <= 150).all()  # within three 50 ms samples
    assert released["neighbour"].str.startswith("completed").all()
    assert released["probe"].str.startswith("admitted, TTFT 100 ms").all()


def test_facts_and_story(synthetic):
    _, run, verdicts = synthetic
    facts = run_facts(run)
    assert facts["memory_source"] == "nvml" and facts["kv_pools"][0]["tokens"] == 8192
    assert facts["gap_ticks"] == 18
    whole = " ".join(memory_story(run, verdicts, None))
    assert "Of 40 cancels: 36 released, 4 leaked." in whole
    leaked = next(v for v in verdicts if v.verdict == "leaked")
    story = " ".join(memory_story(run, verdicts, leaked))
    assert "NOT released" in story and "GiB" in story
    released = verdicts[0]
    story = " ".join(memory_story(run, verdicts, released))
    assert "127.40 GiB" in story and re.search(r"\([+-]0\.0 %\)", story)  # NVML used stays flat across the cancel


def test_compare_has_one_column_per_run(synthetic):
    _, run, verdicts = synthetic
    sample = load_run(SAMPLE, "latest", metrics=VIEW_METRICS)
    df = compare_runs([("synthetic", run, verdicts), ("sample", sample, judge_run(sample))])
    assert list(df.columns) == ["synthetic", "sample"]
    assert df.loc["verdict: leaked", "synthetic"] == 4 and df.loc["cancels", "synthetic"] == 40
    with pytest.raises(ValueError):
        compare_runs([("a", run, verdicts), ("a", run, verdicts)])
    assert kv_pool(sample)["tokens"] == 8192


def test_report_html_is_offline_and_holds_the_page_figures(tmp_path):
    out = tmp_path / "report.html"
    res = cli("report", "latest", "--store", str(SAMPLE), "--html", str(out))
    assert res.returncode == 0, res.stderr
    html = out.read_text()
    assert not re.search(r"<script[^>]+src=", html)  # plotly.js is embedded, nothing fetched
    assert "plotly.js v" in html or "Plotly" in html
    assert html.count("Plotly.newPlot") == 4  # the summary bars, the zoomed story, the whole timeline, the pool
    run = load_run(SAMPLE, "latest", metrics=VIEW_METRICS)
    verdicts = judge_run(run)
    # the five-second picture comes first, with the run's own numbers, then the anatomy in the timeline
    summary = cancel_summary(run, pick_story_cancel(verdicts))
    first = summary["sentence"][0].upper() + summary["sentence"][1:]
    assert html.index(escape(first)) < html.index("Why is GPU memory still high?")
    assert re.match(r"Memory \d\.\d\d GiB before and after; the KV pool's used part went from \d+ MiB to \d+ MiB; "
                    r"the request left the engine \d+ ms after the stop; the next request got in \d+ ms later\.", first)
    for name in ("engine KV pool: used", "engine KV pool: free", "engine other", "engine process memory",
                 "total (measured)", "used at p95", "free at peak"):
        assert f'"name":"{name}"' in html, name
    for t in timeline_figure(run, verdicts).data:
        if t.name:
            assert f'"name":"{t.name}"' in html, t.name
    assert html.count(">released<") == sum(v.verdict == "released" for v in verdicts)
    assert "Why is GPU memory still high?" in html


def test_report_html_bad_paths_are_one_line_errors(tmp_path):
    res = cli("report", "latest", "--store", str(SAMPLE), "--html", str(tmp_path / "nope" / "r.html"))
    assert res.returncode == 2 and "does not exist" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    res = cli("report", "latest", "--store", str(tmp_path / "none.db"), "--html", str(tmp_path / "r.html"))
    assert res.returncode == 2 and "no run store" in res.stderr
    assert not (tmp_path / "r.html").exists()


def test_the_shipped_sample_is_released_on_the_engines_own_abort_lines():
    """The shipped sample run (make sample-run, direct to the embedded engine, its log read): every cancel
    released, each engine_abort the engine's own log line, and no app on these HTTP paths."""
    run = load_run(SAMPLE, "latest")
    verdicts = judge_run(run)
    assert verdicts and {v.verdict for v in verdicts} == {"released"}, [(v.scenario, v.rule) for v in verdicts]
    aborted = run.events[run.events["kind"] == "engine_aborted"].set_index("request_id")["t_s"]
    for v in verdicts:
        assert v.sources["engine_abort"] == {"source": "engine_log", "reason": None}, v
        assert v.timepoints["engine_abort"] == aborted.loc[[v.request_id]].min()
        assert v.sources["app_received"] == {"source": None, "reason": "no app on this path"}


def test_the_legend_names_each_kind_of_line_once_however_many_targets_draw_one():
    # the sample run again with a second target and process beside it (the relay of `make demo`): every memory
    # part, gauge and rate is drawn for each, and listed once
    import pandas as pd
    run = load_run(SAMPLE, "latest")
    one = timeline_figure(run, judge_run(run))
    twin = run.samples[run.samples["source"].isin(["vllm", "process"])].copy()
    twin["target"] = twin["target"].astype(str).map({"t0": "relay", "engine": "relay"})
    run.samples = pd.concat([run.samples, twin], ignore_index=True).sort_values("mono_ns", kind="stable")
    run.info["targets"] = [*run.info["targets"], {"label": "relay", "url": "http://127.0.0.1:8300"}]
    two = timeline_figure(run, judge_run(run))

    def listed(fig):
        return [t.name for t in fig.data if t.showlegend is not False]
    assert len(listed(two)) == len(set(listed(two))) == len(listed(one)) + 2, (listed(one), listed(two))
    assert {"running", "waiting", "KV usage", "prefix hit rate"} <= set(listed(two))
    assert {"running t0", "KV usage t0"} <= set(listed(one))  # a kind drawn once keeps whose it is
    full = [trace_name(t) for t in two.data]
    assert {"running t0", "running relay", "KV usage t0", "KV usage relay"} <= set(full), full
    assert len(two.data) > len(one.data)
    # each line still says whose it is where the reader points at it, a fill too, and the line styles are keyed
    kv = next(t for t in two.data if trace_name(t) == "KV usage relay")
    assert kv.text == "KV usage relay" and "%{text}" in kv.hovertemplate and kv.legendgroup == "KV usage"
    fills = [t for t in two.data if t.stackgroup]
    assert fills and all(t.text == trace_name(t) for t in fills), [(t.name, t.text) for t in fills]
    assert {"t0: solid lines", "relay: dot lines"} <= set(listed(two)) - set(listed(one)), listed(two)
