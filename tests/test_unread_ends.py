"""The engine's own ends its clients have not read (VllmCase.ends_unread): a slow reader, or a hop that buffers, keeps
a request in the ledger long after the engine ended it, and a count at the ledger's can then hold a kept request in its
place. An adversarial review built these runs; each is tg kept by the engine to the end, counted and stepping, and the
code before this reading judged every one `released`. Each close reads one end, never two; a close whose end the
look-back holds reads it; another cancel's end that only could have been is no read."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from cancelwatch.analysis.verdicts import judge_run
from tests.test_kv_blocks import NO_HITS, BLOCK, no_abort_run, row
from tests.test_no_log_readings import build, ns, verdict_of
from tests.test_verdicts import build_run, steady_gen


def within(t: float, lo: float, hi: float = 99.0) -> float:
    return float(lo <= t < hi)


def gen_of(count):
    """generation_tokens_total of a run whose running requests make 40 tokens/s each."""
    made = np.cumsum([count(t) * 0.04 for t in np.arange(0, 12, 0.001)])
    return lambda t: 100 + float(made[int(t / 0.001)])


TG = dict(request_id="tg", role="target", sent=0.5, first=0.8, closed=2.001, cancel=2.0, terminal_state="cancelled",
          max_tokens=2000)


def one_close_two_ends(s_end: float, r_end: float, r_closed: float):
    """No request log, no abort known. S, a slow reader, ended at `s_end` (its end counted), its client reading to 5 s;
    R ended at `r_end`, its client closing promptly at `r_closed`; N counted from 1.92 s, its first token at 2.1 s.
    R's one close read both ends (one before the stretch, one in it), the count's shortfall before the stop went to N
    alone, and N made a newcomer in tg's place with KV usage unchanged."""
    count = lambda t: within(t, .1) + within(t, .5) + within(t, .1, s_end) + within(t, .2, r_end) + within(t, 1.92)  # noqa
    return no_abort_run(count, lambda t: count(t) + within(t, .1),
                        [row("S", .1, .3, 5.0, "completed"), row("R", .2, .4, r_closed, "completed"), row("N", 1.9, 2.1)],
                        ends=lambda t: float(t >= s_end) + float(t >= r_end))


def a_close_whose_end_came_before_the_stretch():
    """R2 ended at 0.9 s, before the stretch (from 1.0 s), its client closing at 1.1 s; S, sent at 1.5 s, ended at
    2.3 s (its end counted) and reads to 5 s; tg runs alone after. R2's close read S's end: the count of 1 from 2.3 s
    read as the ledger's others (S), tg out, with KV falling (S's blocks)."""
    count = lambda t: within(t, .1, .9) + within(t, .5) + within(t, 1.52, 2.3)  # noqa: E731
    return verdict_of(build(count, lambda t: .1 * count(t), gen_of(count), lambda t: float(t >= .9) + float(t >= 2.3),
                            [dict(request_id="R2", sent=.1, first=.2, closed=1.1, max_tokens=40), TG,
                             dict(request_id="S", sent=1.5, first=1.6, closed=5.0, max_tokens=40)],
                            [("tg", 2.0, "decode", 50)]))


def another_cancels_end_that_only_could_have_been():
    """C2 (max_tokens unknown) stopped at 2.4 s, its relay abort at 2.45 s taking it out; S ended at 2.3 s (its end
    counted), reading to 5 s; no abort of tg. C2 could have ended by itself before its abort, and that credit took S's
    end: the count of 1 from 2.45 s read as tg gone."""
    count = lambda t: within(t, .5) + within(t, .3, 2.45) + within(t, .2, 2.3)  # noqa: E731
    run = build(count, lambda t: .1 * count(t), gen_of(count), lambda t: float(t >= 2.3),
                [TG, dict(TG, request_id="C2", sent=.3, first=.4, closed=2.401, cancel=2.4, max_tokens=float("nan")),
                 dict(request_id="S", sent=.2, first=.3, closed=5.0, max_tokens=100)],
                [("tg", 2.0, "decode", 50), ("C2", 2.4, "decode", 50)])
    abort = {"request_id": "C2", "kind": "engine_abort", "mono_ns": ns(2.45), "wall_ns": 0, "t_s": 2.45,
             "data": json.dumps({"cancel_id": "c1", "source": "relay"})}
    run.events = pd.concat([run.events, pd.DataFrame([abort])]).sort_values("mono_ns").reset_index(drop=True)
    return verdict_of(run)


