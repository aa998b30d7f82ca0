"""Read runs out of a store into pandas. Pure reading: safe while a recorder is writing (WAL)."""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd


class StoreError(Exception):
    """A store or run that cannot be read; the message names the fix."""


def connect_readonly(path: str | Path) -> sqlite3.Connection:
    p = Path(path)
    if not p.is_file():
        raise StoreError(f"no run store at {p}: record a run first (cancelwatch sample --target URL)")
    con = sqlite3.connect(f"file:{p.resolve()}?mode=ro", uri=True, timeout=5.0)
    try:
        con.execute("SELECT 1 FROM runs LIMIT 1")
    except sqlite3.DatabaseError as exc:
        con.close()
        raise StoreError(f"{p} is not a cancelwatch run store ({exc}): point --store at a .db written by cancelwatch") from exc
    return con


def list_runs(path: str | Path) -> pd.DataFrame:
    """One row per run, newest last."""
    with connect_readonly(path) as con:
        df = pd.read_sql_query(
            "SELECT id, name, status, started_wall_ns, ended_wall_ns, targets FROM runs ORDER BY id", con
        )
    df["started"] = pd.to_datetime(df["started_wall_ns"], unit="ns", utc=True)
    df["duration_s"] = (df["ended_wall_ns"] - df["started_wall_ns"]) / 1e9
    return df


def resolve_run_id(path: str | Path, run: str | int) -> int:
    """Turn 'latest' or an id into an existing run id."""
    with connect_readonly(path) as con:
        if str(run) == "latest":
            row = con.execute("SELECT max(id) FROM runs").fetchone()
            if row is None or row[0] is None:
                raise StoreError(f"{path} holds no runs yet: record one with cancelwatch sample --target URL")
            return int(row[0])
        try:
            rid = int(run)
        except ValueError as exc:
            raise StoreError(f"run must be an integer id or 'latest', not {run!r}") from exc
        if con.execute("SELECT 1 FROM runs WHERE id = ?", (rid,)).fetchone() is None:
            raise StoreError(f"no run {rid} in {path}: list them with cancelwatch runs")
        return rid


@dataclass
class Run:
    """One run as frames. Times: `t_s` is seconds since the run started (monotonic clock)."""

    id: int
    info: dict
    samples: pd.DataFrame
    scrapes: pd.DataFrame
    gaps: pd.DataFrame
    events: pd.DataFrame = field(default_factory=pd.DataFrame)
    ledger: pd.DataFrame = field(default_factory=pd.DataFrame)

    def series(self, metric: str, source: str | None = None, target: str | None = None) -> pd.DataFrame:
        df = self.samples[self.samples["metric"] == metric]
        if source is not None:
            df = df[df["source"] == source]
        if target is not None:
            df = df[df["target"] == target]
        return df


_JSON_COLUMNS = ("targets", "engine", "cache", "settings", "stats")


def load_run(path: str | Path, run: str | int = "latest") -> Run:
    rid = resolve_run_id(path, run)
    with connect_readonly(path) as con:
        con.row_factory = sqlite3.Row
        info = dict(con.execute("SELECT * FROM runs WHERE id = ?", (rid,)).fetchone())
        con.row_factory = None
        for key in _JSON_COLUMNS:
            info[key] = json.loads(info[key] or "{}")
        t0 = info["started_mono_ns"]
        samples = pd.read_sql_query(
            """SELECT se.source, se.target, se.metric, se.labels, sa.value,
                      sc.wall_ns, sc.mono_ns, sc.duration_ns, sa.scrape_id
               FROM samples sa JOIN series se ON se.id = sa.series_id
                               JOIN scrapes sc ON sc.id = sa.scrape_id
               WHERE sa.run_id = ? ORDER BY sc.mono_ns""",
            con,
            params=(rid,),
        )
        scrapes = pd.read_sql_query(
            "SELECT id, source, target, tick, wall_ns, mono_ns, duration_ns, ok, n_samples "
            "FROM scrapes WHERE run_id = ? ORDER BY mono_ns",
            con,
            params=(rid,),
        )
        gaps = pd.read_sql_query(
            "SELECT source, target, kind, start_wall_ns, start_mono_ns, end_mono_ns, ticks, detail "
            "FROM gaps WHERE run_id = ? ORDER BY start_mono_ns",
            con,
            params=(rid,),
        )
        events = pd.read_sql_query(
            "SELECT request_id, kind, wall_ns, mono_ns, data FROM events WHERE run_id = ? ORDER BY mono_ns",
            con,
            params=(rid,),
        )
        ledger = pd.read_sql_query("SELECT * FROM ledger WHERE run_id = ?", con, params=(rid,))
    for df, col in ((samples, "mono_ns"), (scrapes, "mono_ns"), (gaps, "start_mono_ns"), (events, "mono_ns")):
        df["t_s"] = (df[col] - t0) / 1e9
    if not gaps.empty:
        gaps["end_t_s"] = (gaps["end_mono_ns"] - t0) / 1e9
    return Run(id=rid, info=info, samples=samples, scrapes=scrapes, gaps=gaps, events=events, ledger=ledger)
