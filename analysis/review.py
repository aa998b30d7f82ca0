"""What the notebooks compute: a capacity review over one or more runs, and the numbers of the
VRAM-plateau walk-through. The notebooks hold narrative and calls only."""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from cancelwatch.analysis.anatomy import cancel_summary
from cancelwatch.analysis.cancel_table import cancel_table, release_latencies_ms, verdict_counts
from cancelwatch.analysis.capacity import capacity, capacity_figure, capacity_frame, fleet_frame, gpu_memory_frame
from cancelwatch.analysis.compare import compare_runs
from cancelwatch.analysis.explain import memory_story, pick_story_cancel
from cancelwatch.analysis.facts import VIEW_METRICS
from cancelwatch.analysis.judged import judged_run
from cancelwatch.analysis.verdicts import CancelVerdict
from cancelwatch.runstore.reader import Run, StoreError


@dataclass
class ReviewRun:
    label: str
    run: Run
    verdicts: list[CancelVerdict]


def parse_run_ids(run_ids) -> list[str]:
    """'1,2', [1, 2], 'latest' or 3 -> ['1', '2'] / ['latest'] / ['3']."""
    if run_ids is None:
        return ["latest"]
    if isinstance(run_ids, (int, np.integer)):
        return [str(int(run_ids))]
    if isinstance(run_ids, str):
        items = [x.strip() for x in run_ids.split(",")]
    else:
        items = [str(x).strip() for x in run_ids]
    items = [x for x in items if x]
    if not items:
        raise StoreError("no run given: set run_ids, e.g. run_ids = \"latest\" or \"1,2\"")
    return items


def open_runs(store: str, run_ids) -> list[ReviewRun]:
    """Load and judge each run; StoreError (one readable line) for an unknown run or a missing store."""
    out = []
    for rid in parse_run_ids(run_ids):
        # a day's run from its overview and the verdicts kept with it (analysis/judged.py), never read whole
        run, verdicts, *_ = judged_run(store, rid, metrics=VIEW_METRICS)
        label = f"run {run.id}" + (f" ({run.info['name']})" if run.info.get("name") else "")
        out.append(ReviewRun(label, run, verdicts))
    if len({r.label for r in out}) != len(out):
        raise StoreError(f"the same run was given twice: {[r.label for r in out]}")
    return out


def release_latency_summary(runs: list[ReviewRun], slo_ms: float) -> pd.DataFrame:
    """Per run: released cancels, release latency (engine abort -> left scheduler) p50/p95/max, and
    the share released within the SLO."""
    rows = []
    for r in runs:
        lat = release_latencies_ms(r.verdicts)
        rows.append({
            "run": r.label,
            "cancels": len(r.verdicts),
            "released": int(len(lat)),
            "p50 (ms)": float(np.quantile(lat, 0.5)) if len(lat) else None,
            "p95 (ms)": float(np.quantile(lat, 0.95)) if len(lat) else None,
            "max (ms)": float(lat.max()) if len(lat) else None,
            f"within {slo_ms:g} ms": (f"{int((lat <= slo_ms).sum())} of {len(r.verdicts)}" if r.verdicts else "no cancels"),
            "engine abort from": _abort_sources(r.verdicts),
        })
    return pd.DataFrame(rows).set_index("run")


def _abort_sources(verdicts: list[CancelVerdict]) -> str:
    """What the cancels' engine_abort rests on, counted: `engine log 11, relay 1, none (no engine log) 2`."""
    counts: dict[str, int] = {}
    for v in verdicts:
        key = v.source_label("engine_abort") or f"none ({v.source_reason('engine_abort') or 'not recorded'})"
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{k} {n}" for k, n in counts.items()) or "no cancels"


def verdict_summary(runs: list[ReviewRun]) -> pd.DataFrame:
    """Verdict counts, one column per run."""
    return pd.DataFrame({r.label: verdict_counts(r.verdicts) for r in runs})


def capacity_drawing(runs: list[ReviewRun], context_len: int) -> go.Figure:
    """Every run's KV pool as one bar: used at p95, peak, free, and how many more requests fit."""
    return capacity_figure([(r.label, capacity(r.run, context_len)) for r in runs])


def capacity_summary(runs: list[ReviewRun], context_len: int) -> dict[str, pd.DataFrame]:
    return {r.label: capacity_frame(capacity(r.run, context_len)) for r in runs}


def fleet_summary(runs: list[ReviewRun], context_len: int) -> dict[str, pd.DataFrame]:
    """Per run with more than one replica (an imported fleet, a run with several targets): each replica
    and the fleet."""
    return {r.label: fleet_frame(r.run, context_len) for r in runs if len(r.run.info.get("targets", [])) > 1}


