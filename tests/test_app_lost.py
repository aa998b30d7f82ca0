"""An explicit cancel the app loses (analysis/verdicts: app_lost_cancel). The client of an explicit cancel
reads on until the app ends the stream, so a lost cancel shows as a request that ran to its end: leaked
where the engine's own samples show it went on with the request across the grace, never on the client's
tokens alone (a hop that buffers delivers tokens the engine made before the stop)."""

from __future__ import annotations

import json

import pandas as pd

from cancelwatch.analysis.verdicts import judge_run
from tests.test_verdicts import T0, build_run, steady_gen


def ns(s: float) -> int:
    return T0 + int(s * 1e9)


def answered(run, answer: str = "cancelled", end_s: float = 5.0, tokens: int = 60, relay_readings: bool = False):
    """The target's explicit cancel at 2 s, answered `answer` by the app 5 ms later; the client then read
    `tokens` more to the request's end at `end_s` (completed). The relay's own readings (app received,
    engine abort) only with `relay_readings`: an answer made up on the way carries none."""
    tg = run.ledger["request_id"] == "tg"
    run.ledger.loc[tg, ["terminal_state", "closed_mono_ns"]] = ["completed", ns(end_s)]
    run.ledger["tokens_after_cancel"] = [0] * len(run.ledger)
    run.ledger.loc[tg, "tokens_after_cancel"] = tokens
    ev = run.events
    if not relay_readings:
        ev = ev[~ev["kind"].isin(["app_received", "engine_abort"])]
    ans = {"request_id": "tg", "kind": "app_answered", "mono_ns": ns(2.005), "wall_ns": 0, "t_s": 2.005,
           "data": json.dumps({"cancel_id": "c1", "answer": answer, "source": "app", "metrics_target": "t0"})}
    run.events = pd.concat([ev, pd.DataFrame([ans])], ignore_index=True).sort_values("mono_ns")
    return run


def reading(v):
    """The count reading a lost cancel's verdict rests on: (at_s, count, others_fewest, others_most, compared_with,
    the open requests as (id, reason))."""
    r = v.evidence.count_reading
    return (r["at_s"], r["count"], r["others_fewest"], r["others_most"], r["compared_with"],
            [(o["request_id"], o["reason"]) for o in r["open"]])


def in_engine_until(end_s: float):
    """The server counts the neighbour and the target until `end_s`, then the neighbour alone."""
    return lambda t: 2.0 if t < end_s else 1.0


def test_a_cancel_the_app_answered_while_the_engine_ran_on_is_leaked():
    (v,) = judge_run(answered(build_run(in_engine_until(5.0), lambda t: 0.4, steady_gen)))
    assert (v.verdict, v.rule) == ("leaked", "app_lost_cancel"), v
    assert v.evidence.kept_running_ms == 3000.0 and v.evidence.app_answer == "cancelled", v.evidence
    # what it read: at the grace's last sample the server counted the target beside the neighbour
    assert reading(v) == (4.0, 2.0, 1.0, 1.0, 2.0, []), v.evidence.count_reading


def test_the_answer_is_named_whatever_the_app_said():
    # a replica that does not hold the request keeps the cancel for later, or an app refuses the owner
    for answer in ("kept_until_registered", "rejected_not_owner", "HTTP 404"):
        (v,) = judge_run(answered(build_run(in_engine_until(5.0), lambda t: 0.4, steady_gen), answer))
        assert (v.verdict, v.rule, v.evidence.app_answer) == ("leaked", "app_lost_cancel", answer), v


def test_tokens_a_buffering_hop_held_back_are_not_a_lost_cancel():
    # the engine was done with the target at 1.8 s, before the stop; the client read its last tokens to 5 s:
    # not a leak, and not a race either
    (v,) = judge_run(answered(build_run(in_engine_until(1.8), lambda t: 0.4, steady_gen)))
    assert (v.verdict, v.rule) == ("inconclusive", "app_lost_unconfirmed"), v


