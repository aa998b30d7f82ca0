"""runstore.reader.load_window: one stretch of a run holds exactly what the whole run holds in that stretch
(scrapes, samples, gaps and events in it; the ledger rows open in it), read without the rest."""

from __future__ import annotations

import pandas as pd
import pytest

from bench.synthetic import write_synthetic_run
from cancelwatch.runstore.reader import WindowReader, load_run, load_window
from cancelwatch.runstore.schema import NARROW_SAMPLE_INDEXES, samples_indexes


def indexes_of(path) -> set[str]:
    import sqlite3

    with sqlite3.connect(path) as con:
        names = samples_indexes(con)
    con.close()
    return names


def narrowed(path, folder):
    """A copy of the store at `path`, in `folder`/narrow, indexed as a store written before the covering series
    index (or too big to migrate to it) is."""
    from cancelwatch.runstore.writer import samples_indexed_as

    return samples_indexed_as(path, NARROW_SAMPLE_INDEXES, folder / "narrow")


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = tmp_path_factory.mktemp("window") / "w.db"
    write_synthetic_run(path, duration_s=120, cancels=10, name="w")
    return path


def test_a_window_holds_the_runs_rows_in_its_stretch_and_no_others(store):
    whole = load_run(store, "latest")
    lo, hi = 40.0, 47.5
    part = load_window(store, "latest", lo, hi)
    inside = whole.scrapes[(whole.scrapes["t_s"] >= lo) & (whole.scrapes["t_s"] <= hi)]
    assert len(part.scrapes) == len(inside) > 0
    assert sorted(part.scrapes["id"]) == sorted(inside["id"])
    want = whole.samples[whole.samples["scrape_id"].isin(inside["id"])]
    assert len(part.samples) == len(want) > 0
    key = ["scrape_id", "metric", "value"]
    got = part.samples[key].astype({"metric": str}).sort_values(key).reset_index(drop=True)
    assert got.equals(want[key].astype({"metric": str}).sort_values(key).reset_index(drop=True))
    ev = whole.events[(whole.events["t_s"] >= lo) & (whole.events["t_s"] <= hi)]
    assert sorted(part.events["mono_ns"]) == sorted(ev["mono_ns"])
    t0 = whole.info["started_mono_ns"]
    led = whole.ledger
    open_in = led[(led["sent_mono_ns"] <= t0 + hi * 1e9) & ~(led["closed_mono_ns"] < t0 + lo * 1e9)]
    assert sorted(part.ledger["request_id"]) == sorted(open_in["request_id"])
    assert part.info["started_mono_ns"] == t0


def test_the_lookback_reaches_earlier_events_and_rows_but_not_samples(store):
    narrow = load_window(store, "latest", 60.0, 62.0)
    wide = load_window(store, "latest", 60.0, 62.0, lookback_s=30.0)
    assert len(wide.samples) == len(narrow.samples)
    assert wide.events["t_s"].min() >= 30.0 and len(wide.events) >= len(narrow.events)
    assert set(narrow.ledger["request_id"]) <= set(wide.ledger["request_id"])


def test_rows_a_recorder_still_holds_join_the_window(store):
    extra = pd.DataFrame([{"request_id": "live-1", "scenario": "watched", "role": "watched", "n": 1,
                           "sent_mono_ns": 1, "closed_mono_ns": None}])
    part = load_window(store, "latest", 10.0, 12.0, extra_ledger=extra)
    assert "live-1" in set(part.ledger["request_id"])


def test_each_cancel_judged_on_its_own_window_gets_the_verdict_the_whole_run_gives_it(store):
    from cancelwatch.analysis.verdicts import judge_run
    from cancelwatch.analysis.watching import LOOKBACK_S, judge_cancels, window_of

    whole = judge_run(load_run(store, "latest"))
    assert len(whole) == 10 and {v.verdict for v in whole} >= {"released"}
    for v in whole:
        lo, hi = window_of(v.timepoints["user_stop"], 2.0)
        (alone,) = judge_cancels(load_window(store, "latest", lo, hi, lookback_s=LOOKBACK_S), {v.request_id}, 2.0)
        assert (alone.verdict, alone.rule) == (v.verdict, v.rule), v.request_id


