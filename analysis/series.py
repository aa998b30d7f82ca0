"""The per-metric series accessor: one metric as one value per scrape, and the scheduler's gauges
side by side. Times `t_s` are instants, seconds since the run started."""

from __future__ import annotations

import pandas as pd

from runstore.reader import Run

SERIES_COLUMNS = ["scrape_id", "t_s", "source", "target", "value"]
SCHEDULER_COLUMNS = ["t_s", "running", "waiting", "count", "kv", "gen_tokens"]


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


def scheduler_frame(run: Run, target: str | None = None) -> pd.DataFrame:
    """Per scrape: t_s, running, waiting, count (= running + waiting), kv (KV-cache usage ratio,
    0..1), gen_tokens (generation_tokens_total, a counter)."""
    parts = {}
    for col, metric in (("running", "requests_running"), ("waiting", "requests_waiting"),
                        ("kv", "kv_cache_usage_ratio"), ("gen_tokens", "generation_tokens_total")):
        df = series_frame(run, metric, target)
        parts[col] = df.set_index("t_s")["value"] if not df.empty else pd.Series(dtype=float)
    frame = pd.DataFrame(parts).sort_index()
    frame.index.name = "t_s"
    frame = frame.reset_index()
    if frame.empty:
        return pd.DataFrame(columns=SCHEDULER_COLUMNS)
    frame["count"] = frame["running"] + frame["waiting"]
    return frame