def test_an_app_that_says_the_request_had_ended_is_the_race():
    (v,) = judge_run(answered(build_run(in_engine_until(5.0), lambda t: 0.4, steady_gen), "already_completed"))
    assert (v.verdict, v.rule) == ("inconclusive", "completion_won_race"), v


def test_a_neighbour_whose_end_reaches_its_client_a_moment_late_does_not_hide_the_loss():
    # the engine ended the neighbour at 3.00 s; its client read the end at 3.1 s (a hop's delay)
    run = build_run(lambda t: 2.0 if t < 3.0 else 1.0, lambda t: 0.4, steady_gen)
    run.ledger.loc[run.ledger["request_id"] == "nb", "closed_mono_ns"] = ns(3.1)
    (v,) = judge_run(answered(run, end_s=5.0))
    assert (v.verdict, v.rule) == ("leaked", "app_lost_cancel"), v


def test_a_nan_sample_in_the_grace_is_left_out_not_read_as_a_fall():
    run = answered(build_run(in_engine_until(5.0), lambda t: 0.4, steady_gen))
    s = run.samples
    s.loc[(s["metric"] == "requests_waiting") & (s["t_s"].between(2.49, 2.51)), "value"] = float("nan")
    (v,) = judge_run(run)
    assert (v.verdict, v.rule) == ("leaked", "app_lost_cancel"), v


def test_two_targets_stopped_together_cannot_be_told_apart_by_the_count():
    # a second target of the scenario, stopped with the first: the server's count cannot say which it kept
    second = {"request_id": "tb", "scenario": "s", "role": "target", "n": 1, "sent_mono_ns": ns(0.5),
              "first_token_mono_ns": ns(0.8), "closed_mono_ns": ns(2.01), "cancel_mono_ns": ns(2.0),
              "terminal_state": "cancelled"}
    run = answered(build_run(lambda t: 3.0 if t < 2.05 else 2.0, lambda t: 0.4, steady_gen, extra_ledger=[second]))
    tg = [v for v in judge_run(run) if v.request_id == "tg"]
    assert [(v.verdict, v.rule) for v in tg] == [("inconclusive", "app_lost_unconfirmed")], tg


def test_a_completion_a_few_tokens_after_the_stop_is_the_race():
    (v,) = judge_run(answered(build_run(in_engine_until(5.0), lambda t: 0.4, steady_gen), tokens=3))
    assert (v.verdict, v.rule) == ("inconclusive", "completion_won_race"), v


def test_an_end_inside_the_grace_is_not_called_lost():
    (v,) = judge_run(answered(build_run(in_engine_until(3.5), lambda t: 0.4, steady_gen), end_s=3.5, tokens=30))
    assert v.rule != "app_lost_cancel", v


def test_without_an_explicit_cancel_a_completion_stays_the_race():
    run = answered(build_run(in_engine_until(5.0), lambda t: 0.4, steady_gen))
    run.events = run.events[run.events["kind"] != "app_answered"]
    (v,) = judge_run(run)
    assert (v.verdict, v.rule) == ("inconclusive", "completion_won_race"), v


def test_an_engine_that_stopped_stepping_is_not_called_lost():
    # the server still counted the target, but no token was generated across the grace: not the engine's word
    (v,) = judge_run(answered(build_run(in_engine_until(5.0), lambda t: 0.4, lambda t: 100.0)))
    assert v.rule != "app_lost_cancel", v


def test_a_request_sent_a_moment_before_a_sample_is_not_yet_the_engines():
    # a probe sent at 3.00 s enters the server's count at 3.10 s (a hop and the API server hand it on): the
    # sample at 3.05 s counts the ledger's open requests less that one, and the engine still held the target
    probe = {"request_id": "pr", "scenario": "s", "role": "probe", "n": 1, "sent_mono_ns": ns(3.0),
             "first_token_mono_ns": ns(3.3), "closed_mono_ns": ns(3.4), "cancel_mono_ns": None,
             "terminal_state": "completed"}
    run = build_run(lambda t: 3.0 if 3.1 <= t < 3.4 else 2.0, lambda t: 0.4, steady_gen, extra_ledger=[probe])
    (v,) = [v for v in judge_run(answered(run)) if v.request_id == "tg"]
    assert (v.verdict, v.rule) == ("leaked", "app_lost_cancel"), v


