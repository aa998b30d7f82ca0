"""The write side of the run store: one SQLite file in WAL mode.

Every statement that writes a run lives here. A recording writes through `StoreWriter` (one thread,
batched commits); a run built in one go (the synthetic long run of the benchmarks and tests) uses the
same statements through `write_scrape_block`, `write_gaps`, `write_events` and `write_ledger`. Events
are of the kinds in `runstore/event_kinds.py: EVENT_KINDS`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import queue
import re
import shutil
import sqlite3
import threading
import time
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import numpy as np

from cancelwatch.runstore.errors import StoreError
from cancelwatch.runstore.event_kinds import EVENT_KINDS
from cancelwatch.runstore.overview import bucket_of, scrape_rows, series_rows, write_overview
from cancelwatch.runstore.records import EventRecord, GapRecord, LedgerRecord, Sample, ScrapeRecord
from cancelwatch.runstore.schema import DDL, SCHEMA_VERSION, samples_indexes

RUN_JSON_COLUMNS = ("targets", "engine", "cache", "settings", "stats")
LEDGER_COLUMNS = [f.name for f in dataclasses.fields(LedgerRecord)]

_INSERT_SCRAPE = ("INSERT INTO scrapes(id, run_id, source, target, tick, wall_ns, mono_ns, duration_ns, ok, n_samples) "
                  "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)")
_INSERT_SAMPLE = "INSERT INTO samples(run_id, series_id, scrape_id, value) VALUES (?, ?, ?, ?)"
_INSERT_GAP = ("INSERT INTO gaps(run_id, source, target, kind, start_wall_ns, start_mono_ns, end_mono_ns, ticks, detail) "
               "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)")
_INSERT_EVENT = "INSERT INTO events(run_id, request_id, kind, wall_ns, mono_ns, data) VALUES (?, ?, ?, ?, ?, ?)"
_INSERT_LEDGER = (f"INSERT OR REPLACE INTO ledger(run_id, {', '.join(LEDGER_COLUMNS)}) "
                  f"VALUES (?, {', '.join('?' for _ in LEDGER_COLUMNS)})")


def _statements(script: str) -> list[str]:
    """A DDL script cut into its statements (executescript would commit each one on its own)."""
    out, current = [], ""
    for line in script.splitlines(keepends=True):
        current += line
        if sqlite3.complete_statement(current):
            out.append(current.strip())
            current = ""
    if current.strip():
        out.append(current.strip())
    return out


BUSY_TIMEOUT_S = 10.0  # how long a write waits out another process's lock (sqlite3's busy handler)
# how long opening a store waits out another process opening or writing it: as long as a busy write
OPEN_WAIT_S = BUSY_TIMEOUT_S


def _locked(exc: sqlite3.Error) -> bool:
    return isinstance(exc, sqlite3.OperationalError) and ("locked" in str(exc) or "busy" in str(exc))


def open_store(path: str | Path) -> sqlite3.Connection:
    """Open (creating if needed) a run store for writing. StoreError names the path on failure.

    Two processes opening one new store at the same moment can get "database is locked" at once from the
    journal-mode change or the schema transaction: SQLite does not call the busy handler where waiting
    could deadlock (six processes opening one new store failed ~1 in 150 opens). Such a refusal is waited
    out, with a short growing pause, like any busy write, for OPEN_WAIT_S; only then is it an error."""
    p = Path(path)
    deadline = time.monotonic() + OPEN_WAIT_S
    pause = 0.002
    while True:
        try:
            return _open_once(p)
        except (sqlite3.Error, OSError) as exc:
            if _locked(exc) and time.monotonic() < deadline:
                time.sleep(pause)
                pause = min(0.1, pause * 2)
                continue
            if _locked(exc):
                raise StoreError(f"the run store at {p} stayed locked by another process for over {OPEN_WAIT_S:g} s "
                                 "while opening: stop the other writer or record into another file with --store") \
                    from exc
            raise StoreError(f"cannot write the run store at {p} ({exc}): choose a writable path with --store") \
                from exc


# Building an index over an existing store's samples holds the write lock meanwhile (about a second a million
# samples): another recorder waits OPEN_WAIT_S for it, a watch starting on the store waits too. A store with more
# samples than this keeps its narrower series index (its runs read whole as before; a run long enough to need the
# covering one is read from its overview)
MIGRATE_MAX_SAMPLES = 2_000_000
_MIGRATIONS = frozenset(st for st in _statements(DDL) if "samples_series" in st or "samples_run" in st)


def _migrates(con: sqlite3.Connection) -> bool:
    """Whether the samples' covering series index is built here (schema.py): a new store, one that has it, or one
    small enough to build it at once."""
    have = samples_indexes(con)
    if "samples_series" in have or "samples_run" not in have:
        return True
    last = con.execute("SELECT max(rowid) FROM samples").fetchone()[0]  # the rowid's b-tree: no scan
    return (last or 0) <= MIGRATE_MAX_SAMPLES


def _open_once(p: Path) -> sqlite3.Connection:
    con = None
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        con = sqlite3.connect(str(p), timeout=BUSY_TIMEOUT_S, check_same_thread=False)
        con.execute("PRAGMA journal_mode=WAL")
        con.execute("PRAGMA synchronous=NORMAL")
        # the whole schema in one transaction: a reader opening the store meanwhile sees no table or all of
        # them, never `meta` without `runs` (CI saw a dashboard read land between two CREATEs)
        con.isolation_level = None
        con.execute("BEGIN IMMEDIATE")
        con.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
        row = con.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        if row is not None and row[0] != str(SCHEMA_VERSION):
            con.execute("ROLLBACK")
            # checked before any DDL: a store of another version is left exactly as it was
            raise StoreError(f"the run store at {p} has schema {row[0]}, this cancelwatch writes {SCHEMA_VERSION}: "
                             "record into a new file with --store")
        for statement in _statements(DDL):
            if statement not in _MIGRATIONS or _migrates(con):
                con.execute(statement)
        con.execute("INSERT OR IGNORE INTO meta(key, value) VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
        con.execute("COMMIT")
        con.isolation_level = ""  # back to implicit transactions, which the rest of the writer relies on
    except BaseException:
        if con is not None:
            con.close()  # rolls the schema transaction back: no lock outlives the failure (or a Ctrl-C in it)
        raise
    return con


SAMPLE_INDEX = re.compile(r"CREATE INDEX IF NOT EXISTS \w+ ON samples\([^)]*\);")


def samples_indexed_as(path: str | Path, ddl: str, into: str | Path) -> Path:
    """A copy of the store at `path`, in the folder `into`, with the samples' indexes another schema's `ddl` (its
    runstore/schema.py) makes: the same rows as that revision's recorder would have indexed them (bench/judging.py
    measures each revision on its own). The store itself where they are this schema's."""
    wanted = SAMPLE_INDEX.findall(ddl)
    if sorted(wanted) == sorted(SAMPLE_INDEX.findall(DDL)):
        return Path(path)
    Path(into).mkdir(parents=True, exist_ok=True)
    out = Path(into) / Path(path).name
    shutil.copyfile(path, out)
    with sqlite3.connect(out) as con:
        for name in samples_indexes(con):
            con.execute(f"DROP INDEX {name}")
        for statement in wanted:
            con.execute(statement)
    con.execute("VACUUM")
    con.close()
    return out


