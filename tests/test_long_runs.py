"""A day's run as the page opens it (issue 21 point 3): the overview the writer keeps as samples land, the
verdicts a live judge stores with the run, and a long run's view built from those without its samples."""

from __future__ import annotations

import json
import math
import random
import shutil
import sqlite3
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import cancelwatch.analysis.long_runs as long_runs
from cancelwatch.analysis.facts import VERDICT_METRICS, VIEW_METRICS
from cancelwatch.analysis.long_runs import is_long, long_run_verdicts, stops
from cancelwatch.analysis.summary import sampling_stats
from cancelwatch.analysis.verdicts import judge_run
from cancelwatch.analysis.verdicts.stored import from_stored, judged_by, stored
from cancelwatch.analysis.watching import LOOKBACK_S
from bench.synthetic import write_synthetic_run
from cancelwatch.runstore.overview import BUCKET_NS
from cancelwatch.runstore.reader import load_overview, load_run, load_verdicts, load_window, overview_span_s
from cancelwatch.runstore.records import Sample, ScrapeRecord
from cancelwatch.runstore.schema import OVERVIEW_S
from cancelwatch.runstore.writer import StoreWriter, create_run, finish_run, open_store, write_verdicts

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "dashboard" / "sample" / "sample.db"
T0, W0 = 5_000_000_000, 1_790_000_000_000_000_000
NO_ROWS = pd.DataFrame(columns=["request_id", "judged_by", "body"])


