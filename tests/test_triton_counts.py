"""Triton without its log: the model's count read as a change from its last reading before the stop (TritonCase.
others_bounds), on the recorded suite (tests/fixtures/triton/suite_run.db) with worlds built into it that fit what the
run recorded. Each world's truth is known by construction; the verdict must not say the other (inconclusive is
allowed where the readings cannot tell)."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from tests.test_triton_verdicts import RUN, _ns, _stop_of, without_log
from cancelwatch.analysis.verdicts import judge_run
from cancelwatch.runstore.reader import load_run

GEN, SLOW = {"model": "generator"}, {"model": "slow"}


@pytest.fixture
def run():
    return without_log(load_run(RUN, "latest"))


def judged(run, scenario: str, **kw) -> dict[str, tuple[str, str]]:
    return {v.request_id: (v.verdict, v.rule) for v in judge_run(run, **kw) if v.scenario == scenario}


def gauge(run, metric: str, labels: dict, lo: float, hi: float, value: float | None = None, add: float = 0.0) -> None:
    s = run.samples.copy()
    rows = (s["metric"] == metric) & (s["labels"].astype(str) == json.dumps(labels)) & (s["t_s"] >= lo) & \
        (s["t_s"] < hi)
    s.loc[rows, "value"] = float(value) if value is not None else s.loc[rows, "value"] + add
    run.samples = s


def request(run, rid: str, model: str, sent: float, closed: float, *, cancel: float | None = None,
            state: str = "completed", scenario: str = "triton_executing", role: str = "neighbour") -> None:
    row = {**run.ledger[run.ledger["role"] == "neighbour"].iloc[0].to_dict(), "request_id": rid, "scenario": scenario,
           "role": role, "sent_mono_ns": _ns(run, sent), "first_token_mono_ns": None, "closed_mono_ns": _ns(run, closed),
           "cancel_mono_ns": None if cancel is None else _ns(run, cancel), "terminal_state": state}
    run.ledger = pd.concat([run.ledger, pd.DataFrame([row])], ignore_index=True)
    event = {"request_id": rid, "kind": "request_sent", "wall_ns": 0, "mono_ns": _ns(run, sent), "t_s": sent,
             "data": json.dumps({"scenario": scenario, "role": role, "model": model})}
    run.events = pd.concat([run.events, pd.DataFrame([event])], ignore_index=True).sort_values("t_s", kind="stable")


def scrape_took(run, t: float, seconds: float) -> None:
    sc = run.scrapes.copy()
    rows = (sc["source"] == "triton") & ((sc["t_s"] - t).abs() < 0.003)
    assert rows.sum() == 1
    sc.loc[rows, "duration_ns"] = int(seconds * 1e9)
    run.scrapes = sc


def target_of(run, scenario: str) -> str:
    ledger = run.ledger
    return ledger[(ledger["scenario"] == scenario) & (ledger["role"] == "target")]["request_id"].iloc[0]


def test_a_baseline_scrape_answered_after_the_stop_may_not_hold_the_target(run):
    # the last scrape before the stop (6.900) took 20 ms: the model dropped the target at 6.912, the gauge was read
    # at 6.915 with the neighbour alone, and stayed there: released, never leaked
    scrape_took(run, 6.900, 0.020)
    gauge(run, "model_active_requests", GEN, 6.89, 7.0, value=1)
    assert judged(run, "triton_executing")[target_of(run, "triton_executing")][0] != "leaked"


def test_a_request_whose_client_saw_an_error_may_run_on(run):
    # a neighbour whose call failed at its client at 7.02 (a dropped connection: no cancel), run on to 12.0 by the
    # server; the target released at 7.0 as recorded. Its unit is not the target's
    request(run, "E", "generator", sent=5.0, closed=7.02, state="error")
    gauge(run, "model_active_requests", GEN, 5.05, 12.0, add=1)
    assert judged(run, "triton_executing")[target_of(run, "triton_executing")][0] != "leaked"


def test_a_completed_request_may_be_counted_just_after_its_client_read_its_end(run):
    # M's client read its end at 8.899; the model let its unit go at 8.902, after the 8.900 reading. M2, stopped by its
    # client at 6.50 and gone at 6.52, may still be in as far as the ledger knows
    request(run, "M", "generator", sent=5.0, closed=8.899)
    gauge(run, "model_active_requests", GEN, 5.05, 8.901, add=1)
    request(run, "M2", "generator", sent=5.5, closed=6.501, cancel=6.50, state="cancelled")
    gauge(run, "model_active_requests", GEN, 5.55, 6.52, add=1)
    assert judged(run, "triton_executing")[target_of(run, "triton_executing")][0] != "leaked"


def test_a_slow_baseline_scrape_answered_after_later_readings_does_not_order_them(run):
    # the baseline scrape (6.900) took 500 ms and read the gauge at about 7.38; R, in at every reading up to 7.30,
    # had left by then. Read as if the baseline came first, R could not have entered since, and the target's
    # leaving (at 6.93) read as a leak
    ledger = run.ledger
    run.ledger = ledger[~((ledger["scenario"] == "triton_executing") & (ledger["role"] == "probe"))]
    tg = (run.ledger["scenario"] == "triton_executing") & (run.ledger["role"] == "target")
    run.ledger.loc[tg, ["sent_mono_ns", "first_token_mono_ns"]] = [_ns(run, 6.85), None]
    stop = (run.events["kind"] == "user_stop") & run.events["data"].str.contains("triton_executing")
    run.events.loc[stop, "data"] = run.events.loc[stop, "data"].map(
        lambda d: json.dumps({**json.loads(d), "tokens_at_cancel": 0, "sent_mono_ns": _ns(run, 6.85)}))
    request(run, "R", "generator", sent=5.0, closed=7.35)
    gauge(run, "model_active_requests", GEN, 5.05, 6.86, add=1)
    gauge(run, "model_active_requests", GEN, 6.86, 7.33, value=2)
    gauge(run, "model_active_requests", GEN, 7.33, 10.4, value=1)
    gauge(run, "model_active_requests", GEN, 6.89, 6.91, value=1)
    scrape_took(run, 6.900, 0.5)
    assert judged(run, "triton_executing", grace_s=0.4)[target_of(run, "triton_executing")][0] != "leaked"


def test_one_reading_between_the_queue_and_the_model_is_no_release(run):
    # U, queued behind the http_timeout target, its cancel never reaching the server, is dispatched when that ends
    # (33.2); the 33.200 reading falls between the core's queue and the model's count (pending 0, active 0), then U
    # runs to 35.7. The one low reading is not U gone: the count rises after it beyond any other's entry
    ledger = run.ledger
    run.ledger = ledger[~((ledger["scenario"] == "triton_http_timeout") & (ledger["role"] == "probe"))]
    request(run, "U", "slow", sent=31.80, closed=32.301, cancel=32.30, state="cancelled",
            scenario="triton_http_timeout", role="target")
    stop = run.events[(run.events["kind"] == "user_stop") & run.events["data"].str.contains("triton_http_timeout")]
    row = stop.iloc[0].to_dict()
    data = {**json.loads(row["data"]), "sent_mono_ns": _ns(run, 31.80), "cancel_id": "U", "inputs": {"MS": 2500}}
    row.update(request_id="U", t_s=32.30, mono_ns=_ns(run, 32.30), data=json.dumps(data))
    run.events = pd.concat([run.events, pd.DataFrame([row])], ignore_index=True).sort_values("t_s", kind="stable")
    gauge(run, "triton_pending_requests", {**SLOW, "version": "1"}, 31.85, 33.2, value=1)
    gauge(run, "model_active_requests", SLOW, 33.21, 35.7, value=1)
    assert judged(run, "triton_http_timeout")["U"][0] != "released"


@pytest.mark.parametrize("change", ["no_ledger_row", "never_sent", "sent_as_another_model"])
def test_a_target_the_ledger_does_not_place_is_judged_without_a_fault(run, change):
    rid = target_of(run, "triton_executing")
    row = run.ledger["request_id"] == rid
    if change == "no_ledger_row":
        run.ledger = run.ledger[~row]
    elif change == "never_sent":
        run.ledger.loc[row, "sent_mono_ns"] = None
    else:
        sent = (run.events["kind"] == "request_sent") & (run.events["request_id"] == rid)
        run.events.loc[sent, "data"] = run.events.loc[sent, "data"].map(
            lambda d: json.dumps({**json.loads(d), "model": "slow"}))
    assert rid in judged(run, "triton_executing")


def _queued_twin(run, *, stopped: bool = True) -> tuple[str, str]:
    """The queued scenario with Q2, a second slow request sent after its target and stopped 30 ms before it, with no
    answer: the core's one CANCELED drop (1.10 s) may be Q2's. The world built: it was Q2's, and the target stayed in
    the queue to 3.0 s (past the grace), the pending gauge one higher from Q2's send to then."""
    t_stop = _stop_of(run, "triton_queued")
    request(run, "Q2", "slow", sent=0.54, closed=t_stop - 0.03 + 0.001, cancel=t_stop - 0.03, state="cancelled",
            scenario="triton_queued", role="neighbour")
    if stopped:
        stop = run.events[(run.events["kind"] == "user_stop") & run.events["data"].str.contains("triton_queued")]
        row = stop.iloc[0].to_dict()
        data = {**json.loads(row["data"]), "sent_mono_ns": _ns(run, 0.54), "cancel_id": "Q2"}
        row.update(request_id="Q2", t_s=t_stop - 0.03, mono_ns=_ns(run, t_stop - 0.03), data=json.dumps(data))
        run.events = pd.concat([run.events, pd.DataFrame([row])], ignore_index=True).sort_values("t_s", kind="stable")
    gauge(run, "triton_pending_requests", {**SLOW, "version": "1"}, 0.54, 3.0, add=1)
    return target_of(run, "triton_queued"), "Q2"


