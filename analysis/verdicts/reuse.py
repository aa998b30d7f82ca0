"""When a watched cancel's freed capacity was handed out again. A watch sends no probe of its own: its fifth
timepoint (`reusable`) stands on a request of the watched traffic that was queued behind the cancel while the engine
was full, and got in once the cancel left. Where nothing shows that (no request waited, the engine stepped without
shown to be full, the cancel was itself waiting, another request left the engine in the meantime: an end of the
engine's own, another cancel's abort), the fifth point stays open with that reason."""

from __future__ import annotations

import math

import numpy as np

from cancelwatch.analysis.bounds import FULL_STEPS, WHOLE
from cancelwatch.analysis.verdicts.core import CancelVerdict
from cancelwatch.analysis.verdicts.vllm_case import VllmCase

NOT_LEFT = "it was not seen to leave the scheduler: no freed capacity to hand out"
NONE_WAITING = ("no request was waiting for the engine when it left ({waiting} waiting at the sample before): a watch "
                "sends no probe, so when its freed capacity was handed out again is not measured")
ITSELF_WAITING = "it was itself waiting for the engine when it left: it held no place to hand out"
NOT_FULL = ("request {queued} was seen waiting {ms:.0f} ms with the engine stepping {steps} time(s): too briefly to "
            "show the engine was full")
NONE_GOT_IN = ("request {queued}, the first waiting behind it, did not get its first token between its leaving and "
               "the grace's end")
OTHERS_LEFT = ("request {queued} waited and got in {ms:.0f} ms after the stop, but {others} left the engine in the "
               "meantime: whose place it took is not known")
NO_SAMPLE_AFTER = "request {queued} got in {ms:.0f} ms after the stop, but no sample after it shows what else left"
QUEUED = "request {queued} waited behind it ({waiting} waiting) and got its first token {ms:.0f} ms after the stop"


def queued_behind(c: VllmCase, v: CancelVerdict) -> None:
    """A watch's cancel: `reusable` at the first token of the oldest request waiting at the last sample that surely
    held it (VllmCase.waiters_at), where that request stayed waiting while the engine stepped (the engine was full),
    got in after the cancel left and within the grace, and nothing else left the engine in the meantime."""
    times, t_left = c.sched["t_s"], v.timepoints.get("left_scheduler")
    i_left = len(times) if t_left is None else int(np.searchsorted(times, t_left, side="left"))
    if t_left is None or not 0 < i_left < len(times):
        return _open(v, NOT_LEFT)
    # the last sample it was surely still in: before its abort (else its stop), and before the sample that shows it
    # gone. The release can be read a sample after the step that dropped it (the request let in is counted for sure
    # only once its first token is out), and a sample there holds the queue already let in (seen behind a browser's
    # Stop: the abort, the queued request let in at the next step, the release read a sample later)
    i_in = min(i_left, int(np.searchsorted(times, c.t_ref, side="right"))) - 1
    if i_in < 0:
        i_in = i_left - 1
    waiters = c.waiters_at(i_in)
    r = c.reqs
    if c.rid in {r.ids[k] for k in waiters}:
        return _open(v, ITSELF_WAITING)
    if not waiters:
        w = float(c.sched["waiting"][i_in])
        return _open(v, NONE_WAITING.format(waiting="no count" if math.isnan(w) else f"{w:.0f}"))
    k = waiters[-1]  # the oldest: the next let in
    queued, t_first, sent = str(r.ids[k]), float(r.first[k]), float(r.sent[k])
    ms = 1000 * (t_first - c.t_stop)
    # the unbroken run of samples with a request waiting, up to the last one holding the cancel, from the waiter's
    # send on: a request takes a moment to reach the engine's queue through the hops, and the samples before it
    # did show none waiting
    with np.errstate(invalid="ignore"):
        waiting = c.sched["waiting"][: i_in + 1] >= WHOLE
    first = int(np.searchsorted(times, sent, side="left"))
    gaps = np.nonzero(~waiting[first:])[0]
    start = first + (int(gaps[-1]) + 1 if len(gaps) else 0)
    with np.errstate(invalid="ignore"):
        steps = int((np.diff(c.sched["gen_tokens"][start: i_in + 1]) > 0).sum())
    if start > i_in or steps < FULL_STEPS:
        held = 1000 * (float(times[i_in]) - float(times[min(start, i_in)])) if start <= i_in else 0.0
        return _open(v, NOT_FULL.format(queued=queued, ms=held, steps=steps))
    since = max(float(times[i_in]), c.t_abort if c.t_abort is not None else -math.inf)
    if not since < t_first <= t_left + c.grace_s:
        return _open(v, NONE_GOT_IN.format(queued=queued))
    j = int(np.searchsorted(times, t_first, side="left"))
    if j >= len(times):
        return _open(v, NO_SAMPLE_AFTER.format(queued=queued, ms=ms))
    others = c.others_leaving(k, float(times[i_in]), t_first, j, i_in)
    if others:
        return _open(v, OTHERS_LEFT.format(queued=queued, ms=ms, others=", ".join(others)))
    v.timepoints["reusable"] = t_first
    v.sources["reusable"] = {"source": "queued", "reason": QUEUED.format(
        queued=queued, waiting=f"{float(c.sched['waiting'][i_in]):.0f}", ms=ms)}


def _open(v: CancelVerdict, why: str) -> None:
    v.sources["reusable"] = {"source": None, "reason": why}