def oracle(run) -> pd.DataFrame:
    """Per series and bucket, from the whole run's samples: count, min, max and last non-NaN value."""
    s = run.samples.assign(bucket=(run.samples["mono_ns"] - run.info["started_mono_ns"]) // BUCKET_NS)
    s = s.astype({"metric": str, "labels": str, "source": str, "target": str})
    out = s.groupby(["source", "target", "metric", "labels", "bucket"]).agg(
        n=("value", "size"), vmin=("value", "min"), vmax=("value", "max"),
        vlast=("value", lambda v: v.dropna().iloc[-1] if v.notna().any() else math.nan))
    return out.sort_index()


def stored_overview(path: Path, rid: int) -> pd.DataFrame:
    con = sqlite3.connect(path)
    df = pd.read_sql_query("SELECT s.source, s.target, s.metric, s.labels, o.bucket, o.n, o.vmin, o.vmax, o.vlast "
                           "FROM overview o JOIN series s ON s.id = o.series_id WHERE o.run_id = ?", con, params=(rid,))
    con.close()
    return df.set_index(["source", "target", "metric", "labels", "bucket"]).sort_index()


def test_the_writer_keeps_each_buckets_count_min_max_and_last_as_batches_land(tmp_path):
    """Through StoreWriter, as a recording writes: scrapes over four buckets in many small batches (a bucket is
    filled by several), with NaN values and a failed read; against the whole run's samples."""
    path = tmp_path / "cw.db"
    con = open_store(path)
    rid = create_run(con, name="overview", targets=[{"label": "t0", "url": "http://127.0.0.1:8000"}],
                     engine={}, settings={"hz": 20.0}, wall_ns=W0, mono_ns=T0)
    writer = StoreWriter(con, rid, flush_s=0.005)
    rng = random.Random(3)
    step = BUCKET_NS // 25  # 25 reads a bucket, over 4 buckets
    for tick in range(100):
        at = T0 + tick * step + 7
        if tick == 40:  # a failed read: no samples, counted as failed in its bucket
            writer.put(ScrapeRecord("vllm", "t0", tick, W0 + at - T0, at, 9_000_000, False, []))
            continue
        kv = math.nan if tick % 25 in (3, 24) else rng.random()
        running = float(rng.randint(0, 4)) if tick // 25 != 2 else math.nan  # bucket 2: NaN throughout
        writer.put(ScrapeRecord("vllm", "t0", tick, W0 + at - T0, at, 2_000_000 + tick, True, [
            Sample("vllm", "kv_cache_usage_ratio", kv, (("engine", "0"),), W0 + at - T0, at),
            Sample("vllm", "requests_running", running, (("engine", "0"),), W0 + at - T0, at),
            Sample("vllm", "requests_running", 1.0, (("engine", "1"),), W0 + at - T0, at)]))
    writer.close()
    finish_run(con, rid, "completed", {}, ended_wall_ns=W0 + 100 * step)
    con.close()

    run = load_run(path, rid)
    want, got = oracle(run), stored_overview(path, rid)
    assert list(got.index) == list(want.index) and len(got) == 12  # 3 series x 4 buckets
    assert (got["n"] == want["n"]).all()
    for col in ("vmin", "vmax", "vlast"):
        assert np.allclose(got[col].astype(float), want[col].astype(float), equal_nan=True), col
    nan_bucket = got.xs(("requests_running", '{"engine": "0"}', 2), level=("metric", "labels", "bucket"))
    assert nan_bucket[["vmin", "vmax", "vlast"]].isna().all(axis=None)
    # the scrapes' counts per source: what sampling_stats of the overview says is what it says of the whole run
    whole = sampling_stats(run).set_index(["source", "target"])
    over = sampling_stats(load_overview(path, rid)).set_index(["source", "target"])
    for col in ("scrapes_ok", "scrapes_failed", "samples", "gaps", "gap_ticks"):
        assert (over[col] == whole[col]).all(), col
    assert over["effective_hz"].to_numpy() == pytest.approx(whole["effective_hz"].to_numpy())
    assert over["scrape_p50_ms"].isna().all()  # no percentile from counts per bucket: said, not guessed


@pytest.fixture(scope="module")
def day(tmp_path_factory):
    """A synthetic run (bench/synthetic.py: every fifth cancel lost) written in blocks, as the benchmarks do."""
    path = tmp_path_factory.mktemp("long") / "day.db"
    rid = write_synthetic_run(path, duration_s=900, cancels=30, leak_every=5, filler_series=3, name="day")
    return path, rid


def test_a_run_written_in_blocks_has_the_same_overview(day):
    path, rid = day
    want, got = oracle(load_run(path, rid)), stored_overview(path, rid)
    assert list(got.index) == list(want.index)
    assert (got["n"] == want["n"]).all()
    for col in ("vmin", "vmax", "vlast"):
        assert np.allclose(got[col].astype(float), want[col].astype(float), equal_nan=True), col


def test_the_overview_keeps_every_peak_and_every_table_but_the_samples(day):
    path, rid = day
    whole, over = load_run(path, rid, metrics=VIEW_METRICS), load_overview(path, rid, metrics=VIEW_METRICS)
    assert overview_span_s(path, rid) == pytest.approx(whole.scrapes["t_s"].max(), abs=0.06)
    assert len(over.samples) < len(whole.samples) / 50
    for metric in ("requests_running", "kv_cache_usage_ratio", "gpu_memory_used_bytes"):
        w, o = whole.series(metric)["value"], over.series(metric)["value"]
        assert o.max() == w.max() and o.min() == w.min(), metric
    # each bucket's two samples lie inside the bucket: its min a quarter in, its max three quarters in
    s = over.series("requests_running")
    inside = np.mod(s["t_s"].to_numpy(), OVERVIEW_S)
    at_min = s["scrape_id"].to_numpy() % 2 == 1  # ids -(2 bucket + 1) for the min, -(2 bucket + 2) for the max
    assert np.allclose(inside[at_min], OVERVIEW_S / 4) and np.allclose(inside[~at_min], 3 * OVERVIEW_S / 4)
    assert at_min.sum() == (~at_min).sum() == len(np.unique(np.floor(s["t_s"].to_numpy() / OVERVIEW_S)))
    for name in ("events", "ledger", "gaps"):
        assert len(getattr(over, name)) == len(getattr(whole, name)) > 0, name
    assert over.info["overview"]["bucket_s"] == OVERVIEW_S and over.scrapes.empty


def test_a_stored_verdict_reads_back_as_it_was_given(day):
    path, rid = day
    verdicts = judge_run(load_run(path, rid))
    assert {v.verdict for v in verdicts} == {"released", "leaked"}
    for v in verdicts:
        back = from_stored(json.loads(json.dumps(stored(v))))
        assert json.dumps(back.as_json(), sort_keys=True) == json.dumps(v.as_json(), sort_keys=True)


def test_a_long_runs_verdicts_are_the_stored_ones_and_the_rest_judged_on_their_windows(day, tmp_path):
    """Half the cancels stored by these rules, one of them altered (proof it is read, not judged again), one by
    other rules (judged again, not shown); the rest judged on their own windows. Every verdict is the whole run's."""
    src, rid = day
    path = tmp_path / "day.db"
    shutil.copy(src, path)
    whole = {v.request_id: v for v in judge_run(load_run(path, rid))}
    ids = list(stops(load_overview(path, rid))["request_id"])
    assert ids == list(whole) and len(ids) == 30
    altered = dict(stored(whole[ids[0]]), verdict="stale_gauge")
    other_rules = dict(stored(whole[ids[1]]), verdict="stale_gauge")
    con = open_store(path)
    with con:
        write_verdicts(con, rid, judged_by(), [(ids[0], altered), *[(i, stored(whole[i])) for i in ids[2:15]]])
        write_verdicts(con, rid, "window 0000000000000000", [(ids[1], other_rules)])
    con.close()
    windows = []

    def window(lo, hi):
        windows.append((lo, hi))
        return load_window(path, rid, lo, hi, lookback_s=LOOKBACK_S)

    got = long_run_verdicts(load_overview(path, rid, metrics=VIEW_METRICS), load_verdicts(path, rid), window)
    assert [v.request_id for v in got] == ids
    assert got[0].verdict == "stale_gauge"  # the stored one, as stored
    assert len(windows) == 1 + 15  # the one stored by other rules, and the 15 never stored
    for v in got[1:]:
        assert json.dumps(v.as_json(), sort_keys=True) == json.dumps(whole[v.request_id].as_json(), sort_keys=True)
    # a run still recorded: a cancel whose window reaches past what is recorded is left to the live judge
    t_last = stops(load_overview(path, rid))["t_s"].max()
    partial = long_run_verdicts(load_overview(path, rid), load_verdicts(path, rid), window, now_s=t_last + 1.0)
    assert [v.request_id for v in partial] == ids[:-1]


def test_a_store_from_before_the_overview_reads_as_before(tmp_path):
    path = tmp_path / "old.db"
    shutil.copy(SAMPLE, path)
    con = sqlite3.connect(path)
    assert not con.execute("SELECT 1 FROM sqlite_master WHERE name IN ('overview', 'verdicts')").fetchall()
    con.close()
    assert overview_span_s(path, "latest") is None and not is_long(None)
    assert load_verdicts(path, "latest").empty
    before = judge_run(load_run(path, "latest"))
    open_store(path).close()  # written again: it gains the tables, its runs none of their rows
    assert overview_span_s(path, "latest") is None
    assert [v.verdict for v in judge_run(load_run(path, "latest"))] == [v.verdict for v in before]


def test_how_long_a_run_must_be_to_open_from_its_overview(monkeypatch):
    assert not is_long(long_runs.LONG_RUN_S) and is_long(long_runs.LONG_RUN_S + 1)
    monkeypatch.setattr(long_runs, "LONG_RUN_S", 60.0)
    assert is_long(61.0) and not is_long(61.0, long_run_s=120.0)


def never_read_whole(day, tmp_path, monkeypatch) -> tuple[Path, int, list[str]]:
    """The day's run copied into `tmp_path`, its verdicts judged whole (as JSON), then the long-run bound lowered
    to 5 minutes and load_run refusing: from here on the run is long and must never be read whole."""
    import cancelwatch.runstore.reader as reader

    src, rid = day
    path = tmp_path / "day.db"
    shutil.copy(src, path)
    whole = [json.dumps(v.as_json(), sort_keys=True) for v in judge_run(load_run(path, rid))]
    monkeypatch.setattr(long_runs, "LONG_RUN_S", 300.0)

    def refused(*args, **kwargs):
        raise AssertionError("a long run is never read whole")

    monkeypatch.setattr(reader, "load_run", refused)
    return path, rid, whole


def test_the_report_of_a_long_run_never_reads_it_whole_and_the_recorders_tail_keeps_its_verdicts(day, tmp_path,
                                                                                                monkeypatch):
    """`cancelwatch report` (in this process, the bound lowered) and record's own tail on a long run: every
    cancel judged on its own window, the same verdicts as the whole run gives; the tail stores them, the report
    only reads. The run is never read whole (load_run refuses here)."""
    from typer.testing import CliRunner

    from cancelwatch.cli import app
    from cancelwatch.report_commands import judged_run

    path, rid, whole = never_read_whole(day, tmp_path, monkeypatch)
    res = CliRunner().invoke(app, ["report", str(rid), "--json", "--store", str(path)])
    assert res.exit_code in (0, 1), res.output
    doc = json.loads(res.stdout)
    assert [json.dumps(c, sort_keys=True) for c in doc["cancels"]] == whole
    assert load_verdicts(path, rid).empty  # a report reads: nothing written
    run, verdicts = judged_run(path, rid, None, keep=True)  # record's tail
    assert "overview" in run.info
    assert [json.dumps(v.as_json(), sort_keys=True) for v in verdicts] == whole
    rows = load_verdicts(path, rid)
    assert len(rows) == 30 and set(rows["judged_by"]) == {judged_by()}
    # another grace is judged again with it, and not kept as if the run's own
    _, other = judged_run(path, rid, 0.5, keep=True)
    assert {v.evidence.grace_s for v in other} == {0.5}
    assert set(load_verdicts(path, rid)["judged_by"]) == {judged_by()}
    assert [json.dumps(stored(v), sort_keys=True) for v in verdicts] == \
        [json.dumps(b, sort_keys=True) for b in load_verdicts(path, rid).set_index("request_id").loc[
            [v.request_id for v in verdicts], "body"]]


def test_records_own_report_reads_a_run_past_ten_minutes_from_its_overview_and_its_live_verdicts(day, tmp_path,
                                                                                                 monkeypatch, capsys):
    """`record`'s end (report_recorded) on a 15-minute run, with no bound lowered: the verdicts its live judge kept
    are the table's (one altered: proof it is read, not judged again), the cancels it had not judged yet (the last
    ones) are judged on their windows and kept; the run is never read whole (load_run refuses here)."""
    import types

    import typer

    import cancelwatch.runstore.reader as reader
    from cancelwatch.cancel_commands import report_recorded

    src, rid = day
    path = tmp_path / "day.db"
    shutil.copy(src, path)
    assert overview_span_s(path, rid) > long_runs.RECORDED_LONG_S and not is_long(overview_span_s(path, rid))
    whole = {v.request_id: v for v in judge_run(load_run(path, rid))}
    ids = list(whole)
    released = next(i for i in ids[:25] if whole[i].verdict == "released")
    con = open_store(path)
    with con:  # as the live judge kept them: all but the last five, one of them altered
        write_verdicts(con, rid, judged_by(), [(i, dict(stored(whole[i]), verdict="stale_gauge") if i == released
                                                else stored(whole[i])) for i in ids[:25]])
    con.close()

    def refused(*args, **kwargs):
        raise AssertionError("record's report never reads a run past RECORDED_LONG_S whole")

    monkeypatch.setattr(reader, "load_run", refused)
    result = types.SimpleNamespace(run_id=rid, stats={}, status="completed", exit_code=0)
    with pytest.raises(typer.Exit) as ended:
        report_recorded(path, result, 2.0)
    assert ended.value.exit_code == 1  # leaks, and the altered stale gauge: not accepted
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("│")]
    said = {i[-8:]: next(line for line in table if i[-8:] in line) for i in ids}
    assert " stale_gauge " in said[released[-8:]]
    assert all(f" {whole[i].verdict} " in said[i[-8:]] for i in ids if i != released)
    rows = load_verdicts(path, rid).set_index("request_id")
    assert len(rows) == 30  # the five it had not judged are kept now, as the whole run judges them
    assert all(json.dumps(rows.loc[i, "body"], sort_keys=True) == json.dumps(stored(whole[i]), sort_keys=True)
               for i in ids[25:])


