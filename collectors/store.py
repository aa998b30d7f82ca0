"""The write side of the run store: one SQLite file in WAL mode, written by one thread in batches."""

from __future__ import annotations

import dataclasses
import json
import queue
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from collectors.samples import Sample
from runstore.reader import StoreError
from runstore.schema import DDL, SCHEMA_VERSION


def open_store(path: str | Path) -> sqlite3.Connection:
    """Open (creating if needed) a run store for writing. StoreError names the path on failure."""
    p = Path(path)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        con = sqlite3.connect(str(p), timeout=10.0, check_same_thread=False)
        con.execute("PRAGMA journal_mode=WAL")
        con.execute("PRAGMA synchronous=NORMAL")
        con.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
        row = con.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        if row is not None and row[0] != str(SCHEMA_VERSION):
            con.close()
            # checked before any DDL: a store of another version is left exactly as it was
            raise StoreError(f"the run store at {p} has schema {row[0]}, this cancelwatch writes {SCHEMA_VERSION}: "
                             "record into a new file with --store")
        con.executescript(DDL)
        con.execute("INSERT OR IGNORE INTO meta(key, value) VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
        con.commit()
    except (OSError, sqlite3.Error) as exc:
        raise StoreError(f"cannot write the run store at {p} ({exc}): choose a writable path with --store") from exc
    return con


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


@dataclass
class ScrapeRecord:
    source: str
    target: str
    tick: int
    wall_ns: int
    mono_ns: int
    duration_ns: int
    ok: bool
    samples: list[Sample] = field(default_factory=list)


@dataclass
class GapRecord:
    source: str
    target: str
    kind: str  # missed | error | parse_error | lost
    start_wall_ns: int
    start_mono_ns: int
    end_mono_ns: int
    ticks: int
    detail: str = ""


@dataclass
class EventRecord:
    kind: str
    wall_ns: int
    mono_ns: int
    request_id: str | None = None
    data: dict = field(default_factory=dict)


@dataclass
class LedgerRecord:
    """What the client knows of one request. Times are time.monotonic_ns()."""

    request_id: str
    scenario: str
    role: str  # target | neighbour | probe | filler
    n: int = 1
    prompt_tokens: int = 0
    max_tokens: int = 0
    sent_mono_ns: int | None = None
    first_token_mono_ns: int | None = None
    chunks: int = 0
    tokens_after_cancel: int = 0
    cancel_mono_ns: int | None = None
    closed_mono_ns: int | None = None
    terminal_state: str | None = None
    reason: str | None = None
    error: str | None = None


_LEDGER_COLUMNS = [f.name for f in dataclasses.fields(LedgerRecord)]

_STOP = object()


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
        self._q: queue.Queue = queue.Queue()
        self._series: dict[tuple, int] = {}
        self._thread = threading.Thread(target=self._loop, name="store-writer", daemon=True)
        self._thread.start()

    def put(self, record: ScrapeRecord | GapRecord | EventRecord | LedgerRecord) -> None:
        self._q.put(record)

    def set_run_json(self, column: str, value: dict) -> None:
        self._q.put(("json", column, value))

    def close(self, timeout_s: float = 30.0) -> None:
        self._q.put(_STOP)
        self._thread.join(timeout_s)
        if self.error is not None:
            raise StoreError(f"writing the run store failed: {self.error}") from self.error

    def _series_id(self, s: Sample, target: str) -> int:
        key = (s.source, target, s.metric, s.labels)
        sid = self._series.get(key)
        if sid is None:
            labels = json.dumps(dict(s.labels), sort_keys=True)
            self.con.execute(
                "INSERT OR IGNORE INTO series(run_id, source, target, metric, labels) VALUES (?, ?, ?, ?, ?)",
                (self.run_id, s.source, target, s.metric, labels),
            )
            sid = self.con.execute(
                "SELECT id FROM series WHERE run_id=? AND source=? AND target=? AND metric=? AND labels=?",
                (self.run_id, s.source, target, s.metric, labels),
            ).fetchone()[0]
            self._series[key] = sid
        return sid

    def _write(self, rec) -> int | None:
        """Write one record; for a scrape, return how many samples it stored."""
        con = self.con
        if isinstance(rec, ScrapeRecord):
            cur = con.execute(
                "INSERT INTO scrapes(run_id, source, target, tick, wall_ns, mono_ns, duration_ns, ok, n_samples) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (self.run_id, rec.source, rec.target, rec.tick, rec.wall_ns, rec.mono_ns, rec.duration_ns,
                 int(rec.ok), len(rec.samples)),
            )
            scrape_id = cur.lastrowid
            rows = [
                (self.run_id, self._series_id(s, rec.target), scrape_id, None if s.value != s.value else s.value)
                for s in rec.samples
            ]
            con.executemany("INSERT INTO samples(run_id, series_id, scrape_id, value) VALUES (?, ?, ?, ?)", rows)
            return len(rows)
        elif isinstance(rec, GapRecord):
            con.execute(
                "INSERT INTO gaps(run_id, source, target, kind, start_wall_ns, start_mono_ns, end_mono_ns, ticks, detail) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (self.run_id, rec.source, rec.target, rec.kind, rec.start_wall_ns, rec.start_mono_ns,
                 rec.end_mono_ns, rec.ticks, rec.detail[:500]),
            )
        elif isinstance(rec, EventRecord):
            con.execute(
                "INSERT INTO events(run_id, request_id, kind, wall_ns, mono_ns, data) VALUES (?, ?, ?, ?, ?, ?)",
                (self.run_id, rec.request_id, rec.kind, rec.wall_ns, rec.mono_ns, json.dumps(rec.data)),
            )
        elif isinstance(rec, LedgerRecord):
            cols = ", ".join(_LEDGER_COLUMNS)
            marks = ", ".join("?" for _ in _LEDGER_COLUMNS)
            con.execute(
                f"INSERT OR REPLACE INTO ledger(run_id, {cols}) VALUES (?, {marks})",
                (self.run_id, *(getattr(rec, c) for c in _LEDGER_COLUMNS)),
            )
        elif isinstance(rec, tuple) and rec[0] == "json":
            _, column, value = rec
            if column not in ("targets", "engine", "cache", "settings", "stats"):
                raise ValueError(f"not a JSON column of runs: {column}")
            con.execute(f"UPDATE runs SET {column} = ? WHERE id = ?", (json.dumps(value), self.run_id))
        return None

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
                counts = [n for n in written if n is not None]
                self.samples_written += sum(counts)
                self.scrapes_written += len(counts)
            except sqlite3.Error as exc:
                # Keep draining so producers never block; the error surfaces at close().
                self.error = exc


def finish_run(con: sqlite3.Connection, run_id: int, status: str, stats: dict) -> None:
    con.execute(
        "UPDATE runs SET status = ?, ended_wall_ns = ?, stats = ? WHERE id = ?",
        (status, time.time_ns(), json.dumps(stats), run_id),
    )
    con.commit()
