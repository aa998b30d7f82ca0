"""Without the engine's request log and with no abort known, hand-built runs whose truth the construction fixes,
where an end the engine counted of its own stands in for another's (issue 37, a review's counterexamples): a
neighbour's end counted before the last sample before the stop but read by its client after it must not excuse the
cancelled request's own end (it ran out: not released); a request the engine ran ahead of before its stop, read
past a lost one the frame let go oldest first, must not be called leaked on its own end's count."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest

from cancelwatch.analysis.verdicts import judge_run
from cancelwatch.runstore.reader import Run
from cancelwatch.runstore.records import WATCHED_SCENARIO

T0 = 1_000_000_000_000


def ns(s):
    return None if s is None else T0 + int(round(s * 1e9))


def build(count, kv, gen, finished, ledger, stops, *, hz=20, length_s=6.0, delivered=None, answer_s=0.0):
    """A run at `hz`: count(t), kv(t), gen(t) and finished(t) (requests_finished_total{reason=stop}); `ledger`:
    dicts with request_id, role, sent, first, closed, cancel (s), terminal_state, max_tokens, chunks; `stops`:
    (request id, stop, phase, tokens at the stop); delivered(t): the chunks the clients got by t (record's
    client_chunks_total), where given; answer_s: how long each of the engine's scrapes took to answer, recorded (its
    values are the engine's at stamp + answer_s). No engine log; the clients' closes are their own stamps."""
    times = np.round(np.arange(0, length_s, 1 / hz), 6)
    rows = []
    for i, t in enumerate(times):
        if delivered is not None:
            rows.append({"source": "clients", "target": "t0", "metric": "client_chunks_total", "labels": "{}",
                         "value": float(delivered(t)), "wall_ns": 0, "mono_ns": ns(t), "duration_ns": 1,
                         "scrape_id": len(times) + i, "t_s": t})
        for metric, labels, value in (("requests_running", "{}", count(t)), ("requests_waiting", "{}", 0.0),
                                      ("kv_cache_usage_ratio", "{}", kv(t)), ("generation_tokens_total", "{}", gen(t)),
                                      ("requests_finished_total", '{"finished_reason": "stop"}', finished(t))):
            rows.append({"source": "vllm", "target": "t0", "metric": metric, "labels": labels, "value": value,
                         "wall_ns": 0, "mono_ns": ns(t), "duration_ns": 1, "scrape_id": i, "t_s": t})
    led = [{"request_id": r["request_id"], "scenario": "s", "role": r.get("role", "neighbour"), "n": 1,
            "sent_mono_ns": ns(r.get("sent")), "first_token_mono_ns": ns(r.get("first")),
            "closed_mono_ns": ns(r.get("closed")), "cancel_mono_ns": ns(r.get("cancel")),
            "terminal_state": r.get("terminal_state", "completed"), "max_tokens": r.get("max_tokens", math.nan),
            "chunks": r.get("chunks", 0)}
           for r in ledger]
    events = []
    for k, (rid, t_stop, phase, tokens) in enumerate(stops):
        cid = {"cancel_id": f"c{k}"}
        events += [{"request_id": rid, "kind": "user_stop", "mono_ns": ns(t_stop),
                    "data": json.dumps({**cid, "scenario": "s", "phase": phase, "metrics_target": "t0",
                                        "tokens_at_cancel": tokens})},
                   {"request_id": rid, "kind": "client_closed", "mono_ns": ns(t_stop + 0.001),
                    "data": json.dumps({**cid, "source": "client"})}]
    events = pd.DataFrame(events).sort_values("mono_ns").assign(wall_ns=0)
    events["t_s"] = (events["mono_ns"] - T0) / 1e9
    info = {"started_mono_ns": T0, "targets": [{"label": "t0", "url": "http://127.0.0.1:8000"}],
            "status": "completed", "settings": {}}
    scrapes = pd.DataFrame({"source": "vllm", "target": "t0", "ok": 1, "mono_ns": [ns(t) for t in times],
                            "n_samples": 5, "duration_ns": int(answer_s * 1e9), "t_s": times}) if answer_s \
        else pd.DataFrame()
    return Run(id=1, info=info, samples=pd.DataFrame(rows), scrapes=scrapes, gaps=pd.DataFrame(),
               events=events, ledger=pd.DataFrame(led))


def verdict_of(run, rid="tg"):
    return {v.request_id: v for v in judge_run(run)}[rid]


def GEN(t):
    return 100 + 40 * t

TARGET = dict(request_id="tg", role="target", sent=0.5, first=0.8, closed=2.001, cancel=2.0,
              terminal_state="cancelled", max_tokens=40)


@pytest.mark.parametrize("read_at", [1.99, 2.02])
def test_an_end_counted_before_the_stop_and_read_after_it_excuses_none_of_the_cancelled_ones(read_at):
    """A neighbour's stop string: its end counted at 1.94 (the 1.95 sample), the engine dropping it a step later;
    its client reads it at `read_at`. The target, a driver request two tokens from its end at the 2.00 stop, runs
    out at 2.03 (its own end, counted at the 2.05 sample). The counter's rise after the stop is the target's."""
    count = lambda t: 0.0 if t < 0.1 else 1.0 if t < 0.55 else 2.0 if t < 1.97 else 1.0 if t < 2.03 else \
        0.0 if t < 2.15 else 1.0  # noqa: E731
    finished = lambda t: 0.0 if t < 1.94 else 1.0 if t < 2.03 else 2.0  # noqa: E731
    kv = lambda t: 0.0 if t < 0.1 else 0.4 if t < 1.97 else 0.25 if t < 2.03 else 0.0 if t < 2.15 else 0.1  # noqa
    ledger = [dict(request_id="nb", sent=0.1, first=0.3, closed=read_at), TARGET,
              dict(request_id="pr", role="probe", sent=2.1, first=2.3, closed=5.5)]
    v = verdict_of(build(count, kv, GEN, finished, ledger, [("tg", 2.0, "decode", 38)]))
    assert v.verdict == "inconclusive" and v.evidence.rule == "gone_may_have_run_out", v.evidence.why


def test_a_scrape_answered_late_beside_a_closed_loop_replacement_excuses_none_of_the_cancelled_ones():
    """The 1.95 scrape answered ~50 ms late: in that span the neighbour ends (1.97), its client reads it (1.99) and
    sends its replacement (1.995), which the engine admits. The target runs out at 2.03, its own end."""
    count = lambda t: 0.0 if t < 0.1 else 1.0 if t < 0.55 else 2.0 if t < 2.05 else 1.0  # noqa: E731
    finished = lambda t: 0.0 if t < 1.93 else 1.0 if t < 2.03 else 2.0  # noqa: E731
    kv = lambda t: 0.0 if t < 0.1 else 0.4 if t < 2.05 else 0.2  # noqa: E731
    ledger = [dict(request_id="nb", sent=0.1, first=0.3, closed=1.99, max_tokens=60), TARGET,
              dict(request_id="y", sent=1.995, first=2.06, closed=5.5, max_tokens=200)]
    v = verdict_of(build(count, kv, GEN, finished, ledger, [("tg", 2.0, "decode", 38)]))
    assert v.verdict == "inconclusive" and v.evidence.rule == "gone_may_have_run_out", v.evidence.why


def test_a_release_of_a_race_is_read_where_the_counter_shows_no_end_of_its_own():
    """The same race with the abort winning: the count falls at the first sample after the stop and the engine's
    own-ends counter does not move (an abort is not counted there): released."""
    count = lambda t: 0.0 if t < 0.1 else 1.0 if t < 0.55 else 2.0 if t < 2.03 else 1.0 if t < 2.15 else 2.0  # noqa
    kv = lambda t: 0.0 if t < 0.1 else 0.4 if t < 2.03 else 0.2 if t < 2.15 else 0.3  # noqa: E731
    ledger = [dict(request_id="nb", sent=0.1, first=0.3, closed=5.5), TARGET,
              dict(request_id="pr", role="probe", sent=2.1, first=2.3, closed=5.5)]
    v = verdict_of(build(count, kv, GEN, lambda t: 0.0, ledger, [("tg", 2.0, "decode", 38)]))
    assert v.verdict == "released", v.evidence.why


def test_a_request_the_engine_ran_ahead_of_is_not_read_as_kept_on_its_own_ends_count():
    """Behind a hop that buffers: the target's engine request ran out at 2.5 (its own end counted) while the hop
    still fed its client, who stops it at 3.0. Another request, stopped at 2.97 with its cancel lost, runs on: the
    frame lets that older lost one go oldest first, and the count still holding it must not read as the target
    kept, on the count of an end that is the target's own."""
    count = lambda t: 0.0 if t < 0.15 else 1.0 if t < 0.55 else 2.0 if t < 2.5 else 1.0  # noqa: E731
    kv = lambda t: 0.0 if t < 0.15 else 0.2 if t < 0.55 else 0.4 if t < 2.5 else 0.2  # noqa: E731
    finished = lambda t: 0.0 if t < 2.5 else 1.0  # noqa: E731
    ledger = [dict(request_id="L", role="target", sent=0.1, first=0.3, closed=2.971, cancel=2.97,
                   terminal_state="cancelled", max_tokens=2000),
              dict(TARGET, closed=3.001, cancel=3.0, max_tokens=80)]
    run = build(count, kv, GEN, finished, ledger, [("L", 2.97, "decode", 100), ("tg", 3.0, "decode", 60)],
                length_s=12)
    v = verdict_of(run)
    assert v.verdict == "inconclusive", (v.evidence.rule, v.evidence.why)