def test_records_report_of_a_long_run_whose_store_filled_up_is_printed_and_says_what_was_not_kept(day, tmp_path,
                                                                                                  monkeypatch, capsys):
    """A record past RECORDED_LONG_S that ended for a full disk: its end still reads the run (reading works) and
    prints the table and the store's line; the verdicts it judged and could not keep are said, never a traceback."""
    import sqlite3
    import types

    import typer

    import cancelwatch.runstore.writer as writer_mod
    from cancelwatch.cancel_commands import report_recorded

    src, rid = day
    path = tmp_path / "day.db"
    shutil.copy(src, path)

    def full(*args, **kwargs):
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(writer_mod, "write_verdicts", full)
    result = types.SimpleNamespace(run_id=rid, stats={"store_error": "database or disk is full"}, status="failed",
                                   exit_code=1)
    with pytest.raises(typer.Exit) as ended:
        report_recorded(path, result, 2.0)
    assert ended.value.exit_code == 1
    said = capsys.readouterr()
    ids = list(stops(load_overview(path, rid))["request_id"])
    assert len(ids) == 30 and all(i[-8:] in said.out for i in ids)  # every cancel in the table
    assert "30 verdict(s) not kept in the run" in said.err and "database or disk is full" in said.err
    assert load_verdicts(path, rid).empty