def create_run(
    con: sqlite3.Connection,
    *,
    name: str | None,
    targets: list[dict],
    engine: dict,
    settings: dict,
    wall_ns: int,
    mono_ns: int,
) -> int:
    cur = con.execute(
        "INSERT INTO runs(name, started_wall_ns, started_mono_ns, status, targets, engine, settings) "
        "VALUES (?, ?, ?, 'running', ?, ?, ?)",
        (name, wall_ns, mono_ns, json.dumps(targets), json.dumps(engine), json.dumps(settings)),
    )
    con.commit()
    return int(cur.lastrowid)


def finish_run(con: sqlite3.Connection, run_id: int, status: str, stats: dict, ended_wall_ns: int | None = None) -> None:
    """The run's end status and stats. StoreError when the store refuses them (a full disk)."""
    row = (status, ended_wall_ns or time.time_ns(), json.dumps(stats), run_id)
    try:
        con.execute("UPDATE runs SET status = ?, ended_wall_ns = ?, stats = ? WHERE id = ?", row)
        con.commit()
        return
    except sqlite3.Error:
        pass
    # a full disk (or file-size limit) that stopped the writer stops this write too when the WAL is at the
    # limit: move the WAL into the database and truncate it, which frees its room, then try once more
    try:
        con.rollback()
        con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        con.execute("UPDATE runs SET status = ?, ended_wall_ns = ?, stats = ? WHERE id = ?", row)
        con.commit()
    except sqlite3.Error as exc:
        raise StoreError(f"the run store at {store_path(con)} did not take the run's end status ({exc}): the run "
                         "shows as 'running'") from exc


