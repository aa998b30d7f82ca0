"""A watch's fifth timepoint (analysis/verdicts/reuse.py) on hand-built runs: a watch sends no probe, so `reusable`
stands on a watched request queued behind the cancel while the engine was full, let in once the cancel left; where
nothing waited, or another request left the engine in the meantime, it stays open and says why. The real engine
and browser: test_page_stop_browser.py."""

from __future__ import annotations

import json

from cancelwatch.analysis.verdicts import judge_run
from cancelwatch.runstore.records import WATCHED_SCENARIO
from tests.test_verdicts import T0, build_run, steady_gen

ns = lambda s: T0 + int(s * 1e9)  # noqa: E731
LEFT_S = 2.05  # the cancel is out of the scheduler by the sample at 2.05 (the one at 2.0 still holds it)


def watched(first_s: float = 2.07, waiting=lambda t: 1.0 if t < LEFT_S else 0.0, finished=lambda t: 0.0,
            other_close_s=None, q_sent_s: float = 1.0, q_n: int = 1, other_abort_s=None, gen=steady_gen):
    """nb and tg run; q, sent at 1.0, waits until the cancel of tg leaves and gets its first token at `first_s`.
    `other_close_s`: another watched request (ot, in the engine since 0.2) closes then, a cancel the ledger saw."""
    count = lambda t: (3.0 if t < LEFT_S else 2.0 if t < 3.0 else 1.0) - (t < q_sent_s) + (  # noqa: E731
        1.0 if other_close_s is not None and t < other_close_s else 0.0)
    more = [{"request_id": "q", "scenario": "s", "role": "target", "n": q_n, "sent_mono_ns": ns(q_sent_s),
             "first_token_mono_ns": ns(first_s), "closed_mono_ns": ns(3.0), "cancel_mono_ns": None,
             "terminal_state": "completed"}]
    if other_close_s is not None:
        cancelled = other_abort_s is not None
        more.append({"request_id": "ot", "scenario": "s", "role": "target", "n": 1, "sent_mono_ns": ns(0.2),
                     "first_token_mono_ns": ns(0.3), "closed_mono_ns": ns(other_close_s),
                     "cancel_mono_ns": ns(other_close_s) if cancelled else None,
                     "terminal_state": "cancelled" if cancelled else "completed"})
    run = build_run(count, lambda t: 0.5 if t < LEFT_S else 0.3, gen, extra_ledger=more, waiting=waiting,
                    finished=finished, engine_log=[("engine_added", "nb", 0.1), ("engine_added", "tg", 0.5),
                                                   ("engine_added", "q", q_sent_s), ("engine_aborted", "tg", 2.002),
                                                   *([("engine_added", "ot", 0.2)] if other_close_s else []),
                                                   *([("engine_aborted", "ot", other_abort_s)] if other_abort_s else [])])
    run.ledger["scenario"] = WATCHED_SCENARIO
    stop = run.events["kind"] == "user_stop"
    run.events.loc[stop, "data"] = [json.dumps({**json.loads(d), "scenario": WATCHED_SCENARIO})
                                    for d in run.events.loc[stop, "data"]]
    return next(v for v in judge_run(run) if v.request_id == "tg")


def test_a_request_queued_behind_the_cancel_and_let_in_once_it_left_times_the_fifth_point():
    v = watched()
    assert v.verdict == "released" and abs(v.timepoints["left_scheduler"] - LEFT_S) < 1e-9, v.evidence
    assert abs(v.timepoints["reusable"] - 2.07) < 1e-6 and v.sources["reusable"]["source"] == "queued", v.sources["reusable"]
    assert v.sources["reusable"]["reason"] == ("request q waited behind it (1 waiting) and got its first token "
                                               "70 ms after the stop")


def test_with_nothing_waiting_the_fifth_point_stays_open_and_says_why():
    v = watched(waiting=lambda t: 0.0)
    assert v.timepoints["reusable"] is None and v.sources["reusable"]["source"] is None
    assert v.sources["reusable"]["reason"].startswith("no request was waiting for the engine when it left (0 waiting")


