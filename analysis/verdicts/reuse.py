"""When a watched cancel's freed capacity was handed out again. A watch sends no probe of its own: its fifth
timepoint (`reusable`) stands on a request of the watched traffic that was queued behind the cancel while the engine
was full, and got in once the cancel left. Only where nothing else could have made the room: no request waited, or
another left the engine in the meantime (an end of the engine's own, another client's close), and the fifth point
stays open with that reason."""

from __future__ import annotations

import math

import numpy as np

from analysis.verdicts.core import CancelVerdict
from analysis.verdicts.vllm_case import VllmCase

# a watch's cancel with no such request: what keeps the fifth timepoint open
NOT_LEFT = "it was not seen to leave the scheduler: no freed capacity to hand out"
NONE_WAITING = ("no request was waiting for the engine when it left ({waiting} waiting at the sample before): a watch "
                "sends no probe, so when its freed capacity was handed out again is not measured")
NONE_GOT_IN = ("the first watched request waiting behind it did not get its first token between its leaving and the "
               "grace's end")
OTHERS_LEFT = ("request {queued} waited and got in {ms:.0f} ms after the stop, but {others} left the engine in the "
               "meantime: whose place it took is not known")
QUEUED = "request {queued} waited behind it ({waiting} waiting) and got its first token {ms:.0f} ms after the stop"


def queued_behind(c: VllmCase, v: CancelVerdict) -> None:
    """A watch's cancel: `reusable` at the first token of the first request that waited behind it (the scheduler's
    waiting count W above zero at the last sample it was in; the last W watched requests sent and open by then
    waited, and the first of them is let in first) where that came after it left and within the grace; where another request left the engine between that sample and its first token (the
    engine's own end counter rose, or another client's request closed), which place it took is not known."""
    times, t_left = c.sched["t_s"], v.timepoints.get("left_scheduler")
    if t_left is None:
        return _open(v, NOT_LEFT)
    i_left = int(np.searchsorted(times, t_left, side="left"))
    if i_left == 0 or i_left >= len(times):
        return _open(v, NOT_LEFT)
    i_in = i_left - 1  # the last sample it was still in
    waiting = float(c.sched["waiting"][i_in])
    if not waiting >= 1:
        return _open(v, NONE_WAITING.format(waiting="no count" if math.isnan(waiting) else f"{waiting:.0f}"))
    r, t_in, since = c.reqs, float(times[i_in]), max(float(times[i_in]), c.t_abort or -math.inf)
    # vLLM admits first come, first served: the waiting ones are the last sent of those open at the sample
    with np.errstate(invalid="ignore"):
        open_then = np.nonzero((r.ids != c.rid) & (r.sent <= t_in) & ~(r.closed <= t_in))[0]
    waiters = open_then[np.argsort(r.sent[open_then], kind="stable")][-int(waiting):]
    if not len(waiters):
        return _open(v, NONE_GOT_IN)
    k = int(waiters[0])  # the first of them to be let in
    t_first, queued = float(r.first[k]), str(r.ids[k])
    if not since < t_first <= t_left + c.grace_s:
        return _open(v, NONE_GOT_IN)
    ms = 1000 * (t_first - c.t_stop)
    fin = c.sched["finished"]
    j = int(np.searchsorted(times, t_first, side="left"))
    own_ends = float(fin[min(j, len(times) - 1)] - fin[i_in])
    with np.errstate(invalid="ignore"):
        closed = (r.ids != c.rid) & (r.closed > times[i_in]) & (r.closed < t_first)
    # an engine that does not count its ends (vllm:request_success_total) may have ended one: as good as one
    ends = "an end of the engine's own" if own_ends > 0 else "an end its counter did not read" if own_ends != 0 else None
    others = [*([ends] if ends else []), *[str(x) for x in r.ids[closed]]]
    if j >= len(times) or others:
        return _open(v, OTHERS_LEFT.format(queued=queued, ms=ms, others=", ".join(others) or "(no sample after)"))
    v.timepoints["reusable"] = t_first
    v.sources["reusable"] = {"source": "queued", "reason": QUEUED.format(queued=queued, waiting=f"{waiting:.0f}",
                                                                         ms=ms)}


def _open(v: CancelVerdict, why: str) -> None:
    v.sources["reusable"] = {"source": None, "reason": why}
