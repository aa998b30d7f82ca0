"""The vocabulary of a cancel's verdict, shared by every engine family's rules: the five timepoints and
their labels, the latencies between them, what a timepoint rests on, the constants of judging, and the
verdict record itself. Here, below analysis/verdicts.py and analysis/triton_verdicts.py, so neither
imports the other's privates."""

from __future__ import annotations

from dataclasses import dataclass, field

from analysis.evidence import Evidence
from runstore.reader import Run
from runstore.records import DriveSettings

GRACE_S = 2.0
MIN_SAMPLES = 5
RACE_TOKENS = 8  # a stop this close to the end is a race the completion may win
HORIZON_S = 60.0  # how far past the abort a request that did not leave in the grace is followed
TIMEPOINTS = ("user_stop", "app_received", "engine_abort", "left_scheduler", "reusable")
POINT_LABELS = {
    "user_stop": "user stop",
    "app_received": "app received",
    "engine_abort": "engine abort",
    "left_scheduler": "left scheduler",
    "reusable": "reusable",
}
# the four latencies: from each timepoint to the next
LATENCIES = tuple(zip(TIMEPOINTS, TIMEPOINTS[1:]))
# and the one a reader asks first, whole even where no app stands between the client and the engine
STOP_TO_ABORT = ("user_stop", "engine_abort")


def latency_key(a: str, b: str) -> str:
    """The latency's key in the report's JSON: `user_stop->app_received_ms`."""
    return f"{a}->{b}_ms"


def latency_label(a: str, b: str) -> str:
    """The latency's name in every table shown to a person: `user stop → app received (ms)`."""
    return f"{POINT_LABELS[a]} → {POINT_LABELS[b]} (ms)"


@dataclass
class CancelVerdict:
    request_id: str
    scenario: str
    phase_at_cancel: str
    timepoints: dict  # timepoint -> instant, s since the run started; None where not reached
    verdict: str
    evidence: Evidence
    terminal_state: str | None = None
    # timepoint -> {"source": one of SOURCES or None, "reason": why there is no value, or None}
    sources: dict = field(default_factory=dict)

    def latency_ms(self, a: str, b: str) -> float | None:
        """Duration, ms from timepoint `a` to `b`; None when either was not reached."""
        ta, tb = self.timepoints.get(a), self.timepoints.get(b)
        return None if ta is None or tb is None else round((tb - ta) * 1000, 1)

    def latencies(self) -> dict:
        return {latency_key(a, b): self.latency_ms(a, b) for a, b in (*LATENCIES, STOP_TO_ABORT)}

    def source_of(self, point: str) -> str | None:
        return (self.sources.get(point) or {}).get("source")

    def source_label(self, point: str) -> str | None:
        """Where the point came from, in words (`engine log`); None when it has no source."""
        src = self.source_of(point)
        return SOURCE_LABELS.get(src, src) if src else None

    def source_reason(self, point: str) -> str | None:
        return (self.sources.get(point) or {}).get("reason")

    def sources_text(self) -> str:
        """Where each timepoint came from, in words: `engine abort: engine log · app received: none (no
        app on this path) · ...`."""
        parts = []
        for p in TIMEPOINTS:
            if p in self.sources:
                what = self.source_label(p) or f"none ({self.source_reason(p) or 'not reached'})"
                parts.append(f"{POINT_LABELS[p]}: {what}")
        return " · ".join(parts)

    def as_json(self) -> dict:
        return {"request_id": self.request_id, "scenario": self.scenario, "phase_at_cancel": self.phase_at_cancel,
                "timepoints": dict(self.timepoints), "timepoint_sources": dict(self.sources), "verdict": self.verdict, "evidence": self.evidence.as_json(),
                "terminal_state": self.terminal_state, "latencies_ms": self.latencies()}


def run_grace_s(run: Run) -> float:
    """Duration, s: the grace window the run was recorded with (`record --grace`), else the default."""
    grace_s = DriveSettings.of_run(run.info.get("settings")).grace_s
    return GRACE_S if grace_s is None else grace_s


# what each timepoint rests on, in every table and JSON: where its value came from
SOURCES = ("engine_log", "relay", "client", "samples")
SOURCE_LABELS = {"engine_log": "engine log", "relay": "relay (in the app)", "client": "client",
                 "samples": "scheduler samples"}
NO_APP = "no app on this path"
NO_LOG = "no engine log"
# an engine log line is stamped to the millisecond, then mapped onto the run's clock: an abort may
# read a hair before the stop that caused it
LOG_SLACK_S = 0.05


def engine_log_state(run: Run, target: str | None) -> str:
    """"read" when the engine log of `target` was followed during the run, else why not."""
    logs = (run.info.get("engine") or {}).get("engine_log")
    if not logs:
        return "the run has no engine log facts (recorded before engine logs were read)"
    entry = logs.get(target) or {}
    return "read" if entry.get("path") else (entry.get("off") or NO_LOG)