def _window_query(store, monkeypatch, lo: float, hi: float):
    """The samples query a window of `store` sends, and the window."""
    import sqlite3

    import cancelwatch.runstore.reader as reader

    sent = []
    real = reader._window_rows
    monkeypatch.setattr(reader, "_window_rows", lambda con, q, params, *a: sent.append((q, params, con))
                        or real(con, q, params, *a))
    monkeypatch.setattr(reader, "_arrow", lambda *a: pytest.fail("a window read through ADBC"))
    part = load_window(store, "latest", lo, hi)
    (query, params, own), = [(q, p, o) for q, p, o in sent if "FROM samples" in q]
    # through the reader's own sqlite3 connection, not ADBC (test_windows_read_in_the_recorders_own_process...)
    assert isinstance(own, sqlite3.Connection)
    return part, _plan(store, query, params)


def _plan(store, query: str, params) -> str:
    """The plan SQLite makes for `query` on `store`."""
    import sqlite3

    with sqlite3.connect(store) as con:
        plan = " ".join(r[3] for r in con.execute("EXPLAIN QUERY PLAN " + query, params))
    con.close()
    return plan


def test_a_windows_samples_are_read_from_the_covering_index_by_scrape_range_not_the_whole_run(store, monkeypatch):
    # bench/window.py measures it (a window's cost at 15 min, 1 h and 4 h); here the plan SQLite makes for the
    # query the reader sends: each series searched between its source's first and last scrape of the window,
    # from the index alone, never a scan of the run's samples by series
    whole = load_run(store, "latest").samples
    part, plan = _window_query(store, monkeypatch, 60.0, 66.0)
    branches = plan.count("USING COVERING INDEX samples_series (series_id=? AND run_id=? AND scrape_id>? AND scrape_id<?)")
    assert branches == part.samples.groupby(["source", "target"], observed=True).ngroups >= 2, plan
    assert "SCAN" not in plan, plan
    inside = whole[(whole["t_s"] >= 60.0) & (whole["t_s"] <= 66.0)].reset_index(drop=True)
    strings = {c: object for c in ("source", "target", "metric", "labels")}
    pd.testing.assert_frame_equal(part.samples.astype(strings), inside.astype(strings))
    # and an empty stretch reads no sample at all (not the whole run)
    assert len(part.samples) > 0 and load_window(store, "latest", 500.0, 506.0).samples.empty


def test_a_store_with_the_narrow_series_index_reads_a_window_by_its_scrapes(tmp_path, monkeypatch):
    """A store too big to migrate keeps samples_run: a window goes by (run, scrape), not by series, whose range
    that index cannot bound."""
    written = tmp_path / "w.db"
    write_synthetic_run(written, duration_s=60, cancels=3, name="narrow")
    part, plan = _window_query(narrowed(written, tmp_path), monkeypatch, 20.0, 26.0)
    assert "USING INDEX samples_scrape" in plan and "samples_run" not in plan, plan
    assert part.samples.equals(load_window(written, "latest", 20.0, 26.0).samples)


def test_a_windows_samples_read_with_their_ids_packed_or_apart_are_the_same(tmp_path, monkeypatch):
    """A window reads a sample's two ids as one number where both fit a double's 53 bits (_PACKED_VALUES), else as
    two: the same samples either way, with a value stored as NULL (a NaN) read as NaN, and as the whole run holds."""
    import numpy as np

    import cancelwatch.runstore.reader as reader
    from bench.synthetic import T0_NS, WALL0_NS
    from cancelwatch.runstore.writer import create_run, finish_run, open_store, write_scrape_block

    path = tmp_path / "nan.db"
    con = open_store(path)
    rid = create_run(con, name="nan", targets=[{"label": "t0", "url": "x", "family": "vllm"}], engine={},
                     settings={}, wall_ns=WALL0_NS, mono_ns=T0_NS)
    n = 200
    mono = T0_NS + np.arange(n, dtype=np.int64) * 50_000_000
    kv = np.linspace(0.0, 0.9, n)
    kv[::7] = np.nan
    with con:
        write_scrape_block(con, rid, "vllm", "t0", series={("requests_running", ()): np.arange(n) % 5,
                                                            ("kv_cache_usage_ratio", ()): kv},
                           ticks=np.arange(n), wall_ns=mono - T0_NS + WALL0_NS, mono_ns=mono, duration_ns=1000)
    finish_run(con, rid, "completed", {})
    con.close()
    sent = []
    real = reader._window_rows
    monkeypatch.setattr(reader, "_window_rows", lambda con, q, params, *a: sent.append(q) or real(con, q, params, *a))
    packed = load_window(path, "latest", 2.0, 6.0).samples
    assert "<<" in sent[-1] and packed["value"].isna().any() and len(packed) == 2 * 81
    monkeypatch.setattr(reader, "_SERIES_BITS", 0)  # no series id fits: each id read apart
    apart = load_window(path, "latest", 2.0, 6.0).samples
    assert "<<" not in sent[-1]
    pd.testing.assert_frame_equal(packed, apart)
    strings = {c: object for c in ("source", "target", "metric", "labels")}
    pd.testing.assert_frame_equal(packed.astype(strings), _whole_in(path, 2.0, 6.0).astype(strings))


