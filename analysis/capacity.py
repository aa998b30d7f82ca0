"""Capacity figures of a run: how much of the KV pool was used, and how much room is left."""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from analysis.facts import kv_pool, scheduler_targets
from analysis.series import series_frame
from runstore.reader import Run


def time_with_waiting(run: Run, target: str) -> tuple[float, float]:
    """Seconds with at least one waiting request, and the seconds observed. A sample stands for the
    time to the next one, capped at two sample periods so that a gap counts as not observed."""
    df = series_frame(run, "requests_waiting", target)
    if len(df) < 2:
        return 0.0, 0.0
    t = df["t_s"].to_numpy(dtype=float)
    dt = np.diff(t)
    period = float(np.median(dt)) if len(dt) else 0.0
    dt = np.minimum(dt, 2 * period)
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
    vals = kv["value"].dropna().to_numpy(dtype=float) if not kv.empty else np.array([])
    peak = float(vals.max()) if len(vals) else None
    p95 = float(np.quantile(vals, 0.95)) if len(vals) else None
    pre = series_frame(run, "preemptions_total", target)["value"].dropna()
    waiting_s, observed_s = time_with_waiting(run, target)
    running = series_frame(run, "requests_running", target)["value"].dropna()
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
            ("time with requests waiting", f"{cap['waiting_s']:.1f} s ({pct(cap['waiting_share'])})")]
    return pd.DataFrame(rows, columns=["figure", "value"]).astype(str)


def capacity_figure(caps: list[tuple[str, dict]]) -> go.Figure:
    """Per run, its KV pool as one bar in tokens: used at p95, the peak above it, and what was still free
    at the peak, labelled with how many more requests of the context length fit there. Patterns and
    the labels on the bars read without colour."""
    fig = go.Figure()
    names = [label for label, _ in caps]
    parts = (("used at p95", "#e45756", "/", lambda c: c["p95_kv"] * c["pool_tokens"]),
             ("peak above p95", "#f58518", "x", lambda c: (c["peak_kv"] - c["p95_kv"]) * c["pool_tokens"]),
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
