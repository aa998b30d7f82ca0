"""The run format on its own: what the writer writes, the reader reads back, without an engine."""

from __future__ import annotations

import json
import math
import sqlite3
import subprocess
import sys
import time
from contextlib import closing

import numpy as np
import pytest

from cancelwatch.runstore.errors import StoreError
from cancelwatch.runstore.reader import list_runs, load_run
from cancelwatch.runstore.records import DriveSettings, EventRecord, GapRecord, LedgerRecord, Sample, ScrapeRecord, freeze_labels
from cancelwatch.runstore.writer import (
    StoreWriter,
    create_run,
    finish_run,
    open_store,
    write_events,
    write_gaps,
    write_ledger,
    write_scrape_block,
)

T0 = 5_000_000_000  # monotonic start of the run, ns
W0 = 1_790_000_000_000_000_000  # wall clock at the start, ns
LABELS = freeze_labels({"engine": "0", "model_name": "tiny"})


def scrape(tick: int, running: float, kv: float, source: str = "vllm", target: str = "t0") -> ScrapeRecord:
    at = T0 + tick * 50_000_000
    samples = [Sample(source, "requests_running", running, LABELS, W0 + at - T0, at),
               Sample(source, "kv_cache_usage_ratio", kv, LABELS, W0 + at - T0, at)]
    return ScrapeRecord(source, target, tick, W0 + at - T0, at, 2_000_000, True, samples)


def recorded_run(path) -> int:
    """A small run as a recording writes it: through StoreWriter, from several threads' records."""
    con = open_store(path)
    settings = {"hz": 20.0, "extra": {"driven_target": "http://127.0.0.1:8000", "grace_s": 1.5,
                                      "scenarios": ["decode"], "model": "tiny", "relay_url": None}}
    rid = create_run(con, name="round-trip", targets=[{"label": "t0", "url": "http://127.0.0.1:8000"}],
                     engine={"nvml": "off"}, settings=settings, wall_ns=W0, mono_ns=T0)
    writer = StoreWriter(con, rid, flush_s=0.05)
    for tick, (running, kv) in enumerate([(1, 0.25), (2, 0.5), (1, math.nan), (0, 0.0)]):
        writer.put(scrape(tick, running, kv))
    writer.put(ScrapeRecord("vllm", "t0", 4, W0 + 200_000_000, T0 + 200_000_000, 1_000_000_000, False, []))
    writer.put(GapRecord("vllm", "t0", "error", W0 + 200_000_000, T0 + 200_000_000, T0 + 300_000_000, 2,
                         "connection refused" * 50))
    writer.put(EventRecord("user_stop", W0 + 60_000_000, T0 + 60_000_000, "cw-decode-target-1",
                           {"scenario": "decode", "phase": "decode", "cancel_id": "c1"}))
    row = LedgerRecord("cw-decode-target-1", "decode", "target", n=2, prompt_tokens=600, max_tokens=1500,
                       sent_mono_ns=T0 + 10_000_000, chunks=3)
    writer.put(row)
    row.terminal_state, row.reason, row.chunks = "cancelled", "task cancelled", 7
    writer.put(row)  # the same request again: its row is replaced, not doubled
    writer.set_run_json("cache", {"t0": {"num_gpu_blocks": "64", "block_size": "128"}})
    writer.close()
    finish_run(con, rid, "completed", {"samples_written": writer.samples_written}, ended_wall_ns=W0 + 10**9)
    con.close()
    return rid


