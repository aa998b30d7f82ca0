"""The engine families' verdicts, one entry a family: a run is judged by the rules of the family its
targets record, through the one public entry, `judge_run`; and the report document of a run, with what
its family adds. A run written before targets recorded their family is read by its engine facts (a
Triton run's say so; any other is vLLM's, the only family there was). A family this cancelwatch does not
know is one line (UnknownFamily), never judged as vLLM."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

import pandas as pd

from cancelwatch.analysis.ghosts import EngineReading, ghost_records
from cancelwatch.analysis.hops import app_received, hop_story, hop_traces, run_hops, stopped_at
from cancelwatch.analysis.page_stops import (app_received_source, app_receipts, page_stops, report_rows, standing_reports,
                                 user_stop_source)
from cancelwatch.analysis.summary import sampling_stats
from cancelwatch.analysis.verdicts.core import TAP_RECEIVED, CancelVerdict, run_assumptions, run_grace_s
from cancelwatch.analysis.verdicts.ghost_list import ghost_table
from cancelwatch.analysis.verdicts.triton import TRITON, judge_triton, report_fields
from cancelwatch.analysis.verdicts.vllm import VLLM, judge_vllm
from cancelwatch.analysis.verdicts.vllm_frames import ends_beyond_the_run, vllm_in_engine
from cancelwatch.analysis.verdicts.vllm_log import vllm_report_fields
from cancelwatch.runstore.errors import StoreError
from cancelwatch.runstore.reader import Run
from cancelwatch.runstore.records import DriveSettings


def _nothing(run: Run) -> dict:
    return {}


def _no_count(run: Run, target: str | None) -> None:
    return None


def _no_traffic(run: Run) -> None:
    return None


@dataclass(frozen=True)
class Family:
    # one verdict per cancel: (run, grace_s, metrics_target, only) -> verdicts. `only`: the cancels asked for (a live
    # judge's window); the family may leave out any other whose verdict none of those rests on, or judge all
    judge: Callable[[Run, float, str | None, set[str] | None], list[CancelVerdict]]
    # the fields the family adds to a run's report document
    report_fields: Callable[[Run], dict] = _nothing
    # the engine's count of requests against the ledger's requests in it (run, target) -> EngineReading, for
    # ghosts (analysis/ghosts.py); None where the family's gauges count no requests
    in_engine: Callable[[Run, str | None], EngineReading | None] = _no_count
    # the run's own evidence, beyond its cancels', that requests it did not send reached the engine (a sentence; None
    # where it shows none): what contradicts the assumption no_traffic_beside_the_run
    traffic_beyond: Callable[[Run], str | None] = _no_traffic


FAMILIES: dict[str, Family] = {
    VLLM: Family(judge_vllm, vllm_report_fields, vllm_in_engine, ends_beyond_the_run),
    TRITON: Family(judge_triton, report_fields),
}


class UnknownFamily(StoreError):
    """The run records an engine family this cancelwatch has no rules for; the message says what to do."""


def family_of(run: Run) -> str:
    """The engine family of the run's targets; for a run from before targets said so, its engine facts'."""
    named = sorted({t["family"] for t in run.info.get("targets") or [] if isinstance(t, dict) and t.get("family")})
    if not named:
        return TRITON if (run.info.get("engine") or {}).get("engine") == TRITON else VLLM
    unknown = [n for n in named if n not in FAMILIES]
    if unknown:
        raise UnknownFamily(f"run {run.id} was recorded on engine family {unknown[0][:40]!r}, which this cancelwatch has no "
                            f"rules for (it knows {', '.join(FAMILIES)}): read it with the cancelwatch that recorded it")
    if len(named) > 1:
        raise UnknownFamily(f"run {run.id} mixes engine families ({', '.join(named)}): cancelwatch judges a run of one "
                            "family; record each family into a run of its own")
    return named[0]


def judge_run(run: Run, grace_s: float | None = None, metrics_target: str | None = None,
              only: set[str] | None = None) -> list[CancelVerdict]:
    """One verdict per cancel; `grace_s` defaults to the run's own. `only`: the verdicts of these requests alone (a
    live judge's window), each the one the run's whole set of cancels would give it: the family judges the others
    its verdicts rest on (vLLM: the cancels with no abort, whose leaving the ledger's count beside them reads)."""
    grace_s = run_grace_s(run) if grace_s is None else grace_s
    family = FAMILIES[family_of(run)]
    # the events and the ledger as they are now: a notebook or a test may change one in place between two judgements
    # (what the rules make of them once a judgement, Run.memo, is made again; a window is judged once)
    run.forget("events", "ledger")
    verdicts = family.judge(run, grace_s, metrics_target, only)
    if only is not None:
        verdicts = [v for v in verdicts if v.request_id in only]
    with_hops(run, verdicts, grace_s)
    with_app_receipts(run, verdicts)
    with_page_stops(run, verdicts)
    return verdicts


def with_app_receipts(run: Run, verdicts: list[CancelVerdict]) -> None:
    """Each cancel's app_received on its app's own word, where the app reported seeing its client leave and the
    report holds (analysis/page_stops.py): it replaces the tap's reading of the app's connection closing (an app
    that noticed late says so). A report not used is noted in the source's reason; the verdict is unchanged."""
    reports = app_receipts(run, [h.get("name") for h in run_hops(run)])
    if not reports:
        return
    standing = standing_reports(reports)
    for v in verdicts:
        if (v.sources.get("app_received") or {}).get("source") == "relay":
            continue  # the relay app's own reading already
        receipt = standing.get(v.request_id)
        t_app, source = app_received_source(receipt, v.timepoints["user_stop"], v.evidence.grace_s,
                                            _passed_app(v, receipt.hop if receipt is not None else None))
        if t_app is not None:
            v.timepoints["app_received"] = t_app
            v.sources["app_received"] = source
        elif source is not None:
            was = v.sources.get("app_received") or {}
            v.sources["app_received"] = {"source": was.get("source"), "reason": "; ".join(
                r for r in (was.get("reason"), source["reason"]) if r)}


def _passed_app(v: CancelVerdict, reader: str | None) -> float | None:
    """Where the cancel was first seen past the app whose report the tap `reader` read: that tap seeing the app
    close its upstream, or the engine's abort."""
    names = [h.hop for h in v.hops]
    app = v.hops[names.index(reader) - 1] if reader in names and names.index(reader) > 0 else None
    seen = [t for t in (app.passed_s if app is not None else None, v.timepoints.get("engine_abort")) if t is not None]
    return min(seen) if seen else None


def with_page_stops(run: Run, verdicts: list[CancelVerdict]) -> None:
    """Each cancel's user_stop on its page's word, where its page reported the Stop click and the report holds
    (analysis/page_stops.py); else, in a run with page reports, why it rests on the client side's close. The
    verdict is judged as before, from the client side's close, which its evidence keeps (client_left_s): a page's
    word times the click, it decides nothing."""
    reports = page_stops(run, [h.get("name") for h in run_hops(run)])
    if not reports:
        return
    standing = standing_reports(reports)
    led = run.ledger.set_index("request_id")["sent_mono_ns"] if not run.ledger.empty else pd.Series(dtype=float)
    t0 = run.info["started_mono_ns"]
    for v in verdicts:
        sent = led.get(v.request_id)
        t_sent = None if sent is None or pd.isna(sent) else (float(sent) - t0) / 1e9
        t_close = v.timepoints["user_stop"]
        t_click, source = user_stop_source(standing.get(v.request_id), t_close, t_sent, v.evidence.grace_s, True)
        if t_click is not None:
            v.timepoints["user_stop"], v.evidence.client_left_s = t_click, t_close
        if source is not None:
            v.sources["user_stop"] = source


def engine_reading(run: Run, target: str | None) -> EngineReading | None:
    """`target`'s engine count against the ledger's requests in it, as the run's family reads them."""
    return FAMILIES[family_of(run)].in_engine(run, target)


def ghosts_of(run: Run, verdicts: list[CancelVerdict]) -> pd.DataFrame:
    """The run's leaked cancels as ghosts, with their ages (analysis/verdicts/ghost_list.py)."""
    return ghost_table(run, verdicts, engine_reading)


def with_hops(run: Run, verdicts: list[CancelVerdict], grace_s: float) -> None:
    """Each cancel's way through the taps of the run (none: nothing changes): its steps, where it stopped,
    the path in a sentence, and `app_received` from the tap in front of the app where no app said so itself.
    The verdict stays the family's: it rests on the engine's evidence, a socket close proves nothing alone."""
    traces = hop_traces(run, verdicts)
    for v in verdicts:
        v.hops = traces.get(v.request_id, [])
        if not v.hops:
            continue
        stop = stopped_at(v.hops, grace_s)
        v.evidence.stopped_at = stop.hop if stop is not None else None
        v.evidence.path = hop_story(v.hops, grace_s)
        app = app_received(v.hops)
        if app is not None and v.timepoints.get("app_received") is None:
            v.timepoints["app_received"] = app.reached_s
            v.sources["app_received"] = {"source": "tap", "reason": TAP_RECEIVED}


def neighbours_ok(run: Run) -> bool:
    nb = run.ledger[run.ledger["role"] == "neighbour"] if not run.ledger.empty else run.ledger
    return bool(len(nb)) and bool((nb["terminal_state"] == "completed").all())


def report_document(run: Run, grace_s: float | None = None, verdicts: list[CancelVerdict] | None = None) -> dict:
    """The report of a run; pass `verdicts` when they are already judged."""
    verdicts = judge_run(run, grace_s) if verdicts is None else verdicts
    stats = sampling_stats(run)
    driven = DriveSettings.of_run(run.info.get("settings")).driven_target
    family = family_of(run)
    watch = (run.info.get("settings") or {}).get("watch")
    return {
        "run_id": run.id,
        "name": run.info.get("name"),
        "target": driven or (run.info["targets"][0]["url"] if run.info.get("targets") else None),
        "metrics_url": run.info["targets"][0]["url"] if run.info.get("targets") else None,
        "status": run.info["status"],
        # a watch sends nothing of its own: no neighbour to keep going, its traffic is the users'
        "neighbours_ok": None if watch else neighbours_ok(run),
        "watch": None if not watch else {**watch, "requests": len(run.ledger)},
        # a page's word on its Stop clicks (analysis/page_stops.py): each report, used or why not
        "page_reports": report_rows(page_stops(run, [h.get("name") for h in run_hops(run)]),
                                    {v.request_id: v.sources.get("user_stop") or {} for v in verdicts}),
        "sampling": json.loads(stats.to_json(orient="records")) if not stats.empty else [],
        "family": family,
        "cancels": [v.as_json() for v in verdicts],
        # the leaked requests: which the engine still held at the last sample, and each one's age
        "ghosts": ghost_records(ghosts_of(run, verdicts)),
        # what the verdicts rest on that their evidence does not show, and where the run contradicts it
        "assumptions": run_assumptions(verdicts, FAMILIES[family].traffic_beyond(run)),
        **FAMILIES[family].report_fields(run),
    }