def _ramp(t, t_from, t_to, tokens):
    """Tokens made (or read) by t at an even pace from t_from to t_to."""
    return float(np.clip((t - t_from) / (t_to - t_from), 0.0, 1.0) * tokens)


@pytest.mark.parametrize("made_for_it", [22, 60])
def test_the_tokens_made_for_nobody_tell_a_release_from_a_request_that_ran_out(made_for_it):
    """Without the request log: a neighbour ends on its own at 3.03 and its client reads that at 3.40; the target, 50
    of its 120 tokens read at its 3.00 stop, is gone at the 3.05 sample with it. The count and the own-ends counter
    cannot tell whether the target ran out (an engine that ran ahead of its client behind a buffering hop) or was
    aborted. The engine's generation counter against what the clients got can: 22 tokens made for it (its client's
    20, two in flight) is a release; 60 (40 for nobody) is a request that may have run out."""
    count = lambda t: 0.0 if t < 0.12 else 1.0 if t < 0.55 else 2.0 if t < 3.03 else 0.0 if t < 3.5 else 1.0  # noqa
    kv = lambda t: 0.0 if t < 0.12 else 0.2 if t < 0.55 else 0.4 if t < 3.03 else 0.0 if t < 3.5 else 0.1  # noqa
    finished = lambda t: 0.0 if t < 3.03 else 1.0  # noqa: E731
    target_end = 3.0 if made_for_it < 60 else 3.03

    def gen(t):
        return 1000 + _ramp(t, 0.3, 3.03, 100) + _ramp(t, 0.8, target_end, made_for_it) + _ramp(t, 3.55, 6.0, 50)

    def delivered(t):  # each chunk reaches its client 10 ms after the engine made it; the target's client stops at 20
        return _ramp(t - 0.01, 0.3, 3.03, 100) + min(_ramp(t - 0.01, 0.8, target_end, made_for_it), 20.0) \
            + _ramp(t - 0.01, 3.55, 6.0, 50)

    ledger = [dict(request_id="nb", sent=0.1, first=0.31, closed=3.4, max_tokens=100, chunks=100),
              dict(TARGET, max_tokens=60, chunks=20),
              dict(request_id="pr", role="probe", sent=3.45, first=3.56, closed=6.0, max_tokens=50, chunks=50)]
    run = build(count, kv, gen, finished, ledger, [("tg", 3.0, "decode", 20)], delivered=delivered, length_s=7)
    v = verdict_of(run)
    if made_for_it < 60:
        assert v.verdict == "released", (v.evidence.rule, v.evidence.why)
        assert v.evidence.tokens_for_nobody_at_most < 40
    else:
        assert (v.verdict, v.evidence.rule) == ("inconclusive", "gone_may_have_run_out"), v.evidence.why
    # the same runs without the clients' count: the counters alone cannot tell
    bare = build(count, kv, gen, finished, ledger, [("tg", 3.0, "decode", 20)], length_s=7)
    assert verdict_of(bare).evidence.rule == "gone_may_have_run_out"


