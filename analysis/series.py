"""The per-metric series accessor: one metric as one value per scrape, and the scheduler's gauges
side by side. Times `t_s` are instants, seconds since the run started."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd

from cancelwatch.runstore.reader import Run

SERIES_COLUMNS = ["scrape_id", "t_s", "source", "target", "value"]
SCHEDULER_COLUMNS = ["t_s", "running", "waiting", "count", "kv", "gen_tokens", "prefix_hits", "preemptions",
                     "finished"]
# vllm:request_success_total's reasons for a request the engine ended by itself: an abort (there only from some
# paths: vLLM 0.32 counts no client's) and an error are not a request run to its end
OWN_ENDS = frozenset({"stop", "length", "repetition"})


def series_frame(run: Run, metric: str, target: str | None = None) -> pd.DataFrame:
    """One metric's samples summed over its label sets per scrape, in time order (of one target when
    given): columns scrape_id, t_s, source, target, value."""
    df = run.series(metric, target=target)
    if df.empty:
        return pd.DataFrame(columns=SERIES_COLUMNS)
    if df["scrape_id"].duplicated().any():
        # several label sets a scrape (engines, GPUs): one value a scrape. Only then: grouping
        # 72,000 scrapes an hour costs more than the whole figure
        df = df.groupby(["scrape_id", "source", "target"], as_index=False, observed=True).agg(
            t_s=("t_s", "first"), value=("value", "sum"))
    return df[SERIES_COLUMNS].sort_values("t_s", kind="stable").reset_index(drop=True)


def own_ends(run: Run, target: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(instants, values) per scrape, in time order: the requests the engine ended by themselves
    (requests_finished_total over the finished_reason labels of OWN_ENDS), a counter; empty where no series says
    its reason."""
    labels, scrape, t, v = run.series_arrays("requests_finished_total", ("labels", "scrape_id", "t_s", "value"), target)
    reasons = {lab: (json.loads(lab) if lab else {}).get("finished_reason") for lab in set(labels)}
    own = np.array([reasons[lab] in OWN_ENDS for lab in labels], dtype=bool)
    if not own.any():
        return np.array([]), np.array([])
    scrape, t, v = scrape[own].astype(float), t[own].astype(float), v[own].astype(float)
    # one value a scrape: its label sets summed, at its first instant
    order = np.argsort(scrape, kind="stable")
    scrape, t, v = scrape[order], t[order], v[order]
    starts = np.flatnonzero(np.r_[True, scrape[1:] != scrape[:-1]])
    t, v = t[starts], np.add.reduceat(v, starts)
    by_t = np.argsort(t, kind="stable")
    return t[by_t], v[by_t]


def scheduler_frame(run: Run, target: str | None = None) -> pd.DataFrame:
    """Per scrape: t_s, running, waiting, count (= running + waiting), kv (KV-cache usage ratio,
    0..1), gen_tokens (generation_tokens_total, a counter), prefix_hits and preemptions (counters: prompt
    tokens found in the prefix cache, requests preempted), finished (a counter: own_ends); a series the
    engine does not serve is NaN."""
    cols = scheduler_columns(run, target)
    return pd.DataFrame({c: cols[c] for c in SCHEDULER_COLUMNS})


def scheduler_columns(run: Run, target: str | None = None) -> dict[str, np.ndarray]:
    """scheduler_frame's columns as float arrays: every cancel a watch judges builds them for its window, and the
    rules read arrays."""
    parts = {col: _per_scrape(run, metric, target) for col, metric in _SCHEDULER_METRICS}
    parts["finished"] = own_ends(run, target)
    times = np.unique(np.concatenate([t for t, _ in parts.values()])) if parts else np.array([])
    cols = {"t_s": times}
    for col, (t, v) in parts.items():
        out = np.full(len(times), np.nan)
        out[np.searchsorted(times, t)] = v
        cols[col] = out
    # counters the scheduler's scrape carries beside its gauges: a stray instant of theirs alone adds no row
    keep = ~np.isnan(np.vstack([cols[c] for c in ("running", "waiting", "kv", "gen_tokens")])).all(axis=0)
    cols = {c: a[keep].astype(float) for c, a in cols.items()}
    cols["count"] = cols["running"] + cols["waiting"]
    return cols


