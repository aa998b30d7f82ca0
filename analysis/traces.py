"""A run's series as traces, one per source and target: what the timeline draws and the memory anatomy
splits. Here, below both, so that neither imports the other."""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from cancelwatch.analysis.facts import memory_source
from cancelwatch.analysis.series import series_frame
from cancelwatch.runstore.reader import Run

GiB = 1024**3


@dataclass(frozen=True)  # shared: a run makes each metric's traces once (metric_traces)
class Trace:
    name: str
    source: str
    target: str
    t: np.ndarray
    v: np.ndarray


def metric_traces(run: Run, metric: str, by_labels: bool = False) -> list[Trace]:
    """One trace per target (label sets summed per scrape), or per (target, label set). Made once a run: the
    timeline, its zoom, the memory's anatomy and its story read the same ones."""
    return list(run.derived(("metric_traces", metric, by_labels), lambda: _metric_traces(run, metric, by_labels)))


def _metric_traces(run: Run, metric: str, by_labels: bool) -> tuple[Trace, ...]:
    df = run.series(metric) if by_labels else series_frame(run, metric)
    if df.empty:
        return ()
    keys = ["source", "target", "labels"] if by_labels else ["source", "target"]
    out = []
    for key, g in df.groupby(keys, observed=True, sort=False):
        source, target = key[0], key[1]
        labels = json.loads(key[2]) if by_labels else {}
        g = g.sort_values("t_s", kind="stable")
        name = str(target) + (f" gpu {labels.get('gpu')}" if "gpu" in labels else "")
        out.append(Trace(name, str(source), str(target), g["t_s"].to_numpy(dtype=float),
                         g["value"].to_numpy(dtype=float)))
    return tuple(out)


def memory_traces(run: Run) -> tuple[str, list[tuple[str, Trace]]]:
    """(kind, [(role, trace)]): per GPU used and driver-reserved from NVML, else engine RSS per target."""
    kind = memory_source(run)
    out: list[tuple[str, Trace]] = []
    if kind == "nvml":
        reserved = {t.name: t for t in metric_traces(run, "gpu_memory_reserved_bytes", by_labels=True)}
        for used in metric_traces(run, "gpu_memory_used_bytes", by_labels=True):
            out.append(("used", used))
            if used.name in reserved:
                r = reserved[used.name]
                out.append(("reserved", Trace(used.name, used.source, used.target, used.t,
                                              used.v + np.interp(used.t, r.t, r.v))))
    elif kind == "process":
        out = [("rss", t) for t in metric_traces(run, "engine_rss_bytes")]
    return kind, out
