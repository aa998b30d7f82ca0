"""Capacity figures of a run: how much of the KV pool was used, and how much room is left."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from cancelwatch.analysis.facts import kv_pool, scheduler_targets
from cancelwatch.analysis.series import sample_period, series_frame, time_weights, weighted_quantile
from cancelwatch.runstore.reader import Run


def time_with_waiting(run: Run, target: str) -> tuple[float, float]:
    """Seconds with at least one waiting request, and the seconds observed. A sample stands for the
    time to the next one, capped at two sample periods so that a gap counts as not observed."""
    df = series_frame(run, "requests_waiting", target)
    if len(df) < 2:
        return 0.0, 0.0
    t = df["t_s"].to_numpy(dtype=float)
    dt = np.minimum(np.diff(t), 2 * sample_period(run, t))
    waiting = df["value"].to_numpy(dtype=float)[:-1] > 0
    return float(dt[waiting].sum()), float(dt.sum())


def capacity(run: Run, context_len: int = 2048, target: str | None = None) -> dict:
    """KV pool in tokens, max concurrency at `context_len`, peak and p95 KV usage, headroom,
    preemptions, time with requests waiting. Missing series give None, never zero."""
    if context_len <= 0:
        raise ValueError("context length must be a positive number of tokens")
    labels = scheduler_targets(run)
    target = target or (labels[0] if labels else None)
    pool = kv_pool(run, target)
    kv = series_frame(run, "kv_cache_usage_ratio", target)
    kv = kv.dropna(subset=["value"]) if not kv.empty else kv
    vals = kv["value"].to_numpy(dtype=float) if not kv.empty else np.array([])
    peak = float(vals.max()) if len(vals) else None
    # time-weighted: a burst's extra samples around the cancels are not extra time at that usage
    t_kv = kv["t_s"].to_numpy(dtype=float) if not kv.empty else np.array([])
    p95 = weighted_quantile(vals, time_weights(t_kv, sample_period(run, t_kv)), 0.95) if len(vals) else None
    pre = series_frame(run, "preemptions_total", target)["value"].dropna()
    waiting_s, observed_s = time_with_waiting(run, target)
    running = series_frame(run, "requests_running", target)["value"].dropna()
    if "overview" in run.info:
        # a long run read from its overview (runstore.reader.load_overview): each bucket is its lowest and highest
        # value, which keep the peak but not how long a value lasted (a 10 s bucket with one waiting sample read
        # as 10 s waiting: 75 times the truth on a synthetic run). Not guessed: n/a
        p95, waiting_s, observed_s = None, None, 0.0
    tokens = pool["tokens"]
    return {
        "target": target,
        "context_len": context_len,
        "pool_tokens": tokens,
        "pool_bytes": pool["bytes"],
        "max_concurrency": tokens // context_len if tokens else None,
        "peak_kv": peak,
        "p95_kv": p95,
        "headroom_ratio": None if peak is None else max(0.0, 1.0 - peak),
        "headroom_tokens": None if peak is None or not tokens else int(round((1.0 - peak) * tokens)),
        "headroom_requests": None if peak is None or not tokens else int((1.0 - peak) * tokens // context_len),
        "peak_running": float(running.max()) if len(running) else None,
        "preemptions": float(pre.iloc[-1] - pre.iloc[0]) if len(pre) >= 2 else None,
        "waiting_s": waiting_s,
        "waiting_share": waiting_s / observed_s if observed_s > 0 else None,
    }


def capacity_frame(cap: dict) -> pd.DataFrame:
    def pct(x):
        return "n/a" if x is None else f"{100 * x:.1f} %"

    rows = [("KV pool", f"{cap['pool_tokens']} tokens" if cap["pool_tokens"] else "n/a"),
            (f"max concurrency at {cap['context_len']} tokens", cap["max_concurrency"]),
            ("peak KV usage", pct(cap["peak_kv"])), ("p95 KV usage", pct(cap["p95_kv"])),
            ("headroom at peak", f"{pct(cap['headroom_ratio'])} = {cap['headroom_tokens']} tokens "
                                 f"= {cap['headroom_requests']} more requests of {cap['context_len']} tokens"),
            ("peak running requests", cap["peak_running"]),
            ("preemptions", cap["preemptions"]),
            ("time with requests waiting", "n/a" if cap["waiting_s"] is None else
             f"{cap['waiting_s']:.1f} s ({pct(cap['waiting_share'])})")]
    return pd.DataFrame(rows, columns=["figure", "value"]).astype(str)


def capacity_figure(caps: list[tuple[str, dict]]) -> go.Figure:
    """Per run, its KV pool as one bar in tokens: used at p95, the peak above it, and what was still free
    at the peak, labelled with how many more requests of the context length fit there. Patterns and
    the labels on the bars read without colour."""
    fig = go.Figure()
    names = [label for label, _ in caps]
    # a p95 not known (a long run read from its overview) draws the peak alone, as "peak above p95" from zero
    parts = (("used at p95", "#e45756", "/", lambda c: (c["p95_kv"] or 0.0) * c["pool_tokens"]),
             ("peak above p95", "#f58518", "x", lambda c: (c["peak_kv"] - (c["p95_kv"] or 0.0)) * c["pool_tokens"]),
             ("free at peak", "#f2cfce", ".", lambda c: c["headroom_tokens"]))
    drawable = [c["pool_tokens"] is not None and c["peak_kv"] is not None for _, c in caps]
    for part, colour, shape, value in parts:
        xs = [round(value(c)) if ok else None for (_, c), ok in zip(caps, drawable)]
        texts = [f"{part}: {x} tokens" if x is not None else "" for x in xs]
        fig.add_trace(go.Bar(y=names, x=xs, name=part, orientation="h", text=texts, textposition="inside",
                             marker=dict(color=colour, pattern=dict(shape=shape)),
                             hovertemplate="%{x} tokens<extra>" + part + "</extra>"))
    for (label, c), ok in zip(caps, drawable):
        if not ok:
            fig.add_annotation(y=label, x=0, text="KV pool or usage not known for this run", showarrow=False,
                               xanchor="left")
            continue
        size = f", {c['pool_bytes'] / 1024**2:.0f} MiB" if c["pool_bytes"] else ""
        fig.add_annotation(y=label, x=c["pool_tokens"], xanchor="left", showarrow=False,
                           text=f"  pool {c['pool_tokens']} tokens{size}: room for {c['headroom_requests']} more "
                                f"request(s) of {c['context_len']} tokens at the peak")
    fig.update_layout(barmode="stack", height=140 + 70 * len(caps), margin=dict(l=20, r=260, t=50, b=30),
                      title="The KV pool per run: how much of it requests used, and how much was left",
                      xaxis_title="tokens", legend=dict(orientation="h", y=-0.3))
    return fig


def _bucketed(run: Run, metric: str, target: str, bucket_s: float) -> pd.Series:
    """One metric of one target, one value per time bucket (the last in it): replicas sampled at their
    own instants line up on the buckets."""
    df = series_frame(run, metric, target)
    if df.empty:
        return pd.Series(dtype=float)
    keys = np.floor(df["t_s"].to_numpy(dtype=float) / bucket_s).astype(np.int64)
    return pd.Series(df["value"].to_numpy(dtype=float), index=keys).groupby(level=0).last()


def fleet_frame(run: Run, context_len: int = 2048) -> pd.DataFrame:
    """Per replica, and for the fleet of them, over the run: KV pool, p95 and peak KV usage, max
    concurrency at `context_len`, time with requests waiting, preemptions. The fleet's KV usage is the
    pool-weighted usage of all replicas at each step; its waiting time counts a step once however many
    replicas had requests waiting. Unknowns stay n/a, never zero."""
    targets = scheduler_targets(run)
    caps = [capacity(run, context_len, t) for t in targets]

    def pct(x):
        return "n/a" if x is None else f"{100 * x:.1f} %"

    rows = [{"replica": c["target"], "KV pool (tokens)": c["pool_tokens"], "p95 KV usage": pct(c["p95_kv"]),
             "peak KV usage": pct(c["peak_kv"]), f"max concurrency at {context_len}": c["max_concurrency"],
             "time with requests waiting (s)": None if c["waiting_s"] is None else round(c["waiting_s"], 1), "preemptions": c["preemptions"]}
            for c in caps]
    if len(targets) > 1:
        hz = (run.info.get("settings") or {}).get("hz") or 1.0
        bucket = max(1.0 / float(hz), 0.05)
        pools = {c["target"]: c["pool_tokens"] for c in caps if c["pool_tokens"]}
        kv = pd.DataFrame({t: _bucketed(run, "kv_cache_usage_ratio", t, bucket) for t in pools})
        fleet_kv = None
        if not kv.empty and pools:
            weights = pd.Series(pools, dtype=float)
            used = (kv * weights).sum(axis=1, min_count=1)
            total = kv.notna().mul(weights).sum(axis=1)
            fleet_kv = (used / total.where(total > 0)).dropna().to_numpy()
        waiting = pd.DataFrame({t: _bucketed(run, "requests_waiting", t, bucket) for t in targets})
        steps_waiting = float((waiting.fillna(0).sum(axis=1) > 0).sum()) * bucket if not waiting.empty else 0.0
        pre = [c["preemptions"] for c in caps if c["preemptions"] is not None]
        pool_total = sum(pools.values()) if pools else None
        rows.append({"replica": f"fleet ({len(targets)} replicas)", "KV pool (tokens)": pool_total,
                     "p95 KV usage": pct(float(np.quantile(fleet_kv, 0.95)) if fleet_kv is not None and len(fleet_kv)
                                         else None),
                     "peak KV usage": pct(float(fleet_kv.max()) if fleet_kv is not None and len(fleet_kv) else None),
                     f"max concurrency at {context_len}": pool_total // context_len if pool_total else None,
                     "time with requests waiting (s)": round(steps_waiting, 1),
                     "preemptions": sum(pre) if pre else None})
    def cell(x):
        if x is None or (isinstance(x, float) and np.isnan(x)):
            return "n/a"
        return str(int(x)) if isinstance(x, (int, float, np.integer)) and float(x).is_integer() else str(x)

    return pd.DataFrame([{k: cell(v) for k, v in row.items()} for row in rows])


def gpu_memory_frame(run: Run) -> pd.DataFrame:
    """Per GPU (host and index): memory used and reserved over the run (median and peak, GiB), from NVML
    or from DCGM exporter's history. Empty when the run has no GPU readings."""
    rows = []
    for metric, what in (("gpu_memory_used_bytes", "used"), ("gpu_memory_reserved_bytes", "reserved")):
        df = run.series(metric)
        if df.empty:
            continue
        for (target, labels), g in df.groupby(["target", "labels"], observed=True):
            gpu = json.loads(str(labels)).get("gpu", "?")
            v = g["value"].dropna().to_numpy(dtype=float) / 1024**3
            if len(v):
                rows.append({"host": str(target), "gpu": gpu, "what": what, "median GiB": round(float(np.median(v)), 2),
                             "peak GiB": round(float(v.max()), 2)})
    if not rows:
        return pd.DataFrame(columns=["host", "gpu", "used median GiB", "used peak GiB", "reserved median GiB"])
    df = pd.DataFrame(rows).pivot_table(index=["host", "gpu"], columns="what", values=["median GiB", "peak GiB"])
    df.columns = [f"{what} {stat}" for stat, what in df.columns]
    return df.reset_index()