def test_a_cancel_whose_request_the_log_names_late_is_judged_again_on_a_longer_window(tmp_path):
    """As the live judge does (ENTRY_WAIT_S): a request a hop held reaches the engine 7 s after its stop, past its
    first window (never_added there); judged again on the longer one, it is what the whole run says."""
    path = tmp_path / "late.db"
    rid = write_synthetic_run(path, duration_s=300, cancels=10, leak_every=5, filler_series=0, name="late")
    target = "cw-decode-target-0003"
    con = sqlite3.connect(path)
    (stop,) = con.execute("SELECT mono_ns FROM events WHERE kind = 'user_stop' AND request_id = ?",
                          (target,)).fetchone()
    con.execute("UPDATE events SET wall_ns = wall_ns + (? - mono_ns), mono_ns = ? WHERE kind = 'engine_added' "
                "AND request_id = ?", (stop + 7_000_000_000, stop + 7_000_000_000, target))
    con.execute("UPDATE ledger SET first_token_mono_ns = NULL, chunks = 0 WHERE request_id = ?", (target,))
    con.execute("DELETE FROM events WHERE kind = 'engine_aborted' AND request_id = ?", (target,))
    con.commit()
    con.close()
    whole = {v.request_id: (v.verdict, v.rule) for v in judge_run(load_run(path, rid))}
    got = {v.request_id: (v.verdict, v.rule) for v in long_run_verdicts(
        load_overview(path, rid), NO_ROWS, lambda lo, hi: load_window(path, rid, lo, hi, lookback_s=LOOKBACK_S))}
    assert whole[target][1] != "never_added"
    assert got == whole


