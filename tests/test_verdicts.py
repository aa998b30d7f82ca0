"""Verdict logic on small hand-built runs (analysis is pure: frames in, verdicts out)."""

from __future__ import annotations

import json
import math
from dataclasses import fields

import numpy as np
import pandas as pd
import pytest

from cancelwatch.analysis.evidence import REPORTED_WITH, Evidence
from cancelwatch.analysis.verdicts import judge_run
from cancelwatch.runstore.reader import Run

T0 = 1_000_000_000_000
HZ = 20


def build_run(count, kv, gen, *, stop_s=2.0, abort_s=2.002, probe_first_s=None, extra_ledger=(), missing=None,
              engine_log=None, extra_events=(), resolution_s=0.001, waiting=lambda t: 0.0, series=None, hz=None,
              length_s=6.0, finished=None):
    """A 6 s run (or `length_s`) at 20 Hz (or `hz`): `count(t)`, `kv(t)`, `gen(t)` give running(+0 waiting), KV
    usage and tokens;
    no scrape answered in the stretch `missing` (from, to) in s; `series`: more metrics, name -> f(t); `finished(t)`:
    vllm:request_success_total{finished_reason="stop"} (None: the engine does not say why its requests ended).
    `engine_log`: the engine log was read,
    and these (kind, request id, instant) lines are in it; None: a run without an engine log, whose
    driver stamped app_received and engine_abort on the client (as runs before engine logs did)."""
    times = np.arange(0, length_s, 1 / (hz or HZ))
    rows = []
    for i, t in enumerate(times):
        if missing is not None and missing[0] <= t < missing[1]:
            continue
        more = tuple((metric, f(t)) for metric, f in (series or {}).items())
        for metric, value in (("requests_running", count(t) - waiting(t)), ("requests_waiting", waiting(t)),
                              ("kv_cache_usage_ratio", kv(t)), ("generation_tokens_total", gen(t)), *more):
            rows.append({"source": "vllm", "target": "t0", "metric": metric, "labels": "{}", "value": value,
                         "wall_ns": 0, "mono_ns": T0 + int(t * 1e9), "duration_ns": 1, "scrape_id": i, "t_s": t})
        if finished is not None:
            rows.append({"source": "vllm", "target": "t0", "metric": "requests_finished_total",
                         "labels": '{"finished_reason": "stop"}', "value": finished(t), "wall_ns": 0,
                         "mono_ns": T0 + int(t * 1e9), "duration_ns": 1, "scrape_id": i, "t_s": t})
    samples = pd.DataFrame(rows)
    ns = lambda s: T0 + int(s * 1e9)  # noqa: E731
    ledger = [
        {"request_id": "nb", "scenario": "s", "role": "neighbour", "n": 1, "sent_mono_ns": ns(0.1),
         "first_token_mono_ns": ns(0.3), "closed_mono_ns": ns(5.5), "cancel_mono_ns": None,
         "terminal_state": "completed"},
        {"request_id": "tg", "scenario": "s", "role": "target", "n": 1, "sent_mono_ns": ns(0.5),
         "first_token_mono_ns": ns(0.8), "closed_mono_ns": ns(abort_s), "cancel_mono_ns": ns(stop_s),
         "terminal_state": "cancelled"},
        *extra_ledger,
    ]
    if probe_first_s is not None:
        ledger.append({"request_id": "pr", "scenario": "s", "role": "probe", "n": 1, "sent_mono_ns": ns(abort_s + 0.01),
                       "first_token_mono_ns": ns(probe_first_s), "closed_mono_ns": ns(probe_first_s + 0.1),
                       "cancel_mono_ns": None, "terminal_state": "completed"})
    cid = {"cancel_id": "c1"}
    events = [
        {"request_id": "tg", "kind": "user_stop", "mono_ns": ns(stop_s),
         "data": json.dumps({**cid, "scenario": "s", "phase": "decode", "metrics_target": "t0"})},
    ]
    info = {"started_mono_ns": T0, "targets": [{"label": "t0", "url": "http://x"}], "status": "completed",
            "settings": {}}
    if engine_log is None:
        events += [
            {"request_id": "tg", "kind": "app_received", "mono_ns": ns(stop_s + 0.001), "data": json.dumps(cid)},
            {"request_id": "tg", "kind": "engine_abort", "mono_ns": ns(abort_s), "data": json.dumps(cid)},
        ]
    else:
        info["engine"] = {"engine_log": {"t0": {"path": "/var/log/engine.log"}}}
        events.append({"request_id": "tg", "kind": "client_closed", "mono_ns": ns(stop_s + 0.001),
                       "data": json.dumps({**cid, "source": "client"})})
        for kind, rid, at in engine_log:
            events.append({"request_id": rid, "kind": kind, "mono_ns": ns(at),
                           "data": json.dumps({"engine_request_id": f"cmpl-{rid}-0-0123abcd", "clock": "engine_log",
                                               "resolution_s": resolution_s, "target": "t0"})})
    events = pd.DataFrame([*events, *extra_events]).sort_values("mono_ns")
    events["wall_ns"] = 0
    events["t_s"] = (events["mono_ns"] - T0) / 1e9
    # the sampler's record of the hole: failed scrapes over `missing`
    gaps = pd.DataFrame([{"source": "vllm", "target": "t0", "kind": "error", "t_s": missing[0], "end_t_s": missing[1]}]
                        if missing is not None else [])
    return Run(id=1, info=info, samples=samples, scrapes=pd.DataFrame(), gaps=gaps, events=events,
               ledger=pd.DataFrame(ledger))


def steady_gen(t):
    return 100 + 20 * t


def test_released_when_count_and_kv_drop_right_after_the_abort():
    # no request log: the engine's counter of its own ends (none) says the fall was no natural end
    run = build_run(lambda t: 2.0 if t < 2.05 else 1.0, lambda t: 0.4 if t < 2.05 else 0.1, steady_gen,
                    probe_first_s=2.3, finished=lambda t: 0.0)
    (v,) = judge_run(run)
    assert v.verdict == "released"
    assert 2.05 <= v.timepoints["left_scheduler"] <= 2.1
    assert v.timepoints["reusable"] == 2.3
    assert v.evidence.kv_before == 0.4 and v.evidence.kv_after == 0.1


@pytest.mark.parametrize("finished", [None, lambda t: 0.0 if t < 2.04 else 1.0], ids=["not_said", "an_end_of_its_own"])
def test_without_an_abort_a_fall_the_engine_may_have_made_on_its_own_is_no_release(finished):
    # no request log and no abort: the count falling after the stop is a release only where no end of the engine's
    # own can be it. The engine does not say why its requests ended, or it ended one by itself as the count fell
    # (vllm:request_success_total{finished_reason="stop"} rose) and no other request's end reached its client
    run = build_run(lambda t: 2.0 if t < 2.05 else 1.0, lambda t: 0.4 if t < 2.05 else 0.1, steady_gen,
                    probe_first_s=2.3, finished=finished)
    (v,) = judge_run(run)
    assert (v.verdict, v.rule) == ("inconclusive", "gone_may_have_run_out"), v
    assert v.evidence.count_reading is None or v.evidence.count_reading["count"] == 1.0


def test_leaked_when_the_server_keeps_counting_and_generating():
    run = build_run(lambda t: 2.0 if t < 5.0 else 1.0, lambda t: 0.4, steady_gen)
    (v,) = judge_run(run)
    assert v.verdict == "leaked" and v.evidence.engine_stepping is True
    assert v.evidence.excess_max == 1.0
    # KV never fell: the drop was looked for, so its key is there, empty
    doc = v.evidence.as_json()
    assert "kv_drop_s" in doc and doc["kv_drop_s"] is None and "release_ms" not in doc


def test_stale_gauge_when_nothing_steps_after_the_abort():
    run = build_run(lambda t: 2.0, lambda t: 0.4, lambda t: 100 + 20 * min(t, 2.0))
    (v,) = judge_run(run)
    assert v.verdict == "stale_gauge" and v.evidence.engine_stepping is False