def test_what_keeps_a_lost_cancel_unconfirmed_is_named():
    # the server stopped counting the target at 2.5 s, inside the grace, though its client read on to 5 s
    (v,) = judge_run(answered(build_run(in_engine_until(2.5), lambda t: 0.4, steady_gen)))
    assert (v.verdict, v.rule) == ("inconclusive", "app_lost_unconfirmed"), v
    assert reading(v) == (2.5, 1.0, 1.0, 1.0, 2.0, []), v.evidence.count_reading  # the neighbour alone
    # and too few samples: the scrapes answered once in the grace
    run = answered(build_run(in_engine_until(5.0), lambda t: 0.4, steady_gen))
    s = run.samples
    s.loc[s["t_s"].between(1.99, 3.99), "value"] = float("nan")
    (v,) = judge_run(run)
    assert v.rule == "app_lost_unconfirmed" and v.evidence.count_reading is None, v  # no sample to read
    assert "scheduler sample(s) answered in the grace" in v.evidence.why, v


def test_a_scrape_that_answered_late_is_read_where_it_may_have_been_taken():
    # the engine ended the neighbour at 3.0 s, its client read the end at 3.6 s; the app answered each /metrics
    # of 2.9-3.6 s 0.8 s after its tick (busy generating): those readings may come from after the neighbour's
    # close, and the engine still held the target across the grace
    run = build_run(lambda t: 2.0 if t < 3.0 else 1.0, lambda t: 0.4, steady_gen)
    run.ledger.loc[run.ledger["request_id"] == "nb", "closed_mono_ns"] = ns(3.6)
    run.scrapes = sc = run.samples.drop_duplicates("scrape_id")[
        ["scrape_id", "t_s", "source", "target", "mono_ns", "duration_ns"]].assign(ok=1).reset_index(drop=True)
    sc.loc[sc["t_s"].between(2.9, 3.6), "duration_ns"] = int(0.8e9)
    (v,) = judge_run(answered(run, end_s=5.0))
    assert (v.verdict, v.rule) == ("leaked", "app_lost_cancel"), v
    # answered at once, the same readings are the engine's at their ticks: one short of the ledger
    sc.loc[sc["t_s"].between(2.9, 3.6), "duration_ns"] = 1
    (v,) = judge_run(run)
    assert v.rule == "app_lost_unconfirmed" and reading(v)[1:5] == (1.0, 1.0, 1.0, 2.0), v


def neighbour_read_late(engine_end_s: float, read_s: float, target_gone_s: float = 5.0):
    """The engine ended the neighbour at `engine_end_s` and its client read that end at `read_s` (a hop that
    held its last tokens back); the engine held the target until `target_gone_s`."""
    run = build_run(lambda t: (t < engine_end_s) + (t < target_gone_s) + 0.0, lambda t: 0.4, steady_gen)
    run.ledger.loc[run.ledger["request_id"] == "nb", "closed_mono_ns"] = ns(read_s)
    return answered(run, end_s=5.0)


def test_a_neighbour_the_engine_ended_before_the_stop_does_not_hide_the_loss_once_read():
    # CI: the engine ran ahead of the client on the neighbour just before the stop (the server counted 1, the
    # ledger 2), so the count there cannot say which request was gone; once the neighbour's end was read
    # (2.6 s), the target was the run's only open request and the server still counted it, generating
    (v,) = judge_run(neighbour_read_late(1.8, 2.6))
    assert v.evidence.count_before == 1.0 and v.evidence.ledger_before == 2.0, v.evidence
    assert (v.verdict, v.rule) == ("leaked", "app_lost_cancel"), v


