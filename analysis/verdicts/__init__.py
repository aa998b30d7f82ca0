"""Per-cancel verdicts: each cancel of a run goes down an ordered ladder of named rules, the shared
guards first (it ended before the stop, too few samples, other traffic in its window, an engine restart,
an abort past the grace, ...), then its engine family's evidence rules; the first rule that decides
gives the verdict (released, leaked, stale_gauge, inconclusive), its `rule` code and its `why`.

  core      the vocabulary (timepoints, sources, latencies, constants, CancelVerdict), the table of
            rules (RULES: code -> verdict and sentence, each code once), the shared guards
  vllm      vLLM's evidence: the engine log's abort, the scheduler's gauges against the ledger
  triton    Triton's evidence: the models' log lines and gauges, the core's counters
  log_clock the engine log's clock against the run's (the offset its lines are moved by)
  families  the table of families (FAMILIES: name -> judge), judge_run, report_document

`cancelwatch.analysis.verdicts.judge_run` is the public entry (notebooks/explore.ipynb documents it); the rest of
analysis and the readers take the vocabulary from here too.
"""

from cancelwatch.analysis.verdicts.core import (
    ASSUMPTIONS,
    GRACE_S,
    HORIZON_S,
    LATENCIES,
    LOG_SLACK_S,
    LOST_CANCEL_RULES,
    MIN_SAMPLES,
    NO_APP,
    NO_LOG,
    POINT_LABELS,
    RACE_RULES,
    RACE_TOKENS,
    RULES,
    SEEN_LEAVING,
    SOURCE_LABELS,
    SOURCES,
    STOP_TO_ABORT,
    TIMEPOINTS,
    VERDICTS,
    CancelVerdict,
    Rule,
    engine_log_state,
    latency_key,
    latency_label,
    ledger_by_scenario,
    left_seen_at,
    run_grace_s,
)
from cancelwatch.analysis.verdicts.log_clock import LogClock, log_clocks
from cancelwatch.analysis.verdicts.families import (FAMILIES, UnknownFamily, family_of, ghosts_of, judge_run, engine_reading,
                                        neighbours_ok, report_document)
from cancelwatch.analysis.verdicts.triton import TRITON
from cancelwatch.analysis.verdicts.vllm import VLLM
from cancelwatch.analysis.verdicts.vllm_frames import ledger_inflight

__all__ = [
    "ASSUMPTIONS", "FAMILIES", "GRACE_S", "HORIZON_S", "LATENCIES", "LOG_SLACK_S", "LOST_CANCEL_RULES", "MIN_SAMPLES", "NO_APP", "NO_LOG", "POINT_LABELS",
    "RACE_RULES", "RACE_TOKENS", "RULES", "SEEN_LEAVING", "SOURCES", "SOURCE_LABELS", "STOP_TO_ABORT", "TIMEPOINTS", "TRITON",
    "VERDICTS", "VLLM",
    "CancelVerdict", "LogClock", "UnknownFamily",
    "Rule", "engine_log_state", "family_of", "ghosts_of", "judge_run", "latency_key", "latency_label", "ledger_by_scenario", "left_seen_at", "log_clocks",
    "engine_reading", "ledger_inflight", "neighbours_ok", "report_document", "run_grace_s",
]