def delete_runs(con: sqlite3.Connection, run_ids: Iterable[int]) -> None:
    """Remove whole runs (every table's rows of them): a canary's bounded retention."""
    ids = [(int(r),) for r in run_ids]
    with con:
        for table in ("samples", "scrapes", "series", "gaps", "events", "ledger", "overview", "scrape_overview",
                      "verdicts"):
            con.executemany(f"DELETE FROM {table} WHERE run_id = ?", ids)  # noqa: S608 - fixed table names
        con.executemany("DELETE FROM runs WHERE id = ?", ids)


def set_run_json(con: sqlite3.Connection, run_id: int, column: str, value) -> None:
    """Replace one JSON column of a run (targets, engine, cache, settings, stats)."""
    if column not in RUN_JSON_COLUMNS:
        raise ValueError(f"not a JSON column of runs: {column}")
    con.execute(f"UPDATE runs SET {column} = ? WHERE id = ?", (json.dumps(value), run_id))


def labels_json(labels) -> str:
    """How a series' labels are stored: a JSON object, keys sorted."""
    return json.dumps(dict(labels), sort_keys=True)


def series_id(con: sqlite3.Connection, run_id: int, source: str, target: str, metric: str, labels: str) -> int:
    """The id of a series (created on first use); `labels` as `labels_json` gives it."""
    con.execute("INSERT OR IGNORE INTO series(run_id, source, target, metric, labels) VALUES (?, ?, ?, ?, ?)",
                (run_id, source, target, metric, labels))
    return con.execute("SELECT id FROM series WHERE run_id=? AND source=? AND target=? AND metric=? AND labels=?",
                       (run_id, source, target, metric, labels)).fetchone()[0]


def _value(v: float) -> float | None:
    return None if v is None or math.isnan(v) else v  # a server's NaN is stored as NULL


def write_gaps(con: sqlite3.Connection, run_id: int, gaps: Iterable[GapRecord]) -> None:
    con.executemany(_INSERT_GAP, [(run_id, g.source, g.target, g.kind, g.start_wall_ns, g.start_mono_ns, g.end_mono_ns,
                                   g.ticks, g.detail[:500]) for g in gaps])


log = logging.getLogger("cancelwatch.runstore")
_flagged_kinds: set[str] = set()


def _flag_unknown_kind(kind) -> None:
    """Say once per process that a kind outside EVENT_KINDS was written. It is written all the same: a
    recording never loses an event over its name, and nothing raises on the writer's thread."""
    if isinstance(kind, str) and kind not in EVENT_KINDS and kind not in _flagged_kinds:
        _flagged_kinds.add(kind)
        log.warning("event kind %r is not in runstore/event_kinds.py: EVENT_KINDS; written as given: name it "
                    "there (who writes it, what its data holds)", kind)


def write_events(con: sqlite3.Connection, run_id: int, events: Iterable[EventRecord]) -> None:
    """Events of the kinds in EVENT_KINDS; another kind is written too, and flagged in the log."""
    rows = []
    for e in events:
        _flag_unknown_kind(e.kind)
        rows.append((run_id, e.request_id, e.kind, e.wall_ns, e.mono_ns, json.dumps(e.data)))
    con.executemany(_INSERT_EVENT, rows)