@pytest.mark.parametrize("answer_s", [0.0, 0.08])
def test_a_request_that_ran_out_is_never_read_as_released_off_a_scrape_answered_late(answer_s):
    """A review's counterexample: the target, sent into an idle engine at 1.00, ran its 60 tokens out by 3.03 while
    its client behind a buffering hop got 20 and stopped at 3.00. The counter's read stamped at the quiet instant
    answered 80 ms later already holds tokens made after it: from that read, the tokens for nobody come out short.
    The read that counts is one answered by the quiet instant."""
    count = lambda t: 0.0 if t < 1.02 else 1.0 if t < 3.03 else 0.0 if t < 3.5 else 1.0  # noqa: E731
    kv = lambda t: 0.0 if t < 1.02 else 0.2 if t < 3.03 else 0.0 if t < 3.5 else 0.1  # noqa: E731
    finished = lambda t: 0.0 if t < 3.03 else 1.0  # noqa: E731

    def gen(t):
        t += answer_s  # the engine's counter as it stood when the read was answered
        return 1000 + _ramp(t, 1.03, 3.03, 60) + _ramp(t, 3.55, 6.0, 50)

    def delivered(t):
        return min(_ramp(t - 0.01, 1.03, 3.03, 60), 20.0) + _ramp(t - 0.01, 3.55, 6.0, 50)

    ledger = [dict(TARGET, sent=1.0, first=1.05, max_tokens=60, chunks=20),
              dict(request_id="pr", role="probe", sent=3.45, first=3.56, closed=6.0, max_tokens=50, chunks=50)]
    run = build(count, kv, gen, finished, ledger, [("tg", 3.0, "decode", 20)], delivered=delivered, length_s=7,
                answer_s=answer_s)
    v = verdict_of(run)
    assert (v.verdict, v.evidence.rule) == ("inconclusive", "gone_may_have_run_out"), v.evidence.why