def test_what_the_writer_writes_the_reader_reads(tmp_path):
    store = tmp_path / "cw.db"
    rid = recorded_run(store)
    run = load_run(store, "latest")
    assert run.id == rid and run.info["status"] == "completed" and run.info["name"] == "round-trip"
    assert run.info["stats"] == {"samples_written": 8}
    assert run.info["cache"] == {"t0": {"num_gpu_blocks": "64", "block_size": "128"}}
    assert DriveSettings.of_run(run.info["settings"]) == DriveSettings("http://127.0.0.1:8000", ["decode"], 1.5, "tiny")
    assert (run.info["ended_wall_ns"] - run.info["started_wall_ns"]) == 10**9

    kv = run.series("kv_cache_usage_ratio")
    assert kv["t_s"].tolist() == [0.0, 0.05, 0.1, 0.15]
    assert kv["value"].tolist()[:2] == [0.25, 0.5] and math.isnan(kv["value"].iloc[2])  # NaN stays missing
    assert run.series("requests_running", source="vllm", target="t0")["value"].tolist() == [1, 2, 1, 0]
    assert set(run.samples["labels"]) == {json.dumps(dict(LABELS), sort_keys=True)}
    assert run.series("no_such_metric").empty

    assert run.scrapes["ok"].tolist() == [1, 1, 1, 1, 0] and run.scrapes["n_samples"].tolist() == [2, 2, 2, 2, 0]
    (gap,) = run.gaps.itertuples(index=False)
    assert (gap.kind, gap.ticks, gap.t_s, gap.end_t_s) == ("error", 2, 0.2, 0.3)
    assert len(gap.detail) == 500  # long details are cut, not refused
    (ev,) = run.events.itertuples(index=False)
    assert (ev.kind, ev.request_id, ev.t_s) == ("user_stop", "cw-decode-target-1", 0.06)
    assert json.loads(ev.data)["cancel_id"] == "c1"
    (led,) = run.ledger.to_dict("records")
    assert (led["n"], led["chunks"], led["terminal_state"], led["reason"]) == (2, 7, "cancelled", "task cancelled")
    assert led["sent_mono_ns"] == T0 + 10_000_000 and led["first_token_mono_ns"] is None
    assert list_runs(store)["name"].tolist() == ["round-trip"]


def test_only_the_asked_metrics_are_read(tmp_path):
    store = tmp_path / "cw.db"
    recorded_run(store)
    run = load_run(store, "latest", metrics=["requests_running"])
    assert set(run.samples["metric"]) == {"requests_running"} and len(run.samples) == 4


def test_a_block_write_reads_back_like_a_recording(tmp_path):
    """write_scrape_block (the synthetic long run's path) lays rows as StoreWriter does."""
    rec, block = tmp_path / "rec.db", tmp_path / "block.db"
    recorded_run(rec)
    con = open_store(block)
    rid = create_run(con, name="block", targets=[], engine={}, settings={}, wall_ns=W0, mono_ns=T0)
    mono = T0 + np.arange(4) * 50_000_000
    with con:
        n = write_scrape_block(con, rid, "vllm", "t0", ticks=np.arange(4), wall_ns=mono - T0 + W0, mono_ns=mono,
                               duration_ns=2_000_000,
                               series={("requests_running", LABELS): np.array([1, 2, 1, 0.0]),
                                       ("kv_cache_usage_ratio", LABELS): np.array([0.25, 0.5, math.nan, 0.0])})
        write_gaps(con, rid, [])
        write_events(con, rid, [])
        write_ledger(con, rid, [])
    finish_run(con, rid, "completed", {})
    con.close()
    assert n == 8
    a, b = load_run(rec, "latest"), load_run(block, "latest")
    cols = ["source", "target", "metric", "labels", "value", "t_s", "duration_ns"]
    ok = a.samples[a.samples["scrape_id"].isin(a.scrapes[a.scrapes["ok"] == 1]["id"])]
    assert ok[cols].astype(str).values.tolist() == b.samples[cols].astype(str).values.tolist()


def test_a_store_of_another_schema_is_left_as_it_was(tmp_path):
    store = tmp_path / "old.db"
    recorded_run(store)
    con = open_store(store)
    con.execute("UPDATE meta SET value = '1' WHERE key = 'schema_version'")
    con.commit()
    con.close()
    before = store.read_bytes()
    with pytest.raises(StoreError, match="has schema 1.*--store"):
        open_store(store)
    assert store.read_bytes() == before