def test_a_neighbour_read_after_the_grace_leaves_the_engine_ahead_unconfirmed():
    # the neighbour's end reached its client only after the grace: no sample of the grace tells the two apart
    (v,) = judge_run(neighbour_read_late(1.8, 4.5))
    assert (v.verdict, v.rule) == ("inconclusive", "app_lost_unconfirmed"), v
    assert (v.evidence.count_before, v.evidence.ledger_before, v.evidence.count_reading) == (1.0, 2.0, None), v.evidence


def test_a_target_the_engine_ended_early_is_not_confirmed_by_a_neighbour_read_late():
    # the engine ended the target at 1.9 s (a hop held its tokens back to 5 s) and the neighbour at 1.8 s,
    # read at 2.6 s: from then the server counts nothing where the ledger holds the target
    (v,) = judge_run(neighbour_read_late(1.8, 2.6, target_gone_s=1.9))
    assert (v.verdict, v.rule) == ("inconclusive", "app_lost_unconfirmed"), v
    assert reading(v) == (2.9, 0.0, 0.0, 0.0, 1.0, []), v.evidence.count_reading  # the target's place empty


def test_a_sample_a_probe_might_stand_in_at_is_not_read_when_the_engine_ran_ahead():
    # the engine ended the target at 3.0 s; a probe sent at 2.95 s enters at 3.0 s, so the server's count
    # stays at 1. The samples at 2.95-3.2 s, where the probe is starting, could be the probe alone; later
    # ones count 1 where the ledger holds 2
    probe = {"request_id": "pr", "scenario": "s", "role": "probe", "n": 1, "sent_mono_ns": ns(2.95),
             "first_token_mono_ns": ns(3.05), "closed_mono_ns": ns(5.8), "cancel_mono_ns": None,
             "terminal_state": "completed"}
    run = build_run(lambda t: (t < 1.8) + (t < 3.0) + (t >= 3.0) + 0.0, lambda t: 0.4, steady_gen,
                    extra_ledger=[probe])
    run.ledger.loc[run.ledger["request_id"] == "nb", "closed_mono_ns"] = ns(2.6)
    (v,) = [v for v in judge_run(answered(run, end_s=5.0)) if v.request_id == "tg"]
    assert (v.verdict, v.rule) == ("inconclusive", "app_lost_unconfirmed"), v


def test_a_request_sent_while_a_slow_scrape_was_answered_does_not_stand_in_for_the_target():
    # the engine ended the target at 2.3 s (a hop held its tokens back to 5 s); from 2.2 s the app answered
    # each /metrics 1.8 s after its tick (busy), so the readings from 2.2 s on count a probe sent at 3.9 s
    # that the ledger holds only from then: the count must not be read as the target's
    span = 1.8
    engine = lambda t: 1 + (t < 2.3) + (t >= 3.9) + 0.0  # noqa: E731 - the neighbour, the target, the probe
    probe = {"request_id": "pr", "scenario": "s", "role": "probe", "n": 1, "sent_mono_ns": ns(3.9),
             "first_token_mono_ns": ns(4.0), "closed_mono_ns": ns(6.5), "cancel_mono_ns": None,
             "terminal_state": "completed"}
    late = lambda t: t + span if t >= 2.2 else t  # noqa: E731 - when the server read its gauges
    run = build_run(lambda t: engine(late(t)), lambda t: 0.4, lambda t: steady_gen(late(t)), extra_ledger=[probe])
    run.scrapes = sc = run.samples.drop_duplicates("scrape_id")[
        ["scrape_id", "t_s", "source", "target", "mono_ns", "duration_ns"]].assign(ok=1).reset_index(drop=True)
    sc.loc[sc["t_s"] >= 2.2, "duration_ns"] = int(span * 1e9)
    (v,) = [v for v in judge_run(answered(run, end_s=5.0)) if v.request_id == "tg"]
    assert (v.verdict, v.rule) == ("inconclusive", "app_lost_unconfirmed"), v
    # read at 4.0 s, the count (2) holds the probe: with it, the target's place must have held 3
    assert reading(v) == (2.2, 2.0, 1.0, 1.0, 3.0, [("pr", "sent_during_its_scrape")]), v.evidence.count_reading