def test_a_whole_runs_samples_changed_in_place_before_they_are_read_are_read_as_they_are_now(store):
    """A window hands the rules its samples' codes as it reads them (the reader has them at hand); a whole run leaves
    them to be made when read (a summary or an export never reads them, and they cost memory a sample), so a run
    changed in place before it is read is read as it is."""
    run = load_run(store, "latest")
    run.samples.loc[run.samples["metric"] == "requests_running", "metric"] = "requests_waiting"
    assert not run.has_metric("requests_running") and run.has_metric("requests_waiting")
    window = load_window(store, "latest", 40.0, 47.5)
    assert window.has_metric("requests_running")


def _whole_in(path, lo: float, hi: float) -> pd.DataFrame:
    whole = load_run(path, "latest").samples
    return whole[(whole["t_s"] >= lo) & (whole["t_s"] <= hi)].reset_index(drop=True)


def test_a_fleets_window_and_a_late_written_scrape_read_by_scrape_and_hold_the_same_samples(tmp_path, monkeypatch):
    """The series index's read sends a branch per (source, target) and reads each source's ids from first to last:
    a run of more sources than MAX_WINDOW_BRANCHES (a fleet imported from Prometheus; SQLite takes at most 500
    branches), or one whose ids do not rise with its scrapes (a read written late), is read by scrape instead."""
    import numpy as np

    import cancelwatch.runstore.reader as reader
    from bench.synthetic import T0_NS, WALL0_NS
    from cancelwatch.runstore.writer import create_run, finish_run, open_store, write_scrape_block

    fleet = tmp_path / "fleet.db"
    con = open_store(fleet)
    n, replicas = 40, reader.MAX_WINDOW_BRANCHES + 1
    rid = create_run(con, name="fleet", targets=[{"label": f"r{i}", "url": "x", "family": "vllm"} for i in range(replicas)],
                     engine={}, settings={}, wall_ns=WALL0_NS, mono_ns=T0_NS)
    mono = T0_NS + np.arange(n, dtype=np.int64) * 15 * 10**9
    with con:  # each replica's reads written at once, as an import writes them
        for i in range(replicas):
            write_scrape_block(con, rid, "vllm", f"r{i}", series={("requests_running", ()): np.arange(n) + i,
                                                                  ("kv_cache_usage_ratio", ()): np.full(n, np.nan)},
                               ticks=np.arange(n), wall_ns=mono - T0_NS + WALL0_NS, mono_ns=mono, duration_ns=1000)
    finish_run(con, rid, "completed", {})
    con.close()
    expected = _whole_in(fleet, 100.0, 200.0)
    part, plan = _window_query(fleet, monkeypatch, 100.0, 200.0)
    assert "USING INDEX samples_scrape" in plan, plan
    assert len(expected) == 2 * 7 * replicas and part.samples.equals(expected)
    monkeypatch.undo()

    late = tmp_path / "late.db"
    rid = write_synthetic_run(late, duration_s=120, cancels=3, name="late")
    con = open_store(late)
    with con:  # one read of vllm/t0 stamped at 45 s, written after the whole run: its id above every other
        at = np.array([T0_NS + 45_010_000_000])
        write_scrape_block(con, rid, "vllm", "t0", series={("requests_running", ()): [1.0]}, ticks=[2400],
                           wall_ns=at - T0_NS + WALL0_NS, mono_ns=at, duration_ns=1)
    con.close()
    expected = _whole_in(late, 40.0, 47.5)
    part, plan = _window_query(late, monkeypatch, 40.0, 47.5)
    assert "USING INDEX samples_scrape" in plan, plan
    assert 45.01 in part.samples["t_s"].round(3).tolist() and part.samples.equals(expected)