def test_another_request_leaving_meanwhile_leaves_whose_place_it_took_open():
    # another watched request ended between the last sample holding the cancel and q's first token: the engine
    # counted its end, and its client closed
    v = watched(other_close_s=2.03, finished=lambda t: 0.0 if t < 2.03 else 1.0)
    assert v.verdict == "released" and abs(v.timepoints["left_scheduler"] - LEFT_S) < 1e-9, v.evidence
    assert v.timepoints["reusable"] is None, v.sources["reusable"]
    assert "but an end of the engine's own, ot left the engine in the meantime" in v.sources["reusable"]["reason"]
    # its client's close alone
    v = watched(other_close_s=2.03)
    assert v.timepoints["reusable"] is None and "but ot left the engine in the meantime" in v.sources["reusable"]["reason"]
    # an engine that does not count its ends may have ended one
    v = watched(finished=None)
    assert v.timepoints["reusable"] is None and "an end its counter did not read" in v.sources["reusable"]["reason"]


def test_a_waiting_request_let_in_before_the_cancel_left_or_after_the_grace_is_not_its_reuse():
    for first in (1.9, 2.05 + 5.0):
        v = watched(first_s=first)
        assert v.timepoints["reusable"] is None, (first, v.sources["reusable"])
        assert v.sources["reusable"]["reason"] == ("request q, the first waiting behind it, did not get its first "
                                                   "token between its leaving and the grace's end"), first


def test_a_request_that_waited_only_between_two_steps_shows_no_full_engine():
    # q came at 1.995, waiting at one sample only (a request between two engine steps): nothing says the engine
    # had no room for it
    v = watched(q_sent_s=1.995, waiting=lambda t: 1.0 if 1.995 <= t < LEFT_S else 0.0)
    assert v.timepoints["reusable"] is None, v.sources["reusable"]
    assert v.sources["reusable"]["reason"].startswith("request q was seen waiting 0 ms with the engine stepping 0 "
                                                      "time(s)"), v.sources["reusable"]
    # an engine that made no token while q waited (stalled): no step showed it full either
    v = watched(gen=lambda t: 100.0 if t < 2.5 else 100 + 20 * t)
    assert v.timepoints["reusable"] is None and "too briefly to show the engine was full" in \
        v.sources["reusable"]["reason"], v.sources["reusable"]


def test_a_waiter_of_two_sequences_is_the_one_let_in():
    # q asks for two sequences: both waiting (the gauge counts sequences), q is still the one let in
    v = watched(q_n=2, waiting=lambda t: 2.0 if t < LEFT_S else 0.0)
    assert v.sources["reusable"]["source"] == "queued", v.sources["reusable"]
    assert v.sources["reusable"]["reason"].startswith("request q waited behind it (2 waiting)")


def test_another_cancel_aborted_in_between_leaves_whose_place_it_took_open():
    # ot's client closed before the last sample holding tg, its abort line after it: it left in the meantime
    v = watched(other_close_s=1.995, other_abort_s=2.01)
    assert v.timepoints["reusable"] is None, v.sources["reusable"]
    assert "but ot left the engine in the meantime" in v.sources["reusable"]["reason"], v.sources["reusable"]


def test_a_waiter_still_on_its_way_through_the_hops_at_the_first_sample_is_queued_from_when_it_waits():
    # q was sent at 1.0 and reached the engine's queue 0.12 s later (through nginx and an app): the samples between
    # showed none waiting. From then on it waited while the engine stepped: the engine was full (seen in CI)
    v = watched(waiting=lambda t: 1.0 if 1.12 <= t < LEFT_S else 0.0)
    assert v.sources["reusable"]["source"] == "queued", v.sources["reusable"]
    # and a waiter that came and went before waiting again is counted from its last unbroken wait only
    v = watched(waiting=lambda t: 1.0 if 1.12 <= t < 1.5 or 1.96 <= t < LEFT_S else 0.0)
    assert v.timepoints["reusable"] is None and "too briefly" in v.sources["reusable"]["reason"], v.sources["reusable"]


