"""A run's summary: how well each source was sampled, and what the scheduler and memory did."""

from __future__ import annotations

import math

import pandas as pd

from cancelwatch.analysis.series import series_frame
from cancelwatch.runstore.reader import Run

KEY_SERIES = {
    "requests_running": "max",
    "requests_waiting": "max",
    "kv_cache_usage_ratio": "max",
    "engine_rss_bytes": "max",
    "gpu_memory_used_bytes": "max",
}


def sampling_stats(run: Run) -> pd.DataFrame:
    """Per (source, target): scrapes, samples, effective Hz over the run, gaps and their ticks."""
    rows = []
    if "overview" in run.info:
        return _overview_stats(run)
    sc = run.scrapes
    for (source, target), g in sc.groupby(["source", "target"]):
        ok = g[g["ok"] == 1]
        span_s = (ok["mono_ns"].max() - ok["mono_ns"].min()) / 1e9 if len(ok) > 1 else math.nan
        gaps = run.gaps[(run.gaps["source"] == source) & (run.gaps["target"] == target)]
        rows.append(
            {
                "source": source,
                "target": target,
                "scrapes_ok": int(len(ok)),
                "scrapes_failed": int(len(g) - len(ok)),
                "samples": int(ok["n_samples"].sum()),
                "effective_hz": (len(ok) - 1) / span_s if span_s and span_s > 0 else math.nan,
                "scrape_p50_ms": ok["duration_ns"].quantile(0.5) / 1e6 if len(ok) else math.nan,
                "scrape_p99_ms": ok["duration_ns"].quantile(0.99) / 1e6 if len(ok) else math.nan,
                "gaps": int(len(gaps[gaps["kind"] != "lost"])),
                "gap_ticks": int(gaps["ticks"].sum()) if len(gaps) else 0,
            }
        )
    return pd.DataFrame(rows)


def _overview_stats(run: Run) -> pd.DataFrame:
    """sampling_stats of a run read at its overview's resolution (runstore.reader.load_overview): its scrapes'
    counts per bucket, not each scrape, so no percentile of their durations (NaN)."""
    rows = []
    for s in run.info["overview"]["sampling"]:
        gaps = run.gaps[(run.gaps["source"] == s["source"]) & (run.gaps["target"] == s["target"])]
        first, last = s.get("first_ok_mono_ns"), s.get("last_ok_mono_ns")
        span_s = (last - first) / 1e9 if pd.notna(first) and pd.notna(last) else math.nan
        ok = int(s["scrapes_ok"])
        rows.append({"source": s["source"], "target": s["target"], "scrapes_ok": ok,
                     "scrapes_failed": int(s["scrapes_failed"]), "samples": int(s["samples"]),
                     "effective_hz": (ok - 1) / span_s if span_s and span_s > 0 else math.nan,
                     "scrape_p50_ms": math.nan, "scrape_p99_ms": math.nan,
                     "gaps": int(len(gaps[gaps["kind"] != "lost"])),
                     "gap_ticks": int(gaps["ticks"].sum()) if len(gaps) else 0})
    return pd.DataFrame(rows)


def key_figures(run: Run) -> dict:
    """Peak and final values of the series a cancel story is told with; absent series are left out."""
    out = {}
    for metric in KEY_SERIES:
        df = series_frame(run, metric)
        if df.empty:
            continue
        df = df.sort_values("t_s")
        out[metric] = {"max": float(df["value"].max()), "min": float(df["value"].min()), "last": float(df["value"].iloc[-1])}
    return out
