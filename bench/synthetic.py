"""A synthetic run written in the store's own format, for the dashboard benchmark and the long-run tests.

The shapes follow what the embedded engine records (see tests/fixtures/vllm/0.32): a neighbour and a
target decode, the target is cancelled, the server's count and KV usage drop one sample later, a probe
gets in; every `leak_every`-th cancel is never passed on (the count stays up while tokens are
generated). Reserved memory (engine RSS, and NVML used/reserved when `nvml`) stays flat throughout.
Besides the series the dashboard reads, each vLLM scrape carries `filler_series` other `vllm:` series,
as a real full scrape does (about 69 per scrape).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from cancelwatch.collectors.sources.vllm import SOURCE_NAME as VLLM_SOURCE
from cancelwatch.runstore.records import EventRecord, GapRecord, LedgerRecord
from cancelwatch.runstore.writer import (
    create_run,
    finish_run,
    open_store,
    set_run_json,
    write_events,
    write_gaps,
    write_ledger,
    write_scrape_block,
)

GiB = 1024**3
CHUNK_TICKS = 72_000  # written an hour at 20 Hz at a time
T0_NS = 10_000_000_000  # monotonic start of the synthetic run
WALL0_NS = 1_790_000_000_000_000_000


def _cycle_state(t: np.ndarray, period: float, leak: np.ndarray) -> dict[str, np.ndarray]:
    """Scheduler gauges over one cancel cycle per `period` seconds, vectorised over sample times."""
    k = np.floor(t / period).astype(int)
    u = t - k * period  # seconds into this cycle
    leaked = leak[np.minimum(k, len(leak) - 1)]
    neighbour = (u >= 1.0) & (u < 10.0)
    target = (u >= 1.5) & (u < np.where(leaked, 9.0, 5.05))
    waiting = (u >= 1.4) & (u < 1.5)
    probe = (u >= 5.3) & (u < 7.0)
    running = neighbour.astype(float) + target + probe
    kv = 0.02 * neighbour * np.minimum(u - 1.0, 9.0) + 0.04 * target * np.minimum(u - 1.5, 8.0) + 0.03 * probe
    return {"running": running, "waiting": waiting.astype(float), "kv": np.clip(kv, 0, 1), "cycle": k, "u": u}


def write_synthetic_run(path: str | Path, *, duration_s: float = 3600.0, hz: float = 20.0, cancels: int = 200,
                        leak_every: int = 20, nvml: bool = True, filler_series: int = 55,
                        gaps: int = 10, name: str = "synthetic") -> int:
    """Write one completed run into the store at `path` through the run store's writer; returns its id."""
    con = open_store(path)
    period = duration_s / cancels
    targets = [{"label": "t0", "url": "http://127.0.0.1:8000"}]
    engine = {"targets": {"t0": {"embedded": True, "model": "synthetic", "kv_bytes_per_token": 32768,
                                 "shape": {"max_num_seqs": 4, "num_gpu_blocks": 64, "block_size": 128}}},
              "nvml": "on" if nvml else "off", "engine_log": {"t0": {"path": "synthetic-engine.log"}}}
    settings = {"hz": hz, "name": name, "extra": {"driven_target": targets[0]["url"], "grace_s": 2.0,
                                                   "scenarios": ["decode"]}}
    rid = create_run(con, name=name, targets=targets, engine=engine, settings=settings, wall_ns=WALL0_NS, mono_ns=T0_NS)
    cache = {"t0": {"num_gpu_blocks": "64", "block_size": "128", "kv_cache_size_tokens": "8192",
                    "kv_cache_memory_bytes": "None", "enable_prefix_caching": "True", "model_names": ["synthetic"]}}
    set_run_json(con, rid, "cache", cache)

    n = int(duration_s * hz)
    t = np.arange(n) / hz
    rng = np.random.default_rng(7)
    leak = np.zeros(cancels, dtype=bool)
    if leak_every:
        leak[leak_every - 1::leak_every] = True
    st = _cycle_state(t, period, leak)
    # sampled gaps: `gaps` stretches of 3 missed ticks, spread over the run
    missing = np.zeros(n, dtype=bool)
    gap_rows = []
    for g in range(gaps):
        i = int((g + 0.5) * n / max(gaps, 1))
        missing[i:i + 3] = True
        gap_rows.append(GapRecord(VLLM_SOURCE, "t0", "missed", WALL0_NS + int(t[i] * 1e9), T0_NS + int(t[i] * 1e9),
                                  T0_NS + int(t[min(i + 3, n - 1)] * 1e9), 3, "synthetic"))
    gen = np.cumsum(st["running"] * 20.0)
    queries = np.cumsum(((st["u"] >= 1.5) & (st["u"] < 1.55)) * 600.0 + ((st["u"] >= 5.3) & (st["u"] < 5.35)) * 100.0)
    hits = np.cumsum(((st["u"] >= 5.3) & (st["u"] < 5.35)) * 50.0)
    engine_labels = (("engine", "0"), ("model_name", "synthetic"))
    vllm_series = {
        ("requests_running", engine_labels): st["running"],
        ("requests_waiting", engine_labels): st["waiting"],
        ("kv_cache_usage_ratio", engine_labels): st["kv"],
        ("generation_tokens_total", engine_labels): gen,
        ("prefix_cache_queries_tokens_total", engine_labels): queries,
        ("prefix_cache_hits_tokens_total", engine_labels): hits,
        ("preemptions_total", engine_labels): np.zeros(n),
    }
    for f in range(filler_series):
        vllm_series[(f"vllm:synthetic_filler_{f}", engine_labels)] = gen * (f + 1)
    proc_series = {("engine_rss_bytes", ()): 1.62 * GiB + rng.normal(0, 2e6, n), ("engine_processes", ()): np.full(n, 3.0)}
    gpu = (("gpu", "0"), ("uuid", "GPU-synthetic"))
    nvml_series = {
        ("gpu_memory_total_bytes", gpu): np.full(n, 141.0 * GiB),
        ("gpu_memory_used_bytes", gpu): 127.4 * GiB + rng.normal(0, 1e5, n),
        ("gpu_memory_reserved_bytes", gpu): np.full(n, 0.55 * GiB),
        ("gpu_memory_free_bytes", gpu): 13.05 * GiB - rng.normal(0, 1e5, n),
    }
    sources = [(VLLM_SOURCE, "t0", vllm_series, missing), ("process", "engine", proc_series, np.zeros(n, dtype=bool))]
    if nvml:
        sources.append(("nvml", "gpu", nvml_series, np.zeros(n, dtype=bool)))

    # an hour of ticks at a time, each its own transaction: a day's rows at once held ~14 GB of Python lists
    for lo in range(0, n, CHUNK_TICKS):
        with con:
            for source, target, series, miss in sources:
                keep = lo + np.nonzero(~miss[lo:lo + CHUNK_TICKS])[0]
                mono = T0_NS + (t[keep] * 1e9).astype(np.int64)
                write_scrape_block(con, rid, source, target,
                                   series={key: values[keep] for key, values in series.items()}, ticks=keep,
                                   wall_ns=mono - T0_NS + WALL0_NS, mono_ns=mono, duration_ns=3_000_000)
    with con:
        write_gaps(con, rid, gap_rows)
        _write_cancels(con, rid, period, cancels, leak)
    finish_run(con, rid, "completed", {"synthetic": True})
    con.close()
    return rid