def test_a_metric_of_several_label_sets_keeps_its_sum_in_the_overview(tmp_path):
    """Two GPUs, one steady at 80 GB, one moving between 70 and 80 GB: the overview's sum never drops a GPU
    (a bucket's max row is kept where its min equals it), and bounds the true sum from both sides."""
    from cancelwatch.runstore.writer import write_scrape_block

    path = tmp_path / "gpus.db"
    con = open_store(path)
    rid = create_run(con, name="gpus", targets=[{"label": "t0", "url": "http://127.0.0.1:8000"}], engine={},
                     settings={"hz": 20.0}, wall_ns=W0, mono_ns=T0)
    n = 20 * 60
    t = np.arange(n) / 20.0
    moving = 75e9 + 5e9 * np.sin(t / 3.0)
    with con:
        write_scrape_block(con, rid, "nvml", "gpu", series={
            ("gpu_memory_used_bytes", (("gpu", "0"),)): np.full(n, 80e9),
            ("gpu_memory_used_bytes", (("gpu", "1"),)): moving},
            ticks=np.arange(n), wall_ns=W0 + (t * 1e9).astype(np.int64), mono_ns=T0 + (t * 1e9).astype(np.int64),
            duration_ns=1_000_000)
    finish_run(con, rid, "completed", {}, ended_wall_ns=W0 + n * 50_000_000)
    con.close()
    from cancelwatch.analysis.series import series_frame

    whole = series_frame(load_run(path, rid), "gpu_memory_used_bytes")["value"]
    over = series_frame(load_overview(path, rid), "gpu_memory_used_bytes")["value"]
    assert over.min() >= 150e9 - 1 and over.min() <= whole.min() + 1
    assert over.max() >= whole.max() - 1 and over.max() <= 160e9 + 1


def test_a_deleted_run_takes_its_overview_and_verdicts_with_it(day, tmp_path):
    from cancelwatch.runstore.writer import delete_runs

    src, rid = day
    path = tmp_path / "day.db"
    shutil.copy(src, path)
    con = open_store(path)
    with con:
        write_verdicts(con, rid, judged_by(), [("x", {"verdict": "released"})])
    delete_runs(con, [rid])
    left = {t: con.execute(f"SELECT count(*) FROM {t} WHERE run_id = ?", (rid,)).fetchone()[0]  # noqa: S608
            for t in ("overview", "scrape_overview", "verdicts", "samples")}
    con.close()
    assert left == {"overview": 0, "scrape_overview": 0, "verdicts": 0, "samples": 0}