def _lost_behind_a_hop(*, aborted: bool, late_entry: bool = False):
    """A target (156 tokens, 80 read) stopped at 2.00 beside a neighbour, behind a hop with no request log. Lost, it
    runs on and ends by itself at 3.20 with the neighbour, whose client reads that at 3.25; the engine is then idle.
    `aborted`: the cancel comes through instead, the target leaves at 2.05 and the neighbour ends alone. `late_entry`:
    a request sent at 1.90, not in the count before the stop, enters and ends by itself at 3.20 too, its tokens held by
    the hop until then."""
    gone = 2.03 if aborted else 3.2
    extra = late_entry and aborted

    def count(t):  # the neighbour from 0.12, the target from 0.55, the newcomer from 2.01
        return float(0.12 <= t < 3.2) + float(0.55 <= t < gone) + float(extra and 2.01 <= t < 3.2)

    kv = lambda t: 0.1 * count(t)  # noqa: E731
    finished = lambda t: 0.0 if t < 3.2 else 1.0 + float(not aborted) + float(extra)  # noqa: E731
    def gen(t):  # 60 tokens a second each: the target's 156 by 3.20 where it runs to its end
        return 1000 + 60 * (np.clip(t, 0.15, 3.2) - 0.15) + 60 * (np.clip(t, 0.6, gone) - 0.6) \
            + 60 * (np.clip(t, 2.02, 3.2) - 2.02) * extra

    ledger = [dict(request_id="nb", sent=0.1, first=0.15, closed=3.25, max_tokens=183, chunks=183),
              dict(TARGET, sent=0.5, first=0.6, closed=2.001, cancel=2.0, max_tokens=156, chunks=80)]
    if late_entry:
        ledger.append(dict(request_id="y", sent=1.9, first=3.22, closed=3.25, max_tokens=71, chunks=71))
    return build(count, kv, gen, finished, ledger, [("tg", 2.0, "decode", 80)], length_s=6)