def test_foreign_traffic_makes_it_inconclusive():
    run = build_run(lambda t: 3.0 if t < 2.05 else 2.0, lambda t: 0.4 if t < 2.05 else 0.1, steady_gen)
    (v,) = judge_run(run)
    assert v.verdict == "inconclusive" and v.rule == "other_traffic_counted", v
    doc = v.evidence.as_json()
    assert doc["kv_before"] == 0.4 and "kv_drop_s" not in doc and "engine_stepping" not in doc


def test_a_count_that_reconciles_only_briefly_is_not_a_release():
    # the server drops to the ledger's count for one sample, then counts the request again
    run = build_run(lambda t: 1.0 if 2.05 <= t < 2.1 else (2.0 if t < 5 else 1.0), lambda t: 0.4, steady_gen)
    (v,) = judge_run(run)
    assert v.verdict == "leaked"


def test_evidence_keeps_a_reached_field_that_is_none_and_leaves_out_an_unreached_one():
    ev = Evidence(grace_s=2.0, metrics_target="t0", samples_in_window=3)
    assert list(ev.as_json()) == ["grace_s", "metrics_target", "samples_in_window"]
    ev.kv_before = math.nan  # the stage before the stop was reached, with no sample in it
    doc = ev.as_json()
    assert doc["count_before"] is None and doc["ledger_before"] is None and math.isnan(doc["kv_before"])
    assert not {"note", "kv_drop_s", "excess_max", "generation_tokens_delta"} & set(doc)
    ev.engine_stepping = False
    doc = ev.as_json()
    assert doc["kv_drop_s"] is None and doc["excess_max"] is None and doc["generation_tokens_delta"] is None
    assert not {"release_ms", "gauges_refreshed", "why"} & set(doc)
    assert json.dumps(doc).count("NaN") == 1


def test_evidence_groups_name_its_own_fields():
    names = [f.name for f in fields(Evidence)]
    for f in fields(Evidence):
        assert set(f.metadata.get(REPORTED_WITH, ())) <= set(names) - {f.name}, f.name


def test_a_scrape_outage_across_the_grace_is_inconclusive_not_a_stale_gauge():
    # the request was running; from the stop on, /metrics did not answer for 3 s (past the 2 s grace)
    run = build_run(lambda t: 2.0, lambda t: 0.4, steady_gen, missing=(2.0, 5.0))
    (v,) = judge_run(run)
    assert v.verdict == "inconclusive" and v.rule == "no_samples_in_grace", v
    assert v.timepoints["left_scheduler"] is None


def test_a_few_samples_before_an_outage_across_the_grace_say_the_outage_not_the_rate():
    # three scrapes answered in the second before the stop, then none until well past the grace (an engine
    # frozen right after its abort): too few to judge on, and what is missing is the grace
    run = build_run(lambda t: 2.0, lambda t: 0.4, steady_gen, missing=(1.15, 6.0))
    (v,) = judge_run(run)
    assert (v.verdict, v.rule, v.evidence.samples_in_window) == ("inconclusive", "no_samples_in_grace", 3), v
    # sampled at 1 Hz all along: two samples in the grace, four in the window: the rate is the reason
    (v,) = judge_run(build_run(lambda t: 2.0, lambda t: 0.4, steady_gen, hz=1.0))
    assert (v.verdict, v.rule, v.evidence.samples_in_window) == ("inconclusive", "too_few_samples", 4), v
    # at 0.5 Hz one sample in the grace, and no hole recorded: the rate, still, never "an outage"
    (v,) = judge_run(build_run(lambda t: 2.0, lambda t: 0.4, steady_gen, hz=0.5))
    assert (v.verdict, v.rule) == ("inconclusive", "too_few_samples"), v


def test_an_engine_restart_inside_the_window_is_inconclusive_not_released():
    # the engine died and came back right after the abort: its gauges and counters start again at 0
    def restarted(value):
        return lambda t: value(t) if t < 2.3 else 0.0

    run = build_run(restarted(lambda t: 2.0), restarted(lambda t: 0.4), restarted(steady_gen), probe_first_s=3.0)
    (v,) = judge_run(run)
    assert v.verdict == "inconclusive" and v.rule == "engine_restarted", v


ADDED = [("engine_added", "nb", 0.1), ("engine_added", "tg", 0.5)]


def test_with_the_engine_log_the_abort_is_the_engines_own_and_no_app_is_said_so():
    run = build_run(lambda t: 2.0 if t < 2.05 else 1.0, lambda t: 0.4 if t < 2.05 else 0.1, steady_gen,
                    probe_first_s=2.3, engine_log=[*ADDED, ("engine_aborted", "tg", 2.012)])
    (v,) = judge_run(run)
    assert v.verdict == "released"
    assert v.timepoints["engine_abort"] == 2.012  # the log's line, not the client's close at 2.001
    src = v.as_json()["timepoint_sources"]
    assert src["engine_abort"] == {"source": "engine_log", "reason": None}
    assert src["app_received"] == {"source": None, "reason": "no app on this path"}
    assert src["left_scheduler"]["source"] == "samples" and src["user_stop"]["source"] == "client"
    assert v.timepoints["app_received"] is None and v.evidence.engine_log == "read"


def test_without_an_engine_log_engine_abort_is_null_with_its_reason_not_a_client_stamp():
    run = build_run(lambda t: 2.0 if t < 2.05 else 1.0, lambda t: 0.4 if t < 2.05 else 0.1, steady_gen,
                    probe_first_s=2.3, finished=lambda t: 0.0)
    (v,) = judge_run(run)
    assert v.verdict == "released"
    assert v.timepoints["engine_abort"] is None and v.timepoints["app_received"] is None
    assert v.sources["engine_abort"] == {"source": None, "reason": "no engine log"}


@pytest.mark.parametrize("engine_log", [None, [*ADDED, ("engine_aborted", "tg", 2.01)]], ids=["no-log", "log"])
def test_a_count_drop_without_a_kv_drop_is_not_released_even_once_the_probe_runs(engine_log):
    # the count reconciles at once and the probe got its first token, but KV usage never fell
    run = build_run(lambda t: 2.0 if t < 2.05 else 1.0, lambda t: 0.4, steady_gen, probe_first_s=2.2,
                    engine_log=engine_log)
    (v,) = judge_run(run)
    assert v.verdict != "released", v
    assert v.timepoints["left_scheduler"] is None


def test_a_lost_cancel_that_ends_inside_the_grace_is_leaked_with_the_time_it_ran():
    # no abort line: the request ran on after the stop and left at its natural end, 1 s later
    run = build_run(lambda t: 2.0 if t < 3.0 else 1.0, lambda t: 0.4 if t < 3.0 else 0.1, steady_gen,
                    engine_log=ADDED)
    (v,) = judge_run(run)
    assert v.verdict == "leaked" and v.rule == "no_abort_ran_to_end", v
    assert 950 <= v.evidence.kept_running_ms <= 1050
    assert v.sources["engine_abort"] == {"source": None, "reason": "no abort in the engine log"}


def test_an_engine_that_had_already_finished_the_request_is_not_released():
    # the server stopped counting the request 0.5 s before the stop; no abort line follows
    run = build_run(lambda t: 2.0 if t < 1.5 else 1.0, lambda t: 0.4 if t < 1.5 else 0.1, steady_gen,
                    probe_first_s=2.2, engine_log=ADDED)
    (v,) = judge_run(run)
    assert v.verdict == "inconclusive" and v.rule == "already_finished", v


def test_an_engine_that_aborted_the_request_before_the_stop_says_so():
    # the engine's own log: the request was aborted 0.5 s before the client's stop (an error in its stream)
    run = build_run(lambda t: 2.0 if t < 1.5 else 1.0, lambda t: 0.4 if t < 1.5 else 0.1, steady_gen,
                    probe_first_s=2.2, engine_log=[*ADDED, ("engine_aborted", "tg", 1.5)])
    (v,) = judge_run(run)
    assert v.verdict == "inconclusive" and v.rule == "aborted_before_stop", v
    assert v.timepoints["engine_abort"] is None  # an abort before the stop is not this cancel's


def beside(count, log, tokens=500):
    """The neighbour alone until the target's send at 0.5 s (one sequence alone: 20 tokens a second),
    then `count(t)`; every request asked for `tokens`."""
    run = build_run(lambda t: 1.0 if t < 0.5 else count(t), lambda t: 0.4, steady_gen, engine_log=[*ADDED, *log])
    run.ledger["max_tokens"] = tokens
    return run