def test_a_reader_never_sees_half_a_schema_while_a_store_is_created(tmp_path, monkeypatch):
    """CI saw a dashboard read land between the writer's CREATE of `meta` and of `runs` ('not a cancelwatch
    run store'). Before each statement the writer runs, a second connection looks: no table, or all."""
    import cancelwatch.runstore.writer as writer

    store = tmp_path / "cw.db"
    seen: list[frozenset] = []
    real_connect = sqlite3.connect

    def look(_statement):
        with closing(real_connect(f"file:{store}?mode=ro", uri=True)) as peek:
            seen.append(frozenset(r[0] for r in peek.execute("SELECT name FROM sqlite_master WHERE type='table'")))

    def traced(*args, **kwargs):
        con = real_connect(*args, **kwargs)
        con.set_trace_callback(look)
        return con

    monkeypatch.setattr(writer.sqlite3, "connect", traced)
    con = open_store(store)
    con.set_trace_callback(None)
    con.close()
    with closing(real_connect(store)) as db:
        every = frozenset(r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'"))
    assert {"meta", "runs", "samples"} <= every
    assert len(seen) > 5 and set(seen) <= {frozenset(), every}, [sorted(s) for s in set(seen)]


def test_a_store_with_no_tables_yet_holds_no_runs(tmp_path):
    store = tmp_path / "cw.db"
    sqlite3.connect(store).execute("PRAGMA journal_mode=WAL").close()  # what a recorder has made before its schema
    assert store.is_file()
    with pytest.raises(StoreError, match="holds no runs yet"):
        load_run(store, "latest")
    assert list_runs(store).empty  # `cancelwatch runs` and the dashboard: an empty list, as for a new store
    (tmp_path / "junk.db").write_bytes(b"not sqlite at all" * 100)
    with pytest.raises(StoreError, match="not a cancelwatch run store"):
        load_run(tmp_path / "junk.db", "latest")
    # a recorded store whose first page was overwritten shows no tables too, but is damage, not a new store
    damaged = tmp_path / "damaged.db"
    recorded_run(damaged)
    raw = bytearray(damaged.read_bytes())
    raw[100], raw[103], raw[104] = 13, 0, 0  # page 1 becomes an empty leaf: sqlite_master holds nothing
    damaged.write_bytes(bytes(raw))
    with pytest.raises(StoreError) as raised:
        load_run(damaged, "latest")
    assert "no runs yet" not in str(raised.value), raised.value


def test_a_store_that_refuses_the_schema_is_left_unlocked(tmp_path):
    """A file open_store cannot put its schema in (another program's table of the same name) fails in one line,
    and the failed schema transaction leaves no lock behind while the error is still held."""
    foreign = tmp_path / "other.db"
    with closing(sqlite3.connect(foreign)) as db:
        db.execute("CREATE TABLE series (x)")  # no run_id: the schema's index on it fails
        db.commit()
    with pytest.raises(StoreError, match="choose a writable path") as raised:
        open_store(foreign)
    assert raised.value is not None  # the error (and what its traceback holds) is still alive here
    with closing(sqlite3.connect(foreign, timeout=0, isolation_level=None)) as other:
        other.execute("BEGIN IMMEDIATE")  # "database is locked" while the failed connection kept its transaction
        other.execute("ROLLBACK")
    with closing(sqlite3.connect(foreign)) as db:  # and nothing of the schema was left half made
        assert [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")] == ["series"]


_LOCKER = """
import sqlite3, sys, time
held = sqlite3.connect(sys.argv[1], isolation_level=None)
held.execute("PRAGMA locking_mode=EXCLUSIVE")
held.execute("BEGIN EXCLUSIVE")
print("locked", flush=True)
time.sleep(float(sys.argv[2]))
"""


def _hold_lock(store, for_s: float):
    """Lock the store from another process (POSIX locks do not part two SQLite copies in one process: the
    sqlite3 module's and ADBC's), as a writer closing or checkpointing its WAL does, for `for_s`."""
    proc = subprocess.Popen([sys.executable, "-c", _LOCKER, str(store), str(for_s)], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_a_read_waits_out_a_writers_brief_lock(tmp_path):
    """A writer holding the store's lock for a moment delays a read, it does not fail it: CI saw the Arrow
    read (ADBC, which sets no busy handler of its own) fail at once with "database is locked"."""
    import cancelwatch.runstore.reader as reader

    store = tmp_path / "cw.db"
    recorded_run(store)
    for read in (lambda: reader._arrow(store, "SELECT count(*) AS n FROM samples", ()).to_pylist()[0]["n"],
                 lambda: len(load_run(store, "latest").samples)):
        locker = _hold_lock(store, 0.8)
        started = time.monotonic()
        try:
            assert read() > 0
        finally:
            locker.wait(30)
        assert time.monotonic() - started >= 0.5  # it did meet the lock, and waited
    # a lock held past the wait is said as a lock, not as damage
    locker = _hold_lock(store, 8)
    try:
        with pytest.raises(StoreError, match="locked by another process.*try again") as raised:
            load_run(store, "latest")
        assert "damaged" not in str(raised.value) and "not a cancelwatch" not in str(raised.value)
    finally:
        locker.kill()
        locker.wait(30)


def _open_and_count(path: str, barrier, results) -> None:
    try:
        barrier.wait(30)  # every process reaches open_store at the same moment
        con = open_store(path)
        con.execute("SELECT count(*) FROM runs").fetchone()
        con.close()
        results.put(None)
    except Exception as exc:  # noqa: BLE001 - what the test counts
        results.put(f"{type(exc).__name__}: {exc}")


def test_one_new_store_opened_by_several_processes_at_once(tmp_path):
    """Six processes opening one new store at the same moment: before the open waited out an immediate
    "database is locked" (the journal-mode change, the schema transaction), ~1 open in 150 failed here."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    failures, opens = [], 0
    for round_ in range(20):
        store = tmp_path / f"r{round_}" / "cw.db"
        barrier, results = ctx.Barrier(6), ctx.Queue()
        procs = [ctx.Process(target=_open_and_count, args=(str(store), barrier, results)) for _ in range(6)]
        for p in procs:
            p.start()
        outcomes = [results.get(timeout=60) for _ in procs]
        for p in procs:
            p.join(30)
        opens += len(outcomes)
        failures += [f"round {round_}: {o}" for o in outcomes if o is not None]
        with closing(sqlite3.connect(store)) as db:  # one schema, made once
            assert db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchall() != []
    assert opens == 120
    assert not failures, failures


def test_a_store_locked_past_the_open_wait_says_so_in_one_line(tmp_path, monkeypatch):
    import cancelwatch.runstore.writer as writer

    store = tmp_path / "cw.db"
    recorded_run(store)
    monkeypatch.setattr(writer, "OPEN_WAIT_S", 0.5)
    monkeypatch.setattr(writer, "BUSY_TIMEOUT_S", 0.1)
    locker = _hold_lock(store, 8)
    try:
        started = time.monotonic()
        with pytest.raises(StoreError, match="stayed locked by another process for over 0.5 s") as raised:
            open_store(store)
        assert time.monotonic() - started >= 0.5  # it waited the lock out first
        assert "\n" not in str(raised.value) and "--store" in str(raised.value)
    finally:
        locker.kill()
        locker.wait(30)
    assert len(load_run(store, "latest").samples) > 0  # nothing recorded was lost


def test_deleting_runs_leaves_the_others_whole(tmp_path):
    from bench.synthetic import write_synthetic_run
    from cancelwatch.runstore.writer import delete_runs, open_store

    store = tmp_path / "cw.db"
    first = write_synthetic_run(store, duration_s=60, cancels=3, name="a")
    second = write_synthetic_run(store, duration_s=60, cancels=3, name="b")
    before = load_run(store, second)
    con = open_store(store)
    try:
        delete_runs(con, [first])
        left = {t: con.execute(f"SELECT count(*) FROM {t} WHERE run_id = ?", (first,)).fetchone()[0]
                for t in ("samples", "scrapes", "series", "gaps", "events", "ledger")}
    finally:
        con.close()
    assert list(list_runs(store)["id"]) == [second] and not any(left.values()), left
    after = load_run(store, second)
    assert len(after.samples) == len(before.samples) > 0 and len(after.events) == len(before.events)
