"""Runs side by side: one column per run, one row per figure (direct vs through a proxy, before vs after)."""

from __future__ import annotations

import numpy as np
import pandas as pd

from cancelwatch.analysis.cancel_table import release_latencies_ms, verdict_counts
from cancelwatch.analysis.capacity import capacity
from cancelwatch.analysis.facts import run_facts
from cancelwatch.analysis.verdicts import CancelVerdict, neighbours_ok
from cancelwatch.runstore.reader import Run


def _quantile(a: np.ndarray, q: float) -> float | None:
    return float(np.quantile(a, q)) if len(a) else None


def run_column(run: Run, verdicts: list[CancelVerdict], context_len: int = 2048) -> dict:
    facts = run_facts(run)
    cap = capacity(run, context_len)
    rel = release_latencies_ms(verdicts)
    counts = verdict_counts(verdicts)
    stop_to_probe_s = [v.timepoints["reusable"] - v.timepoints["user_stop"] for v in verdicts
                  if v.timepoints.get("reusable") is not None]
    return {
        "name": facts["name"],
        "status": facts["status"],
        "duration (s)": facts["duration_s"],
        "target": facts["driven_target"] or (facts["targets"][0]["url"] if facts["targets"] else None),
        "cancels": len(verdicts),
        **{f"verdict: {k}": n for k, n in counts.items()},
        "release p50 (ms)": _quantile(rel, 0.5),
        "release p95 (ms)": _quantile(rel, 0.95),
        "release max (ms)": float(rel.max()) if len(rel) else None,
        "stop → probe first token p50 (ms)": _quantile(1000 * np.array(stop_to_probe_s), 0.5),
        "neighbours all completed": neighbours_ok(run) if not run.ledger.empty else None,
        "KV pool (tokens)": cap["pool_tokens"],
        "peak KV usage (%)": None if cap["peak_kv"] is None else 100 * cap["peak_kv"],
        "p95 KV usage (%)": None if cap["p95_kv"] is None else 100 * cap["p95_kv"],
        f"max concurrency at {context_len} tokens": cap["max_concurrency"],
        "time with requests waiting (%)": None if cap["waiting_share"] is None else 100 * cap["waiting_share"],
        "preemptions": cap["preemptions"],
        "memory source": facts["memory_source"],
        "sampling gap ticks": facts["gap_ticks"],
    }


def compare_runs(runs: list[tuple[str, Run, list[CancelVerdict]]], context_len: int = 2048) -> pd.DataFrame:
    """`runs`: (column label, run, its verdicts). Labels must be distinct."""
    labels = [label for label, _, _ in runs]
    if len(set(labels)) != len(labels):
        raise ValueError(f"run labels must be distinct, got {labels}")
    cols = {label: run_column(run, verdicts, context_len) for label, run, verdicts in runs}
    return pd.DataFrame(cols)