def gpu_summary(runs: list[ReviewRun]) -> dict[str, pd.DataFrame]:
    """Per run with GPU readings: memory used and reserved per GPU and host."""
    out = {r.label: gpu_memory_frame(r.run) for r in runs}
    return {label: df for label, df in out.items() if not df.empty}


def comparison(runs: list[ReviewRun], context_len: int) -> pd.DataFrame:
    return compare_runs([(r.label, r.run, r.verdicts) for r in runs], context_len)


def latency_distribution(runs: list[ReviewRun]) -> pd.DataFrame:
    """Long table of release latencies for a histogram: run, scenario, release (ms)."""
    rows = [{"run": r.label, "scenario": v.scenario, "release (ms)": v.evidence.release_ms}
            for r in runs for v in r.verdicts if v.verdict == "released" and v.evidence.release_ms is not None]
    return pd.DataFrame(rows, columns=["run", "scenario", "release (ms)"])


def plateau_walkthrough(review: ReviewRun, request_id: str | None = None) -> dict:
    """The cancel the VRAM-plateau notebook walks through (the given one, else the clearest), its
    sentences and its row of the cancel table."""
    verdicts = review.verdicts
    if request_id:
        chosen = next((v for v in verdicts if v.request_id == request_id), None)
        if chosen is None:
            raise StoreError(f"no cancel {request_id!r} in {review.label}: leave cancel empty to pick one")
    else:
        chosen = pick_story_cancel(verdicts)
    table = cancel_table(review.run, verdicts)
    return {
        "cancel": chosen,
        "summary": cancel_summary(review.run, chosen) if chosen is not None else None,
        "story": memory_story(review.run, verdicts, chosen),
        "overview": memory_story(review.run, verdicts, None),
        "row": table[table["request_id"] == chosen.request_id] if chosen is not None else table.head(0),
        "card": cancel_card(table[table["request_id"] == chosen.request_id]) if chosen is not None else None,
    }


# the cancel table's columns as a reader who does not run engines reads them (the latencies keep their own
# words: "user stop → engine abort (ms)")
CARD_LABELS = {"request_id": "request", "scenario": "scenario", "phase": "where it was when stopped",
               "verdict": "verdict", "stop_s": "stopped at (s into the run)", "hops (ms)": "hops on the way (ms)",
               "neighbour": "the request running beside it", "probe": "the next request",
               "why": "why", "evidence": "what it rests on"}
NOTHING = "—"


def cancel_card(row: pd.DataFrame) -> pd.DataFrame:
    """One cancel of the cancel table as two columns a stakeholder reads: what, and its value in words; a dash
    where the cancel's path has nothing (no app on the path, a point not reached); numbers rounded; the evidence
    a point a line, whole."""
    if len(row) != 1:
        raise ValueError(f"a cancel card is one cancel's row, not {len(row)}")
    out = []
    for col, value in row.iloc[0].items():
        if pd.api.types.is_scalar(value) and (pd.isna(value) or (isinstance(value, str) and value in ("", "n/a"))):
            text = NOTHING
        elif isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_)):
            text = f"{float(value):,.1f}" if col != "stop_s" else f"{float(value):,.2f}"
        else:
            text = str(value).replace(" · ", "\n")
        out.append({"": CARD_LABELS.get(col, col), "value": text})
    return pd.DataFrame(out)


def card_view(card: pd.DataFrame):
    """The card as the notebook shows it: no index or header, its text wrapped where it breaks, left-aligned, the
    run's own text (request ids, rule fields) escaped: shown, never run."""
    return (card.style.hide(axis="index").hide(axis="columns").format(escape="html")
            .set_properties(**{"white-space": "pre-wrap", "text-align": "left"}))


def latency_histogram(runs: list[ReviewRun]) -> go.Figure:
    """Release latencies of every released cancel, one colour per run."""
    df = latency_distribution(runs)
    fig = go.Figure()
    for label, g in df.groupby("run", sort=False):
        fig.add_trace(go.Histogram(x=g["release (ms)"], name=label, opacity=0.75, nbinsx=30,
                                   hovertemplate="%{x} ms: %{y} cancels<extra>%{fullData.name}</extra>"))
    fig.update_layout(barmode="overlay", height=350, margin=dict(l=50, r=20, t=30, b=40),
                      xaxis_title="engine abort → left scheduler (ms)", yaxis_title="cancels",
                      title="release latency" if len(df) else "release latency: no released cancels")
    return fig


class OfflineFigures:
    """Figures as HTML with plotly.js embedded once and no MathJax from a CDN, so that a rendered
    notebook opens offline (plotly's notebook renderer always links MathJax from a CDN)."""

    def __init__(self) -> None:
        self._first = True

    def html(self, fig: go.Figure) -> str:
        out = fig.to_html(full_html=False, include_plotlyjs=self._first, include_mathjax=False,
                          config={"displaylogo": False})
        self._first = False
        return out
