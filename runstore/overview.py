"""A run's overview, kept as its samples land: per series and OVERVIEW_S bucket of the run's clock the count,
min, max and last value, and per source and bucket its scrapes. What a page showing a day reads instead of
the day's millions of samples (runstore.reader.load_overview): a bucket's min and max keep every peak a
timeline must show, which a sample every so often would miss.

Writes add to a bucket (an upsert): a recorder's batch ends mid-bucket, and the next one goes on filling it."""

from __future__ import annotations

import sqlite3

import numpy as np

from cancelwatch.runstore.schema import OVERVIEW_S

BUCKET_NS = OVERVIEW_S * 1_000_000_000

_UPSERT_SERIES = """
INSERT INTO overview(run_id, series_id, bucket, n, vmin, vmax, vlast) VALUES (?, ?, ?, ?, ?, ?, ?)
ON CONFLICT(run_id, series_id, bucket) DO UPDATE SET
    n = n + excluded.n,
    vmin = CASE WHEN vmin IS NULL THEN excluded.vmin WHEN excluded.vmin IS NULL THEN vmin
                ELSE min(vmin, excluded.vmin) END,
    vmax = CASE WHEN vmax IS NULL THEN excluded.vmax WHEN excluded.vmax IS NULL THEN vmax
                ELSE max(vmax, excluded.vmax) END,
    vlast = coalesce(excluded.vlast, vlast)
"""
_UPSERT_SCRAPES = """
INSERT INTO scrape_overview(run_id, source, target, bucket, n_ok, n_failed, n_samples, first_ok_mono_ns,
                            last_ok_mono_ns, duration_sum_ns, duration_max_ns)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
ON CONFLICT(run_id, source, target, bucket) DO UPDATE SET
    n_ok = n_ok + excluded.n_ok,
    n_failed = n_failed + excluded.n_failed,
    n_samples = n_samples + excluded.n_samples,
    first_ok_mono_ns = coalesce(min(first_ok_mono_ns, excluded.first_ok_mono_ns), first_ok_mono_ns,
                                excluded.first_ok_mono_ns),
    last_ok_mono_ns = coalesce(max(last_ok_mono_ns, excluded.last_ok_mono_ns), last_ok_mono_ns,
                               excluded.last_ok_mono_ns),
    duration_sum_ns = duration_sum_ns + excluded.duration_sum_ns,
    duration_max_ns = max(duration_max_ns, excluded.duration_max_ns)
"""


def bucket_of(mono_ns, t0_ns: int):
    """The bucket of an instant (or an array of them), monotonic ns, in a run started at `t0_ns`."""
    return (np.asarray(mono_ns, dtype=np.int64) - t0_ns) // BUCKET_NS


def _groups(keys: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(order, starts): a stable sort by the key columns, and where each run of equal keys starts in it."""
    order = np.lexsort(keys[::-1])  # lexsort sorts by its last key first, and is stable
    sorted_keys = np.stack([k[order] for k in keys])
    change = np.any(sorted_keys[:, 1:] != sorted_keys[:, :-1], axis=0)
    return order, np.r_[0, np.nonzero(change)[0] + 1]


def series_rows(run_id: int, series_ids: np.ndarray, buckets: np.ndarray, values: np.ndarray) -> list[tuple]:
    """Overview rows of samples given in the order they were taken (NaN: the server's NaN)."""
    if not len(values):
        return []
    order, starts = _groups([np.asarray(series_ids, dtype=np.int64), np.asarray(buckets, dtype=np.int64)])
    v = np.asarray(values, dtype=float)[order]
    ends = np.r_[starts[1:], len(v)]
    with np.errstate(invalid="ignore"):
        vmin = np.fmin.reduceat(v, starts)  # fmin/fmax pass NaN over: NaN only where all were
        vmax = np.fmax.reduceat(v, starts)
    # the last value that was not NaN in each bucket
    idx = np.where(~np.isnan(v), np.arange(len(v)), -1)
    last = np.maximum.accumulate(idx)[ends - 1]
    vlast = np.where(last >= starts, v[np.maximum(last, 0)], np.nan)
    sid, bkt = np.asarray(series_ids)[order][starts], np.asarray(buckets)[order][starts]

    def num(x: float) -> float | None:
        return None if np.isnan(x) else float(x)

    return [(run_id, int(s), int(b), int(n), num(lo), num(hi), num(la))
            for s, b, n, lo, hi, la in zip(sid, bkt, ends - starts, vmin, vmax, vlast)]


def scrape_rows(run_id: int, source: str, target: str, buckets: np.ndarray, ok: np.ndarray, n_samples: np.ndarray,
                mono_ns: np.ndarray, duration_ns: np.ndarray) -> list[tuple]:
    """Overview rows of one source's scrapes."""
    if not len(buckets):
        return []
    order, starts = _groups([np.asarray(buckets, dtype=np.int64)])
    ok = np.asarray(ok, dtype=bool)[order]
    mono = np.asarray(mono_ns, dtype=np.int64)[order]
    dur = np.where(ok, np.asarray(duration_ns, dtype=np.int64)[order], 0)
    n_samples = np.where(ok, np.asarray(n_samples, dtype=np.int64)[order], 0)
    big = np.iinfo(np.int64).max
    first = np.minimum.reduceat(np.where(ok, mono, big), starts)
    last = np.maximum.reduceat(np.where(ok, mono, -1), starts)
    n_ok = np.add.reduceat(ok.astype(np.int64), starts)
    n_all = np.diff(np.r_[starts, len(ok)])
    bkt = np.asarray(buckets, dtype=np.int64)[order][starts]
    return [(run_id, source, target, int(b), int(k), int(a - k), int(ns), None if f == big else int(f),
             None if la < 0 else int(la), int(ds), int(dm))
            for b, k, a, ns, f, la, ds, dm in zip(bkt, n_ok, n_all, np.add.reduceat(n_samples, starts), first, last,
                                                   np.add.reduceat(dur, starts), np.maximum.reduceat(dur, starts))]


def write_overview(con: sqlite3.Connection, series: list[tuple], scrapes: list[tuple]) -> None:
    """Add rows of series_rows and scrape_rows to the run's overview (inside the caller's transaction)."""
    if series:
        con.executemany(_UPSERT_SERIES, series)
    if scrapes:
        con.executemany(_UPSERT_SCRAPES, scrapes)