def test_a_request_the_ledger_does_not_know_in_the_window_is_weighed_never_read_as_a_leak():
    # a clean abort, then an unrelated stream 100 ms after the stop that the server counts: the count was
    # at the ledger's between the two, so the target was not in it
    run = beside(lambda t: 2.0 if t < 2.05 or t >= 2.1 else 1.0,
                 [("engine_aborted", "tg", 2.01), ("engine_added", "stranger", 2.1)])
    (v,) = judge_run(run)
    assert v.verdict == "released" and v.rule == "released_beside_traffic", v
    assert v.evidence.foreign_requests == 1 and v.timepoints["left_scheduler"] == pytest.approx(2.05)
    # the stranger comes before the count shows the target gone: the count never falls to the ledger's,
    # and which of the two it holds cannot be told
    run = beside(lambda t: 2.0, [("engine_aborted", "tg", 2.01), ("engine_added", "stranger", 2.04)])
    (v,) = judge_run(run)
    assert v.verdict == "inconclusive" and v.rule == "other_traffic_logged", v


def test_a_count_at_the_ledgers_beside_traffic_is_no_release_where_a_held_request_may_have_left():
    # the abort is logged but the engine keeps the target; the neighbour, 40 tokens (2 s alone, 1.6 s at
    # the quarter faster bound), may have ended by 2.05 s while its client reads on: the count at the
    # ledger's could be the target standing in for it
    run = beside(lambda t: 2.0 if t < 2.05 or t >= 2.1 else 1.0,
                 [("engine_aborted", "tg", 2.01), ("engine_added", "stranger", 2.1)], tokens=40)
    (v,) = judge_run(run)
    assert v.verdict == "inconclusive" and v.rule == "other_traffic_logged", v


def test_a_lost_cancel_beside_traffic_is_leaked_only_where_its_tokens_outlast_the_grace():
    # no abort line and a stranger in the window; one sequence alone makes 20 tokens a second (25 with the
    # quarter added): 500 tokens outlast the grace by far, 30 could have ended before the stop
    for tokens, verdict, rule in ((500, "leaked", "no_abort_beside_traffic"), (30, "inconclusive", "other_traffic_logged")):
        (v,) = judge_run(beside(lambda t: 2.0, [("engine_added", "stranger", 2.1)], tokens=tokens))
        assert (v.verdict, v.rule) == (verdict, rule), (tokens, v)
    # without a stretch of one sequence alone no rate bounds it: never leaked on a guess
    run = build_run(lambda t: 2.0, lambda t: 0.4, steady_gen, engine_log=[*ADDED, ("engine_added", "stranger", 2.1)])
    run.ledger["max_tokens"] = 500
    (v,) = judge_run(run)
    assert (v.verdict, v.rule) == ("inconclusive", "other_traffic_logged"), v


def test_a_burst_is_judged_per_id_so_one_leak_marks_one_cancel():
    ns = lambda s: T0 + int(s * 1e9)  # noqa: E731
    second = {"request_id": "tg2", "scenario": "s", "role": "target", "n": 1, "sent_mono_ns": ns(0.5),
              "first_token_mono_ns": ns(0.8), "closed_mono_ns": ns(2.002), "cancel_mono_ns": ns(2.0),
              "terminal_state": "cancelled"}
    stop2 = {"request_id": "tg2", "kind": "user_stop", "mono_ns": ns(2.0),
             "data": json.dumps({"cancel_id": "c2", "scenario": "s", "phase": "decode", "metrics_target": "t0"})}
    # three in the engine; tg's abort frees one at once, tg2 (lost cancel) runs on to 5 s
    run = build_run(lambda t: 3.0 if t < 2.05 else (2.0 if t < 5.0 else 1.0),
                    lambda t: 0.6 if t < 2.05 else (0.4 if t < 5.0 else 0.1), steady_gen,
                    extra_ledger=[second], extra_events=[stop2],
                    engine_log=[*ADDED, ("engine_added", "tg2", 0.5), ("engine_aborted", "tg", 2.01)])
    verdicts = {v.request_id: v for v in judge_run(run)}
    assert verdicts["tg"].verdict == "released", verdicts["tg"]
    assert verdicts["tg2"].verdict == "leaked" and verdicts["tg2"].rule == "no_abort_ran_to_end", verdicts["tg2"]


def test_an_abort_that_reaches_the_engine_only_after_the_grace_is_a_leak():
    # a gateway that passes the disconnect on 3 s late: the engine's abort line comes after the grace
    run = build_run(lambda t: 2.0 if t < 5.05 else 1.0, lambda t: 0.4 if t < 5.05 else 0.1, steady_gen,
                    engine_log=[*ADDED, ("engine_aborted", "tg", 5.0)])
    (v,) = judge_run(run)
    assert v.verdict == "leaked" and v.evidence.kept_running_ms == 3000.0, v
    assert v.sources["engine_abort"]["source"] == "engine_log"


def test_a_request_that_completed_before_a_missed_trigger_is_not_a_race_won():
    # the queued scenario's trigger never saw the target waiting; it ran to its end before the stop
    ns = lambda s: T0 + int(s * 1e9)  # noqa: E731
    missed = {"request_id": "tg", "kind": "trigger_missed", "mono_ns": ns(1.99),
              "data": json.dumps({"trigger": "while_queued", "trigger_value": 0})}
    run = build_run(lambda t: 2.0 if t < 1.5 else 1.0, lambda t: 0.4, steady_gen, engine_log=ADDED,
                    extra_events=[missed])
    run.ledger.loc[run.ledger["request_id"] == "tg", ["terminal_state", "closed_mono_ns"]] = ["completed", ns(1.5)]
    (v,) = judge_run(run)
    assert v.verdict == "inconclusive" and v.rule == "trigger_never_reached" and v.evidence.race is None, v


def test_an_abort_stamped_to_the_whole_second_is_still_this_cancels_abort():
    # vLLM's default log format: the abort 10 ms after a stop at 2.7 s is stamped 2.0
    run = build_run(lambda t: 2.0 if t < 2.75 else 1.0, lambda t: 0.4 if t < 2.75 else 0.1, steady_gen, stop_s=2.7,
                    abort_s=2.702, resolution_s=1.0,
                    engine_log=[("engine_added", "nb", 0.0), ("engine_added", "tg", 0.0), ("engine_aborted", "tg", 2.0)])
    (v,) = judge_run(run)
    assert v.verdict == "released", v
    assert v.sources["engine_abort"]["source"] == "engine_log" and "1 s" in v.sources["engine_abort"]["reason"]


def test_a_whole_second_stamp_that_straddles_the_grace_is_not_called_either_way():
    # stop at 1.5 s; the abort line says 3.0 (so it came between 3.0 and 4.0): within 2 s of the stop, or not
    run = build_run(lambda t: 2.0 if t < 3.95 else 1.0, lambda t: 0.4 if t < 3.95 else 0.1, steady_gen, stop_s=1.5,
                    abort_s=1.502, resolution_s=1.0, engine_log=[*ADDED, ("engine_aborted", "tg", 3.0)])
    (v,) = judge_run(run)
    assert v.verdict == "inconclusive" and v.rule == "abort_stamp_straddles_grace", v


def test_an_engine_that_logs_the_abort_but_keeps_the_request_is_leaked_not_other_traffic():
    # the log names every request and this one's abort; the engine still counts it and keeps generating
    run = build_run(lambda t: 2.0, lambda t: 0.4, steady_gen, engine_log=[*ADDED, ("engine_aborted", "tg", 2.01)])
    (v,) = judge_run(run)
    assert v.verdict == "leaked" and v.rule == "abort_logged_still_generating", v


def test_without_a_log_a_race_the_completion_won_is_said_as_such():
    # 2 tokens before the end; the server stopped counting it just before the stop; no engine log
    run = build_run(lambda t: 2.0 if t < 1.92 else 1.0, lambda t: 0.4 if t < 1.92 else 0.1, steady_gen)
    run.ledger["max_tokens"] = 40
    stop = run.events["kind"] == "user_stop"
    run.events.loc[stop, "data"] = [json.dumps({**json.loads(d), "tokens_at_cancel": 38})
                                    for d in run.events.loc[stop, "data"]]
    (v,) = judge_run(run)
    assert v.verdict == "inconclusive" and v.evidence.race, v


