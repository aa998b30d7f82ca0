"""A long run (a day's watch) as a page shows it: drawn from its overview (runstore.reader.load_overview), its
cancels' verdicts as the live judge stored them, and a zoom read at full resolution on its own stretch. Pure:
the overview, the stored rows and a window reader in, the verdicts out.

A cancel with no stored verdict these rules gave (the judge missed it, or the rules changed since) is judged
here as the live judge would have: on its own window, in stop order, each told when the earlier ones saw their
requests leave. The whole run's samples are never read."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import pandas as pd

from cancelwatch.analysis.rows import frame_rows
from cancelwatch.analysis.verdicts import CancelVerdict, run_grace_s
from cancelwatch.analysis.verdicts.log_clock import log_clocks, log_offsets
from cancelwatch.analysis.verdicts.stored import usable
from cancelwatch.analysis.watching import ENTRY_WAIT_S, NOT_YET_ENTERED, judge_cancels, left_seen, scenario_end_after, window_of
from cancelwatch.runstore.reader import Run

LONG_RUN_S = 3 * 3600.0  # a run longer than this is drawn from its overview: its samples take longer to read
# `record`'s own report, at its end, reads a run longer than this from its overview and the verdicts its live judge
# kept: read whole, a run's samples cost the recorder memory in proportion to its length (217 MiB after 12 min)
RECORDED_LONG_S = 10 * 60.0
OVERVIEW_NOTE = ("drawn from the run's overview: each {bucket_s} s of a series as its lowest and highest value; "
                 "choose a cancel to see its stretch at full resolution")


def is_long(span_s: float | None, long_run_s: float | None = None) -> bool:
    """Whether a run whose overview covers `span_s` is read from it (None: it has no overview)."""
    return span_s is not None and span_s > (LONG_RUN_S if long_run_s is None else long_run_s)


def stops(run: Run) -> pd.DataFrame:
    """The run's user stops, in stop order: request_id, t_s."""
    ev = run.events
    if ev.empty:
        return pd.DataFrame(columns=["request_id", "t_s"])
    s = run.events_of("user_stop").dropna(subset=["request_id"])
    return s.drop_duplicates("request_id")[["request_id", "t_s"]].sort_values("t_s", kind="stable")


def long_run_verdicts(run: Run, stored_rows: pd.DataFrame, window: Callable[[float, float], Run],
                      grace_s: float | None = None, now_s: float | None = None) -> list[CancelVerdict]:
    """One verdict per stop of `run` (its overview), in stop order: the stored one where these rules gave it,
    else judged on `window(from_s, to_s)`, or `window(from_s, to_s, log_offsets)` where an engine log's clock is
    off the run's (log_clock.log_offsets: its lines are read where their stamps put them). `now_s`: for a run still
    recorded, how far it reaches (a cancel whose window is not all recorded yet is left for the live judge)."""
    offsets = log_offsets(log_clocks(run))  # the overview holds the events and the ledger whole
    if offsets:
        window = partial(window, log_offsets_s=offsets)
    own = run_grace_s(run)
    grace_s = own if grace_s is None else grace_s
    kept = usable(stored_rows) if grace_s == own else {}  # stored as judged with the run's own grace
    out, seen = [], {}
    ends = sorted(run.events_of("scenario_end")["t_s"])
    for rid, t_stop in frame_rows(stops(run)):
        v = kept.get(rid)
        if v is None:
            v = _judged(rid, t_stop, grace_s, window, seen, now_s, scenario_end_after(t_stop, ends))
            if v is None:
                continue
        seen.update(left_seen([v]))
        out.append(v)
    return out


def _judged(rid: str, t_stop: float, grace_s: float, window, seen: dict, now_s: float | None,
            until: float) -> CancelVerdict | None:
    """One cancel judged on its own window, as the live judge does (to its scenario's end, `until`, where that is
    later): one the engine's log does not name by its window's end is judged once more on a window ENTRY_WAIT_S
    longer, where a late Added line tells. None: its window is not all recorded yet (the live judge's, then)."""
    v = None
    for extra in (0.0, ENTRY_WAIT_S):
        lo, hi = window_of(t_stop, grace_s, extra)
        hi = max(hi, until)
        if now_s is not None and hi > now_s:
            return None
        got = judge_cancels(window(lo, hi), {rid}, grace_s, seen)
        v = got[0] if got else v
        if v is None or v.rule not in NOT_YET_ENTERED:
            return v
    return v