def test_a_lost_cancel_that_ran_to_its_end_is_told_by_the_engines_own_ends_without_the_log():
    """Both requests the engine held before the stop end by themselves (the own-ends counter rises by two) and the
    engine is idle after: the target was never aborted, it ran on for nobody and left at its own end. Leaked, with
    when it was still there and when it had left by; with the abort, the counter rises by the neighbour's end only
    and the target's leaving reads as a release."""
    v = verdict_of(_lost_behind_a_hop(aborted=False))
    assert (v.verdict, v.rule) == ("leaked", "ended_by_itself_after_stop"), v.evidence.why
    assert v.timepoints["left_scheduler"] == pytest.approx(3.2)
    assert 1.0 < v.evidence.kept_running_ms / 1000 < 1.2  # the last sample before its end, after the stop
    assert v.evidence.release_ms is None and v.evidence.tokens_after_client_left is not None
    assert "no_traffic_beside_the_run" in v.evidence.assumes
    v = verdict_of(_lost_behind_a_hop(aborted=True))
    assert v.verdict == "released", (v.rule, v.evidence.why)


def test_a_request_that_entered_after_the_stop_and_ended_by_itself_is_not_read_as_the_cancelled_ones_end():
    """The abort came through and the target left at 2.03; a request sent at 1.90, not yet counted before the stop,
    entered and ended by itself at 3.20 beside the neighbour, none of its tokens at its client until then (the count
    cannot tell it from the target). The counter's two ends are as many as the engine held before the stop, but one
    is the newcomer's: the target's own end is not shown."""
    v = verdict_of(_lost_behind_a_hop(aborted=True, late_entry=True))
    assert (v.verdict, v.rule) == ("inconclusive", "gone_may_have_run_out"), (v.rule, v.evidence.why)


def _aborted_beside(count, finished, gen, ledger, **kw):
    """A run of the template's shape whose target the abort took out at 2.03 (its own end never counted)."""
    base = [dict(request_id="nb", sent=0.1, first=0.15, closed=3.25, max_tokens=183, chunks=183),
            dict(TARGET, sent=0.5, first=0.6, closed=2.001, cancel=2.0, max_tokens=156, chunks=80)]
    return build(count, lambda t: 0.1 * count(t), gen, finished, base + ledger, [("tg", 2.0, "decode", 80)],
                 length_s=6, **kw)


def _watched_batch():
    """A watched request sent at 2.50 (its row's n unread: a batch of two prompts) enters as two engine requests that
    end by themselves at 3.00; the neighbour ends at 3.20. Three ends: as many as the two held plus one entering."""
    count = lambda t: float(0.12 <= t < 3.2) + float(0.55 <= t < 2.03) + 2 * float(2.55 <= t < 3.0)  # noqa: E731
    finished = lambda t: 2 * float(t >= 3.0) + float(t >= 3.2)  # noqa: E731
    gen = lambda t: 1000 + 60 * (np.clip(t, 0.15, 3.2) + np.clip(t, 0.6, 2.03) + 2 * np.clip(t, 2.55, 3.0))  # noqa
    run = _aborted_beside(count, finished, gen, [dict(request_id="w", sent=2.5, first=2.6, closed=3.02, chunks=54)])
    run.ledger["scenario"] = WATCHED_SCENARIO
    run.ledger.loc[run.ledger["request_id"] == "w", "n"] = math.nan
    run.events["data"] = [json.dumps({**json.loads(d), "scenario": WATCHED_SCENARIO}) for d in run.events["data"]]
    return run


def _short_one_inside_a_late_answer():
    """Every scrape answered 50 ms after its stamp. A request sent at 1.90 enters and ends by itself at 3.18 with the
    neighbour; a 2-token one sent at 3.16, after the first idle read's stamp and before its answer, is in and out
    by then: its end is in that read."""
    lag = 0.05

    def at(f):
        return lambda t: f(t + lag)

    count = at(lambda t: float(0.12 <= t < 3.18) + float(0.55 <= t < 2.03) + float(2.01 <= t < 3.18)
               + float(3.175 <= t < 3.195))
    finished = at(lambda t: 2.0 * float(t >= 3.18) + float(t >= 3.195))
    gen = at(lambda t: 1000 + 60 * (np.clip(t, 0.15, 3.18) + np.clip(t, 0.6, 2.03) + np.clip(t, 2.02, 3.18))
             + 2 * float(t >= 3.195))
    return _aborted_beside(count, finished, gen, [
        dict(request_id="y", sent=1.9, first=3.22, closed=3.25, max_tokens=71, chunks=71),
        dict(request_id="z", sent=3.16, first=3.197, closed=3.199, max_tokens=2, chunks=2)], answer_s=lag)