def test_an_engine_id_without_vllms_chat_suffix_is_still_matched_to_its_ledger_id():
    # vLLM before 0.14 names a chat request `chatcmpl-<X-Request-Id>` with no suffix; the driver's own ids
    # end in 8 hex, so the source's reading strips a piece of the id itself: the ledger knows better
    run = build_run(lambda t: 2.0 if t < 2.05 else 1.0, lambda t: 0.4 if t < 2.05 else 0.1, steady_gen,
                    engine_log=[("engine_added", "nb", 0.1)])
    ns = lambda s: T0 + int(s * 1e9)  # noqa: E731
    run.ledger.loc[run.ledger["request_id"] == "tg", "request_id"] = "cw-chat-target-e87967d0"
    run.events.loc[run.events["request_id"] == "tg", "request_id"] = "cw-chat-target-e87967d0"
    lines = [(kind, at) for kind, at in (("engine_added", 0.5), ("engine_aborted", 2.01))]
    extra = pd.DataFrame([{"request_id": "cw-chat-target", "kind": kind, "mono_ns": ns(at), "wall_ns": 0,
                           "t_s": at, "data": json.dumps({"engine_request_id": "chatcmpl-cw-chat-target-e87967d0",
                                                          "clock": "engine_log", "resolution_s": 0.001,
                                                          "target": "t0"})} for kind, at in lines])
    run.events = pd.concat([run.events, extra]).sort_values("mono_ns", ignore_index=True)
    (v,) = judge_run(run)
    assert v.verdict == "released" and v.sources["engine_abort"]["source"] == "engine_log", v


def test_a_lost_cancel_the_gauges_had_not_counted_yet_is_leaked_even_with_the_probe_sent_at_once():
    # a long prefill step: the gauges do not count the target at the stop, so the driver sees the count
    # reconciled and sends the probe at once. The engine log says when each request entered the engine:
    # the probe only at 2.5 s, the target long before, and never an abort for it
    def count(t):  # neighbour; + the target once counted; + the probe while it runs; the target ends at 5 s
        return 1.0 + (2.3 <= t < 5.0) + (2.55 <= t < 2.8)

    run = build_run(count, lambda t: 0.1 * count(t), steady_gen, probe_first_s=2.7,
                    engine_log=[*ADDED, ("engine_added", "pr", 2.5)])
    (v,) = judge_run(run)
    assert v.verdict == "leaked" and v.rule == "no_abort_ran_to_end", v
    assert 2900 <= v.evidence.kept_running_ms <= 3100


def test_an_outage_over_the_whole_window_says_no_samples():
    # /metrics silent from 1 s before the stop to past the grace: no sample at all to judge by
    run = build_run(lambda t: 2.0, lambda t: 0.4, steady_gen, missing=(0.9, 5.0),
                    engine_log=[*ADDED, ("engine_aborted", "tg", 2.01)])
    (v,) = judge_run(run)
    assert v.verdict == "inconclusive" and v.evidence.samples_in_window == 0, v
    assert v.rule == "no_samples"


def test_still_counted_is_judged_at_the_grace_end_not_on_the_largest_excess_inside_it():
    # the abort at 2.002 s; the engine's next steps keep counting the target until 3.9 s, then the count is
    # reconciled inside the 2 s grace (KV usage stays: blocks still cached). Judged on the largest excess
    # inside the grace this read as a leak; at the grace's end the server counts no more than the ledger
    abort = ("engine_aborted", "tg", 2.01)
    run = build_run(lambda t: 2.0 if t < 3.9 else 1.0, lambda t: 0.4, steady_gen, engine_log=[*ADDED, abort])
    (v,) = judge_run(run)
    assert v.verdict == "inconclusive" and v.evidence.rule == "kv_did_not_fall", v
    assert v.evidence.excess_max == 1.0 and v.evidence.excess_at_grace_end == 0.0
    # still counted at the grace's end, while the engine steps: leaked, as before
    (v,) = judge_run(build_run(lambda t: 2.0 if t < 4.5 else 1.0, lambda t: 0.4, steady_gen,
                               engine_log=[*ADDED, abort]))
    assert v.verdict == "leaked" and v.evidence.excess_at_grace_end == 1.0, v


def test_a_target_still_waiting_at_its_stop_owes_no_kv_back():
    # max_num_seqs 1: the neighbour runs, the target waits behind it (the gauges: 1 running, 1 waiting)
    # until its stop; the abort takes it from the queue. It held no KV, so KV usage does not fall: the
    # count reconciled is its release, whatever its phase's name says
    def waiting(t):
        return 1.0 if t < 2.05 else 0.0

    run = build_run(lambda t: 2.0 if t < 2.05 else 1.0, lambda t: 0.4, steady_gen, waiting=waiting,
                    engine_log=[*ADDED, ("engine_aborted", "tg", 2.01)])
    (v,) = judge_run(run)
    assert v.verdict == "released", v
    # the same gauges with the target running at its stop (the neighbour waiting): its KV must come back
    run = build_run(lambda t: 2.0 if t < 2.05 else 1.0, lambda t: 0.4, steady_gen, waiting=waiting,
                    engine_log=[("engine_added", "tg", 0.05), ("engine_added", "nb", 0.5),
                                ("engine_aborted", "tg", 2.01)])
    run.ledger.loc[run.ledger["request_id"] == "tg", ["sent_mono_ns", "first_token_mono_ns"]] = [T0 + int(0.05e9),
                                                                                                  T0 + int(0.3e9)]
    run.ledger.loc[run.ledger["request_id"] == "nb", ["sent_mono_ns", "first_token_mono_ns"]] = [T0 + int(0.5e9),
                                                                                                  T0 + int(0.8e9)]
    (v,) = judge_run(run)
    assert v.verdict == "inconclusive" and v.evidence.rule == "kv_did_not_fall", v


def test_a_ledger_changed_in_place_between_two_judgements_is_read_as_it_is_now():
    # the rules make the ledger's and the events' rows once a judgement (Run.memo): a notebook that judges, changes
    # the ledger in place and judges again gets what a run changed before its first judgement gets
    def waiting(t):
        return 1.0 if t < 2.05 else 0.0

    def changed(run):
        for rid, sent, first in (("tg", 0.05, 0.3), ("nb", 0.5, 0.8)):
            run.ledger.loc[run.ledger["request_id"] == rid, ["sent_mono_ns", "first_token_mono_ns"]] = [
                T0 + int(sent * 1e9), T0 + int(first * 1e9)]
        return run

    def built():
        return build_run(lambda t: 2.0 if t < 2.05 else 1.0, lambda t: 0.4, steady_gen, waiting=waiting,
                         engine_log=[("engine_added", "tg", 0.05), ("engine_added", "nb", 0.5),
                                     ("engine_aborted", "tg", 2.01)])

    run = built()
    (before,) = judge_run(run)
    (after,) = judge_run(changed(run))
    (fresh,) = judge_run(changed(built()))
    assert after.evidence.rule == fresh.evidence.rule == "kv_did_not_fall" != before.evidence.rule, (before, after)


def test_an_n2_request_waiting_is_two_of_the_waiting_sequences():
    # the target runs; the neighbour, an n=2 request sent after it, waits with both its sequences (W=2):
    # the target is not among the waiting, and its KV must come back (it does not: KV stays)
    run = build_run(lambda t: 3.0 if t < 2.05 else 2.0, lambda t: 0.4, steady_gen, waiting=lambda t: 2.0,
                    engine_log=[("engine_added", "tg", 0.05), ("engine_added", "nb", 0.5),
                                ("engine_aborted", "tg", 2.01)])
    run.ledger.loc[run.ledger["request_id"] == "tg", ["sent_mono_ns", "first_token_mono_ns"]] = [T0 + int(0.05e9),
                                                                                                  T0 + int(0.3e9)]
    run.ledger.loc[run.ledger["request_id"] == "nb", ["sent_mono_ns", "first_token_mono_ns", "n"]] = [
        T0 + int(0.5e9), T0 + int(0.8e9), 2]
    (v,) = judge_run(run)
    assert v.verdict == "inconclusive" and v.evidence.rule == "kv_did_not_fall", v