def write_ledger(con: sqlite3.Connection, run_id: int, rows: Iterable[LedgerRecord]) -> None:
    con.executemany(_INSERT_LEDGER, [(run_id, *(getattr(r, c) for c in LEDGER_COLUMNS)) for r in rows])


def write_scrape_block(con: sqlite3.Connection, run_id: int, source: str, target: str, *,
                       series: Mapping[tuple[str, tuple], Sequence[float]], ticks: Sequence[int],
                       wall_ns: Sequence[int], mono_ns: Sequence[int], duration_ns: int) -> int:
    """Many successful scrapes of one source at once, each holding one value of every series in `series`
    ((metric, labels) -> one value per scrape). Rows land as a recording lays them, scrape by scrape.
    Returns how many samples were written."""
    n = len(ticks)
    if not n:
        return 0
    first = con.execute("SELECT coalesce(max(id), 0) FROM scrapes").fetchone()[0] + 1
    scrape_ids = first + np.arange(n, dtype=np.int64)
    con.executemany(_INSERT_SCRAPE, zip(scrape_ids.tolist(), [run_id] * n, [source] * n, [target] * n,
                                        [int(t) for t in ticks], [int(w) for w in wall_ns], [int(m) for m in mono_ns],
                                        [duration_ns] * n, [1] * n, [len(series)] * n))
    sids = np.array([series_id(con, run_id, source, target, metric, labels_json(labels))
                     for metric, labels in series], dtype=np.int64)
    vals = np.stack([np.asarray(v, dtype=float) for v in series.values()])  # (series, scrapes)
    flat = vals.T.ravel()
    stored = flat.astype(object)
    stored[np.isnan(flat)] = None
    con.executemany(_INSERT_SAMPLE, zip([run_id] * flat.size, np.tile(sids, n).tolist(),
                                        np.repeat(scrape_ids, len(sids)).tolist(), stored.tolist()))
    buckets = bucket_of(mono_ns, _started_mono_ns(con, run_id))
    write_overview(con, series_rows(run_id, np.tile(sids, n), np.repeat(buckets, len(sids)), flat),
                   scrape_rows(run_id, source, target, buckets, np.ones(n, dtype=bool), np.full(n, len(series)),
                               mono_ns, np.full(n, duration_ns)))
    return int(flat.size)


def _started_mono_ns(con: sqlite3.Connection, run_id: int) -> int:
    return int(con.execute("SELECT started_mono_ns FROM runs WHERE id = ?", (run_id,)).fetchone()[0])


def write_verdicts(con: sqlite3.Connection, run_id: int, judged_by: str, verdicts: Iterable[tuple[str, dict | str]]) -> None:
    """Verdicts given as the run was recorded: (request id, CancelVerdict.stored(), or verdict_json of it); a
    later one replaces it."""
    con.executemany("INSERT OR REPLACE INTO verdicts(run_id, request_id, judged_by, body) VALUES (?, ?, ?, ?)",
                    [(run_id, rid, judged_by, body if isinstance(body, str) else verdict_json(body))
                     for rid, body in verdicts])


def keep_verdicts(path: str | Path, run_id: int, judged_by: str, verdicts: list[tuple[str, dict | str]]) -> None:
    """write_verdicts on a connection of its own (a recorder's tail, after its writer closed). A store that takes
    no more (a full disk, which may be what ended the run) is a StoreError naming it."""
    con = open_store(path)
    try:
        with con:
            write_verdicts(con, run_id, judged_by, verdicts)
    except sqlite3.Error as exc:
        raise StoreError(f"{path}: the verdicts could not be written ({exc}); free space or fix the store, then "
                         "`cancelwatch report` judges them again") from None
    finally:
        con.close()


def verdict_json(body: dict) -> str:
    return json.dumps(body, default=_plain)


def _plain(value):
    """A numpy number in a verdict's evidence, as the Python number it holds."""
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON")


_STOP = object()


