"""Memory anatomy: what the engine's memory is made of, over time, in bytes.

The total is what the run measured: NVML's used memory on a GPU, the engine's RSS on the CPU (its
analogue: the CPU build keeps the KV pool in process memory). Inside it, the parts the run knows:

  KV pool, used   KV usage x pool bytes (vllm:kv_cache_usage_ratio x kv_cache_memory_bytes, or
                  blocks x block size x bytes per token): what requests hold
  KV pool, free   the rest of the pool: reserved at start-up, handed out again to the next request
  weights         the model's parameters at the served dtype (the embedded engine's config.json)
  other           what is left: runtime, activations, allocator cache, CUDA context. Never split
                  further: the run did not measure how.

A part is drawn only where its inputs were measured: no KV sample near a memory sample leaves the
pool's split empty there (the memory total still stands), and a memory gap stays a gap.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import plotly.graph_objects as go

from cancelwatch.analysis.facts import kv_pool, scheduler_targets
from cancelwatch.analysis.series import sample_period
from cancelwatch.analysis.traces import GiB, Trace, memory_traces, metric_traces
from cancelwatch.runstore.reader import Run

KV_USED, KV_FREE, WEIGHTS, OTHER = "KV pool: used", "KV pool: free", "weights", "other"
PARTS = (OTHER, WEIGHTS, KV_USED, KV_FREE)  # bottom to top: a cancel empties the top of the stack
# fill colour and pattern of each part: the pattern and the trace's own label read without colour
PART_STYLE = {
    OTHER: ("#bab0ac", ""),
    WEIGHTS: ("#9d755d", "x"),
    KV_USED: ("#e45756", "/"),
    KV_FREE: ("#f2cfce", "."),
}
# a KV sample is matched to a memory sample of the same tick only (every source is read on one clock)
MATCH_PERIODS = 0.5


@dataclass
class Anatomy:
    """One memory total and its parts, all in bytes, at the memory samples' instants (s since the run
    started); NaN where a part's input was not measured."""

    kind: str  # "nvml" (GPU used) or "process" (engine RSS)
    name: str  # the memory trace: a GPU, or the engine's process tree
    source: str  # the run's source and target of the total (its gaps are the anatomy's)
    target: str
    t: np.ndarray
    total: np.ndarray
    parts: dict[str, np.ndarray] = field(default_factory=dict)
    pool_bytes: float | None = None
    weights_bytes: float | None = None
    notes: list[str] = field(default_factory=list)

    def at(self, lo: float, hi: float) -> dict[str, float | None]:
        """Each part's and the total's median over the instants [lo, hi), bytes; None where unmeasured."""
        sel = (self.t >= lo) & (self.t < hi)
        out: dict[str, float | None] = {}
        for name, values in (("total", self.total), *self.parts.items()):
            v = values[sel]
            v = v[~np.isnan(v)]
            out[name] = float(np.median(v)) if len(v) else None
        return out


def _matched(t: np.ndarray, kv: Trace | None, period: float | None = None) -> np.ndarray:
    """KV usage at each of `t`: the nearest KV sample within MATCH_PERIODS of the baseline period
    (`period`, else the KV samples' median interval), else NaN."""
    out = np.full(len(t), np.nan)
    if kv is None or not len(kv.t) or not len(t):
        return out
    if period is None:
        period = float(np.median(np.diff(kv.t))) if len(kv.t) > 1 else 0.05
    idx = np.clip(np.searchsorted(kv.t, t), 1, len(kv.t) - 1) if len(kv.t) > 1 else np.zeros(len(t), dtype=int)
    left = np.maximum(idx - 1, 0)
    nearest = np.where(np.abs(kv.t[left] - t) <= np.abs(kv.t[idx] - t), left, idx)
    close = np.abs(kv.t[nearest] - t) <= MATCH_PERIODS * period
    out[close] = kv.v[nearest[close]]
    return out


def memory_anatomy(run: Run) -> list[Anatomy]:
    """One anatomy per memory total the run measured (each GPU's used memory, or the engine's RSS).
    The KV pool and weights go into a total only when the run can tell which engine it belongs to:
    one memory total, or the embedded engine's own process tree."""
    kind, mem = memory_traces(run)
    totals = [tr for role, tr in mem if role in ("used", "rss")]
    targets = scheduler_targets(run)
    engines = (run.info.get("engine") or {}).get("targets") or {}
    out = []
    for tr in totals:
        a = Anatomy(kind=kind, name=tr.name, source=tr.source, target=tr.target, t=tr.t, total=tr.v.astype(float))
        owner = _owner(run, kind, totals, targets, engines)
        if owner is None:
            a.notes.append("the KV pool is not split out: the run cannot tell which engine this memory belongs to")
            out.append(a)
            continue
        pool = kv_pool(run, owner)
        a.pool_bytes = float(pool["bytes"]) if pool.get("bytes") else None
        w = (engines.get(owner) or {}).get("weights_bytes")
        a.weights_bytes = float(w) if w else None
        if a.pool_bytes is None:
            a.notes.append(f"the KV pool's size is unknown for {owner}: no kv_cache_memory_bytes, no bytes per token")
        if a.weights_bytes is None:
            a.notes.append("the weights' size is unknown (not the embedded engine, or not a Llama-shaped model): "
                           "they are inside 'other'")
        kv = next((k for k in metric_traces(run, "kv_cache_usage_ratio") if k.target == owner), None)
        usage = _matched(tr.t, kv, sample_period(run, kv.t if kv is not None else None))
        known = (a.pool_bytes or 0.0) + (a.weights_bytes or 0.0)
        if a.pool_bytes is not None:
            used = np.round(usage * a.pool_bytes)
            a.parts[KV_USED] = used
            a.parts[KV_FREE] = a.pool_bytes - used  # NaN where usage is
        if a.weights_bytes is not None:
            a.parts[WEIGHTS] = np.where(np.isnan(a.total), np.nan, a.weights_bytes)
        a.parts[OTHER] = a.total - known
        if np.nanmin(a.parts[OTHER], initial=math.inf) < 0:
            a.notes.append("the measured total is smaller than the pool and weights it should hold (memory not yet "
                           "touched is not resident): 'other' goes below zero there, shown as it is")
        out.append(a)
    return out