def test_an_engine_that_comes_back_after_the_horizon_is_still_a_restart():
    # killed 50 ms after the stop, back only 75 s later (a slow engine: 74 s under a 0.3-CPU quota): the
    # first sample after the scrape outage, past the 60 s horizon, is what shows the counter gone back
    run = build_run(lambda t: 2.0, lambda t: 0.4, steady_gen, engine_log=[*ADDED, ("engine_aborted", "tg", 2.01)])
    s = run.samples
    run.samples = s[s["t_s"] < 2.05]
    back = run.samples[run.samples["t_s"] == run.samples["t_s"].max()].copy()
    rows = []
    for k in range(20):  # the new engine: 1 running (the probe), KV 0.1, its token counter from 0
        for metric, value in (("requests_running", 1.0), ("requests_waiting", 0.0), ("kv_cache_usage_ratio", 0.1),
                              ("generation_tokens_total", 5.0 * k)):
            row = back.iloc[0].to_dict() | {"metric": metric, "value": value, "t_s": 77.0 + 0.05 * k,
                                            "mono_ns": T0 + int((77.0 + 0.05 * k) * 1e9), "scrape_id": 10_000 + k}
            rows.append(row)
    run.samples = pd.concat([run.samples, pd.DataFrame(rows)], ignore_index=True)
    run.gaps = pd.DataFrame([{"source": "vllm", "target": "t0", "kind": "error", "t_s": 2.05, "end_t_s": 77.0,
                              "ticks": 1500, "detail": "connection refused"}])
    (v,) = judge_run(run)
    assert (v.verdict, v.evidence.rule) == ("inconclusive", "engine_restarted"), v


@pytest.mark.parametrize("series, waived", [
    # the scheduler preempted a request a moment before the stop: this one's blocks may have gone back then
    ({"preemptions_total": lambda t: 0.0 if t < 1.5 else 1.0}, "preempted"),
    # the prefix cache gave the target 512 prompt tokens as it was admitted (0.5-0.8 s), the neighbour running
    ({"prefix_cache_hits_tokens_total": lambda t: 0.0 if t < 0.6 else 512.0}, "prefix_shared"),
    # hits long before it was admitted are another request's
    ({"prefix_cache_hits_tokens_total": lambda t: 0.0 if t < 0.2 else 512.0}, None),
    ({}, None),
])
def test_no_kv_drop_is_asked_of_a_preempted_or_prefix_sharing_request(series, waived):
    # the count falls with the abort; KV usage does not (the neighbour took as many blocks as were freed)
    run = build_run(lambda t: 2.0 if t < 2.05 else 1.0, lambda t: 0.4, steady_gen,
                    engine_log=[*ADDED, ("engine_aborted", "tg", 2.01)],
                    series=series)
    (v,) = judge_run(run)
    if waived:
        assert (v.verdict, v.rule, v.evidence.kv_drop_waived) == ("released", "released", waived), v
    else:
        assert (v.verdict, v.rule) == ("inconclusive", "kv_did_not_fall"), v


def test_a_leaked_request_alone_in_the_engine_is_given_every_token_the_engine_made_after_its_stop():
    # the neighbour ended at 1 s: from the stop (2 s) until the target left at its end (3 s) the engine held
    # the target alone, so the 20 tokens its counter gained in that second were the target's, made for nobody
    def gen(t):
        return 100 + 20 * min(t, 3.0)

    run = build_run(lambda t: 2.0 if t < 1.0 else (1.0 if t < 3.0 else 0.0), lambda t: 0.4 if t < 3.0 else 0.0,
                    gen, engine_log=ADDED)
    run.ledger.loc[run.ledger["request_id"] == "nb", "closed_mono_ns"] = T0 + int(1.0e9)
    (v,) = judge_run(run)
    assert (v.verdict, v.rule) == ("leaked", "no_abort_ran_to_end"), v
    assert (v.evidence.tokens_after_client_left, v.evidence.tokens_after_client_left_is) == (20.0, "attributed")
    assert v.evidence.as_json()["tokens_after_client_left"] == 20.0


def test_a_leaked_request_beside_others_is_given_a_bound_and_a_released_one_no_figure():
    # the neighbour ran on beside the target: the engine's 20 tokens in that second were both requests',
    # at most all of them the target's
    run = build_run(lambda t: 2.0 if t < 3.0 else 1.0, lambda t: 0.4 if t < 3.0 else 0.1, steady_gen,
                    engine_log=ADDED)
    (v,) = judge_run(run)
    assert v.verdict == "leaked", v
    assert (v.evidence.tokens_after_client_left, v.evidence.tokens_after_client_left_is) == (20.0, "at_most")
    released = build_run(lambda t: 2.0 if t < 2.05 else 1.0, lambda t: 0.4 if t < 2.05 else 0.1, steady_gen,
                         probe_first_s=2.2, engine_log=[*ADDED, ("engine_aborted", "tg", 2.01)])
    (r,) = judge_run(released)
    assert r.verdict == "released" and "tokens_after_client_left" not in r.evidence.as_json(), r


def test_two_overlapping_reads_answering_out_of_order_at_the_windows_end_are_not_a_restart():
    # seen live: a ticker woke late and caught up, two reads 70 us apart at the end of the window; the first
    # answered 82 ms later with more tokens than the second (54 ms). Its body was built after the second's:
    # the counter never went back, and the release stands
    run = build_run(lambda t: 2.0 if t < 2.05 else 1.0, lambda t: 0.4 if t < 2.05 else 0.1, steady_gen,
                    probe_first_s=2.2, engine_log=[*ADDED, ("engine_aborted", "tg", 2.01)])
    (v,) = judge_run(run)
    assert v.verdict == "released", v
    t_end = v.timepoints["engine_abort"] + v.evidence.grace_s
    s = run.samples
    late = s["t_s"] == s["t_s"][s["t_s"] <= t_end].max()  # the last read inside the window: answered late
    assert late.any()
    t_late = float(s.loc[late, "t_s"].iloc[0])
    s.loc[late & (s["metric"] == "generation_tokens_total"), "value"] += 1.0
    twin = s[late].copy()  # the read started 70 us after it, answered first, with the tokens of its own moment
    twin["t_s"] += 70e-6
    twin["mono_ns"] += 70_000
    twin["scrape_id"] = 99_999
    twin.loc[twin["metric"] == "generation_tokens_total", "value"] -= 0.5
    run.samples = pd.concat([s, twin], ignore_index=True)
    run.scrapes = pd.DataFrame([{"target": "t0", "ok": 1, "t_s": t_late, "duration_ns": 82_000_000},
                                {"target": "t0", "ok": 1, "t_s": t_late + 70e-6, "duration_ns": 54_000_000}])
    (v,) = judge_run(run)
    assert v.verdict == "released", v
    # had the first read answered before the second started, the second's fewer tokens are a dip; one that
    # the samples after the window climb out of, not a restart
    run.scrapes.loc[0, "duration_ns"] = 0
    (v,) = judge_run(run)
    assert v.verdict == "released", v
    # and one they stay below is
    s = run.samples
    s.loc[(s["t_s"] > t_late + 0.01) & (s["metric"] == "generation_tokens_total"), "value"] = 5.0
    (v,) = judge_run(run)
    assert (v.verdict, v.rule) == ("inconclusive", "engine_restarted"), v


def entered_after_stop_run() -> Run:
    """The target sent at 1.9 s and given up at 2 s before any token, while a hop still held its request: the
    engine takes it at 2.5 s and runs it to 4 s, with no abort."""
    run = build_run(lambda t: 2.0 if 2.5 <= t < 4.0 else 1.0, lambda t: 0.4 if 2.5 <= t < 4.0 else 0.2, steady_gen,
                    engine_log=[("engine_added", "nb", 0.1), ("engine_added", "tg", 2.5)])
    tg = run.ledger["request_id"] == "tg"
    run.ledger.loc[tg, "sent_mono_ns"] = T0 + int(1.9e9)
    run.ledger.loc[tg, "first_token_mono_ns"] = None
    return run