def test_a_runs_series_read_whole_go_through_the_covering_index(store, monkeypatch):
    """A page or a report reads its series from the index alone (no table row looked up per sample)."""
    import cancelwatch.runstore.reader as reader

    sent = []
    real = reader._arrow
    monkeypatch.setattr(reader, "_arrow", lambda path, q, params: sent.append((q, params)) or real(path, q, params))
    load_run(store, "latest")
    (query, params), = [(q, p) for q, p in sent if "FROM samples" in q]
    plan = _plan(store, query, params)
    assert "USING COVERING INDEX samples_series" in plan, plan


def test_a_store_with_the_narrow_series_index_gets_the_covering_one_when_written_and_reads_the_same(tmp_path):
    from cancelwatch.runstore.writer import open_store

    written = tmp_path / "old.db"
    write_synthetic_run(written, duration_s=30, cancels=2, name="old")
    before = load_run(written, "latest").samples
    path = narrowed(written, tmp_path)  # the indexes of a store written before the covering ones
    assert load_run(path, "latest").samples.equals(before)  # read as it stands
    open_store(path).close()
    names = indexes_of(path)
    assert names == {"samples_series", "samples_scrape"}
    assert load_run(path, "latest").samples.equals(before)
    assert not load_window(path, "latest", 10.0, 12.0).samples.empty


def write_while_reading_windows(path: str, n: int = 2500) -> None:
    """A recorder's writer taking scrapes and events at ~400 a second while a thread of the same process
    reads windows of the run on one connection held throughout, as the watch's live judge does; prints what the
    store holds after, and what that connection read of the run's last second once the writer was done."""
    import threading
    import time

    from cancelwatch.runstore.records import EventRecord, Sample, ScrapeRecord
    from cancelwatch.runstore.writer import StoreWriter, create_run, open_store

    con = open_store(path)
    t0 = time.monotonic_ns()
    rid = create_run(con, name="w", targets=[{"label": "t0", "url": "http://127.0.0.1:1"}], engine={}, settings={},
                     wall_ns=time.time_ns(), mono_ns=t0)
    writer, stop, errors = StoreWriter(con, rid), threading.Event(), []
    windows = WindowReader(path)

    def judge():
        while not stop.is_set():
            now = (time.monotonic_ns() - t0) / 1e9
            try:
                windows(rid, max(0.0, now - 3.0), now)
            except Exception as exc:  # noqa: BLE001 - said below, with what was kept
                errors.append(type(exc).__name__)

    reader = threading.Thread(target=judge)
    reader.start()
    for i in range(n):
        m = time.monotonic_ns()
        writer.put(ScrapeRecord("vllm", "t0", i, time.time_ns(), m, 1000, True,
                                [Sample("vllm", "requests_running", float(i % 5), (), time.time_ns(), m)]))
        writer.put(EventRecord("tap_request", time.time_ns(), m, f"r{i}", {"conn": i}))
        time.sleep(0.002)
    stop.set()
    reader.join()
    try:
        writer.close()
    except Exception as exc:  # noqa: BLE001
        errors.append(str(exc)[:120])
    con.close()
    run = load_run(path, rid)
    end = float(run.scrapes["t_s"].max())
    last = windows(rid, end - 1.0, end)  # the held connection reads what was written since it opened
    windows.close()
    print(f"kept {len(run.events)} {len(run.scrapes)} of {n}; errors {errors[:3]}")
    print(f"last second {len(last.scrapes)} of {int((run.scrapes['t_s'] >= end - 1.0).sum())}")


