"""One row per cancel: what was cancelled, the verdict, the latencies between the five points, and
what happened to the neighbour and the probe."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from cancelwatch.analysis.evidence import count_reading_text
from cancelwatch.analysis.verdicts import LATENCIES, STOP_TO_ABORT, CancelVerdict, latency_label, ledger_by_scenario
from cancelwatch.runstore.reader import Run

VERDICT_COLOURS = {
    "released": "#1a9850",
    "leaked": "#d73027",
    "stale_gauge": "#f59e0b",
    "inconclusive": "#7f7f7f",
}
LATENCY_COLUMNS = [latency_label(a, b) for a, b in (*LATENCIES, STOP_TO_ABORT)]
COLUMNS = ["request_id", "scenario", "phase", "verdict", "stop_s", *LATENCY_COLUMNS, "hops (ms)", "neighbour", "probe",
           "why", "evidence"]


def hops_text(v: CancelVerdict) -> str:
    """The cancel's way through the taps, ms each component held it: `nginx 3 · vllm 6`; a component that did
    not pass it on within the grace `kept`, one whose tap never saw it reach it `-`; empty without taps."""
    parts = []
    for s in v.hops:
        if s.reached_s is None:
            parts.append(f"{s.hop} -")
        elif s.held_ms is None or s.held_ms > v.evidence.grace_s * 1000:
            parts.append(f"{s.hop} kept")
        else:
            parts.append(f"{s.hop} {s.held_ms:g}")
    return " · ".join(parts)


def _outcomes(by_scenario: dict, t0: int, v: CancelVerdict) -> tuple[str, str]:
    """The neighbour running beside this cancel and the probe sent after it, as short phrases."""
    g = by_scenario.get(v.scenario)
    if g is None:
        return "n/a", "n/a"
    stop_ns = t0 + v.timepoints["user_stop"] * 1e9
    neighbour = "none"
    nb = np.nonzero((g["role"] == "neighbour") & (g["sent"] <= stop_ns))[0]
    if len(nb):
        i = nb[-1]
        neighbour = str(g["state"][i] or "unknown")
        if neighbour == "completed" and not math.isnan(g["chunks"][i]):
            neighbour = f"completed ({int(g['chunks'][i])} chunks)"
    probe = "not sent"
    pr = np.nonzero((g["role"] == "probe") & (g["sent"] >= stop_ns))[0]
    if len(pr):
        i = pr[0]
        first, sent = g["first"][i], g["sent"][i]
        probe = (f"admitted, TTFT {(first - sent) / 1e6:.0f} ms" if not math.isnan(first) and not math.isnan(sent)
                 else f"not admitted ({g['state'][i]})")
    return neighbour, probe


def _evidence_text(v: CancelVerdict) -> str:
    """The rule that gave the verdict, what its count was read against, then where each timepoint came from:
    `rule: released · count 0 at 1.80 s, ... · user stop: client · ...`."""
    parts = (f"rule: {v.rule}" if v.rule else "", count_reading_text(v.evidence.count_reading), v.sources_text())
    return " · ".join(part for part in parts if part)


def cancel_table(run: Run, verdicts: list[CancelVerdict]) -> pd.DataFrame:
    rows = []
    by_scenario = ledger_by_scenario(run.ledger)
    t0 = run.info["started_mono_ns"]
    for v in verdicts:
        neighbour, probe = _outcomes(by_scenario, t0, v)
        rows.append({
            "request_id": v.request_id,
            "scenario": v.scenario,
            "phase": v.phase_at_cancel,
            "verdict": v.verdict,
            "stop_s": round(v.timepoints["user_stop"], 3),
            **{latency_label(a, b): v.latency_ms(a, b) for a, b in (*LATENCIES, STOP_TO_ABORT)},
            "hops (ms)": hops_text(v),
            "neighbour": neighbour,
            "probe": probe,
            "why": v.evidence.why or "",
            "evidence": _evidence_text(v),
        })
    df = pd.DataFrame(rows, columns=COLUMNS)
    for col in LATENCY_COLUMNS:
        df[col] = pd.to_numeric(df[col], errors="coerce")
    return df


def cancel_window(v: CancelVerdict, pad_s: float = 3.0) -> tuple[float, float]:
    """The stretch of the run a cancel's story plays in: from before the stop to after it was reusable (and
    after a hop that kept it let its upstream go)."""
    pts = [t for t in v.timepoints.values() if t is not None]
    pts += [t for s in v.hops for t in (s.reached_s, s.passed_s, s.upstream_end_s) if t is not None]
    end = max(pts + [v.timepoints["user_stop"] + v.evidence.grace_s])
    return v.timepoints["user_stop"] - pad_s, end + pad_s


def release_latencies_ms(verdicts: list[CancelVerdict]) -> np.ndarray:
    """engine abort -> left scheduler, for the cancels that were released."""
    out = [v.evidence.release_ms for v in verdicts if v.verdict == "released"]
    return np.array([x for x in out if x is not None], dtype=float)


def verdict_counts(verdicts: list[CancelVerdict]) -> dict[str, int]:
    counts = {k: 0 for k in VERDICT_COLOURS}
    for v in verdicts:
        counts[v.verdict] = counts.get(v.verdict, 0) + 1
    return counts