def test_a_request_the_engine_took_only_after_its_client_left_is_leaked_not_already_finished():
    # seen through the watch on a starved host: the client gave up while a frozen hop held its request, which
    # reached the engine 5 ms after the stop and ran to its end, with no abort. The server counting one less
    # than the ledger at the stop was the request not there yet: "already finished" said the opposite
    (v,) = judge_run(entered_after_stop_run())
    assert (v.verdict, v.rule) == ("leaked", "entered_after_stop"), v
    # it was in the engine from its entry (2.5 s) to 4 s; the neighbour ran beside it: its tokens are a bound
    assert 1450 <= v.evidence.kept_running_ms <= 1550 and v.timepoints["left_scheduler"] == pytest.approx(4.0)
    assert v.evidence.rule_fields["after_s"] == pytest.approx(0.5, abs=0.01), v.evidence.rule_fields
    assert (v.evidence.tokens_after_client_left, v.evidence.tokens_after_client_left_is) == (30.0, "at_most")
    # an Added line after the stop that no sample shows running (the count never above the ledger's): no leak
    # is read from the line alone
    run = entered_after_stop_run()
    running = run.samples["metric"] == "requests_running"
    run.samples.loc[running, "value"] = (run.samples.loc[running, "t_s"] < 5.5).astype(float)  # the neighbour
    (q,) = judge_run(run)
    assert q.rule != "entered_after_stop", q
    # entering before the stop, the same counts are a request the engine had finished: not this rule
    early = build_run(lambda t: 2.0 if t < 1.5 else 1.0, lambda t: 0.4 if t < 1.5 else 0.2, steady_gen,
                      engine_log=ADDED)
    (e,) = judge_run(early)
    assert e.rule != "entered_after_stop", e


# ------------------------------------------------------------- requests on their way (CI, stop 29)
def another_cancel(rid: str, sent_s: float, stop_s: float, scenario: str) -> tuple[dict, list[dict]]:
    """A second cancel for build_run's extra_ledger and extra_events: `rid` sent at `sent_s`, its client gone
    at `stop_s` before any token, no abort."""
    ns = lambda s: T0 + int(s * 1e9)  # noqa: E731
    row = {"request_id": rid, "scenario": scenario, "role": "target", "n": 1, "sent_mono_ns": ns(sent_s),
           "first_token_mono_ns": None, "closed_mono_ns": ns(stop_s), "cancel_mono_ns": ns(stop_s),
           "terminal_state": "cancelled"}
    events = [{"request_id": rid, "kind": "user_stop", "mono_ns": ns(stop_s), "data": json.dumps(
        {"cancel_id": f"c-{rid}", "scenario": scenario, "phase": "in_flight", "metrics_target": "t0"})},
              {"request_id": rid, "kind": "client_closed", "mono_ns": ns(stop_s + 0.001), "data": json.dumps(
                  {"cancel_id": f"c-{rid}", "source": "client"})}]
    return row, events

def on_its_way(added_s: float | None, first_s: float | None, count):
    """The target (no abort in the log) runs on to 3 s, a second after its 2 s stop. A third request is sent
    at 2.3 s, after the stop, and enters the engine at `added_s` (None: not by the run's end: a hop holds it)
    with its first token at `first_s`; `count` is what the engine counts."""
    ns = lambda s: T0 + int(s * 1e9)  # noqa: E731
    held = {"request_id": "hop", "scenario": "s", "role": "neighbour", "n": 1, "sent_mono_ns": ns(2.3),
            "first_token_mono_ns": None if first_s is None else ns(first_s), "closed_mono_ns": None,
            "cancel_mono_ns": None, "terminal_state": None}
    log = [*ADDED, ("engine_added", "hop", added_s)] if added_s is not None else ADDED
    return build_run(count, lambda t: 0.4, steady_gen, extra_ledger=[held], engine_log=log)


@pytest.mark.parametrize("added_s, first_s, count", [
    # the hop still holds it: the engine never counts it
    (None, None, lambda t: 2.0 if t < 3.0 else 1.0),
    # it entered at 2.3 s and the engine counted it only from its first step, 0.3 s later
    (2.3, 2.6, lambda t: 2.0 if t < 2.6 else (3.0 if t < 3.0 else 2.0)),
], ids=["held_by_a_hop", "not_counted_yet"])
def test_a_request_on_its_way_does_not_make_a_leaked_one_read_as_gone(added_s, first_s, count):
    # counted from its send (or its Added line, the gauges a step behind), the request on its way filled the
    # target's place in the ledger: the target read as gone at 2.3 s, 0.3 s after its stop, where it ran to 3 s
    (v,) = judge_run(on_its_way(added_s, first_s, count))
    assert (v.verdict, v.rule) == ("leaked", "no_abort_ran_to_end"), v.evidence.why
    assert v.timepoints["left_scheduler"] == pytest.approx(3.0, abs=0.06), v.timepoints


def test_a_leaked_request_is_gone_once_the_engine_holds_nothing():
    """The target leaks (no abort) and leaves at 3 s, when the engine, its neighbour done, holds nothing. A
    second cancel, sent at 3.2 s and given up at 3.5 s, enters the engine only at 4 s (a hop held it) and runs
    alone to 5.5 s. With the first kept in the ledger after it left (a watch has no scenario end), the engine
    counting the second alone was read as never counting it beyond the ledger."""
    ns = lambda s: T0 + int(s * 1e9)  # noqa: E731
    late, stop = another_cancel("lt", 3.2, 3.5, "s")
    count = lambda t: 2.0 if t < 1.5 else (1.0 if t < 3.0 else (0.0 if t < 4.0 else (1.0 if t < 5.5 else 0.0)))  # noqa: E731
    run = build_run(count, lambda t: 0.4, steady_gen, extra_ledger=[late], extra_events=stop,
                    engine_log=[*ADDED, ("engine_added", "lt", 4.0)])
    run.ledger.loc[run.ledger["request_id"] == "nb", "closed_mono_ns"] = ns(1.5)
    verdicts = {v.request_id: v for v in judge_run(run)}
    assert (verdicts["tg"].verdict, verdicts["tg"].rule) == ("leaked", "no_abort_ran_to_end"), verdicts["tg"]
    lt = verdicts["lt"]
    assert (lt.verdict, lt.rule) == ("leaked", "entered_after_stop"), lt.evidence.why
    assert lt.timepoints["left_scheduler"] == pytest.approx(5.5, abs=0.06), lt.timepoints


def test_a_request_the_log_has_entering_after_an_idle_sample_is_not_taken_as_gone_there():
    """The review of the idle bound: `lk` (no abort, its client gone at 1 s) reaches the engine at 2.1 s (its
    Added line), and the gauges count it only from the engine's next step, 2.25 s; the engine is idle at 2.2 s.
    Taken as gone there, `lk` left the ledger while the engine ran it, and the target, aborted at 2.01 s and
    gone at 2.05 s, read as still generating (leaked)."""
    ns = lambda s: T0 + int(s * 1e9)  # noqa: E731
    count = lambda t: (1.0 if t < 1.0 else 0.0) + (1.0 if 0.5 <= t < 2.05 else 0.0) + (1.0 if t >= 2.25 else 0.0)  # noqa: E731
    lk, stop = another_cancel("lk", 0.6, 1.0, "w")
    run = build_run(count, lambda t: 0.4 if t < 2.05 else 0.1, steady_gen, extra_ledger=[lk], extra_events=stop,
                    engine_log=[*ADDED, ("engine_added", "lk", 2.1), ("engine_aborted", "tg", 2.01)])
    run.ledger.loc[run.ledger["request_id"] == "nb", "closed_mono_ns"] = ns(1.0)
    verdicts = {v.request_id: v for v in judge_run(run)}
    assert (verdicts["tg"].verdict, verdicts["tg"].rule) == ("released", "released"), verdicts["tg"].evidence.why