@pytest.mark.parametrize("log", [True, False], ids=["log", "no_log"])
@pytest.mark.parametrize("stopped", [True, False], ids=["q2_stopped", "q2_closed"])
def test_a_canceled_drop_another_stopped_request_may_have_made_is_not_this_ones(log, stopped):
    # one CANCELED rise, two requests of the model stopped before any answer: it is one of theirs, and the target may
    # be the one still queued. Read as the target's drop, it was released whatever the other did. Q2's client may
    # also just have closed its call (no stop the run made): gRPC cancels it all the same
    run = load_run(RUN, "latest")
    run = run if log else without_log(run)
    target, q2 = _queued_twin(run, stopped=stopped)
    got = {v.request_id: v for v in judge_run(run) if v.scenario == "triton_queued"}
    assert got[target].verdict != "released", got[target].rule
    if log:  # the log names neither as started: only the count can tell, and it cannot
        assert got[target].rule == "canceled_rise_shared"
        assert [o["request_id"] for o in got[target].evidence.count_reading["open"]] == [q2]
    if stopped:
        assert got[q2].verdict != "leaked"


def test_a_rise_that_holds_every_request_that_may_have_made_it_releases_each():
    # the same, but the core counted two drops at 1.10 s: both were dropped, each is released by it
    run = load_run(RUN, "latest")
    target, q2 = _queued_twin(run)
    gauge(run, "triton_pending_requests", {**SLOW, "version": "1"}, 0.54, 3.0, add=-1)  # as recorded
    gauge(run, "triton_request_failure_total", {**SLOW, "reason": "CANCELED", "version": "1"}, 1.09, 99.0, add=1)
    got = {v.request_id: (v.verdict, v.rule) for v in judge_run(run) if v.scenario == "triton_queued"}
    assert got[target] == ("released", "dropped_in_queue") and got[q2] == ("released", "dropped_in_queue")


