"""The engine families' verdicts, one entry a family: a run is judged by the rules of the family it
records (a run that records none is vLLM's: runs from before Triton), through the one public entry,
`judge_run`; and the report document of a run, with what its family adds."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from analysis.summary import sampling_stats
from analysis.verdicts.core import CancelVerdict, run_grace_s
from analysis.verdicts.triton import TRITON, judge_triton, report_fields
from analysis.verdicts.vllm import VLLM, judge_vllm
from runstore.reader import Run
from runstore.records import DriveSettings


def _nothing(run: Run) -> dict:
    return {}


@dataclass(frozen=True)
class Family:
    # one verdict per cancel: (run, grace_s, metrics_target) -> verdicts
    judge: Callable[[Run, float, str | None], list[CancelVerdict]]
    # the fields the family adds to a run's report document
    report_fields: Callable[[Run], dict] = _nothing


FAMILIES: dict[str, Family] = {
    VLLM: Family(judge_vllm),
    TRITON: Family(judge_triton, report_fields),
}


def family_of(run: Run) -> str:
    """The family the run records (its engine facts' `engine`), else vLLM."""
    name = (run.info.get("engine") or {}).get("engine")
    return name if name in FAMILIES else VLLM


def judge_run(run: Run, grace_s: float | None = None, metrics_target: str | None = None) -> list[CancelVerdict]:
    """One verdict per cancel; `grace_s` defaults to the run's own."""
    grace_s = run_grace_s(run) if grace_s is None else grace_s
    return FAMILIES[family_of(run)].judge(run, grace_s, metrics_target)


def neighbours_ok(run: Run) -> bool:
    nb = run.ledger[run.ledger["role"] == "neighbour"] if not run.ledger.empty else run.ledger
    return bool(len(nb)) and bool((nb["terminal_state"] == "completed").all())


def report_document(run: Run, grace_s: float | None = None, verdicts: list[CancelVerdict] | None = None) -> dict:
    """The report of a run; pass `verdicts` when they are already judged."""
    verdicts = judge_run(run, grace_s) if verdicts is None else verdicts
    stats = sampling_stats(run)
    driven = DriveSettings.of_run(run.info.get("settings")).driven_target
    return {
        "run_id": run.id,
        "name": run.info.get("name"),
        "target": driven or (run.info["targets"][0]["url"] if run.info.get("targets") else None),
        "metrics_url": run.info["targets"][0]["url"] if run.info.get("targets") else None,
        "status": run.info["status"],
        "neighbours_ok": neighbours_ok(run),
        "sampling": json.loads(stats.to_json(orient="records")) if not stats.empty else [],
        "cancels": [v.as_json() for v in verdicts],
        **FAMILIES[family_of(run)].report_fields(run),
    }
