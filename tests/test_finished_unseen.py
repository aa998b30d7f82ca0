"""A request the engine ended by itself while its client still read it (a slow reader, a hop that buffers)
stands in, in a count at the ledger's, for a cancelled request the engine kept: vllm:request_success_total
says the engine ended it (analysis/verdicts/vllm_case.py, VllmCase.finished_unseen). Small runs of
tests/test_verdicts.py: the neighbour nb reads its stream to 5.5 s; the engine ends it at 2.3 s."""

from __future__ import annotations

import json

import pytest

from cancelwatch.analysis.verdicts import judge_run
from cancelwatch.analysis.watching import LOOKBACK_S, judge_cancels, window_of
from tests.test_verdicts import ADDED, T0, build_run, steady_gen

ENDED_AT = 2.3  # the engine ends nb (its client reads on to 5.5 s)


def run_with(count, kv, engine_log=None, ends=lambda t: float(t >= ENDED_AT), length_s=6.0):
    """`ends(t)`: vllm:request_success_total{finished_reason="length"}; every request asked 500 tokens (at 20
    tokens/s alone, none could run out within the run but nb, whose engine end is said)."""
    run = build_run(count, kv, steady_gen, engine_log=engine_log, series={"requests_finished_total": ends},
                    length_s=length_s)
    s = run.samples
    s.loc[s["metric"] == "requests_finished_total", "labels"] = json.dumps({"finished_reason": "length"})
    run.ledger["max_tokens"] = 500
    return run


def kept(t):  # nb and tg until the engine ends nb: tg runs on
    return 2.0 if t < ENDED_AT else 1.0


def gone(t):  # tg leaves at its abort, nb at its end
    return (2.0 if t < 2.05 else 1.0) if t < ENDED_AT else 0.0


def kv_of(count):
    return lambda t: 0.2 * count(t)


@pytest.mark.parametrize("engine_log", [None, [*ADDED, ("engine_aborted", "tg", 2.01)]], ids=["no_log", "abort_logged"])
def test_a_kept_request_hidden_by_a_slow_readers_end_is_not_released(engine_log):
    # the count (1) is the ledger's without tg from 2.3 s, and KV usage falls (nb's blocks): read as a release
    # before. The engine had ended nb: the one it still counts is tg
    (v,) = judge_run(run_with(kept, kv_of(kept), engine_log))
    assert (v.verdict, v.rule) == ("inconclusive", "finished_unseen"), (v.verdict, v.rule, v.evidence)
    # the count (1) is within the ledger's other requests only by the one the engine ended while its client read on
    r = v.evidence.count_reading
    assert (r["count"], r["others_fewest"], r["others_most"]) == (1.0, 0.0, 1.0), r
    assert [(o["request_id"], o["reason"], o.get("count")) for o in r["open"]] == [(None, "ended_by_itself_unread", 1)], r


@pytest.mark.parametrize("engine_log", [None, [*ADDED, ("engine_aborted", "tg", 2.01)]], ids=["no_log", "abort_logged"])
def test_a_request_that_left_beside_a_slow_reader_is_released(engine_log):
    (v,) = judge_run(run_with(gone, kv_of(gone), engine_log))
    assert (v.verdict, v.rule) == ("released", "released"), (v.verdict, v.rule, v.evidence)
    assert v.timepoints["left_scheduler"] == pytest.approx(2.05, abs=0.001)


def test_a_kept_request_hidden_by_an_end_made_before_the_stop_is_not_released():
    # the engine ended nb at 1.5 s, before the stop (the count one below the ledger there: it ran ahead of its
    # reader); from the abort the count (1) is the ledger's without tg. (With no log, already_finished_no_log
    # says the stop came after the end, inconclusive as well)
    def count(t):
        return 2.0 if t < 1.5 else 1.0

    log = [*ADDED, ("engine_aborted", "tg", 2.01)]
    (v,) = judge_run(run_with(count, kv_of(count), log, ends=lambda t: float(t >= 1.5)))
    assert (v.verdict, v.rule) == ("inconclusive", "finished_unseen"), (v.verdict, v.rule, v.evidence)


def test_an_end_its_client_read_at_once_hides_nothing():
    # nb's client read its end 0.1 s after the engine made it: the ledger no longer counts it there
    count = gone
    run = run_with(count, kv_of(count))
    t0 = run.info["started_mono_ns"]
    run.ledger.loc[run.ledger["request_id"] == "nb", "closed_mono_ns"] = t0 + int(2.4e9)
    (v,) = judge_run(run)
    assert (v.verdict, v.rule) == ("released", "released"), (v.verdict, v.rule, v.evidence)


@pytest.mark.parametrize("labels", ["{}", json.dumps({"finished_reason": "abort"})])
def test_a_counter_that_says_no_end_of_its_own_says_nothing(labels):
    # no reason said (an abort may be in it), or an abort: not a request run to its end. The count is read as
    # it was before (the stand-in unseen: a release)
    run = run_with(kept, kv_of(kept))
    s = run.samples
    s.loc[s["metric"] == "requests_finished_total", "labels"] = labels
    (v,) = judge_run(run)
    assert v.rule != "finished_unseen", (v.rule, v.evidence)


# --- a long run: a watch judges each cancel on its own window (load_window), and must read as the whole run does


def ns(s):
    return T0 + int(s * 1e9)


