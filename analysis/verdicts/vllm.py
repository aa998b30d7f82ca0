"""vLLM's evidence rules: reconcile what the client knows (the ledger) with what the scheduler reports.

Timepoints of a cancel, in seconds since the run started, each with the source it rests on:
  user_stop      the client's action (client; in timeout mode, the moment its timeout fired)
  app_received   the relay app saw the cancel for the id it issued (relay), an app reported seeing its client
                 leave (app: analysis/page_stops.py), or the tap in front of an app saw its connection close (tap);
                 null on paths with no app
  engine_abort   the engine's own `Aborted request` log line for this id (engine_log), or the relay's
                 abort() returning (relay); null without an engine log. Never a client stamp.
  left_scheduler first refreshed sample at or after the abort where the server's running+waiting is no
                 more than the ledger's in-flight requests and, for a request the gauges counted while
                 it held KV, KV usage is below its level at the stop (samples)
  reusable       the probe's first token: the freed capacity was handed out again (client); in a watch, the
                 first token of a request queued behind it (queued: analysis/verdicts/reuse.py)

Verdicts: released (left_scheduler within the grace window after the abort); leaked (the engine log
shows no abort while the request stayed in the engine after the stop, even when it then ran to its
natural end inside the grace, or the abort came only after the grace, or, without a log, the server
still counts more than the ledger after the grace while the engine keeps stepping); stale_gauge (the
same, but generation_tokens_total is flat: gauges pinned between steps); inconclusive (the engine had
already finished the request or a race at its last tokens, other traffic anywhere in the window, too
few samples, no samples across the grace, an engine restart in the window).
The ledger counts a request in the server from its send (its Added line, where the log names it) to
its client's close; a request the client completed ends earlier where the engine's evidence says the
engine was done with it while its client still read (engine_done.py): a slow reader beside a lost
cancel must not stand in for the request the engine kept.
Never judged by request_success_total{finished_reason="abort"}:
vLLM does not count client disconnects there.

The shared guards (core.GUARDS) come first; EVIDENCE_RULES are this family's rungs after them.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd

from cancelwatch.analysis.bounds import JUDGE_PASSES, SURPLUS_HOLD_S, WHOLE
from cancelwatch.analysis.rows import event_rows, ledger_dicts, ledger_rows
from cancelwatch.analysis.verdicts.core import (
    CancelVerdict, LOG_SLACK_S, NO_REQUESTS, SEEN_LEAVING, climb, judge, ledger_by_scenario, left_seen_at
)
from cancelwatch.analysis.verdicts.paid_tokens import tokens_after_left
from cancelwatch.analysis.verdicts.requests import in_between
from cancelwatch.analysis.verdicts.reuse import queued_behind
from cancelwatch.analysis.verdicts.vllm_case import VllmCase, _case, _three_without
from cancelwatch.analysis.verdicts.vllm_frames import _RunFrames
from cancelwatch.analysis.verdicts.vllm_log import NAMES_NO_REQUESTS, _app_answers
from cancelwatch.runstore.reader import Run
from cancelwatch.runstore.records import WATCHED_SCENARIO

VLLM = "vllm"


def judge_vllm(run: Run, grace_s: float, metrics_target: str | None = None,
               only: set[str] | None = None) -> list[CancelVerdict]:
    """One verdict per cancel of a vLLM run, judged against the scheduler of `metrics_target` (default:
    the target each stop names, else the run's first). `only`: judge these cancels, and the ones with no abort
    (their leaving is what the others' frames read, below), and leave out the rest: a cancel the log or the relay
    saw aborted changes no other one's frame."""
    ledger = run.ledger
    if ledger.empty or not event_rows(run, "user_stop"):
        return []
    # a request whose cancel never reached the engine stays the ledger's until its scenario ends (or the engine is
    # idle): where its own verdict saw it leave, every other cancel is judged again with it gone then. Seen under
    # AIPerf behind a proxy that passes no cancel on: three leaked requests ran out 0.6 s after their stops and the
    # ledger held them for the rest of the watch, so every later cancel read as `already_finished`. A later cancel's
    # leaving can decide an earlier one too (a review built one: an earlier lost request read as a leak only once a
    # later one was seen gone), so the run is judged again, its frames made anew, while its verdicts see more leave
    seen: dict[str, float] = dict(run.info.get(SEEN_LEAVING) or {})
    frames = _RunFrames(run, metrics_target, seen)
    for i in range(JUDGE_PASSES):
        if i:
            frames.told(seen)
        out = _judge_all(run, grace_s, frames, only)
        left = {v.request_id: t for v in out if v.request_id in frames.unaborted and (t := left_seen_at(v)) is not None}
        more = {rid: t for rid, t in left.items() if t < seen.get(rid, math.inf)}
        if not more:
            break
        seen.update(more)
    return out


def _judge_all(run: Run, grace_s: float, frames: _RunFrames, only: set[str] | None = None) -> list[CancelVerdict]:
    t0, ledger = run.info["started_mono_ns"], run.ledger
    stops, trace, englog, target_of, frame_for = (frames.stops, frames.trace, frames.englog, frames.target_of,
                                                  frames.frame)
    answers = _app_answers(run)
    missed = {r.request_id: json.loads(r.data) for r in event_rows(run, "trigger_missed")}

    # the judged requests' rows as dicts (the rules read them by column name); every row's scenario
    judged = [stop for stop in stops if only is None or stop.request_id in only or stop.request_id in frames.unaborted]
    rows = ledger_dicts(run, [stop.request_id for stop in judged])
    scenario_of = {r.request_id: r.scenario for r in ledger_rows(run)} if "scenario" in ledger else {}
    by_scenario = ledger_by_scenario(ledger)
    out = []
    for stop in judged:
        data = json.loads(stop.data)
        rid, scenario, target = stop.request_id, data.get("scenario"), target_of(data)
        case = _case(run, frame_for(target), englog, trace, by_scenario.get(scenario, NO_REQUESTS), data=data,
                     rid=rid, target=target, lrow=rows.get(rid), t_stop=float(stop.t_s), grace_s=grace_s, t0=t0,
                     missed=missed.get(rid), gone_until=frame_for(target).gone.get(rid, math.inf))
        case.app_answer = answers.get(data.get("cancel_id"))
        lagged = sorted(r for r in englog.ended_early.get(target, {}) if scenario_of.get(r) == scenario)
        case.ev.lagging_clients = lagged or None
        case.ev.log_named_as = englog.ids.renamed_as(target, rid)
        verdict = judge(case, EVIDENCE_RULES)
        if scenario == WATCHED_SCENARIO:  # no probe: a request queued behind it shows the capacity handed out
            queued_behind(case, verdict)
        if verdict.verdict == "leaked":  # what the leak cost: the tokens made for nobody
            paid_for_nobody(case)
        out.append(verdict)
        left = left_seen_at(verdict)
        if left is not None and rid in frames.unaborted:
            frames.seen_leaving(target, rid, left, case.n)
    return out


def paid_for_nobody(c: VllmCase) -> None:
    """A leaked request's tokens after its client left (analysis/verdicts/paid_tokens.py): from the stop, or
    its entry when the engine took it later; to the sample that shows it gone, or its abort when one came
    (late) and no sample did. A request sent again has no cap: the copy could make its whole length again."""
    times = c.sched["t_s"]
    firsts = c.entries if c.has_log else []
    # a copy sent again runs from its own entry; an abort logged while the request ran on ends nothing
    later = [t for t in firsts if t >= c.t_stop] if c.ev.rule == "resubmitted_after_stop" else firsts[:1]
    t_from = max([c.t_stop, *later[:1]])
    t_left = c.tp["left_scheduler"]
    if t_left is None and c.ev.rule == "abort_after_grace":
        t_left = c.t_abort
    c.ev.tokens_after_client_left, c.ev.tokens_after_client_left_is = tokens_after_left(
        times, c.sched["count"], c.sched["gen_tokens"], c.without, n=c.n, t_from=t_from, t_left=t_left,
        remaining=None if c.ev.rule == "resubmitted_after_stop" else c.remaining)


# ------------------------------------------------------------------------------------------ the rules
def without_abort(c: VllmCase) -> CancelVerdict | None:
    """The engine's log was read and names no abort of this request after its stop: either the engine
    no longer held it (it finished first, or never got it), or the cancel never reached the engine."""
    if not c.has_log or c.t_abort is not None:
        return None
    c.note_race()
    return climb(c, (names_no_requests, never_added, aborted_first, entered_after_stop, left_on_its_own_or_stayed))


def names_no_requests(c: VllmCase) -> CancelVerdict | None:
    if c.englog.names_requests(c.target):
        return None
    # no line for any request: its silence says nothing of this one (the cancel is not "lost")
    c.sources["engine_abort"] = (None, NAMES_NO_REQUESTS)
    return c.verdict("log_names_no_requests")


def never_added(c: VllmCase) -> CancelVerdict | None:
    if c.englog.was_added(c.target, c.rid):
        return None
    untold = c.englog.ids.untold(c.target, c.rid)
    return c.verdict("renamed_untold", lines=untold) if untold else c.verdict("never_added")


def aborted_first(c: VllmCase) -> CancelVerdict | None:
    slack = max(LOG_SLACK_S, c.englog.resolution_of(c.target, c.rid))
    early = [x for x in c.englog.aborted.get((c.target, c.rid), []) if x < c.t_stop - slack]
    if early and c.ahead:
        # the engine ended it itself before the client's stop (an error in the stream, another cancel)
        return c.verdict("aborted_before_stop", before_ms=1000 * (c.t_stop - max(early)))
    return None


def entered_after_stop(c: VllmCase) -> CancelVerdict | None:
    """The engine's log has the request entering only after its stop, and no abort: a hop held it (a queue, a
    frozen gateway) and sent it on after the client left. The server counting fewer than the ledger at the
    stop is then a request not yet there, never one already finished; when it left is read from its entry on."""
    firsts = c.entries
    if not firsts or firsts[0] < c.t_stop + max(LOG_SLACK_S, c.englog.resolution_of(c.target, c.rid)):
        return None
    if c.run.ledger["request_id"].astype(str).str.startswith(f"{c.rid}~").any():
        return None  # the client sent this id again (the watch's `id~xxxxxx` row): the line may be the other's
    times, t_in = c.sched["t_s"], firsts[0]
    still_all = c.sched["count"] > c.without + WHOLE
    # a sample with another request entering shows nothing of this one leaving (VllmCase.entering)
    after = np.nonzero((times >= t_in) & ~np.isnan(c.sched["count"]) & (still_all | ~c.entering))[0]
    still = still_all[after]
    counted = np.nonzero(still)[0]
    if not len(counted):
        return None  # the server never counted it beyond the ledger: no sample shows it ran
    # left at the first of three samples in a row without it, once it was counted; it stayed from its entry
    gone = np.nonzero(_three_without(still) & (np.arange(len(still)) > counted[0]))[0]
    if len(gone):
        c.tp["left_scheduler"] = float(times[after[gone[0]]])
        c.ev.kept_running_ms = round((c.tp["left_scheduler"] - t_in) * 1000, 1)
    c.ev.note = "the engine's log has this request entering only after its stop"
    return c.verdict("entered_after_stop", after_s=t_in - c.t_stop)


def left_on_its_own_or_stayed(c: VllmCase) -> CancelVerdict:
    """No abort: when the request left the engine after the stop, by the samples that count it."""
    times, without = c.sched["t_s"], c.without
    still_all = c.sched["count"] > without + WHOLE
    # a count at the ledger's with other stopped requests beside it (VllmCase.stopped_beside) shows one of them
    # gone, not that this one is: gone for sure only where it is lower than the ledger's without any of them
    which = ~still_all & (c.sched["count"] > without - np.minimum(c.stopped_beside, without) + WHOLE)
    # a sample with another request entering shows nothing of this one leaving (VllmCase.entering): read as
    # gone there, a request sent after the stop and not yet counted made one that ran on read as gone
    refreshed_after = np.nonzero((times >= c.t_stop) & c.moved & (still_all | ~c.entering) & ~which)[0]
    if not len(refreshed_after):
        return c.verdict("already_finished" if c.ahead else "no_refresh_after_stop")
    still = still_all[refreshed_after]
    run3 = _three_without(still)
    if c.ahead:
        # the gauges did not count it at the stop (finished, or not yet counted: a long prefill step):
        # only the engine counting it after the stop shows it was still there
        first = np.nonzero(still & (times[refreshed_after] <= c.t_stop + c.grace_s))[0]
        if not len(first):
            return _ran_out(c, None) if c.ev.race else c.verdict("already_finished")
        refreshed_after, still = refreshed_after[first[0]:], still[first[0]:]
        run3 = _three_without(still)
    elif not still[0] and run3[0] and not c.ev.race:
        return c.verdict("finished_on_its_own")
    gone = refreshed_after[run3]
    if not len(gone):
        return c.verdict("no_abort_still_there", after_s=times[refreshed_after[-1]] - c.t_stop)
    c.tp["left_scheduler"] = float(times[gone[0]])
    seen_still = refreshed_after[still & (refreshed_after < gone[0])]
    t_still = float(times[seen_still[-1]]) if len(seen_still) else c.t_stop
    # where the ledger took a lost request out at a fall of the count (_gone_by_surplus: the oldest), this one
    # or another, which left there is an assumption: it was surely there only up to the first such fall
    falls = {rid: t for rid, t in c.assumed_gone.items() if c.t_stop < t <= times[gone[0]]}
    if falls and not c.ev.race:
        first = min(falls.values())
        sure = refreshed_after[still & (times[refreshed_after] < first)]
        t_sure = float(times[sure[-1]]) if len(sure) else c.t_stop
        beside = c.stopped_beside[(times >= c.t_stop) & (times <= first)]
        others = max(len(set(falls) - {c.rid}), int(beside.max()) if len(beside) else 0, 1)
        c.ev.kept_running_ms = round((t_sure - c.t_stop) * 1000, 1)
        if c.rid in falls:  # the oldest: taken out at that fall
            c.tp["left_scheduler"] = falls[c.rid]
        return c.verdict("no_abort_left_oldest_first", still_s=t_sure - c.t_stop, others=others,
                         by_s=c.tp["left_scheduler"] - c.t_stop)
    unsure = np.nonzero(which & (times > t_still) & (times < times[gone[0]]))[0]
    if len(unsure) and not c.ev.race:
        # the count fell while others whose cancels were lost were in the engine too: this one left between the
        # last sample that still held it and the first that shows it gone for sure; kept_running_ms is the least
        c.ev.kept_running_ms = round((t_still - c.t_stop) * 1000, 1)
        return c.verdict("no_abort_left_among_others", still_s=t_still - c.t_stop,
                         others=int(c.stopped_beside[unsure].max()), by_s=times[gone[0]] - c.t_stop)
    if c.ev.race:
        # a few tokens before the end, a request that ran them out looks the same whether the cancel
        # was lost or only too late: neither can be shown
        return _ran_out(c, float(times[gone[0]]))
    c.ev.kept_running_ms = round((times[gone[0]] - c.t_stop) * 1000, 1)
    return c.verdict("no_abort_ran_to_end", kept_ms=c.ev.kept_running_ms)


def _ran_out(c: VllmCase, t_gone: float | None) -> CancelVerdict:
    """A request stopped within its last tokens that left with no abort in the log ran them out: the completion
    won the race, whether the samples saw it gone before the stop (the engine ran ahead of its client), at the
    first sample after it, or later. A lost cancel and one that came too late look the same there."""
    if t_gone is None:
        left = "before the stop: the engine had finished it while its last tokens were on their way to the client"
    else:
        left = f"gone from the engine {1000 * (t_gone - c.t_stop):.0f} ms after the stop"
    return c.verdict("ran_out_its_last_tokens", remaining=c.remaining, left=left)


def ran_ahead_without_log(c: VllmCase) -> CancelVerdict | None:
    """No abort known, and the engine counted fewer requests than the ledger before the stop: one of them had
    finished in the engine while its tokens were still on their way, maybe this one. Where the count holds more
    than the ledger's others where the grace ends, with the engine stepping (what `held` reads a leak by), this
    one was there after the stop whatever ran ahead before it: the later rules judge it (seen behind a proxy
    that passed no cancel on, no request log: a slow reader's request finished ahead of its client, and every
    leaked request stopped beside it read as already finished)."""
    if not c.ahead or c.t_abort is not None:
        return None
    kept = c.kept_at_grace_end
    if kept.stepping and kept.value is not None and kept.value > 0:
        return None
    c.note_race()
    return c.verdict("already_finished_no_log")


def no_baseline(c: VllmCase) -> CancelVerdict | None:
    # no baseline: what the request held, and so what its release must give back, is unknown
    return None if c.baseline.before.any() else c.verdict("no_baseline")


def released(c: VllmCase) -> CancelVerdict | None:
    """The first refreshed sample from the abort on where the count is reconciled to the end of the grace
    and KV usage fell (for a request that held KV): released when within the grace."""
    sched, ev, t_ref = c.sched, c.ev, c.t_ref
    times = sched["t_s"]
    after = np.nonzero(times >= t_ref)[0]
    needs_kv_drop, below, waivers = _kv_given_back(c)
    drop = after[below[after]]
    ev.kv_drop_s = float(times[drop[0]]) if len(drop) else None
    # another request's end after the engine's last step is not in its gauges yet (VllmCase.ended_unseen); a
    # request the engine ended that the ledger still counts is not in them either (finished_unseen)
    # with no abort known (no request log, no relay), the count is all there is: the other stopped requests with
    # no abort are the ledger's only as the count's surplus holds them, oldest first (the frame's reading), and
    # which of them a fall took out is not this one's evidence
    lost_beside = c.stopped_beside if c.t_abort is None else 0.0
    bound = c.without - lost_beside + c.ended_unseen - c.ended_unread_most
    count_ok_all = sched["count"] <= bound + WHOLE
    grace_end = int(np.searchsorted(times, t_ref + c.grace_s, side="right"))
    # the count must stay reconciled to the end of the grace: a probe sent right after the abort
    # can stand in for a request that never left until the server counts the probe too. Reconciled at a sample only
    # by the ends after the engine's last step is reconciled where the step after them bears it out, at every
    # sample to the grace's end (a slow reader's close at the grace's end is such an end: its request long out of
    # the engine, the count holding this one in its place)
    count_ok = count_ok_all & c.confirmed_past_ended_unseen(count_ok_all, bound)
    if grace_end:
        count_ok[:grace_end] = np.logical_and.accumulate(count_ok[:grace_end][::-1])[::-1]
    if c.t_abort is None:
        # and where it leaves: within the requests the engine surely counts there, one sent a moment before not
        # counted yet, and the room it leaves not this one's (seen through a proxy that passed no cancel on, no
        # request log: lost requests queued and new ones not yet counted, a count at the ledger's read as a
        # release)
        count_ok &= sched["count"] <= bound - c.others_entering + WHOLE
    kv_ok = np.logical_or.reduce([below, *waivers.values()]) if needs_kv_drop else np.ones(len(times), dtype=bool)
    hits = after[(count_ok & kv_ok & c.moved)[after]]
    if not len(hits):
        return None
    left = int(hits[0])
    c.tp["left_scheduler"] = float(times[left])
    if times[left] - t_ref > c.grace_s:
        return None
    ran_out = c.may_have_run_out_by(float(times[left]))
    if ran_out:
        c.note_race()
        ended = None if c.ev.race else c.ended_by_itself()
        if ended is not None:  # its own end, with no abort before it: the cancel never reached the engine
            c.tp["left_scheduler"] = ended.pop("t_left")
            c.ev.kept_running_ms = round(ended["still_s"] * 1000, 1)
            return c.verdict("ended_by_itself_after_stop", **ended)
    if not below[left] and needs_kv_drop:
        ev.kv_drop_waived = next(name for name, shown in waivers.items() if shown[left])
    if not below[left] and c.others_unseen[left] - c.others_entering[left] > WHOLE:
        # the count read as the others' holds requests none of whose tokens had reached a client, past ENTER_S + LAG_S
        # from their send, and KV usage says nothing: a hop holding one of them longer leaves its room to this one
        c.assumed.add("counted_once_sent")
    _note_release(c, left, bound[left], int(left - after[0]) + 1)
    if ran_out:
        return c.verdict("gone_may_have_run_out", after_s=float(times[left]) - c.t_stop, tokens=ran_out)
    return c.verdict("released")


def _kv_given_back(c: VllmCase) -> tuple[bool, np.ndarray, dict[str, np.ndarray]]:
    """Whether the request must show its KV given back, per sample whether KV usage is below its level at the
    baseline, and what stands for that drop where it does not show (the waivers, each per sample). A request the
    gauges counted at the stop held KV there, and must give it back; one they never counted (the engine was mid-step
    when it came and went) shows its release by the count alone. The probe taking blocks does not excuse a KV usage
    that never fell, only what shows its blocks went back all the same."""
    kv_before, times = c.baseline.kv_before, c.sched["t_s"]
    needs = (c.phase in ("prefill", "decode", "in_flight") and not math.isnan(kv_before) and not c.ahead
             and not c.waiting_at_stop and not c.kv_waived)
    c.ev.kv_drop_waived = c.kv_waived
    below = c.sched["kv"] < kv_before if not math.isnan(kv_before) else np.zeros(len(times), dtype=bool)
    waivers = {"taken_in_its_place": c.taken_in_its_place(kv_before),
               "blocks_of_the_running": c.blocks_of_the_running, "seat_taken": c.seat_taken} if needs else {}
    return needs, below, waivers


def _note_release(c: VllmCase, left: int, bound: float, samples: int) -> None:
    """What the sample that shows the release read, in the evidence."""
    ev, sched = c.ev, c.sched
    ev.count_after = float(sched["count"][left])
    ev.ledger_after = float(c.without[left])
    ev.count_reading = c.count_reading(left, bound)
    ev.kv_after = float(sched["kv"][left])
    ev.release_ms = round((float(sched["t_s"][left]) - c.t_ref) * 1000, 1)
    ev.samples_to_release = samples
    if c.tp["reusable"] is None:
        ev.probe = "not admitted"


def no_samples_in_grace(c: VllmCase) -> CancelVerdict | None:
    # a scrape outage across the grace: neither a leak nor a stale gauge can be told from nothing
    n = int(c.in_grace.sum())
    return c.verdict("no_samples_in_grace", samples=n, grace_s=c.grace_s) if n < 2 else None


def held(c: VllmCase) -> CancelVerdict:
    """Not released, with samples across the grace: the server's excess over the ledger, and whether the
    engine kept stepping, tell a leak from gauges no step refreshed."""
    sched, ev, in_grace = c.sched, c.ev, c.in_grace
    kept = c.kept_at_grace_end
    excess, at_end, i, stepping = kept.excess, kept.at_end, kept.read_at, kept.stepping
    ev.excess_max = float(excess.max()) if len(excess) else None
    ev.excess_at_grace_end = kept.value
    if len(excess):
        ev.count_reading = c.count_reading(kept.i, c.without[kept.i] + c.ended_unseen[kept.i])
    ev.engine_stepping = bool(stepping)
    ev.generation_tokens_delta = kept.generated
    if not len(excess) or ev.excess_at_grace_end <= 0:
        ev.gauges_refreshed = bool(c.moved[in_grace].any())
        if not ev.gauges_refreshed:
            return c.verdict("gauges_not_refreshed")
        # the count at the ledger's only with requests the engine had ended and the ledger still counts
        hidden = c.ended_unread_most[in_grace]
        if len(hidden) and (excess + hidden)[at_end] > 0:
            return c.verdict("finished_unseen", unread=int(hidden.max()))
        return c.verdict("kv_did_not_fall")
    if c.t_log_abort is not None:
        # the log names every request (no foreign id in the window) and this one's abort: an excess
        # that stays is the engine keeping a request it was told to drop
        return c.verdict("abort_logged_still_generating" if stepping else "abort_logged_gauges_stale")
    # other stopped requests with no abort that the frame took out of the ledger at a fall of the count, oldest
    # first (_gone_by_surplus), may be the ones still counted in this one's place: a leak read past them rests on
    # that reading, and says so
    # (those the frame let go inside this cancel's stretch: an older one it let go before is no more this one's
    # evidence than the requests its window does not hold)
    t_i, t_0 = float(sched["t_s"][i]), float(sched["t_s"][0])
    assumed = sorted(rid for rid, t in c.assumed_gone.items() if rid != c.rid and t_0 <= t <= t_i)
    if stepping and c.t_abort is None and assumed and ev.excess_at_grace_end <= len(assumed):
        reading = ev.count_reading
        reading["others_most"] += len(assumed)
        reading["open"] += [{"request_id": str(r), "reason": "assumed_left_oldest_first"} for r in assumed]
        # oldest first is how requests of one length end by themselves: only where the engine's own ends
        # (vllm:request_success_total, which counts no abort) number those falls. A fall the counter does not show
        # was an abort, and whose nothing says (the older one lost and kept, this one's cancel through)
        # from a hold before the first of them went: the frame lets one go from the start of the hold that showed
        # it gone, which can come a sample after the fall that took it
        ends = c.own_ends_between(min(c.assumed_gone[r] for r in assumed) - SURPLUS_HOLD_S, t_i)
        # where the engine ran ahead of the ledger before the stop, one of those ends may be this one's own: the
        # request the count was short of (seen built: its end, before its stop, read as the lost one's leaving)
        mine = c.n if c.ahead else 0
        if ends is None or ends < len(assumed) + mine - WHOLE:
            return c.verdict("counted_beside_lost", others=len(assumed))
        return c.verdict("still_counted_oldest_first", others=len(assumed))
    return c.verdict("still_counted_generating" if stepping else "gauges_stale")


def resubmitted(c: VllmCase) -> CancelVerdict | None:
    """The engine's log names the request entering again after the stop: something on the path sent it
    once more after its client left (a gateway retrying upstream), and the engine ran it for nobody."""
    if not c.has_log:
        return None
    # a second engine request under the client's id, entering from the stop on (the first is the one
    # cancelled; a copy sent again by a gateway gets an engine id of its own)
    firsts = c.entries
    again = [t for t in firsts[1:] if t >= c.t_stop - max(LOG_SLACK_S, c.englog.resolution_of(c.target, c.rid))]
    if not again:
        return None
    c.ev.note = "a second 'Added request' line for this id after the stop: the request was sent again"
    return c.verdict("resubmitted_after_stop", after_s=min(again) - c.t_stop)


def beside_traffic(c: VllmCase) -> CancelVerdict | None:
    """Requests the ledger does not know entered the engine in the window (its log names them): the
    server's count holds them too, and the rules below would read them as this one. Judged only on what
    that traffic cannot move: the count at or under the ledger's (so this request is not in it), or a
    lost cancel whose request could not have ended by the end of the grace at the engine's fastest."""
    if not c.foreign_logged:
        return None
    if c.t_abort is None:
        return never_added(c) or _lost_beside_traffic(c)
    if c.ahead:
        # the server counted fewer than the ledger before the stop: a request the ledger holds had left
        # (its client lagging), and could stand in for this one in a count at the ledger's
        return c.verdict("other_traffic_logged", requests=c.foreign_logged)
    times, sched = c.sched["t_s"], c.sched
    window = (times >= c.t_abort) & (times <= c.t_abort + c.grace_s) & c.moved
    hits = np.nonzero(window & ~c.entering & ~_may_stand_in(c) & (sched["count"] <= c.without + WHOLE))[0]
    if not len(hits):
        return c.verdict("other_traffic_logged", requests=c.foreign_logged)
    left = int(hits[0])
    c.tp["left_scheduler"] = float(times[left])
    c.ev.count_after, c.ev.ledger_after = float(sched["count"][left]), float(c.without[left])
    c.ev.count_reading = c.count_reading(left, c.without[left])
    c.ev.release_ms = round((times[left] - c.t_abort) * 1000, 1)
    return c.verdict("released_beside_traffic", requests=c.foreign_logged, after_ms=c.ev.release_ms)


def _may_stand_in(c: VllmCase) -> np.ndarray:
    """Per sample of the case's stretch: a request the ledger still holds may have left the engine
    already, and a count at the ledger's could then hold this one in its place: a cancelled one with no
    abort line, or one its client completed that, at the fastest a sequence runs (alone, a quarter
    added), could have ended by then (a lagging client). Everywhere, where that rate is unknown."""
    times, r = c.sched["t_s"], c.reqs
    rate = c.pace
    sent = ~np.isnan(r.sent) & (r.ids != c.rid)
    t_in = np.where(np.isnan(c.added_s), r.sent, c.added_s)
    # a cancelled one with no abort line: from its cancel, while the ledger holds it
    lost = sent & ~np.isnan(r.cancel) & ~np.isfinite(c.aborted_s)
    lo, hi = np.maximum(t_in, r.cancel), r.ends(c.ledger_ends, fallback=np.full(len(r.ids), math.inf))
    # any other not cancelled: from where it could have run out, to its client's close
    read = sent & np.isnan(r.cancel)
    with np.errstate(invalid="ignore"):
        runs = t_in + r.max_tokens / rate if rate else t_in
        timed = read & (r.max_tokens > 0)
    lo = np.where(read, np.where(timed, runs, t_in), lo)
    hi = np.where(read, np.nan_to_num(r.closed, nan=math.inf), hi)
    keep = lost | read
    if len(times):
        keep &= (lo <= times[-1]) & (hi > times[0])
    return in_between(times, lo[keep], hi[keep]).any(axis=0)


def _lost_beside_traffic(c: VllmCase) -> CancelVerdict:
    """No abort, the request entered: still in the engine at the end of the grace if, made at the
    rate of one sequence running alone (no sequence is faster; a quarter added), its tokens take longer
    than from its entry to the end of the grace. Other traffic cannot make that rate look slower."""
    tokens = None if c.lrow is None or pd.isna(c.lrow.get("max_tokens")) else int(c.lrow["max_tokens"])
    if c.pace is None or not tokens:
        return c.verdict("other_traffic_logged", requests=c.foreign_logged)
    rate = c.pace
    t_in = min(c.englog.added[(c.target, c.rid)])
    finish_s = t_in + tokens / rate - c.t_stop
    if finish_s <= c.grace_s + max(LOG_SLACK_S, c.englog.resolution_of(c.target, c.rid)):
        return c.verdict("other_traffic_logged", requests=c.foreign_logged)
    c.assumed.add("no_faster_than_the_pace_margin")
    return c.verdict("no_abort_beside_traffic", rate=rate, tokens=tokens, finish_s=finish_s,
                     requests=c.foreign_logged)


# after the shared guards, in order; the last always gives a verdict
EVIDENCE_RULES = (resubmitted, beside_traffic, without_abort, ran_ahead_without_log, no_baseline, released, no_samples_in_grace,
                  held)
