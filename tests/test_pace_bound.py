"""How fast a request can make its tokens (VllmCase.pace): the fastest one sequence went alone in the frame the cancel
is judged on, a quarter added. A review built false releases from a pace read on the cancel's own few seconds only:
the request that may own an unread end of the engine's (a slow reader's) then "could not have run out" yet, and a
count at the ledger's read as a release while the cancelled request stayed. No request log; the relay's abort of tg
returned, and the engine kept it to the end of the run, counted and stepping."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd

from tests.test_no_log_readings import build, ns
from tests.test_unread_ends import T5, req, within


def gen_at(count, rate, length_s: float):
    """generation_tokens_total: each running request makes rate(t) tokens a second."""
    dt = 0.001
    ts = np.arange(0, length_s + 1, dt)
    made = np.cumsum([count(t) * rate(t) * dt for t in ts])
    return lambda t: 100 + float(made[int(round(t / dt))])


def with_relay_abort(run, at: float):
    e = dict(request_id="tg", kind="engine_abort", mono_ns=ns(at), wall_ns=0, t_s=at,
             data=json.dumps({"cancel_id": "c0", "source": "relay"}))
    run.events = pd.concat([run.events, pd.DataFrame([e])]).sort_values("mono_ns").reset_index(drop=True)
    return run


def tg_of(run):
    from cancelwatch.analysis.verdicts import judge_run

    return next(v for v in judge_run(run) if v.request_id == "tg")


def test_a_host_slow_through_the_cancels_window_does_not_make_a_slow_readers_end_this_ones_room():
    """tg sent at 0.5 s, stopped at 10 s. S (max_tokens 192), sent at 2 s beside it at 40 tokens a second, ran out
    at 6.8 s, its end counted; its client read to 19 s. From 6.8 s tg ran alone, the host starved to 20 tokens a
    second until 14 s. Read on the window (4 s before the stop on), the pace is 25: S could not have run out before
    9.7 s, owns no end, and the count of one read as S released tg at 10.05 s. Over the frame, 50: S could have run
    out by 5.84 s, and its end may be what the count lacks."""
    count = lambda t: within(t, .5) + within(t, 2, 6.8)  # noqa: E731
    rate = lambda t: 20.0 if 6.8 <= t < 14 else 40.0  # noqa: E731
    run = build(count, lambda t: .1 * count(t), gen_at(count, rate, 20), lambda t: float(t >= 6.8),
                [dict(T5, sent=.5, first=.8, closed=10.001, cancel=10.0, max_tokens=5000),
                 dict(req("S", 2, 19), max_tokens=192)], [("tg", 10.0, "decode", 50)], length_s=20)
    v = tg_of(with_relay_abort(run, 10.002))
    assert v.verdict == "inconclusive", (v.verdict, v.rule, v.evidence.why)


def test_a_long_prompt_slowing_every_step_of_the_cancels_window_does_not_either():
    """S (max_tokens 180) ran alone at 40 tokens a second from 2 s; tg, with a long prompt that makes every step
    holding it 25 tokens a second, came at 6 s; S ran out at 6.8 s (its client a slow reader to 19 s); tg, stopped at
    10 s, ran to 15 s. The stretch from a second before the stop read 31.25 (S could not have run out before 7.8 s):
    released at 10.05 s. S's own run alone bounds the pace at 50."""
    count = lambda t: within(t, 2, 6.8) + within(t, 6.0, 15.0)  # noqa: E731
    rate = lambda t: 25.0 if 6.0 <= t < 15.0 else 40.0  # noqa: E731
    run = build(count, lambda t: .1 * count(t), gen_at(count, rate, 21), lambda t: float((t >= 6.8) + (t >= 15.0)),
                [dict(T5, sent=5.9, first=6.3, closed=10.001, cancel=10.0, max_tokens=5000),
                 dict(req("S", 2, 19), max_tokens=180)], [("tg", 10.0, "decode", 50)], length_s=21)
    v = tg_of(with_relay_abort(run, 10.002))
    assert v.verdict == "inconclusive", (v.verdict, v.rule, v.evidence.why)