def store_path(con: sqlite3.Connection) -> str:
    """The file behind a connection (for messages)."""
    try:
        for _, name, file in con.execute("PRAGMA database_list"):
            if name == "main":
                return file or ":memory:"
    except sqlite3.Error:
        pass
    return "?"


class StoreWriter:
    """Owns the store connection on its own thread; producers only enqueue.

    Records are committed in one transaction every `flush_s` so that 20 Hz x several sources costs a
    handful of commits a second, and a reader in another process sees the run grow.
    """

    def __init__(self, con: sqlite3.Connection, run_id: int, flush_s: float = 0.5):
        self.con = con
        self.run_id = run_id
        self.flush_s = flush_s
        self.samples_written = 0
        self.scrapes_written = 0
        self.error: BaseException | None = None
        self.failed = threading.Event()  # set once a write failed: the recorder ends the run
        self.path = store_path(con)
        self._q: queue.Queue = queue.Queue()
        self._series: dict[tuple, int] = {}
        self._t0_ns: int | None = None  # the run's started_mono_ns: where its overview's buckets start
        # (source, target) -> the last two committed reads' mono_ns: see committed_through_ns
        self._committed: dict[tuple[str, str], tuple[int | None, int]] = {}
        self._forgotten: set[tuple[str, str]] = set()  # sources removed on purpose: not waited for (forget)
        self._marks_lock = threading.Lock()  # forget (another thread) against the writer's check-and-assign
        self._thread = threading.Thread(target=self._loop, name="store-writer", daemon=True)
        self._thread.start()

    def put(self, record: ScrapeRecord | GapRecord | EventRecord | LedgerRecord) -> None:
        self._q.put(record)

    def set_run_json(self, column: str, value: dict | list) -> None:
        self._q.put(("json", column, value))

    def put_verdicts(self, judged_by: str, verdicts: list[tuple[str, dict]]) -> None:
        """Verdicts a live judge gave (write_verdicts), written on the writer's thread like every record. Made
        JSON here, on the caller's thread: one that cannot be raises to its caller, never on the writer's."""
        self._q.put(("verdicts", judged_by, [(rid, verdict_json(body)) for rid, body in verdicts]))

    def close(self, timeout_s: float = 30.0) -> None:
        self._q.put(_STOP)
        self._thread.join(timeout_s)
        if self.error is not None:
            raise StoreError(self.error_line()) from self.error

    def committed_through_ns(self) -> int | None:
        """The monotonic instant up to which every source's reads, and the events read with them, are in the
        store: per source the read before its last committed one (a read's events are put after its scrape
        and may be a commit behind it, but are always before the next read's), the earliest over the sources;
        None before every source has two. What a live reader waits for: under a starved host the sources fall
        seconds behind the clock, and a window read by the clock then lacks the log lines it is judged on."""
        marks = list(self._committed.values())
        if not marks or any(prev is None for prev, _ in marks) or self.error is not None:
            return None  # a failed batch's records are lost: nothing past it is held
        return min(prev for prev, _ in marks)

    def expect(self, keys) -> None:
        """The (source, target) pairs the mark waits for before any of them has a read committed: a source whose
        first read is slow (a starved host) must not be left out of it."""
        for key in keys:
            self._committed.setdefault(tuple(key), (None, None))

    def forget(self, key: tuple[str, str]) -> None:
        """A (source, target) removed from the run on purpose (record's relay app, stopped after its scenarios):
        the mark no longer waits for its reads, which have ended."""
        with self._marks_lock:
            self._forgotten.add(tuple(key))
            self._committed.pop(tuple(key), None)

    def error_line(self) -> str:
        """One line: which store, what failed, what to do, and that the earlier writes are kept."""
        exc = self.error
        full = isinstance(exc, sqlite3.Error) and any(
            w in str(exc).lower() for w in ("full", "disk i/o", "too big", "no space"))
        why = "the disk is full or a file-size limit was reached: free space or choose another --store" if full \
            else "choose a writable --store"
        return (f"the run store at {self.path} stopped taking writes ({exc}); {why}. The "
                f"{self.samples_written} samples written before it are kept")

    def _series_id(self, s: Sample, target: str) -> int:
        key = (s.source, target, s.metric, s.labels)
        sid = self._series.get(key)
        if sid is None:
            sid = self._series[key] = series_id(self.con, self.run_id, s.source, target, s.metric,
                                                labels_json(s.labels))
        return sid

    def _write(self, rec) -> int | None:
        """Write one record; for a scrape, return how many samples it stored."""
        con = self.con
        if isinstance(rec, ScrapeRecord):
            cur = con.execute(_INSERT_SCRAPE, (None, self.run_id, rec.source, rec.target, rec.tick, rec.wall_ns,
                                               rec.mono_ns, rec.duration_ns, int(rec.ok), len(rec.samples)))
            scrape_id = cur.lastrowid
            rows = [(self.run_id, self._series_id(s, rec.target), scrape_id, _value(s.value)) for s in rec.samples]
            con.executemany(_INSERT_SAMPLE, rows)
            return len(rows)
        if isinstance(rec, GapRecord):
            write_gaps(con, self.run_id, [rec])
        elif isinstance(rec, EventRecord):
            write_events(con, self.run_id, [rec])
        elif isinstance(rec, LedgerRecord):
            write_ledger(con, self.run_id, [rec])
        elif isinstance(rec, tuple) and rec[0] == "json":
            set_run_json(con, self.run_id, rec[1], rec[2])
        elif isinstance(rec, tuple) and rec[0] == "verdicts":
            write_verdicts(con, self.run_id, rec[1], rec[2])
        return None

    def _write_overview(self, batch: list) -> None:
        """The batch's scrapes added to the run's overview (runstore/overview.py), in its transaction."""
        scrapes = [r for r in batch if isinstance(r, ScrapeRecord)]
        if not scrapes:
            return
        if self._t0_ns is None:
            self._t0_ns = _started_mono_ns(self.con, self.run_id)
        sids, buckets, values = [], [], []
        by_source: dict[tuple[str, str], list[ScrapeRecord]] = {}
        for rec in scrapes:
            bucket = int(bucket_of(rec.mono_ns, self._t0_ns))
            by_source.setdefault((rec.source, rec.target), []).append(rec)
            for smp in rec.samples:
                sids.append(self._series_id(smp, rec.target))
                buckets.append(bucket)
                values.append(math.nan if smp.value is None else smp.value)
        series = series_rows(self.run_id, np.array(sids, dtype=np.int64), np.array(buckets, dtype=np.int64),
                             np.array(values, dtype=float))
        rows = []
        for (source, target), recs in by_source.items():
            mono = np.array([r.mono_ns for r in recs], dtype=np.int64)
            rows += scrape_rows(self.run_id, source, target, bucket_of(mono, self._t0_ns), [r.ok for r in recs],
                                [len(r.samples) for r in recs], mono, [r.duration_ns for r in recs])
        write_overview(self.con, series, rows)

    def _loop(self) -> None:
        stop = False
        while not stop:
            batch = []
            deadline = time.monotonic() + self.flush_s
            while True:
                try:
                    rec = self._q.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if rec is _STOP:
                    stop = True
                    break
                batch.append(rec)
            if not batch:
                continue
            try:
                with self.con:
                    written = [self._write(rec) for rec in batch]
                    self._write_overview(batch)
                with self._marks_lock:
                    for rec in batch:
                        if isinstance(rec, ScrapeRecord) and (key := (rec.source, rec.target)) not in self._forgotten:
                            self._committed[key] = (self._committed.get(key, (None, None))[1], rec.mono_ns)
                counts = [n for n in written if n is not None]
                self.samples_written += sum(counts)
                self.scrapes_written += len(counts)
            except Exception as exc:  # noqa: BLE001 - a thread that died here would leave the queue unread
                # Keep draining so producers never block; the error surfaces at close(), and the
                # recorder, told by `failed`, ends the run rather than sample into nothing.
                self.error = self.error or exc
                self.failed.set()