def test_a_client_sending_its_id_again_is_counted_though_the_log_names_it_by_that_id():
    """The watch keeps a client's id sent again as a row of its own (`rs~a1b2c3`); the engine's log names it
    by the id the client sent (`rs`). Taken as never entered, it was left out of the ledger's count, and the
    engine counting it read as other traffic beside a released cancel."""
    ns = lambda s: T0 + int(s * 1e9)  # noqa: E731
    rows = [{"request_id": "rs", "scenario": "s", "role": "neighbour", "n": 1, "sent_mono_ns": ns(0.2),
             "first_token_mono_ns": ns(0.4), "closed_mono_ns": ns(1.0), "cancel_mono_ns": None,
             "terminal_state": "completed"},
            {"request_id": "rs~a1b2c3", "scenario": "s", "role": "neighbour", "n": 1, "sent_mono_ns": ns(1.2),
             "first_token_mono_ns": ns(1.4), "closed_mono_ns": ns(5.0), "cancel_mono_ns": None,
             "terminal_state": "completed"}]
    spans = ((0.1, 9.0), (0.5, 2.05), (0.2, 1.0), (1.2, 5.0))  # nb, tg, rs, rs~a1b2c3 in the engine
    count = lambda t: float(sum(1 for a, b in spans if a <= t < b))  # noqa: E731
    run = build_run(count, lambda t: 0.4 if t < 2.05 else 0.1, steady_gen, extra_ledger=rows, probe_first_s=2.3,
                    engine_log=[*ADDED, ("engine_added", "rs", 0.2), ("engine_added", "rs", 1.2), ABORT_AT_2_01])
    (v,) = judge_run(run)
    assert (v.verdict, v.rule) == ("released", "released"), v.evidence.why


@pytest.mark.parametrize("part", ["whole", "window"])
def test_a_log_clock_behind_the_runs_does_not_drop_a_request_from_a_windows_count(part):
    """The review of windows: the engine's clock runs 1 s behind the run's. A window whose events start at 0.5 s
    (its lookback) holds none of the Added line of `nb`, sent at 1.2 s and stamped 0.2 s: taken as never
    entered, it was left out of the count, and the target's release read as other traffic."""
    ns = lambda s: T0 + int(s * 1e9)  # noqa: E731
    count = lambda t: (1.0 if 1.25 <= t < 5.8 else 0.0) + (1.0 if 2.05 <= t < 4.05 else 0.0)  # noqa: E731
    run = build_run(count, lambda t: 0.4 if t < 4.05 else 0.2, steady_gen, stop_s=4.0, abort_s=4.01,
                    engine_log=[("engine_added", "nb", 0.2), ("engine_added", "tg", 1.0), ("engine_aborted", "tg", 3.01)])
    ledger = run.ledger
    ledger.loc[ledger["request_id"] == "nb", ["sent_mono_ns", "first_token_mono_ns", "closed_mono_ns"]] = \
        [ns(1.2), ns(1.4), ns(5.8)]
    ledger.loc[ledger["request_id"] == "tg", ["sent_mono_ns", "first_token_mono_ns"]] = [ns(2.0), ns(2.2)]
    if part == "window":
        run.events = run.events[run.events["t_s"] >= 0.5].reset_index(drop=True)
        run.events_span = (0.5, 6.0)
    (v,) = judge_run(run)
    assert (v.verdict, v.rule) == ("released", "released"), v.evidence.why


ABORT_AT_2_01 = ("engine_aborted", "tg", 2.01)


def stopped_row(rid: str, sent_s: float, stop_s: float, closed_s: float | None = None) -> dict:
    ns = lambda s: T0 + int(s * 1e9)  # noqa: E731
    return {"request_id": rid, "scenario": "s", "role": "target", "n": 1, "sent_mono_ns": ns(sent_s),
            "first_token_mono_ns": ns(sent_s + 0.1), "closed_mono_ns": ns(stop_s if closed_s is None else closed_s),
            "cancel_mono_ns": ns(stop_s), "terminal_state": "cancelled"}


def stop_event(rid: str, stop_s: float, cid: str) -> dict:
    return {"request_id": rid, "kind": "user_stop", "mono_ns": T0 + int(stop_s * 1e9),
            "data": json.dumps({"cancel_id": cid, "scenario": "s", "phase": "decode", "metrics_target": "t0"})}


@pytest.mark.parametrize("engine_steps", [False, True])
def test_another_cancels_abort_the_engine_has_not_stepped_past_is_not_this_ones_excess(engine_steps):
    # AIPerf on two cores: this cancel left at once, then another's abort came just before this one's grace ended
    # while an engine step stalled; the gauges, still of the step before, counted the other one (the ledger no
    # longer did). Where the engine did step after that abort and still counts it, the excess is real
    def count(t):
        return 3.0 if t < 2.05 else (2.0 if t < 4.1 or engine_steps else 1.0)

    def gen(t):
        return steady_gen(t) if t < 3.8 or engine_steps else steady_gen(3.8) + (20 * (t - 4.1) if t >= 4.1 else 0)

    run = build_run(count, lambda t: 0.4 if t < 2.05 else 0.3, gen, probe_first_s=2.2,
                    extra_ledger=[stopped_row("ot", 0.3, 3.9)],
                    engine_log=[*ADDED, ("engine_added", "ot", 0.3), ("engine_aborted", "tg", 2.01),
                                ("engine_aborted", "ot", 3.9)])
    v = {x.request_id: x for x in judge_run(run)}["tg"]
    if engine_steps:
        assert v.verdict != "released", v
    else:
        assert (v.verdict, v.rule) == ("released", "released"), v
        assert v.timepoints["left_scheduler"] == pytest.approx(2.05)


@pytest.mark.parametrize("case", ["taken", "kv_rose", "not_logged"])
def test_a_newcomer_admitted_in_the_aborted_ones_place_excuses_a_kv_usage_that_did_not_fall(case):
    # steady load: the step that drops the aborted request admits the next, whose prefill takes the blocks; the
    # count holds the newcomer (its Added line) and not this one, and KV usage is no higher than at the stop
    ns = lambda s: T0 + int(s * 1e9)  # noqa: E731
    newcomer = {"request_id": "nw", "scenario": "s2", "role": "target", "n": 1, "sent_mono_ns": ns(1.95),
                "first_token_mono_ns": ns(2.2), "closed_mono_ns": None, "cancel_mono_ns": None,
                "terminal_state": None}
    log = [*ADDED, ("engine_aborted", "tg", 2.005)] + ([] if case == "not_logged" else [("engine_added", "nw", 2.01)])
    run = build_run(lambda t: 2.0, lambda t: 0.45 if case == "kv_rose" and t >= 2.05 else 0.4, steady_gen,
                    extra_ledger=[newcomer], engine_log=log)
    (v,) = judge_run(run)
    if case == "taken":
        assert (v.verdict, v.evidence.kv_drop_waived) == ("released", "taken_in_its_place"), v
    else:
        # usage rose with the newcomer counted, or the log never says it entered: nothing shows the blocks went back
        assert v.verdict != "released", v


def lost_then_lost_again():
    """Two lost cancels' requests (l1, l2) ran out at 1.6 s; the target's cancel, at 3 s, is lost too: it ran on
    to 4.5 s for nobody."""
    log = [*ADDED, ("engine_added", "l1", 0.2), ("engine_added", "l2", 0.2)]

    def count(t):  # the neighbour from 0.1 s, l1 and l2 from 0.2 s, the target from 0.5 s
        return (float(t >= 0.1) + 2 * float(t >= 0.2) + float(t >= 0.5) - 2 * float(t >= 1.6)
                - float(t >= 4.5))

    return build_run(count, lambda t: 0.6 if t < 1.6 else (0.4 if t < 4.5 else 0.2), steady_gen, stop_s=3.0,
                     abort_s=3.002, extra_ledger=[stopped_row("l1", 0.2, 1.0), stopped_row("l2", 0.2, 1.0)],
                     extra_events=[stop_event("l1", 1.0, "c2"), stop_event("l2", 1.0, "c3")], engine_log=log)