def test_a_release_read_a_sample_after_the_queued_request_got_in_is_still_its_reuse():
    """tg's abort at 2.002; the engine's next step drops it and lets q in (the sample at 2.05: q running, none
    waiting), and q's blocks are tg's (KV usage falls only as q ends, at 2.95). q is counted for sure only once its first token is
    out (2.07), so the release is read at the sample after, 2.10. The queue behind tg is the one before its abort, not
    the one at 2.05 (seen behind a browser's Stop in CI: reusable read as "no request was waiting")."""
    count = lambda t: 3.0 - (t < 1.0) - (t >= 2.05) - (t >= 2.95)  # noqa: E731  (q ends at 2.95)
    more = [{"request_id": "q", "scenario": "s", "role": "target", "n": 1, "sent_mono_ns": ns(1.0),
             "first_token_mono_ns": ns(2.07), "closed_mono_ns": ns(3.0), "cancel_mono_ns": None,
             "terminal_state": "completed"}]
    run = build_run(count, lambda t: 0.5 if t < 2.95 else 0.3, steady_gen, extra_ledger=more, waiting=lambda t: 1.0 if 1.0 <= t < 2.05 else 0.0,
                    finished=lambda t: 0.0, engine_log=[("engine_added", "nb", 0.1), ("engine_added", "tg", 0.5),
                                                        ("engine_added", "q", 1.0), ("engine_aborted", "tg", 2.002)])
    run.ledger["scenario"] = WATCHED_SCENARIO
    stop = run.events["kind"] == "user_stop"
    run.events.loc[stop, "data"] = [json.dumps({**json.loads(d), "scenario": WATCHED_SCENARIO})
                                    for d in run.events.loc[stop, "data"]]
    v = next(v for v in judge_run(run) if v.request_id == "tg")
    assert v.verdict == "released" and abs(v.timepoints["left_scheduler"] - 2.10) < 1e-9, (v.rule, v.timepoints)
    assert v.timepoints["reusable"] is not None and abs(v.timepoints["reusable"] - 2.07) < 1e-6, v.sources["reusable"]
    assert v.sources["reusable"]["reason"].startswith("request q waited behind it (1 waiting)"), v.sources["reusable"]


def seats_full_run(seats, other_close_s=None):
    """Every seat taken at the stop (2 running, max_num_seqs 2), q waiting behind tg; tg's abort at 2.002 and q let
    in at the next step (first token 2.06). q's prompt takes more blocks than tg gave back, so KV usage rises."""
    count = lambda t: 3.0 - (t < 1.0) - (t >= 2.05) - (t >= 4.5)  # noqa: E731  (q ends at 4.5, past the grace)
    more = [{"request_id": "q", "scenario": "s", "role": "target", "n": 1, "sent_mono_ns": ns(1.0),
             "first_token_mono_ns": ns(2.06), "closed_mono_ns": ns(4.55), "cancel_mono_ns": None,
             "terminal_state": "completed"}]
    if other_close_s is not None:  # another request of the run, beside them, its client gone before q got in
        more.append({"request_id": "ot", "scenario": "s", "role": "target", "n": 1, "sent_mono_ns": ns(0.2),
                     "first_token_mono_ns": ns(0.3), "closed_mono_ns": ns(other_close_s),
                     "cancel_mono_ns": ns(other_close_s), "terminal_state": "cancelled"})
    run = build_run(count, lambda t: 0.4 if t < 2.05 else 0.6 if t < 4.5 else 0.3, steady_gen, extra_ledger=more,
                    waiting=lambda t: 1.0 if 1.0 <= t < 2.05 else 0.0, finished=lambda t: 0.0,
                    series={"preemptions_total": lambda t: 0.0},
                    engine_log=[("engine_added", "nb", 0.1), ("engine_added", "tg", 0.5), ("engine_added", "q", 1.0),
                                ("engine_aborted", "tg", 2.002)])
    run.info.setdefault("engine", {})["targets"] = {"t0": {"shape": {"max_num_seqs": seats}}} if seats else {}
    return next(v for v in judge_run(run) if v.request_id == "tg")


def test_a_request_let_in_to_the_seat_of_a_full_engine_shows_the_release_when_kv_usage_rises():
    """The engine's seats all taken, the request waiting behind the cancel got in at the step after its abort and
    nothing else left: the seat, and the blocks, were the cancel's (seat_taken), though KV usage rose with the
    newcomer's longer prompt. Seen behind a browser's Stop in CI (fillers crossing into new blocks as well)."""
    v = seats_full_run(2)
    assert (v.verdict, v.rule, v.evidence.kv_drop_waived) == ("released", "released", "seat_taken"), v.evidence.why
    assert abs(v.timepoints["left_scheduler"] - 2.10) < 1e-9, v.timepoints
    # the engine's seats not known (not started by cancelwatch): KV usage never fell
    assert (seats_full_run(None).verdict, seats_full_run(None).rule) == ("inconclusive", "kv_did_not_fall")
    # another request left in between: whose seat q took is not known
    assert seats_full_run(2, other_close_s=2.03).evidence.kv_drop_waived != "seat_taken"