def test_windows_read_in_the_recorders_own_process_lose_nothing_it_writes(tmp_path):
    """The watch judges each cancel on a window of its run while its writer writes that run, in one process.
    Read through ADBC (its own copy of SQLite), the two copies released each other's locks on the WAL: rows
    committed were lost, the writer met "database disk image is malformed", once the process died of a bus
    error. A window is read through the writer's SQLite: every record is kept. In a child process, so that
    a bus error is a failure here, not the end of the suite."""
    import subprocess
    import sys

    path = tmp_path / "live.db"
    res = subprocess.run([sys.executable, "-c", "import sys; from tests.test_window import write_while_reading_windows "
                          "as w; w(sys.argv[1])", str(path)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    kept, last = res.stdout.strip().splitlines()
    assert kept == "kept 2500 2500 of 2500; errors []", res.stdout + res.stderr[-1000:]
    seen, of = (int(x) for x in last.removeprefix("last second ").split(" of "))
    assert seen == of > 0, last


def test_a_store_too_big_to_index_at_once_keeps_its_narrow_series_index_and_reads_the_same(tmp_path, monkeypatch):
    """Building the covering index holds the write lock (about a second a million samples): a bigger store keeps
    samples_run, and a recorder opening it does not wait on the build."""
    import sqlite3

    import cancelwatch.runstore.writer as writer

    written = tmp_path / "big.db"
    write_synthetic_run(written, duration_s=30, cancels=2, name="big")
    before = load_run(written, "latest").samples
    path = narrowed(written, tmp_path)
    with sqlite3.connect(path) as con:
        n = con.execute("SELECT count(*) FROM samples").fetchone()[0]
    con.close()
    monkeypatch.setattr(writer, "MIGRATE_MAX_SAMPLES", n - 1)
    writer.open_store(path).close()
    names = indexes_of(path)
    assert names == {"samples_run", "samples_scrape"}
    assert load_run(path, "latest").samples.equals(before)
    monkeypatch.setattr(writer, "MIGRATE_MAX_SAMPLES", n)  # at the limit: built
    writer.open_store(path).close()
    names = indexes_of(path)
    assert names == {"samples_series", "samples_scrape"}


def test_a_store_copied_with_another_schemas_sample_indexes_holds_the_same_rows(store, tmp_path):
    """bench/judging.py measures an earlier revision on the store as its recorder would have indexed it."""
    from cancelwatch.runstore.schema import DDL
    from cancelwatch.runstore.writer import samples_indexed_as

    assert samples_indexed_as(store, DDL, tmp_path) == store  # this schema's: the store itself
    copy = samples_indexed_as(store, NARROW_SAMPLE_INDEXES, tmp_path)
    assert copy != store
    names = indexes_of(copy)
    assert names == {"samples_run", "samples_scrape"}
    assert load_run(copy, "latest").samples.equals(load_run(store, "latest").samples)


def test_a_window_reader_closed_while_it_reads_closes_its_connection_once_the_read_ends(store, monkeypatch):
    """The live judge reads in a worker thread; the run it judges can end (Ctrl-C) while a read is under way. Its
    connection is closed once that read ends, not under it; a read after that holds no connection open (a held one
    keeps SQLite from folding its log into the store as the writer closes)."""
    import threading

    import cancelwatch.runstore.reader as reader

    windows, real = WindowReader(store), reader.load_window
    reading, go = threading.Event(), threading.Event()

    def slow(*args, **kwargs):
        run = real(*args, **kwargs)
        reading.set()
        go.wait(10)
        return run

    first = windows("latest", 40.0, 42.0)
    held = windows.connection()
    monkeypatch.setattr(reader, "load_window", slow)
    got = []
    read = threading.Thread(target=lambda: got.append(windows("latest", 40.0, 42.0)))
    read.start()
    assert reading.wait(10)
    closing = threading.Thread(target=windows.close)
    closing.start()
    closing.join(0.3)
    assert closing.is_alive()  # waits for the read
    held.execute("SELECT 1").fetchall()  # still open under it
    go.set()
    read.join(10)
    closing.join(10)
    assert len(got[0].scrapes) == len(first.scrapes) > 0
    with pytest.raises(Exception, match="closed"):
        held.execute("SELECT 1")
    monkeypatch.setattr(reader, "load_window", real)
    assert len(windows("latest", 40.0, 42.0).scrapes) == len(first.scrapes)
    assert windows._con is None