def _write_cancels(con, rid: int, period: float, cancels: int, leak: np.ndarray) -> None:
    def ns(s: float) -> int:
        return T0_NS + int(s * 1e9)

    events: list[EventRecord] = []
    ledger: list[LedgerRecord] = []

    def event(kind, t, request_id=None, **data):
        events.append(EventRecord(kind, WALL0_NS + int(t * 1e9), ns(t), request_id, {**data, "metrics_target": "t0"}))

    def logged(kind, t, request_id):
        # the engine log's line, as the engine-log source stores it
        events.append(EventRecord(kind, WALL0_NS + int(t * 1e9), ns(t), request_id,
                                  {"engine_request_id": f"cmpl-{request_id}-0-0123abcd", "clock": "engine_log",
                                   "resolution_s": 0.001, "target": "t0"}))

    for k in range(cancels):
        c = k * period
        scen = "decode"
        cid = f"c{k:04d}"
        tgt, nb, pr = f"cw-{scen}-target-{k:04d}", f"cw-{scen}-neighbour-{k:04d}", f"cw-{scen}-probe-{k:04d}"
        event("scenario_start", c + 0.9, scenario=scen, repeat=k)
        stop = c + 5.0
        event("user_stop", stop, tgt, scenario=scen, phase="decode", cancel_id=cid, mode="cancel", tokens_at_cancel=70)
        logged("engine_added", c + 1.0, nb)
        logged("engine_added", c + 1.4, tgt)
        event("client_closed", stop + 0.0005, tgt, cancel_id=cid, source="client")
        if not leak[k]:  # a lost cancel leaves no abort line
            logged("engine_aborted", stop + 0.001, tgt)
        event("probe_sent", c + 5.25, pr, scenario=scen)
        logged("engine_added", c + 5.25, pr)
        event("scenario_end", c + 12.0, scenario=scen, repeat=k)
        ledger.append(LedgerRecord(nb, scen, "neighbour", 1, 200, 180, ns(c + 1.0), ns(c + 1.05), 180, 0, None,
                                   ns(c + 10.0), "completed", "length", None))
        ledger.append(LedgerRecord(tgt, scen, "target", 1, 600, 400, ns(c + 1.4), ns(c + 1.6), 70, 0, ns(stop),
                                   ns(stop + 0.001), "cancelled", "client closed", None))
        ledger.append(LedgerRecord(pr, scen, "probe", 1, 100, 32, ns(c + 5.25), ns(c + 5.35), 32, 0, None,
                                   ns(c + 7.0), "completed", "length", None))
    write_events(con, rid, events)
    write_ledger(con, rid, ledger)
