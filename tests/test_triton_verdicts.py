"""Triton verdict rules on a run recorded from the real tritonserver 2.51 (tests/fixtures/triton/suite_run.db:
the whole `triton` suite against the embedded server), judged as recorded and with parts of its evidence
taken away: the server's log (an external Triton recorded without --engine-log), the models' gauges, a
longer grace, a gauge held up after the cancel. The verdict must stay true to what is left."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pandas as pd
import pytest

from cancelwatch.analysis.verdicts import judge_run
from cancelwatch.collectors.sources.triton_log import parse_triton_line
from cancelwatch.runstore.reader import load_run

RUN = Path(__file__).resolve().parent / "fixtures" / "triton" / "suite_run.db"
LOG_KINDS = ("engine_added", "engine_aborted", "engine_finished")


@pytest.fixture
def run():
    return load_run(RUN, "latest")


def verdicts(run, **kw) -> dict[str, list]:
    out: dict[str, list] = {}
    for v in judge_run(run, **kw):
        out.setdefault(v.scenario, []).append(v)
    return out


def without_log(run):
    run.events = run.events[~run.events["kind"].isin(LOG_KINDS)].reset_index(drop=True)
    run.info["engine"]["engine_log"] = {"t0": {"off": "no server log"}}
    return run


def test_as_recorded_every_scenario_gives_its_expected_verdict(run):
    got = verdicts(run)
    stops = run.events[run.events["kind"] == "user_stop"]
    expect = {rid: json.loads(d)["expect"] for rid, d in zip(stops["request_id"], stops["data"])}
    assert len(expect) == 8
    for name, vs in got.items():
        for v in vs:
            assert v.verdict == v.evidence.expected == expect[v.request_id], (name, v.verdict, v.rule)
    assert [v.verdict for v in got["triton_http_timeout"]] == ["leaked"]
    assert [v.verdict for v in got["triton_stream_wide"]] == ["released", "released"]


def test_without_the_server_log_a_request_that_ran_to_its_natural_end_is_not_released(run):
    got = verdicts(without_log(run))
    (http,) = got["triton_http_timeout"]
    (deaf,) = got["triton_deaf"]
    # their gauges fell only when they would have ended anyway: inside a long grace that is no release
    assert http.verdict == "leaked" and http.rule == "gauge_up_to_natural_end", http.rule
    assert deaf.verdict == "leaked" and deaf.rule == "gauge_up_to_natural_end", deaf.rule
    for v in got["triton_executing"] + got["triton_disconnect"]:
        assert v.verdict == "released" and v.rule == "gauge_fell_before_natural_end", v.rule
        assert v.evidence.engine_log == "no server log" and v.source_of("engine_abort") is None
    (queued,) = got["triton_queued"]
    assert queued.verdict == "released" and queued.source_of("engine_abort") == "samples"


def test_without_the_server_log_a_longer_grace_does_not_turn_a_leak_into_a_release(run):
    got = verdicts(without_log(run), grace_s=4.0)
    assert got["triton_deaf"][0].verdict == "leaked"
    assert got["triton_http_timeout"][0].verdict == "leaked"


def test_a_log_with_no_line_of_the_models_is_no_server_log(run):
    run.events = run.events[~run.events["kind"].isin(LOG_KINDS)].reset_index(drop=True)  # facts still say read
    got = verdicts(run)
    (executing,) = got["triton_executing"]
    assert executing.evidence.engine_log.startswith("read, but it holds no line of the models")
    assert executing.phase_at_cancel == "executing"  # the driver's phase, not "queued" for want of a line
    assert executing.verdict == "released"


def test_missing_model_gauges_never_read_as_a_stale_gauge(run):
    run.samples = run.samples[run.samples["metric"] != "model_active_requests"].reset_index(drop=True)
    got = verdicts(run)
    for name in ("triton_executing", "triton_stream_wide", "triton_deadline", "triton_disconnect"):
        for v in got[name]:
            assert v.verdict == "released" and v.rule == "released_on_log_alone", (name, v.rule)
            assert v.timepoints["left_scheduler"] is None


def test_a_gauge_held_up_after_a_stream_wide_cancel_releases_neither_target(run):
    stops = run.events[run.events["kind"] == "user_stop"]
    t_stop = float(stops[stops["data"].str.contains("triton_stream_wide")]["t_s"].iloc[0])
    s = run.samples.copy()
    held = (s["metric"] == "model_active_requests") & (s["labels"].astype(str) == '{"model": "generator"}') & \
        (s["t_s"] > t_stop) & (s["t_s"] < t_stop + 3.0)
    s.loc[held, "value"] += 1.0  # one request's unit of the gauge never comes back
    run.samples = s
    got = verdicts(run)
    assert [v.verdict for v in got["triton_stream_wide"]] == ["stale_gauge", "stale_gauge"]


def test_the_neighbour_ending_does_not_stand_in_for_a_target_that_stayed(run):
    stops = run.events[run.events["kind"] == "user_stop"]
    t_stop = float(stops[stops["data"].str.contains("triton_executing")]["t_s"].iloc[0])
    s = run.samples.copy()
    held = (s["metric"] == "model_active_requests") & (s["labels"].astype(str) == '{"model": "generator"}') & \
        (s["t_s"] > t_stop) & (s["t_s"] < t_stop + 7.0)
    s.loc[held, "value"] += 1.0  # the target's unit stays; the neighbour still ends inside a 6 s grace
    run.samples = s
    (v,) = verdicts(run, grace_s=6.0)["triton_executing"]
    assert v.verdict == "stale_gauge" and v.rule == "gauge_did_not_fall", v.rule


def test_without_the_server_log_the_models_other_requests_are_counted_from_the_ledger(run):
    # the executing target's unit of the gauge never comes back, and its neighbour (same model, another
    # stream) ends inside a 6 s grace: the gauge falls by one, the neighbour's. Counted from the ledger the
    # neighbour is gone then, so that fall is not the target's; a constant "others at the stop" read it as one
    stops = run.events[run.events["kind"] == "user_stop"]
    t_stop = float(stops[stops["data"].str.contains("triton_executing")]["t_s"].iloc[0])
    s = run.samples.copy()
    held = (s["metric"] == "model_active_requests") & (s["labels"].astype(str) == '{"model": "generator"}') & \
        (s["t_s"] > t_stop) & (s["t_s"] < t_stop + 7.0)
    s.loc[held, "value"] += 1.0
    run.samples = s
    ledger = run.ledger[run.ledger["scenario"] == "triton_executing"]
    nb = ledger[ledger["role"] == "neighbour"]
    t0 = run.info["started_mono_ns"]
    assert len(nb) == 1 and t_stop < (float(nb["closed_mono_ns"].iloc[0]) - t0) / 1e9 < t_stop + 6.0, nb
    (v,) = verdicts(without_log(run), grace_s=6.0)["triton_executing"]
    assert v.verdict != "released", (v.verdict, v.rule)


def _stop_of(run, scenario: str) -> float:
    stops = run.events[run.events["kind"] == "user_stop"]
    return float(stops[stops["data"].str.contains(scenario)]["t_s"].iloc[0])


def test_without_the_server_log_a_neighbour_closing_with_the_stop_may_be_the_unit_that_left(run):
    # the executing target's neighbour closed 50 ms after the stop (within LEDGER_LAG_S: the server may have
    # counted it at the stop, or ended it just before). The gauge fell from 2 to 1 and held there: the neighbour
    # left and the target stayed, or the unit is another client's and the target left. Taking the neighbour as
    # gone at the stop made that unit steady traffic, and the target read released
    t_stop = _stop_of(run, "triton_executing")
    t0 = run.info["started_mono_ns"]
    ledger = run.ledger.copy()
    nb = (ledger["scenario"] == "triton_executing") & (ledger["role"] == "neighbour")
    ledger.loc[nb, "closed_mono_ns"] = t0 + int((t_stop + 0.05) * 1e9)
    run.ledger = ledger
    (v,) = verdicts(without_log(run))["triton_executing"]
    assert (v.verdict, v.rule) == ("inconclusive", "gauge_within_others"), (v.verdict, v.rule)
    r = v.evidence.count_reading
    assert (r["count"], r["others_fewest"], r["others_most"]) == (1.0, 0.0, 1.0), r
    assert [(o["request_id"], o["reason"]) for o in r["open"]] == \
        [(ledger.loc[nb, "request_id"].iloc[0], "end_read_within_lag")], r
    assert v.evidence.assumes == ["traffic_beside_held_steady"]


def test_without_the_server_log_one_unit_held_after_two_targets_stopped_together_is_neither_ones_leak(run):
    # stream_wide: two targets of one model stopped at once; one unit of the gauge stays through the grace. It is
    # one of them, and the gauge does not say which: each reads its twin as maybe still there
    t_stop = _stop_of(run, "triton_stream_wide")
    s = run.samples.copy()
    held = (s["metric"] == "model_active_requests") & (s["labels"].astype(str) == '{"model": "generator"}') & \
        (s["t_s"] > t_stop) & (s["t_s"] < t_stop + 3.0)
    s.loc[held, "value"] += 1.0
    run.samples = s
    got = verdicts(without_log(run))["triton_stream_wide"]
    assert [(v.verdict, v.rule) for v in got] == [("inconclusive", "gauge_within_others")] * 2, \
        [(v.verdict, v.rule) for v in got]
    for v, twin in zip(got, reversed(got)):
        assert {"request_id": twin.request_id, "reason": "stopped_no_server_end"} in v.evidence.count_reading["open"]
    # both held: each is surely counted beyond the most its twin and the neighbour can make
    s.loc[held, "value"] += 1.0
    run.samples = s
    assert [v.verdict for v in verdicts(run)["triton_stream_wide"]] == ["leaked", "leaked"]


def _ns(run, t: float) -> int:
    return run.info["started_mono_ns"] + int(t * 1e9)


def _gauge(run, model: str, lo: float, hi: float, add: float) -> None:
    s = run.samples.copy()
    rows = (s["metric"] == "model_active_requests") & (s["labels"].astype(str) == json.dumps({"model": model})) & \
        (s["t_s"] >= lo) & (s["t_s"] < hi)
    s.loc[rows, "value"] += add
    run.samples = s


def test_without_the_server_log_a_neighbour_stopped_just_after_the_target_may_have_ended_on_its_own(run):
    # the neighbour, stopped 140 ms after the target, may have ended by itself just before its own cancel (its
    # client cancelling before it read the end): held surely in up to its cancel, its leaving made the target's room
    t_stop = _stop_of(run, "triton_executing")
    ledger = run.ledger.copy()
    nb = (ledger["scenario"] == "triton_executing") & (ledger["role"] == "neighbour")
    ledger.loc[nb, ["cancel_mono_ns", "closed_mono_ns"]] = [_ns(run, t_stop + 0.14), _ns(run, t_stop + 0.141)]
    ledger.loc[nb, "terminal_state"] = "cancelled"
    run.ledger = ledger
    (v,) = verdicts(without_log(run))["triton_executing"]
    assert v.verdict == "inconclusive", (v.verdict, v.rule, v.evidence.count_reading)


def test_without_the_server_log_a_request_sent_while_a_scrape_was_answered_may_be_in_it(run):
    # one twin of stream_wide held; a third request of the model sent 3 ms after the scrape at 14.950 began, a
    # scrape that took 4 ms to answer, and counted from it on: that reading may hold it, so it shows no leak
    t_stop = _stop_of(run, "triton_stream_wide")
    _gauge(run, "generator", t_stop, t_stop + 3.0, 1.0)
    sc = run.scrapes.copy()
    sc.loc[(sc["source"] == "triton") & (sc["t_s"].sub(14.950124).abs() < 1e-5), "duration_ns"] = 4_000_000
    run.scrapes = sc
    _gauge(run, "generator", 14.95, t_stop + 3.0, 1.0)
    sent = _ns(run, 14.953124)
    row = {**run.ledger[run.ledger["role"] == "neighbour"].iloc[0].to_dict(), "request_id": "z", "role": "neighbour",
           "sent_mono_ns": sent, "first_token_mono_ns": sent + 50_000_000, "closed_mono_ns": _ns(run, 17.0),
           "cancel_mono_ns": None, "terminal_state": "completed"}
    run.ledger = pd.concat([run.ledger, pd.DataFrame([row])], ignore_index=True)
    event = {"request_id": "z", "kind": "request_sent", "wall_ns": 0, "mono_ns": sent, "t_s": 14.953124,
             "data": json.dumps({"scenario": "triton_stream_wide", "role": "neighbour", "model": "generator"})}
    run.events = pd.concat([run.events, pd.DataFrame([event])], ignore_index=True).sort_values("t_s", kind="stable")
    got = verdicts(without_log(run))["triton_stream_wide"]
    assert [v.verdict for v in got] == ["inconclusive"] * 2, [(v.verdict, v.rule) for v in got]


def test_without_the_server_log_a_target_sent_after_the_last_reading_before_its_stop_was_not_counted_there(run):
    # the target sent 3 ms before its stop, after the last reading, and never counted; another client's request
    # steady throughout. Read as if the baseline counted the target, the steady unit was this one, kept
    t_stop = _stop_of(run, "triton_executing")
    ledger = run.ledger.copy()
    tg = (ledger["scenario"] == "triton_executing") & (ledger["role"] == "target")
    ledger.loc[tg, ["sent_mono_ns", "first_token_mono_ns"]] = [_ns(run, t_stop - 0.003), None]
    run.ledger = ledger
    stops = run.events["kind"] == "user_stop"
    run.events.loc[stops & run.events["data"].str.contains("triton_executing"), "data"] = \
        run.events.loc[stops & run.events["data"].str.contains("triton_executing"), "data"].map(
            lambda d: json.dumps({**json.loads(d), "tokens_at_cancel": 0}))
    _gauge(run, "generator", 6.38, 6.99, -1.0)
    _gauge(run, "generator", 6.0, 12.0, 1.0)
    (v,) = verdicts(without_log(run))["triton_executing"]
    assert v.verdict != "leaked", (v.verdict, v.rule, v.evidence.count_reading)


def test_without_the_server_log_sends_that_name_no_model_may_be_any_models(run):
    # stream_wide with one unit held after both targets stopped: a run whose sends do not name their model reads
    # every request of it as maybe this model's, never as another client's steady traffic
    t_stop = _stop_of(run, "triton_stream_wide")
    _gauge(run, "generator", t_stop, t_stop + 3.0, 1.0)
    sent = run.events["kind"] == "request_sent"
    run.events.loc[sent, "data"] = run.events.loc[sent, "data"].map(
        lambda d: json.dumps({k: v for k, v in json.loads(d).items() if k != "model"}))
    got = verdicts(without_log(run))["triton_stream_wide"]
    assert [v.verdict for v in got] == ["inconclusive"] * 2, [(v.verdict, v.rule) for v in got]


def test_a_model_that_logs_the_cancel_but_keeps_its_buffer_is_not_released(run):
    stops = run.events[run.events["kind"] == "user_stop"]
    t_stop = float(stops[stops["data"].str.contains("triton_executing")]["t_s"].iloc[0])
    s = run.samples.copy()
    buf = (s["metric"] == "model_buffer_bytes") & (s["labels"].astype(str) == '{"model": "generator"}')
    assert buf.any()
    s.loc[buf & (s["t_s"] > t_stop), "value"] += float(8 << 20)  # the target's 8 MiB never given back
    run.samples = s
    (v,) = verdicts(run)["triton_executing"]
    assert (v.verdict, v.rule) == ("leaked", "model_kept_buffer"), (v.verdict, v.rule)
    assert v.evidence.buffer_kept_bytes >= 4 << 20 and v.timepoints["engine_abort"] is not None
    # as recorded, the buffer gave the share back: released
    (v,) = verdicts(load_run(RUN, "latest"))["triton_executing"]
    assert v.verdict == "released", v.rule


def test_a_buffer_read_right_is_no_leak_for_targets_stopped_together_or_a_reading_missing(run):
    # stream_wide: two targets of one model stopped at once, a byte of the buffer that is no request's; and
    # the executing target's buffer with its last reading before the stop missing (NaN, never read as 0)
    s = run.samples.copy()
    buf = (s["metric"] == "model_buffer_bytes") & (s["labels"].astype(str) == '{"model": "generator"}')
    s.loc[buf, "value"] += 1.0
    stops = run.events[run.events["kind"] == "user_stop"]
    t_exec = float(stops[stops["data"].str.contains("triton_executing")]["t_s"].iloc[0])
    last = s[buf & (s["t_s"] < t_exec)]["t_s"].max()
    s.loc[buf & (s["t_s"] == last), "value"] = float("nan")
    run.samples = s
    got = verdicts(run)
    assert [v.verdict for v in got["triton_stream_wide"]] == ["released", "released"], \
        [(v.verdict, v.rule) for v in got["triton_stream_wide"]]
    assert [v.verdict for v in got["triton_executing"]] == ["released"], [v.rule for v in got["triton_executing"]]


def test_triton_log_stamps_are_utc_whatever_the_host_zone():
    line = 'I1130 09:29:13.588560 18307 model.py:31] "cancelwatch model=slow request=r event=started ms=800 poll=true"'
    old = os.environ.get("TZ")
    try:
        stamps = []
        for tz in ("UTC", "Asia/Tokyo", "America/Los_Angeles"):
            os.environ["TZ"] = tz
            time.tzset()
            stamps.append(parse_triton_line(line, 2026)[3])
    finally:
        if old is None:
            os.environ.pop("TZ", None)
        else:
            os.environ["TZ"] = old
        time.tzset()
    assert len(set(stamps)) == 1
    assert pd.Timestamp(stamps[0], unit="ns", tz="UTC").strftime("%m-%d %H:%M:%S.%f") == "11-30 09:29:13.588560"
