"""One cancel at two resolutions: cancelwatch's own samples (20 a second) beside Prometheus's scrape of the
same series (an imported run of the same minutes), on the wall clock. Prometheus gives history;
what a cancel does happens between two of its scrapes."""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from cancelwatch.analysis.verdicts import CancelVerdict
from cancelwatch.runstore.reader import Run

SERIES = (("requests_running", "running requests"), ("kv_cache_usage_ratio", "KV-cache usage"))


def _wall_s(run: Run, t_s: float) -> float:
    """An instant of `run` (s since it started) on the wall clock, in epoch seconds."""
    return run.info["started_wall_ns"] / 1e9 + t_s


def replica_of(own: Run, prom: Run, target: str | None) -> str | None:
    """The imported replica that is `own`'s target: the one whose instance is the target URL's host:port,
    else the only one."""
    url = next((t.get("url", "") for t in own.info.get("targets", []) if t["label"] == target), "")
    labels = [t["label"] for t in prom.info.get("targets", [])]
    hostport = url.split("//")[-1].rstrip("/")
    return hostport if hostport in labels else (labels[0] if len(labels) == 1 else None)


def _series(run: Run, metric: str, target: str, lo: float, hi: float) -> tuple[np.ndarray, np.ndarray]:
    df = run.series(metric, target=target)
    if df.empty:
        return np.array([]), np.array([])
    g = df.groupby("scrape_id", observed=True).agg(wall_ns=("wall_ns", "first"), value=("value", "sum"))
    t = g["wall_ns"].to_numpy(dtype=np.int64) / 1e9
    keep = (t >= lo) & (t <= hi)
    order = np.argsort(t[keep])
    return t[keep][order], g["value"].to_numpy(dtype=float)[keep][order]


def resolution_figure(own: Run, prom: Run, cancel: CancelVerdict, replica: str | None = None,
                      before_s: float = 5.0, after_s: float = 15.0) -> tuple[go.Figure, dict]:
    """(figure, counts): the cancel's window on the wall clock, per series the tool's samples and
    Prometheus's; counts holds how many points each shows in the window."""
    target = cancel.evidence.metrics_target
    replica = replica or replica_of(own, prom, target)
    stop = _wall_s(own, cancel.timepoints["user_stop"])
    lo, hi = stop - before_s, stop + after_s
    fig = make_subplots(rows=len(SERIES), cols=1, shared_xaxes=True, vertical_spacing=0.08,
                        subplot_titles=[name for _, name in SERIES])
    counts = {}
    for row, (metric, name) in enumerate(SERIES, start=1):
        t_own, v_own = _series(own, metric, target, lo, hi)
        t_prom, v_prom = _series(prom, metric, replica, lo, hi) if replica else (np.array([]), np.array([]))
        counts[metric] = {"cancelwatch": len(t_own), "prometheus": len(t_prom)}
        fig.add_trace(go.Scatter(x=pd.to_datetime(t_own, unit="s", utc=True), y=v_own, mode="lines+markers",
                                 marker={"size": 3}, line={"width": 1}, name=f"cancelwatch ({name})",
                                 legendgroup="own"), row=row, col=1)
        fig.add_trace(go.Scatter(x=pd.to_datetime(t_prom, unit="s", utc=True), y=v_prom, mode="lines+markers",
                                 line={"shape": "hv", "dash": "dot", "width": 2}, marker={"size": 8, "symbol": "square"},
                                 name=f"Prometheus ({name})", legendgroup="prom"), row=row, col=1)
    for point, label in (("user_stop", "user stop"), ("left_scheduler", "left scheduler")):
        t = cancel.timepoints.get(point)
        if t is not None:
            x = pd.Timestamp(_wall_s(own, t), unit="s", tz="UTC")
            fig.add_vline(x=x, line={"dash": "dash", "width": 1}, annotation_text=label)
    step = (prom.info.get("engine") or {}).get("imported", {}).get("step_s")
    fig.update_layout(height=520, title=(f"One cancel at two resolutions: cancelwatch's samples against Prometheus's"
                                         f" every {step:g} s" if step else "One cancel at two resolutions"))
    return fig, {"replica": replica, "step_s": step, **counts}
