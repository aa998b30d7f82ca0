"""Import history from a Prometheus that already scrapes the fleet: range queries turned into a run.

Each replica (the `instance` label) becomes a target of the run, its vLLM series under the tool's own
names (both the current and the 0.10-era server names; where a replica sends both, the current one
wins, as in the live source), on the query's step grid. GPU memory comes from DCGM exporter
(`DCGM_FI_DEV_FB_USED/FREE/RESERVED`, MiB -> bytes, per GPU and host) or Triton's `nv_gpu_memory_*`.
Counters are stored as the cumulative values Prometheus holds; the figures take their rates. A step
where Prometheus has nothing for a replica is a gap of that replica, never a zero. The run records
where it came from (URL, queries, step, window) and is labelled as imported history.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from cancelwatch.collectors.recording.session import PreflightError
from cancelwatch.collectors.sources.prometheus_api import PrometheusError, PrometheusHistory
from cancelwatch.collectors.sources.triton import SOURCE_NAME as TRITON_SOURCE
from cancelwatch.collectors.sources.vllm import ALIASES, CACHE_CONFIG_METRIC, FAMILY
from cancelwatch.collectors.sources.vllm import SOURCE_NAME as VLLM_SOURCE
from cancelwatch.runstore.records import GapRecord
from cancelwatch.runstore.writer import (
    create_run,
    finish_run,
    open_store,
    set_run_json,
    write_gaps,
    write_scrape_block,
)

# server name -> (our name, scale to the stored unit)
GPU_NAMES = {
    "DCGM_FI_DEV_FB_USED": ("gpu_memory_used_bytes", 1024.0**2),
    "DCGM_FI_DEV_FB_FREE": ("gpu_memory_free_bytes", 1024.0**2),
    "DCGM_FI_DEV_FB_RESERVED": ("gpu_memory_reserved_bytes", 1024.0**2),
    "nv_gpu_memory_used_bytes": ("gpu_memory_used_bytes", 1.0),
    "nv_gpu_memory_total_bytes": ("gpu_memory_total_bytes", 1.0),
}
DROP_LABELS = {"__name__", "instance", "job"}
KIND = "imported history"


@dataclass
class ImportSettings:
    url: str
    start_s: float  # epoch seconds
    end_s: float
    step_s: float = 15.0
    match: str = ""  # label matchers, e.g. {job="vllm"}
    gpu_match: str = ""
    store: Path = Path("runs/cancelwatch.db")
    name: str | None = None
    queries: list[str] = field(default_factory=list)


def _selector(name: str, match: str) -> str:
    inner = match.strip()
    if inner.startswith("{") and inner.endswith("}"):
        inner = inner[1:-1].strip()
    return f"{name}{{{inner}}}" if inner else name


def check_settings(s: ImportSettings) -> None:
    if not (s.end_s > s.start_s):
        raise PreflightError("--end must be after --start: e.g. --start now-2h --end now")
    if s.step_s <= 0:
        raise PreflightError("--step must be positive: e.g. --step 15s")
    if (s.end_s - s.start_s) / s.step_s > 5_000_000:
        raise PreflightError("the window holds more than 5,000,000 steps: use a longer --step or a shorter window")
    for m in (s.match, s.gpu_match):
        if m and not (m.strip().startswith("{") and m.strip().endswith("}")):
            raise PreflightError(f"--match {m!r}: give label matchers in braces, e.g. --match '{{job=\"vllm\"}}'")


def import_prometheus(s: ImportSettings, on_chunk=None) -> tuple[int, dict]:
    """Query, then write one completed run; (run id, summary). PreflightError before any run exists when
    the server cannot be read or nothing matches. `on_chunk(done, total)` reports progress."""
    check_settings(s)
    prom = PrometheusHistory(s.url)
    problem = prom.check()
    if problem:
        raise PreflightError(problem)
    queries = [(name, _selector(name, s.match), VLLM_SOURCE) for name in ALIASES]
    queries += [(name, _selector(name, s.gpu_match), "gpu") for name in GPU_NAMES]
    chunks = prom.chunks(s.start_s, s.end_s, s.step_s)
    grid = s.start_s + s.step_s * np.arange(int(math.floor((s.end_s - s.start_s) / s.step_s + 1e-9)) + 1)
    # (source, target) -> {(metric, labels): values on the grid}; rank per series for the alias choice
    blocks: dict[tuple[str, str], dict[tuple, np.ndarray]] = {}
    ranks: dict[tuple, int] = {}
    asked = []
    total, done = len(queries) * len(chunks), 0
    try:
        for name, query, kind in queries:
            asked.append(query)
            for lo, hi in chunks:
                for series in prom.query_range(query, lo, hi, s.step_s):
                    _place(series, name, kind, grid, s.step_s, blocks, ranks)
                done += 1
                if on_chunk is not None:
                    on_chunk(done, total)
    except PrometheusError as exc:
        raise PreflightError(str(exc)) from None
    replicas = sorted(t for src, t in blocks if src == VLLM_SOURCE)
    if not replicas:
        raise PreflightError(f"no vLLM series in Prometheus at {prom.url} match {s.match or '{}'} between the start and "
                             "the end: check --match and the window (--start, --end)")
    s.queries = asked
    return _write(s, prom, grid, blocks, replicas)


def _place(series: dict, name: str, kind: str, grid: np.ndarray, step_s: float, blocks: dict, ranks: dict) -> None:
    labels = series.get("metric") or {}
    if kind == VLLM_SOURCE:
        metric, rank = ALIASES.get(name, (name, 0))
        scale, source = 1.0, VLLM_SOURCE
        target = labels.get("instance") or labels.get("job") or "prometheus"
        keep = tuple(sorted((k, v) for k, v in labels.items() if k not in DROP_LABELS))
    else:
        (metric, scale), rank, source = GPU_NAMES[name], 0, "dcgm" if name.startswith("DCGM") else TRITON_SOURCE
        target = labels.get("Hostname") or labels.get("instance") or "gpu"
        keep = tuple(sorted(("uuid" if k == "UUID" else k, v) for k, v in labels.items()
                            if k in ("gpu", "UUID", "gpu_uuid", "modelName")))
    key = (source, target, metric, keep)
    prior = ranks.get(key)
    if prior is not None and prior < rank:
        return  # the current name of this series is already there: it wins, as in the live source
    block = blocks.setdefault((source, target), {})
    values = block.get((metric, keep))
    if values is None or (prior is not None and prior > rank):
        values = block[(metric, keep)] = np.full(len(grid), np.nan)
    ranks[key] = rank
    for t, v in series.get("values") or []:
        i = int(round((float(t) - grid[0]) / step_s))
        if 0 <= i < len(grid):
            try:
                values[i] = float(v) * scale
            except ValueError:
                continue


def _write(s: ImportSettings, prom: PrometheusHistory, grid: np.ndarray, blocks: dict,
           replicas: list[str]) -> tuple[int, dict]:
    start_ns = int(grid[0] * 1e9)
    cache = {}
    for r in replicas:  # the KV pool's shape, for the capacity review
        for item in prom.query(_selector(CACHE_CONFIG_METRIC, f'{{instance="{r}"}}'), float(grid[-1])):
            labels = {k: v for k, v in item.get("metric", {}).items() if k not in DROP_LABELS | {"engine", "model_name"}}
            cache[r] = labels
    gpu_hosts = sorted({t for src, t in blocks if src != VLLM_SOURCE})
    # prom.url: no user:password. Each replica is one whose vLLM series were imported: a vLLM target
    targets = [{"label": r, "url": f"{prom.url} instance={r}", "family": FAMILY, "role": "imported history"}
               for r in replicas]
    imported = {"url": prom.url, "prometheus_version": prom.version(), "queries": s.queries, "step_s": s.step_s,
                "start_wall_ns": start_ns, "end_wall_ns": int(grid[-1] * 1e9), "match": s.match,
                "gpu_match": s.gpu_match, "gpu_hosts": gpu_hosts}
    engine = {"imported": imported, "targets": {r: {"imported": True} for r in replicas},
              "engine_log": {r: {"off": "imported history: no engine log"} for r in replicas},
              "nvml": "imported (DCGM exporter)" if gpu_hosts else "off: no GPU series in Prometheus"}
    settings = {"hz": 1.0 / s.step_s, "name": s.name, "kind": KIND, "extra": {}}
    con = open_store(s.store)
    try:
        rid = create_run(con, name=s.name or f"import {prom.url}", targets=targets, engine=engine, settings=settings,
                         wall_ns=start_ns, mono_ns=start_ns)
        if cache:
            set_run_json(con, rid, "cache", cache)
        samples = 0
        gaps: list[GapRecord] = []
        with con:
            for (source, target), series in sorted(blocks.items()):
                present = np.zeros(len(grid), dtype=bool)
                for values in series.values():
                    present |= ~np.isnan(values)
                keep = np.nonzero(present)[0]
                ns = (grid[keep] * 1e9).astype(np.int64)
                samples += write_scrape_block(con, rid, source, target,
                                              series={k: v[keep] for k, v in series.items()}, ticks=keep,
                                              wall_ns=ns, mono_ns=ns, duration_ns=0)
                gaps += _gaps(source, target, grid, present, s.step_s)
            write_gaps(con, rid, gaps)
        stats = {"imported": True, "samples_written": samples, "replicas": replicas, "gpu_hosts": gpu_hosts,
                 "gaps": len(gaps), "steps": len(grid), "imported_at_wall_ns": time.time_ns()}
        finish_run(con, rid, "completed", stats, ended_wall_ns=int(grid[-1] * 1e9))
    finally:
        con.close()
    return rid, stats


def _gaps(source: str, target: str, grid: np.ndarray, present: np.ndarray, step_s: float) -> list[GapRecord]:
    """Stretches of steps where Prometheus held nothing for this replica (it was down, or not yet there)."""
    out = []
    missing = ~present
    i = 0
    while i < len(grid):
        if not missing[i]:
            i += 1
            continue
        j = i
        while j < len(grid) and missing[j]:
            j += 1
        ns0, ns1 = int(grid[i] * 1e9), int(grid[j - 1] * 1e9 + step_s * 1e9)
        out.append(GapRecord(source, target, "missed", ns0, ns0, ns1, j - i, "no data in Prometheus for these steps"))
        i = j
    return out