PEND, CANC = {**SLOW, "version": "1"}, {**SLOW, "reason": "CANCELED", "version": "1"}


def _stop(run, rid: str, t: float, sent: float, scenario: str = "triton_queued", **data) -> None:
    """A stop of `rid` at `t` (s), its data the queued target's with `data` over it."""
    stop = run.events[(run.events["kind"] == "user_stop") & run.events["data"].str.contains("triton_queued")]
    row = stop.iloc[0].to_dict()
    row.update(request_id=rid, t_s=t, mono_ns=_ns(run, t), data=json.dumps(
        {**json.loads(row["data"]), "scenario": scenario, "sent_mono_ns": _ns(run, sent), "cancel_id": rid, **data}))
    run.events = pd.concat([run.events, pd.DataFrame([row])], ignore_index=True).sort_values("t_s", kind="stable")


def _move_stop(run, rid: str, t: float) -> None:
    ev = run.events.copy()
    at = (ev["kind"] == "user_stop") & (ev["request_id"] == rid)
    ev.loc[at, ["t_s", "mono_ns"]] = [t, _ns(run, t)]
    run.events = ev.sort_values("t_s", kind="stable").reset_index(drop=True)
    ledger = run.ledger.copy()
    ledger.loc[ledger["request_id"] == rid, ["cancel_mono_ns", "closed_mono_ns"]] = [_ns(run, t), _ns(run, t + 0.001)]
    run.ledger = ledger