def a_relay_abort_with_a_slow_reader_before_the_stop():
    """The relay's abort at 2.002 s, the engine keeping tg all the same; S ended at 0.8 s (its end counted), reading
    to 5 s. The count below the ledger's before the stop (S's end) waived the KV drop, and the count, never moving,
    read as the ledger's others."""
    count = lambda t: within(t, .1) + within(t, .5) + within(t, .1, .8)  # noqa: E731
    run = build_run(count, lambda t: (count(t) + within(t, .1)) * BLOCK, steady_gen,
                    extra_ledger=[row("S", .1, .3, 5.0, "completed")], series=NO_HITS, length_s=5.4,
                    finished=lambda t: float(t >= .8))
    relay = run.events["kind"].isin(["engine_abort", "app_received"])
    run.events.loc[relay, "data"] = run.events.loc[relay, "data"].map(lambda d: json.dumps({**json.loads(d),
                                                                                            "source": "relay"}))
    (v,) = [x for x in judge_run(run) if x.request_id == "tg"]
    return v


CASES = {
    "one_close_read_for_an_end_before_the_stretch_and_one_in_it": (
        lambda: one_close_two_ends(0.8, 1.15, 1.2), ("inconclusive", "already_finished_no_log")),
    "one_close_read_for_its_own_end_and_a_slow_readers": (
        lambda: one_close_two_ends(1.03, 0.98, 1.1), ("inconclusive", "already_finished_no_log")),
    "a_close_whose_end_came_before_the_stretch": (
        a_close_whose_end_came_before_the_stretch, ("inconclusive", "finished_unseen")),
    "another_cancels_end_that_only_could_have_been": (
        another_cancels_end_that_only_could_have_been, ("inconclusive", "finished_unseen")),
    "a_relay_abort_with_a_slow_reader_before_the_stop": (
        a_relay_abort_with_a_slow_reader_before_the_stop, ("inconclusive", "finished_unseen")),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_slow_readers_unread_end_is_no_room_for_a_kept_request(case):
    build_case, expected = CASES[case]
    v = build_case()
    assert (v.verdict, v.rule) == expected, (v.verdict, v.rule, v.evidence.why, v.evidence.count_reading)
    # the verdict names what keeps it open: the count read against the fewest others the engine can hold
    assert v.evidence.why


def test_a_completed_requests_close_reads_its_own_end_however_late():
    """The neighbour's end at 3.03 s read by its client at 3.40 s (a hop that buffers), tg gone at 3.05 s with it,
    the probe sent at 3.45 s: once the neighbour's close came, its end is read, and the probe, sent after it, owns
    none. tg's release stands on the count (released at 3.05 s, 22 tokens made for it)."""
    from tests.test_no_log_readings import TARGET, _ramp

    count = lambda t: 0.0 if t < 0.12 else 1.0 if t < 0.55 else 2.0 if t < 3.03 else 0.0 if t < 3.5 else 1.0  # noqa
    kv = lambda t: 0.0 if t < 0.12 else 0.2 if t < 0.55 else 0.4 if t < 3.03 else 0.0 if t < 3.5 else 0.1  # noqa
    gen = lambda t: 1000 + _ramp(t, 0.3, 3.03, 100) + _ramp(t, 0.8, 3.0, 22) + _ramp(t, 3.55, 6.0, 50)  # noqa: E731

    def delivered(t):
        return _ramp(t - 0.01, 0.3, 3.03, 100) + min(_ramp(t - 0.01, 0.8, 3.0, 22), 20.0) + _ramp(t - 0.01, 3.55, 6.0, 50)

    ledger = [dict(request_id="nb", sent=0.1, first=0.31, closed=3.4, max_tokens=100, chunks=100),
              dict(TARGET, max_tokens=60, chunks=20),
              dict(request_id="pr", role="probe", sent=3.45, first=3.56, closed=6.0, max_tokens=50, chunks=50)]
    v = verdict_of(build(count, kv, gen, lambda t: float(t >= 3.03), ledger, [("tg", 3.0, "decode", 20)],
                         delivered=delivered, length_s=7))
    assert (v.verdict, v.timepoints["left_scheduler"]) == ("released", 3.05), (v.rule, v.evidence.why)


# a second review's runs: no request log; `abort`, where given, the relay's abort of tg (kept or not, as the count says)
T5 = dict(TG, closed=5.001, cancel=5.0)


def req(rid: str, sent: float, closed: float, **more) -> dict:
    return dict(request_id=rid, sent=sent, first=sent + .1, closed=closed, **more)


def run_of(count, ends, ledger, stop, length_s, abort=None, seqs=None):
    run = build(count, lambda t: .1 * count(t), gen_of(count), lambda t: float(sum(t >= e for e in ends)), ledger,
                [("tg", stop, "decode", 50)], length_s=length_s)
    if seqs:
        run.ledger.loc[run.ledger.request_id == seqs[0], "n"] = seqs[1]
    if abort:
        e = dict(request_id="tg", kind="engine_abort", mono_ns=ns(abort), wall_ns=0, t_s=abort,
                 data=json.dumps({"cancel_id": "c0", "source": "relay"}))
        run.events = pd.concat([run.events, pd.DataFrame([e])]).sort_values("mono_ns").reset_index(drop=True)
    return verdict_of(run)


KEPT = {
    # R, sent before the look-back (from 1.5 s), ended at 1.42 s and closed at 1.60 s: its close reads its own end,
    # not S's (1.52 s, a slow reader to 9 s); tg kept, a newcomer N excusing the shortfall before the stop
    "a_close_reads_its_own_end_from_before_the_look_back": lambda: run_of(
        lambda t: within(t, .5) + within(t, 1, 1.42) + within(t, 1, 1.52) + within(t, 4.92), [1.42, 1.52],
        [T5, req("R", 1, 1.6), req("S", 1, 9), dict(req("N", 4.9, 9), first=5.1)], 5.0, 9.5),
    # the same with the relay's abort and no newcomer
    "the_same_beside_a_relay_abort": lambda: run_of(
        lambda t: within(t, .5) + within(t, 1, 1.42) + within(t, 1, 1.52), [1.42, 1.52],
        [T5, req("R", 1, 1.6), req("S", 1, 9)], 5.0, 9.5, abort=5.002),
    # M (n=2) ended its sequences at 1.3 s and 1.6 s, closed at 1.62 s: two ends of its own, not S's (1.55 s)
    "a_completion_of_two_sequences_reads_its_two_ends": lambda: run_of(
        lambda t: within(t, .5) + within(t, 1, 1.3) + within(t, 1, 1.6) + within(t, 1, 1.55) + within(t, 4.92),
        [1.3, 1.6, 1.55], [T5, req("M", 1, 1.62), req("S", 1, 9), dict(req("N", 4.9, 9), first=5.1)], 5.0, 9.5,
        seqs=("M", 2)),
    # Z, a completed row whose close is its send (it never ran), closes inside the interval that shows S's end
    "a_request_that_never_ran_reads_no_end": lambda: run_of(
        lambda t: within(t, .1) + within(t, .5) + within(t, 1, 5.13), [5.13],
        [req("nb", .1, 9), T5, req("S", 1, 9), req("Z", 5.12, 5.12)], 5.0, 9.5, abort=5.002),
}

RELEASED = {
    # a closed loop: R ended 0.36 s, closed 0.37 s, its replacement R2 sent then (the look-back's start)
    "a_closed_loop_whose_close_starts_the_look_back": lambda: run_of(
        lambda t: within(t, 0, .36) + within(t, .38, 5.9) + within(t, .5, 2.05) + within(t, 2.12, 2.6), [.36, 2.6, 5.9],
        [req("R", 0, .37), req("R2", .37, 5.91), TG, dict(req("pr", 2.1, 2.62), role="probe")], 2.0, 6.5, abort=2.002),
    # Q's stop string: its end counted at 6.99 s, a step before the engine drops it; its client closes at 7.01 s
    "a_stop_strings_end_counted_a_step_early": lambda: run_of(
        lambda t: within(t, .1, 8.9) + within(t, .5, 5.05) + within(t, 4.6, 7.02) + within(t, 5.12, 5.6),
        [6.99, 5.6, 8.9], [req("nb", .1, 9), T5, req("Q", 4.6, 7.01), dict(req("pr", 5.1, 5.62), role="probe")],
        5.0, 9.5, abort=5.002),
    # R's end (1.47 s) and close (1.48 s) just before the look-back's start (1.5 s)
    "a_prompt_reader_at_the_look_backs_start": lambda: run_of(
        lambda t: within(t, .1, 7.9) + within(t, .5, 5.05) + within(t, 1, 1.47) + within(t, 5.12, 5.6),
        [1.47, 5.6, 7.9], [req("nb", .1, 8), T5, req("R", 1, 1.48), dict(req("pr", 5.1, 5.62), role="probe")],
        5.0, 9.5, abort=5.002),
}

RELEASE_AT = {"a_closed_loop_whose_close_starts_the_look_back": 2.05, "a_stop_strings_end_counted_a_step_early": 5.05,
              "a_prompt_reader_at_the_look_backs_start": 5.05}


@pytest.mark.parametrize("case", sorted(KEPT))
def test_a_close_reads_its_own_ends_never_a_slow_readers(case):
    v = KEPT[case]()
    assert v.verdict == "inconclusive", (v.verdict, v.rule, v.evidence.why)


@pytest.mark.parametrize("case", sorted(RELEASED))
def test_ends_read_promptly_leave_a_clean_release_released(case):
    v = RELEASED[case]()
    assert (v.verdict, v.timepoints["left_scheduler"]) == ("released", pytest.approx(RELEASE_AT[case])), \
        (v.verdict, v.rule, v.evidence.why)