def test_a_verdict_that_is_not_json_is_refused_to_its_caller_and_the_writer_goes_on(tmp_path):
    path = tmp_path / "cw.db"
    con = open_store(path)
    rid = create_run(con, name="w", targets=[], engine={}, settings={"hz": 20.0}, wall_ns=W0, mono_ns=T0)
    writer = StoreWriter(con, rid, flush_s=0.005)
    with pytest.raises(TypeError):
        writer.put_verdicts(judged_by(), [("a", {"hops": {1, 2}})])  # a set: not JSON
    writer.put_verdicts(judged_by(), [("b", {"verdict": "released", "n": np.int64(3)})])
    writer.put(ScrapeRecord("vllm", "t0", 0, W0, T0, 1_000_000, True,
                            [Sample("vllm", "requests_running", 1.0, (), W0, T0)]))
    writer.close()
    con.close()
    rows = load_verdicts(path, rid)
    assert list(rows["request_id"]) == ["b"] and rows["body"][0]["n"] == 3
    assert writer.scrapes_written == 1 and not writer.failed.is_set()


def test_anything_the_writer_thread_meets_ends_the_run_said_never_a_silent_dead_thread(tmp_path):
    path = tmp_path / "cw.db"
    con = open_store(path)
    rid = create_run(con, name="w", targets=[], engine={}, settings={"hz": 20.0}, wall_ns=W0, mono_ns=T0)
    writer = StoreWriter(con, rid, flush_s=0.005)
    writer.put(ScrapeRecord("vllm", "t0", 0, W0, T0, 1_000_000, True,
                            [Sample("vllm", "requests_running", "not a number", (), W0, T0)]))
    assert writer.failed.wait(5)
    from cancelwatch.runstore.errors import StoreError

    with pytest.raises(StoreError, match="stopped taking writes"):
        writer.close()
    con.close()


def test_a_ghost_its_verdict_did_not_see_leave_is_aged_from_the_overview_to_within_a_bucket(day):
    """The ghost list replays the engine's count where a verdict did not see its request leave: on a long run, the
    overview's count, which places each leaving within one bucket of where the whole run's samples place it."""
    from cancelwatch.analysis.verdicts import ghosts_of

    path, rid = day
    whole = load_run(path, rid, metrics=VIEW_METRICS)
    verdicts = judge_run(whole)
    leaked = [v for v in verdicts if v.verdict == "leaked"]
    assert len(leaked) == 6
    for v in leaked:  # as a live judge whose window ended before the request left
        v.timepoints["left_scheduler"] = None
    full = ghosts_of(whole, verdicts).set_index("request_id")
    over = ghosts_of(load_overview(path, rid, metrics=VIEW_METRICS), verdicts).set_index("request_id")
    assert list(over.index) == list(full.index) == [v.request_id for v in leaked]
    assert (full["in_engine"] == "left").all() and (over["in_engine"] == "left").all()
    assert np.allclose(over["left_engine_s"], full["left_engine_s"], atol=OVERVIEW_S)


def test_the_notebooks_read_a_long_run_as_the_report_and_the_page_do(day, tmp_path, monkeypatch):
    """Issue 37 point 5: a run of any length is judged in one place (analysis/judged.py), which the report, the
    page and the notebooks' review read it through. The review of a long run reads its overview and judges each
    cancel on its own window (the series the verdicts read, no other), never the run whole, and gives the
    verdicts the whole run gives."""
    import cancelwatch.runstore.reader as reader
    from cancelwatch.analysis import review

    path, rid, whole = never_read_whole(day, tmp_path, monkeypatch)
    read, real = [], reader.load_window

    def window(*args, **kwargs):
        read.append(kwargs.get("metrics"))
        return real(*args, **kwargs)

    monkeypatch.setattr(reader, "load_window", window)
    (got,) = review.open_runs(str(path), rid)
    assert "overview" in got.run.info
    assert [json.dumps(v.as_json(), sort_keys=True) for v in got.verdicts] == whole
    assert len(read) >= 30 and set(read) == {VERDICT_METRICS}