_SCHEDULER_METRICS = (("running", "requests_running"), ("waiting", "requests_waiting"),
                      ("kv", "kv_cache_usage_ratio"), ("gen_tokens", "generation_tokens_total"),
                      ("prefix_hits", "prefix_cache_hits_tokens_total"), ("preemptions", "preemptions_total"))


def _per_scrape(run: Run, metric: str, target: str | None) -> tuple[np.ndarray, np.ndarray]:
    """(instants, values) of one metric of `target`, summed over its label sets per scrape (series_frame), in
    time order."""
    scrape, t, v = (a.astype(float) for a in run.series_arrays(metric, ("scrape_id", "t_s", "value"), target))
    if not len(t):
        return np.array([]), np.array([])
    if len(np.unique(scrape)) < len(scrape):  # several label sets a scrape: one value a scrape
        df = series_frame(run, metric, target)
        return df["t_s"].to_numpy(dtype=float), df["value"].to_numpy(dtype=float)
    order = np.argsort(t, kind="stable")
    return t[order], v[order]


def sample_period(run: Run, t: np.ndarray | None = None) -> float:
    """The sampling period in seconds of a series sampled at instants `t`: its median interval, but
    never less than the run's baseline, 1 / its --hz. Bursts (--burst-hz) add samples between the
    baseline's, so the median interval of a run with bursts can be the burst's; silences and caps are
    measured against the baseline. A source read more slowly keeps its own, longer period."""
    own = float(np.median(np.diff(t))) if t is not None and len(t) > 1 else 0.0
    hz = (run.info.get("settings") or {}).get("hz")
    try:
        base = 1.0 / float(hz) if hz and float(hz) > 0 else 0.0
    except (TypeError, ValueError):
        base = 0.0
    return max(own, base) or 0.05


def time_weights(t: np.ndarray, period: float) -> np.ndarray:
    """How long each sample stands for: the time to the next one, capped at two periods (a gap is
    not observed), so that statistics over a run with bursts do not count the bursts' extra samples
    as extra time. The last sample stands for one period."""
    if not len(t):
        return np.array([])
    dt = np.diff(t, append=t[-1] + period)
    return np.clip(dt, 0.0, 2 * period)


def weighted_quantile(values: np.ndarray, weights: np.ndarray, q: float) -> float:
    """The q-quantile of `values` with each one counted for its weight (time, here)."""
    order = np.argsort(values, kind="stable")
    v, w = values[order], weights[order]
    cum = np.cumsum(w)
    if not len(v) or cum[-1] <= 0:
        return float(np.quantile(values, q)) if len(values) else float("nan")
    return float(v[min(len(v) - 1, int(np.searchsorted(cum, q * cum[-1])))])


def scrape_spans(run: Run, target: str | None, times: np.ndarray, source: str) -> np.ndarray:
    """Per sample instant of `target`'s server (its `source`'s scrapes): how long its scrape took to answer (s; 0
    where the run did not record it). A reading stamped at its scrape's start counts what the server held at some
    instant of that span. The server's scrapes only: another source of the target (the clients' count) reads on
    the same tick grid, at the same instants."""
    sc = run.scrapes
    if sc is None or sc.empty or not len(times):
        return np.zeros(len(times))
    # in arrays: a frame's masks and a reindex cost a millisecond, and a watch judges every cancel on a window
    mine = sc["ok"].to_numpy() == 1
    if "source" in sc:
        mine &= _equals(sc["source"], source)
    if target is not None:
        mine &= _equals(sc["target"], target)
    at = np.round(sc["t_s"].to_numpy(float)[mine], 6)
    took = sc["duration_ns"].to_numpy(float)[mine] / 1e9
    if not len(at):
        return np.zeros(len(times))
    order = np.argsort(at, kind="stable")
    at, took = at[order], took[order]
    want = np.round(times.astype(float), 6)
    # of a repeated instant the last row's, as a dict built in row order keeps it (the stable sort keeps row order)
    i = np.clip(np.searchsorted(at, want, side="right") - 1, 0, None)
    return np.nan_to_num(np.where(at[i] == want, took[i], 0.0), nan=0.0)


def _equals(col: pd.Series, value) -> np.ndarray:
    """col == value, as a bool array; a categorical (the reader's sources and targets) by its codes: its values as
    Python objects cost more than a window's few hundred scrapes."""
    if isinstance(col.dtype, pd.CategoricalDtype):
        names = col.cat.categories
        return col.cat.codes.to_numpy() == (names.get_loc(value) if value in names else -2)
    return col.to_numpy(dtype=object) == value
