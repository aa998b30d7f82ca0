"""Capacity figures of a run: how much of the KV pool was used, and how much room is left."""

from __future__ import annotations

import numpy as np
import pandas as pd

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