def _no_probe(run, scenario: str = "triton_queued") -> None:
    ledger = run.ledger
    probe = ledger[(ledger["scenario"] == scenario) & (ledger["role"] == "probe")]["request_id"].iloc[0]
    run.ledger = ledger[ledger["request_id"] != probe].reset_index(drop=True)
    run.events = run.events[run.events["request_id"] != probe].reset_index(drop=True)


def _failed_scrapes(run, *times: float) -> None:
    sc, s = run.scrapes.copy(), run.samples
    for t in times:
        rows = (sc["source"] == "triton") & ((sc["t_s"] - t).abs() < 0.003)
        assert rows.sum() == 1
        sc.loc[rows, "ok"] = 0
        s = s[s["scrape_id"] != sc.loc[rows, "id"].iloc[0]]
    run.scrapes, run.samples = sc, s.reset_index(drop=True)


def test_a_request_seen_gone_by_the_gauge_may_not_be_counted_dropped_yet(run):
    # Y (queued at the head, stopped at 0.72) is dropped at 1.059: the 1.05 scrape, answered 20 ms late, shows it gone
    # from the queue but not yet counted CANCELED (the counter is written before the gauges), and the next two
    # scrapes failed. The target T, stopped at 1.18 with grace 0.5, stays queued to 1.76 and is counted from 1.8.
    # Taking Y's drop as counted by the last reading before T's stop, because Y's verdict saw it gone there, read
    # Y's drop (+1 at 1.2) as T's: released. Truth: T was queued past its grace (found by a review)
    t = target_of(run, "triton_queued")
    _no_probe(run)
    gauge(run, "triton_pending_requests", PEND, 1.06, 3.19, add=-1)
    gauge(run, "model_active_requests", SLOW, 3.19, 3.21, add=-1)
    request(run, "Y", "slow", sent=0.355, closed=0.721, cancel=0.72, state="cancelled", scenario="triton_queued",
            role="target")
    _stop(run, "Y", 0.72, 0.355, inputs={"MS": 3000})
    gauge(run, "triton_pending_requests", PEND, 0.36, 1.04, add=1)
    scrape_took(run, 1.05, 0.02)
    gauge(run, "triton_pending_requests", PEND, 1.04, 1.06, value=3)
    gauge(run, "model_active_requests", SLOW, 1.04, 1.06, value=1)
    _move_stop(run, t, 1.18)
    gauge(run, "triton_pending_requests", PEND, 1.06, 1.76, add=1)
    gauge(run, "triton_request_failure_total", CANC, 1.77, 99.0, add=1)
    _failed_scrapes(run, 1.10, 1.15)
    got = judged(run, "triton_queued", grace_s=0.5)
    assert got[t][0] != "released" and got["Y"][0] != "leaked", got


def test_a_drop_counted_before_the_stop_is_the_earlier_requests_and_the_next_one_is_this_ones():
    # Z (no stop of the run's: its client closed its call) queued 0.34 to its drop at 1.059, counted at 1.1; the target
    # stopped at 1.3 and dropped at 1.76, counted from 1.8. Two drops for two requests: the second is the target's
    for log in (True, False):
        run = load_run(RUN, "latest")
        run = run if log else without_log(run)
        t = target_of(run, "triton_queued")
        request(run, "Z", "slow", sent=0.34, closed=0.601, cancel=0.60, state="cancelled", scenario="triton_queued")
        gauge(run, "triton_pending_requests", PEND, 0.345, 1.06, add=1)
        _move_stop(run, t, 1.30)
        gauge(run, "triton_pending_requests", PEND, 1.06, 1.76, add=1)
        gauge(run, "triton_request_failure_total", CANC, 1.77, 99.0, add=1)
        assert judged(run, "triton_queued")[t] == ("released", "dropped_in_queue"), log