def with_counter(run, reason="length", max_tokens=500):
    s = run.samples
    s.loc[s["metric"] == "requests_finished_total", "labels"] = json.dumps({"finished_reason": reason})
    run.ledger["max_tokens"] = max_tokens
    return run


def _window(run, lo, hi, lookback):
    """runstore.reader.load_window on an in-memory run: samples in [lo, hi]; events from lo - lookback; the
    ledger rows sent by hi and not closed before lo - lookback."""
    t0, back = run.info["started_mono_ns"], lo - lookback
    s, e, led = run.samples, run.events, run.ledger
    keep = led["sent_mono_ns"].isna() | (led["sent_mono_ns"] <= t0 + hi * 1e9)
    keep &= led["closed_mono_ns"].isna() | (led["closed_mono_ns"] >= t0 + back * 1e9)
    return type(run)(id=run.id, info=dict(run.info), samples=s[(s["t_s"] >= lo) & (s["t_s"] <= hi)].copy(),
                     scrapes=run.scrapes, gaps=run.gaps, events=e[(e["t_s"] >= back) & (e["t_s"] <= hi)].copy(),
                     ledger=led[keep].reset_index(drop=True))


STOP = 70.0


def _late_kept_run():
    def count(t):  # nb and tg; the engine ends nb at STOP + 0.3 (read to STOP + 3.5); tg is kept
        return 2.0 if t < STOP + 0.3 else 1.0

    old = {"request_id": "old", "scenario": "s0", "role": "target", "n": 1, "sent_mono_ns": ns(1.0),
           "first_token_mono_ns": ns(1.1), "closed_mono_ns": ns(1.5), "cancel_mono_ns": ns(1.5),
           "terminal_state": "cancelled"}
    run = build_run(count, kv_of(count), steady_gen, stop_s=STOP, abort_s=STOP + 0.002, extra_ledger=[old],
                    series={"requests_finished_total": lambda t: float(t >= STOP + 0.3)}, length_s=STOP + 6)
    run = with_counter(run)
    run.ledger.loc[run.ledger["request_id"] == "old", "max_tokens"] = 10  # could run out by 1.4 s
    run.ledger.loc[run.ledger["request_id"] == "nb", "closed_mono_ns"] = ns(STOP + 3.5)
    run.ledger.loc[run.ledger["request_id"] == "tg", "sent_mono_ns"] = ns(STOP - 1.5)
    return run


def _kept_beside_a_busy_window():
    def count(t):
        if t < STOP - 3.5:
            return 1.0  # early on, one request alone: the run's solo rate (20 tokens/s)
        # nb, tg, m, ot; ot cancelled (and gone) at STOP - 0.5; the engine ends nb at STOP + 0.3; tg is kept
        return 4.0 if t < STOP - 0.5 else (3.0 if t < STOP + 0.3 else 2.0)

    rows = [{"request_id": "m", "scenario": "s3", "role": "neighbour", "n": 1, "sent_mono_ns": ns(STOP - 2.5),
             "first_token_mono_ns": ns(STOP - 2.4), "closed_mono_ns": ns(STOP + 5.0), "cancel_mono_ns": None,
             "terminal_state": "completed"},
            {"request_id": "ot", "scenario": "s4", "role": "neighbour", "n": 1, "sent_mono_ns": ns(STOP - 3.0),
             "first_token_mono_ns": ns(STOP - 2.9), "closed_mono_ns": ns(STOP - 0.5),
             "cancel_mono_ns": ns(STOP - 0.5), "terminal_state": "cancelled"}]
    run = build_run(count, kv_of(count), steady_gen, stop_s=STOP, abort_s=STOP + 0.002, extra_ledger=rows,
                    series={"requests_finished_total": lambda t: float(t >= STOP + 0.3)}, length_s=STOP + 6)
    run = with_counter(run)
    led = run.ledger
    led.loc[led["request_id"] == "nb", ["sent_mono_ns", "first_token_mono_ns", "closed_mono_ns"]] = \
        [ns(STOP - 1.8), ns(STOP - 1.7), ns(STOP + 3.5)]
    led.loc[led["request_id"] == "tg", ["sent_mono_ns", "first_token_mono_ns"]] = [ns(STOP - 1.5), ns(STOP - 1.4)]
    return run


def test_a_cancel_long_gone_explains_no_end_of_the_engines_in_the_stretch():
    # a cancel at 1.5 s that could have run out by 1.4 s: gone long before (the engine counts nothing beyond the
    # ledger at the stretch's start), it cannot be the request the engine ended at STOP + 0.3 s
    (v,) = judge_run(_late_kept_run())
    assert (v.verdict, v.rule) == ("inconclusive", "finished_unseen"), (v.verdict, v.rule, v.evidence.why)


@pytest.mark.parametrize("build", [_late_kept_run, _kept_beside_a_busy_window], ids=["cancel_long_gone", "busy_window"])
def test_the_live_window_judges_as_the_whole_run(build):
    run = build()
    (whole,) = judge_run(run)
    lo, hi = window_of(STOP, 2.0)
    (live,) = judge_cancels(_window(run, lo, hi, LOOKBACK_S), {"tg"}, 2.0)
    # the same rate and the same requests to explain the engine's ends by: where nothing ran alone in the window,
    # neither knows how soon a cancel of the driver's could have run out, and each lets it explain the end
    assert (live.verdict, live.rule) == (whole.verdict, whole.rule), (live.evidence.why, whole.evidence.why)
