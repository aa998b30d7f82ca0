"""Verdicts kept in the run as they were given (a watch's live judge, each cancel on its own window), and read
back by a page that shows a day without judging a thousand cancels again.

A stored verdict is used only where the rules that gave it are the rules of the reader: `judged_by` holds the
fingerprint of the code that judges (the verdict modules and what they read with), so a verdict given by other
rules is judged again, never shown as if these rules had given it."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from pathlib import Path

from cancelwatch.analysis.evidence import Evidence
from cancelwatch.analysis.hops import HopStep
from cancelwatch.analysis.verdicts.core import CancelVerdict

WINDOW = "window"  # how a live judge judged: each cancel on its own stretch of the run
_ROOT = Path(__file__).resolve().parents[2]
# the code a verdict is the product of: the rules, the evidence they fill, the hops, the window they are read
# on, and what hands them the run (the reader, the records' settings)
_RULE_FILES = ("analysis/verdicts/*.py", "analysis/bounds.py", "analysis/rows.py", "analysis/evidence.py",
               "analysis/hops.py", "analysis/ghosts.py", "analysis/series.py", "analysis/watching.py",
               "analysis/page_stops.py",
               "runstore/reader.py", "runstore/records.py")


@functools.cache
def rules_fingerprint() -> str:
    """A digest of the judging code's source: it changes with any rule. Taken when this module is imported (a
    watch imports it before it listens), not at its first verdict: a checkout upgraded under a watch running
    for days must not stamp the old rules' verdicts with the new rules' name."""
    digest = hashlib.sha256()
    for pattern in _RULE_FILES:
        for path in sorted(_ROOT.glob(pattern)):
            digest.update(str(path.relative_to(_ROOT)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


rules_fingerprint()


def judged_by(how: str = WINDOW) -> str:
    """What a stored verdict says it was given by: how, and by which rules."""
    return f"{how} {rules_fingerprint()}"


def stored(v: CancelVerdict) -> dict:
    """The verdict whole, as JSON: every evidence field and hop step, so that from_stored gives it back equal."""
    return {"request_id": v.request_id, "scenario": v.scenario, "phase_at_cancel": v.phase_at_cancel,
            "timepoints": dict(v.timepoints), "verdict": v.verdict, "evidence": dataclasses.asdict(v.evidence),
            "terminal_state": v.terminal_state, "sources": dict(v.sources),
            "hops": [dataclasses.asdict(h) for h in v.hops]}


def from_stored(body: dict) -> CancelVerdict:
    names = {f.name for f in dataclasses.fields(Evidence)}
    return CancelVerdict(request_id=body["request_id"], scenario=body["scenario"],
                         phase_at_cancel=body["phase_at_cancel"], timepoints=dict(body["timepoints"]),
                         verdict=body["verdict"],
                         evidence=Evidence(**{k: v for k, v in body["evidence"].items() if k in names}),
                         terminal_state=body.get("terminal_state"), sources=dict(body.get("sources") or {}),
                         hops=[HopStep(**h) for h in body.get("hops") or []])


def usable(rows, how: str = WINDOW) -> dict[str, CancelVerdict]:
    """Request id -> verdict, of the stored rows (runstore.reader.load_verdicts) these rules gave."""
    want = judged_by(how)
    return {r.request_id: from_stored(r.body) for r in rows.itertuples() if r.judged_by == want}
