"""A run and its verdicts, whatever its length: the one place `report`, the dashboard and the notebooks read them
through. A run whose overview covers more than LONG_RUN_S (a day's watch) is read at the overview's resolution, its
cancels' verdicts those its live judge stored with it by these rules, the rest each judged on its own window as
the live judge judges (analysis/watching.py): its millions of samples are never read whole. Any other run is read
whole and judged."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import NamedTuple

from cancelwatch.analysis.facts import VERDICT_METRICS
from cancelwatch.analysis.long_runs import is_long, long_run_verdicts
from cancelwatch.analysis.verdicts import CancelVerdict, judge_run
from cancelwatch.analysis.watching import LOOKBACK_S
from cancelwatch.runstore import reader
from cancelwatch.runstore.reader import Run


class JudgedRun(NamedTuple):
    run: Run  # whole, or (long) its overview
    verdicts: list[CancelVerdict]
    long: bool  # read from its overview, its verdicts stored or judged on windows
    stored_rows: object = None  # the verdicts stored with a long run (load_verdicts), for a caller that keeps more


def judged_run(store: str | Path, run: str | int = "latest", grace_s: float | None = None, *,
               metrics: Iterable[str] | None = None, long_run_s: float | None = None,
               window: Callable[[float, float], Run] | None = None, wait_for_windows: bool = False) -> JudgedRun:
    """The run `run` of `store` and one verdict per cancel. `metrics`: the series read (default: all; a long
    run's windows read only those the verdicts read). `long_run_s`: read from the overview past this (default
    LONG_RUN_S). `window`: how a long run's stretch is read (default: load_window; the page passes its cached
    reader). `wait_for_windows`: a run still recorded leaves a cancel whose window is not all recorded yet
    unjudged (its live judge will judge it), as a page refreshed while it grows does."""
    rid = reader.resolve_run_id(store, run)
    span = reader.overview_span_s(store, rid)
    if not is_long(span, long_run_s):
        whole = reader.load_run(store, rid, metrics=metrics)
        return JudgedRun(whole, judge_run(whole, grace_s), False)
    overview = reader.load_overview(store, rid, metrics=metrics)
    rows = reader.load_verdicts(store, rid)
    growing = wait_for_windows and overview.info.get("status") == "running"
    with reader.WindowReader(store) as read:  # the windows one after another, on one connection
        if window is None:
            def window(lo: float, hi: float, log_offsets_s=()) -> Run:
                return read(rid, lo, hi, lookback_s=LOOKBACK_S, metrics=VERDICT_METRICS, log_offsets_s=log_offsets_s)
        verdicts = long_run_verdicts(overview, rows, window, grace_s, now_s=span if growing else None)
    return JudgedRun(overview, verdicts, True, rows)