def test_a_request_the_models_log_names_as_started_after_the_grace_was_never_dropped():
    # the queued target's call carries no cancel (HTTP), and the model logs it started at 3.163, after its grace
    # (2.927); O, another client's request queued 0.45 to 1.059, was cancelled and dropped (+1 at 1.1). The drop
    # was read as the target's: released. Truth: queued through the grace, then run for nobody
    run = load_run(RUN, "latest")
    t = target_of(run, "triton_queued")
    ev = run.events.copy()
    at = (ev["kind"] == "user_stop") & (ev["request_id"] == t)
    ev.loc[at, "data"] = ev.loc[at, "data"].map(
        lambda d: json.dumps({**json.loads(d), "mode": "http_timeout", "inputs": {"MS": 60000}}))
    run.events = ev
    _no_probe(run)
    row = run.events[(run.events["kind"] == "engine_added")
                     & run.events["request_id"].str.contains("filler-62205914")].iloc[0].to_dict()
    row.update(request_id=t, t_s=3.163, mono_ns=_ns(run, 3.163), data=json.dumps(
        {**json.loads(row["data"]), "engine_request_id": t, "detail": "started ms=60000 poll=true"}))
    run.events = pd.concat([run.events, pd.DataFrame([row])], ignore_index=True).sort_values("t_s", kind="stable")
    gauge(run, "triton_pending_requests", PEND, 0.44, 1.06, add=1)
    gauge(run, "model_active_requests", SLOW, 3.19, 99.0, value=1)
    assert judged(run, "triton_queued")[t][0] == "leaked"


def _slow_target(run, stop: float) -> None:
    """W, a slow request of 1210 ms sent at 8.10 (its own end 9.31 at the soonest), stopped at `stop`, with no answer:
    the gauges say when it ran."""
    request(run, "W", "slow", sent=8.10, closed=stop + 0.001, cancel=stop, state="cancelled", scenario="triton_extra",
            role="target")
    _stop(run, "W", stop, 8.10, scenario="triton_extra", inputs={"MS": 1210}, phase="executing")


def test_a_fall_before_the_latest_natural_end_of_a_request_that_queued_is_no_end_of_its_own(run):
    # W (slow, 1210 ms) queued behind F from its send at 8.10 to 8.996, ran, was stopped at 9.19 and dropped by the
    # model at 9.22. Its end from its send is 9.31, but queued it was 10.21: a fall at 9.22 read as its own end
    # made it leaked (gauge_up_to_natural_end). Truth: the cancel worked
    request(run, "F", "slow", sent=8.00, closed=9.00, scenario="triton_extra")
    _slow_target(run, 9.19)
    gauge(run, "model_active_requests", SLOW, 8.04, 9.21, add=1)
    gauge(run, "triton_pending_requests", PEND, 8.14, 8.96, add=1)
    assert judged(run, "triton_extra")["W"][0] != "leaked"


@pytest.mark.parametrize("log", [True, False], ids=["log", "no_log"])
def test_a_stopped_request_with_no_ledger_row_may_have_made_the_drop(log):
    # the twin world with Q2's row never written (a run cut off before its scenario's rows were): its send and stop
    # events remain, and the one drop may be its. Read from the ledger alone, the drop was the target's
    run = load_run(RUN, "latest")
    run = run if log else without_log(run)
    target, q2 = _queued_twin(run)
    run.ledger = run.ledger[run.ledger["request_id"] != q2].reset_index(drop=True)
    assert judged(run, "triton_queued")[target][0] != "released"


def test_a_fall_answered_before_the_soonest_natural_end_is_a_cancels_work(run):
    # W (slow, 1210 ms from its send at 8.10: 9.31 at the soonest), stopped at 9.19 and let go by the model at 9.21,
    # read gone at 9.25: within RACE_S of its soonest end, that was read as its own end, and W leaked
    _slow_target(run, 9.19)
    gauge(run, "model_active_requests", SLOW, 8.11, 9.21, add=1)
    assert judged(run, "triton_extra")["W"] == ("released", "gauge_fell_before_natural_end")


def test_a_fall_inside_a_natural_end_known_only_to_a_fifth_of_a_second_is_no_end_of_its_own(run):
    # W queued behind F to 8.27: its own end 9.31 to 9.48. Stopped at 9.20, let go at 9.33: its end or the cancel's
    request(run, "F", "slow", sent=8.00, closed=8.275, scenario="triton_extra")
    _slow_target(run, 9.20)
    gauge(run, "model_active_requests", SLOW, 8.01, 9.33, add=1)
    gauge(run, "triton_pending_requests", PEND, 8.11, 8.27, add=1)
    assert judged(run, "triton_extra")["W"][0] != "leaked"