def _owner(run: Run, kind: str, totals: list[Trace], targets: list[str], engines: dict) -> str | None:
    """The scheduler target whose KV pool lives in this memory total."""
    if kind == "process":
        embedded = [t for t in targets if (engines.get(t) or {}).get("embedded")]
        return embedded[0] if len(embedded) == 1 else (targets[0] if len(targets) == 1 else None)
    return targets[0] if len(totals) == 1 and len(targets) == 1 else None


MiB = 1024**2
SUMMARY_SPAN_S = 0.1  # each side: the samples right before the stop, and the one that showed the release


def _size(x: float | None) -> str:
    if x is None:
        return "n/a"
    return f"{x / GiB:.2f} GiB" if x >= GiB else f"{x / MiB:.0f} MiB"


def cancel_summary(run: Run, cancel) -> dict | None:
    """For one cancel: the anatomy in the second before the stop and in the second after the request
    left (or after the grace, if it never did), and one sentence with the run's own numbers. None
    when the run measured no memory."""
    anatomies = memory_anatomy(run)
    a = next((x for x in anatomies if x.parts), anatomies[0] if anatomies else None)
    if a is None:
        return None
    tp = cancel.timepoints
    t_stop = tp["user_stop"]
    t_after = tp.get("left_scheduler") or t_stop + cancel.evidence.grace_s
    before = a.at(t_stop - SUMMARY_SPAN_S, t_stop)
    after = a.at(t_after, t_after + SUMMARY_SPAN_S)
    b, f = before["total"], after["total"]
    if b is not None and f is not None and _size(b) == _size(f):
        words = [f"memory {_size(b)} before and after"]
    else:
        words = [f"memory {_size(b)} before, {_size(f)} after"]
    if KV_USED in a.parts:
        words.append(f"the KV pool's used part went from {_size(before.get(KV_USED))} to {_size(after.get(KV_USED))}")
    left, reusable = tp.get("left_scheduler"), tp.get("reusable")
    if cancel.verdict == "released" and left is not None:
        words.append(f"the request left the engine {1000 * (left - t_stop):.0f} ms after the stop")
        if reusable is not None:
            words.append(f"the next request got in {max(0.0, 1000 * (reusable - left)):.0f} ms later")
    else:
        if cancel.verdict == "leaked" and left is not None:
            words.append(f"the cancel was lost: the request ran on for nobody and left only "
                         f"{1000 * (left - t_stop):.0f} ms after the stop")
        elif cancel.verdict == "leaked":
            words.append("the cancel was lost: the request was still in the engine at the end")
        else:
            words.append(f"whether the request left could not be judged ({cancel.verdict})")
        if reusable is not None:
            words.append(f"the next request got in {1000 * (reusable - t_stop):.0f} ms after the stop")
    return {"anatomy": a, "before": before, "after": after, "t_before": t_stop, "t_after": t_after,
            "sentence": "; ".join(words) + "."}


def summary_figure(summary: dict) -> go.Figure:
    """Two stacked bars, before the stop and after the release: the total the same height, the KV
    pool's used part smaller. Labelled parts and patterns read without colour."""
    a = summary["anatomy"]
    cols = ["before the stop", "after the release"]
    fig = go.Figure()
    for part in PARTS:
        if part not in a.parts:
            continue
        colour, shape = PART_STYLE[part]
        ys = [summary["before"].get(part), summary["after"].get(part)]
        ys = [None if y is None else y / GiB for y in ys]
        fig.add_trace(go.Bar(x=cols, y=ys, name=part, marker=dict(color=colour, pattern=dict(shape=shape)),
                             text=[_size(None if y is None else y * GiB) for y in ys], textposition="inside",
                             hovertemplate="%{y:.3f} GiB<extra>" + part + "</extra>"))
    totals = [summary["before"]["total"], summary["after"]["total"]]
    fig.add_trace(go.Scatter(x=cols, y=[None if t is None else t / GiB for t in totals], mode="markers+text",
                             name="total (measured)", text=[_size(t) for t in totals], textposition="top center",
                             marker=dict(symbol="line-ew-open", size=40, color="#222222", line=dict(width=3))))
    fig.update_layout(barmode="stack", height=380, margin=dict(l=40, r=20, t=50, b=30),
                      title=f"Memory before and after one cancel ({a.name}): the total stays, the used part shrinks",
                      yaxis_title="GiB", legend=dict(orientation="h", y=-0.15))
    return fig
