"""Judging a watch's cancels one by one, as each one's grace ends (`cancelwatch watch`): each on its own
stretch of the run (runstore.reader.load_window), never the whole run, by the same rules as a scripted
cancel. Pure: the window in, the verdicts out."""

from __future__ import annotations

import math
from bisect import bisect_left

from cancelwatch.analysis.bounds import BEFORE_S, ENTRY_WAIT_S, SETTLE_S
from cancelwatch.analysis.verdicts import HORIZON_S, SEEN_LEAVING, CancelVerdict, judge_run, left_seen_at
from cancelwatch.runstore.reader import Run

# the ledger rows and engine-log events a cancel's window also reads from before it: a request cancelled
# earlier with no abort may still be in the engine (the rules' own horizon)
LOOKBACK_S = HORIZON_S
NOT_YET_ENTERED = ("never_added",)  # the rules that a later Added line can overturn


def window_of(t_stop_s: float, grace_s: float, extra_s: float = 0.0) -> tuple[float, float]:
    """The stretch one cancel is judged on, s since the run started (`extra_s` longer: ENTRY_WAIT_S)."""
    return t_stop_s - BEFORE_S, t_stop_s + grace_s + SETTLE_S + extra_s


def scenario_end_after(t_stop_s: float, ends: list[float]) -> float:
    """The end of a scripted cancel's scenario (`ends`: the run's scenario_end instants, in order), which its
    window reaches: the scenario still shows the cancel past the grace (the probe admitted, the KV drop, a leaked
    request running out). -inf for a watched cancel: no scenario."""
    i = bisect_left(ends, t_stop_s)
    return ends[i] if i < len(ends) else -math.inf


def due(t_stop_s: float, grace_s: float, now_s: float, extra_s: float = 0.0) -> bool:
    """Whether a cancel stopped at `t_stop_s` can be judged at `now_s` (its window is all recorded)."""
    return now_s >= window_of(t_stop_s, grace_s, extra_s)[1]


def judge_cancels(window: Run, request_ids: set[str], grace_s: float,
                  seen_leaving: dict[str, float] | None = None) -> list[CancelVerdict]:
    """The verdicts of the cancels `request_ids` in `window`. The window's other stops stay in it (judged
    before, or not yet due): each says how long its request may have stayed in the engine, which the
    ledger's count beside these cancels rests on. `seen_leaving`: when the verdicts judged before saw their
    requests leave the engine (left_scheduler), which the window's samples may start after."""
    if seen_leaving:
        window.info[SEEN_LEAVING] = dict(seen_leaving)
    return judge_run(window, grace_s, only=set(request_ids))


def left_seen(verdicts: list[CancelVerdict]) -> dict[str, float]:
    """Request id -> when its verdict saw it leave the engine, for the windows judged after it."""
    return {v.request_id: t for v in verdicts if (t := left_seen_at(v)) is not None}