def _ran_ahead_with_the_counter_unread_before_the_stop():
    """The target ran out in the engine at 1.80 while a hop still fed its client (60 of its 72 tokens by the 2.00
    stop); a request sent at 1.92, its tokens held by the hop, fills its place in the count at the 1.95 sample, whose
    read lacks the own-ends counter. Both end by themselves at 3.20 with the neighbour."""
    count = lambda t: float(0.12 <= t < 3.2) + float(0.55 <= t < 1.8) + float(1.93 <= t < 3.2)  # noqa: E731
    finished = lambda t: math.nan if abs(t - 1.95) < 1e-6 else float(t >= 1.8) + 2.0 * float(t >= 3.2)  # noqa
    gen = lambda t: 1000 + 60 * (np.clip(t, 0.15, 3.2) + np.clip(t, 0.6, 1.8) + np.clip(t, 1.94, 3.2))  # noqa
    ledger = [dict(request_id="nb", sent=0.1, first=0.15, closed=3.25, max_tokens=183, chunks=183),
              dict(TARGET, sent=0.5, first=0.6, closed=2.001, cancel=2.0, max_tokens=72, chunks=60),
              dict(request_id="e", sent=1.92, first=3.22, closed=3.25, max_tokens=76, chunks=76)]
    return build(count, lambda t: 0.1 * count(t), gen, finished, ledger, [("tg", 2.0, "decode", 60)], length_s=6)


def _api_server_stalled_across_the_stop():
    """The API server's loop (its metrics, its counts, its disconnects) stalls from 1.85 to 2.33; the engine core
    runs the target to its end at 2.05, 50 ms after the stop, and the backlog counts that end as its own before the
    disconnect is handled. The scrapes stamped in the stall are answered at 2.32 with the figures of 1.85."""
    def seen(t):
        return 1.85 if 1.85 <= t < 2.33 else t

    count = lambda t: float(0.12 <= seen(t) < 3.2) + float(0.55 <= seen(t) < 2.05)  # noqa: E731
    finished = lambda t: float(seen(t) >= 2.05) + float(seen(t) >= 3.2)  # noqa: E731
    gen = lambda t: 1000 + 60 * (np.clip(seen(t), 0.15, 3.2) + np.clip(seen(t), 0.6, 2.05))  # noqa: E731
    ledger = [dict(request_id="nb", sent=0.1, first=0.15, closed=3.25, max_tokens=200, chunks=200),
              dict(TARGET, sent=0.5, first=0.6, closed=2.001, cancel=2.0, max_tokens=87, chunks=75)]
    run = build(count, lambda t: 0.1 * count(t), gen, finished, ledger, [("tg", 2.0, "decode", 75)], length_s=6)
    times = np.round(np.arange(0, 6, 1 / 20), 6)
    run.scrapes = pd.DataFrame({"source": "vllm", "target": "t0", "ok": 1, "mono_ns": [ns(t) for t in times],
                                "n_samples": 5, "t_s": times,
                                "duration_ns": [int(1e9 * (2.32 - t)) if 1.85 <= t < 2.33 else 1_000_000
                                                for t in times]})
    return run


@pytest.mark.parametrize("case", [_watched_batch, _short_one_inside_a_late_answer,
                                  _ran_ahead_with_the_counter_unread_before_the_stop, _api_server_stalled_across_the_stop],
                         ids=lambda f: f.__name__.strip("_"))
def test_the_engines_own_ends_read_as_a_lost_cancel_only_where_they_cannot_be_anothers(case):
    """A review's counterexamples, each a cancel that reached the engine in time (or a request that had run out before
    it could) where the own ends numbered what the engine held plus what could have entered: a watched row standing
    for two engine requests, an end inside a late answer from a request sent after the read's stamp, a baseline read
    at another sample than the counter's, an API server whose figures froze across the stop. None is leaked."""
    v = verdict_of(case())
    assert v.rule != "ended_by_itself_after_stop" and v.verdict != "leaked", (v.rule, v.evidence.why)