def test_a_watch_window_that_starts_after_an_earlier_lost_request_left_is_told_when_it_left():
    # live, the target's window of the run starts 2 s before its stop, after l1 and l2 left: only their verdicts,
    # judged on their own windows before, say when (analysis.watching.judge_cancels' seen_leaving)
    from cancelwatch.analysis.watching import judge_cancels, left_seen

    earlier = [v for v in judge_run(lost_then_lost_again()) if v.request_id in ("l1", "l2")]
    window = lost_then_lost_again()
    window.samples = window.samples[window.samples["t_s"] >= 2.0]
    (blind,) = judge_cancels(window, {"tg"}, 2.0)
    # untold, l1 and l2 were the ledger's to the end: two more than the count, and the target read
    # `already_finished`. The count holding neither beyond the others for the window's first second now takes
    # them out by its start (_gone_by_surplus); told, they leave where their verdicts saw them go
    assert (blind.verdict, blind.rule, blind.timepoints["left_scheduler"]) == ("leaked", "no_abort_ran_to_end",
                                                                            pytest.approx(4.5)), blind
    window = lost_then_lost_again()
    window.samples = window.samples[window.samples["t_s"] >= 2.0]
    (told,) = judge_cancels(window, {"tg"}, 2.0, left_seen(earlier))
    assert (told.verdict, told.rule, told.timepoints["left_scheduler"]) == ("leaked", "no_abort_ran_to_end",
                                                                         pytest.approx(4.5)), told


def test_a_leaked_request_its_verdict_saw_leave_is_not_counted_in_the_engine_for_the_next_cancel():
    # AIPerf behind a proxy that passes no cancel on: two lost cancels' requests ran out at 1.6 s. Held by the
    # ledger until the engine is idle (under load it never is), they made the next lost cancel's count read
    # two short of the ledger's: `already_finished`, where it ran on to 4.5 s for nobody
    run = lost_then_lost_again()
    verdicts = {v.request_id: v for v in judge_run(run)}
    assert {verdicts[r].rule for r in ("l1", "l2")} == {"no_abort_ran_to_end"}, verdicts
    assert verdicts["l1"].timepoints["left_scheduler"] == pytest.approx(1.6)
    tg = verdicts["tg"]
    assert (tg.verdict, tg.rule, tg.timepoints["left_scheduler"]) == ("leaked", "no_abort_ran_to_end",
                                                                       pytest.approx(4.5)), tg


def lost_ones_overlapping(length_s: float = 10.0):
    """Steady load behind a proxy that passes no cancel on: each lost request is still in the engine when the next
    is lost, so the engine is never without one. l1 (stopped 1 s) runs out at 1.6 s, l2 (1.2 s) at 2.8 s, l3 (2 s)
    at 3.6 s and the target (3 s) at 4.5 s, with a neighbour to 9.5 s (its client closes then)."""
    ns = lambda s: T0 + int(s * 1e9)  # noqa: E731
    spans = {"nb": (0.1, 9.5), "tg": (0.5, 4.5), "l1": (0.2, 1.6), "l2": (0.6, 2.8), "l3": (1.7, 3.6)}

    def count(t):
        return float(sum(1 for a, b in spans.values() if a <= t < b))

    log = [*ADDED, ("engine_added", "l1", 0.2), ("engine_added", "l2", 0.6), ("engine_added", "l3", 1.7)]
    run = build_run(count, lambda t: 0.1 * count(t), steady_gen, stop_s=3.0, abort_s=3.002, length_s=length_s,
                    extra_ledger=[stopped_row("l1", 0.2, 1.0), stopped_row("l2", 0.6, 1.2),
                                  stopped_row("l3", 1.7, 2.0)],
                    extra_events=[stop_event("l1", 1.0, "c2"), stop_event("l2", 1.2, "c3"),
                                  stop_event("l3", 2.0, "c4")], engine_log=log)
    run.ledger.loc[run.ledger["request_id"] == "nb", "closed_mono_ns"] = ns(9.5)
    return run


def test_lost_requests_that_overlap_under_steady_load_are_each_leaked_never_already_finished():
    # AIPerf at concurrency 4 through a proxy that passes no cancel on (issue 21 point 7): no count ever showed
    # which of two lost requests left, so none was seen leaving, the ledger kept them all to the end, and the
    # later cancels read as the engine running ahead: l3 and the target `already_finished` (5 of 20 in the test)
    verdicts = {v.request_id: v for v in judge_run(lost_ones_overlapping())}
    assert {r: v.verdict for r, v in verdicts.items()} == dict.fromkeys(("l1", "l2", "l3", "tg"), "leaked"), \
        {r: (v.verdict, v.rule) for r, v in verdicts.items()}
    # which one left at each fall the count cannot say: each was surely there up to the first fall after its stop,
    # and left by the fall the oldest-first reading gives it (the ghosts' reading), its rule saying so
    assert {v.rule for v in verdicts.values()} == {"no_abort_left_oldest_first"}, verdicts
    assert [verdicts[r].timepoints["left_scheduler"] for r in ("l1", "l2", "l3", "tg")] == pytest.approx(
        [1.6, 2.8, 3.6, 4.5], abs=0.06)
    assert [verdicts[r].evidence.kept_running_ms for r in ("l1", "l2", "l3", "tg")] == pytest.approx(
        [550, 350, 750, 550], abs=60)


def test_the_ledger_takes_the_oldest_lost_request_out_where_the_count_cannot_hold_it_for_the_hold():
    from cancelwatch.analysis.verdicts.vllm_frames import _RunFrames

    frames = _RunFrames(lost_ones_overlapping())
    frame = frames.frame("t0")
    # the oldest first, from the start of the hold (SURPLUS_HOLD_S) over which the count held one fewer than the
    # ledger's lost ones
    assert [round(frame.gone[r], 2) for r in ("l1", "l2", "l3", "tg")] == [1.6, 2.8, 3.6, 4.5], frame.gone
    counted = frame.cols["count"]
    assert np.all(frame.inflight <= counted + 1e-9), "the ledger counted more than the engine held"
    # a count that holds them all keeps them all: l3 counted to 4.2 s is taken out there, not where it left before
    run = lost_ones_overlapping()
    samples = run.samples
    dip = (samples["metric"] == "requests_running") & samples["t_s"].between(3.7, 4.2)
    samples.loc[dip, "value"] += 1.0  # l3 still counted to 4.2 s: its fall at 4.2 s is within a second of tg's
    gone = _RunFrames(run).frame("t0").gone
    assert gone["l3"] == pytest.approx(4.2, abs=0.06) and gone["tg"] == pytest.approx(4.5), gone


def test_a_fall_no_end_of_the_engines_own_accounts_for_leaves_which_lost_request_stays_open():
    # no request log. O's cancel was lost (stopped at 1.5 s, kept to the end); tg's went through: the engine dropped
    # it at 2.05 s (count 3 -> 2, KV usage falls). The counter of the engine's own ends never rose: the fall was an
    # abort, and the count cannot say whose. Oldest first (O gone, tg kept) is how requests of one length end by
    # themselves, not how aborts come: tg is no leak on that reading
    ns = lambda s: T0 + int(s * 1e9)  # noqa: E731
    closed = {"request_id": "O", "kind": "client_closed", "mono_ns": ns(1.501),
              "data": json.dumps({"cancel_id": "cO", "source": "client"})}
    run = build_run(lambda t: 3.0 if t < 2.05 else 2.0, lambda t: 0.6 if t < 2.05 else 0.4, steady_gen,
                    extra_ledger=[stopped_row("O", 0.2, 1.5)], extra_events=[stop_event("O", 1.5, "cO"), closed],
                    finished=lambda t: 0.0, length_s=8.0)
    v = {v.request_id: v for v in judge_run(run)}["tg"]
    assert (v.verdict, v.rule) == ("inconclusive", "counted_beside_lost"), (v.verdict, v.rule, v.evidence.why)
    assert [(o["request_id"], o["reason"]) for o in v.evidence.count_reading["open"]] == \
        [("O", "assumed_left_oldest_first")], v.evidence.count_reading
    # the same falls made by the engine's own ends (the counter rose by one): the oldest first, and tg leaked
    run = build_run(lambda t: 3.0 if t < 2.05 else 2.0, lambda t: 0.6 if t < 2.05 else 0.4, steady_gen,
                    extra_ledger=[stopped_row("O", 0.2, 1.5)], extra_events=[stop_event("O", 1.5, "cO"), closed],
                    finished=lambda t: float(t >= 2.05), length_s=8.0)
    v = {v.request_id: v for v in judge_run(run)}["tg"]
    assert (v.verdict, v.rule) == ("leaked", "still_counted_oldest_first"), (v.verdict, v.rule, v.evidence.why)
