"""The verdict ladder's rules (analysis/verdicts/core.py: RULES). Every verdict names the rule that gave it,
a code of the one table, with that rule's verdict; every code of the table is reached by a run built here
(hand-built vLLM runs as in test_verdicts, the recorded Triton suite with one part of its evidence changed
as in test_triton_verdicts), or is listed in UNREACHED with where it is reached instead. Tests pin the
code, never the sentence."""

from __future__ import annotations

import ast
import copy
import json
import re
from collections import Counter
from pathlib import Path

import pandas as pd
import pytest

from cancelwatch.analysis.cancel_table import cancel_table
from cancelwatch.analysis.protocol import protocol_markdown
from cancelwatch.analysis.verdicts import RULES, VERDICTS, judge_run, report_document
from cancelwatch.runstore.reader import load_run
from tests.test_app_lost import answered
from tests.test_triton_verdicts import RUN, without_log
from tests.test_verdicts import ADDED, T0, build_run, entered_after_stop_run, steady_gen

CORE = Path(__file__).resolve().parents[1] / "analysis" / "verdicts" / "core.py"
ABORT = ("engine_aborted", "tg", 2.01)  # the engine's log: the target aborted 10 ms after the 2 s stop


def ns(s: float) -> int:
    return T0 + int(s * 1e9)


def step(before: float, after: float, at: float):
    return lambda t: before if t < at else after


def flat_from(at: float):
    """generation_tokens_total that stops rising at `at`: the engine stepped no more."""
    return lambda t: 100 + 20 * min(t, at)


def completed(run, missed_trigger: bool = False):
    """The client read the target's end at 1.5 s, before its stop; its trigger never reached, if so."""
    run.ledger.loc[run.ledger["request_id"] == "tg", ["terminal_state", "closed_mono_ns"]] = ["completed", ns(1.5)]
    if missed_trigger:
        missed = {"request_id": "tg", "kind": "trigger_missed", "mono_ns": ns(1.99), "wall_ns": 0, "t_s": 1.99,
                  "data": json.dumps({"trigger": "while_queued", "trigger_value": 0})}
        run.events = pd.concat([run.events, pd.DataFrame([missed])], ignore_index=True)
    return run


def near_the_end(run, left: int = 2):
    """The stop came `left` tokens before the target's end (40 tokens)."""
    run.ledger["max_tokens"] = 40
    stop = run.events["kind"] == "user_stop"
    run.events.loc[stop, "data"] = [json.dumps({**json.loads(d), "tokens_at_cancel": 40 - left})
                                    for d in run.events.loc[stop, "data"]]
    return run


def restarted(value):
    return lambda t: value(t) if t < 2.3 else 0.0


def with_max_tokens(run, tokens: int = 500):
    """Every request of the run asked for `tokens` (the neighbour's 500 outlast the run)."""
    run.ledger["max_tokens"] = tokens
    return run


def alone_first(count):
    """The neighbour alone in the engine until the target is sent at 0.5 s (the run's one sequence alone:
    steady_gen's 20 tokens a second), then `count(t)`."""
    return lambda t: 1.0 if t < 0.5 else count(t)


DROP = (step(2.0, 1.0, 2.05), step(0.4, 0.1, 2.05))  # count and KV usage fall 50 ms after the stop
# rule -> a hand-built vLLM run (test_verdicts.build_run: a stop at 2 s, a neighbour beside the target)
VLLM_RUNS = {
    # the app answered the explicit cancel; the engine counted the target and kept generating to its end at 5 s
    "app_lost_cancel": lambda: answered(build_run(step(2.0, 1.0, 5.0), lambda t: 0.4, steady_gen)),
    # ... but the engine was done with it at 1.8 s, before the stop: the tokens came from a buffer
    "app_lost_unconfirmed": lambda: answered(build_run(step(2.0, 1.0, 1.8), lambda t: 0.4, steady_gen)),
    "trigger_never_reached": lambda: completed(build_run(step(2.0, 1.0, 1.5), lambda t: 0.4, steady_gen,
                                                         engine_log=ADDED), missed_trigger=True),
    "completion_won_race": lambda: completed(build_run(step(2.0, 1.0, 1.5), lambda t: 0.4, steady_gen,
                                                       engine_log=ADDED)),
    # the neighbour's Added line where its send puts it, the target's 3 s after its first token: no one offset
    "log_clock_disagrees": lambda: build_run(*DROP, steady_gen, engine_log=[("engine_added", "nb", 0.1),
                                                                            ("engine_added", "tg", 3.8), ABORT]),
    # no abort line for the target, but the log was cut short in place across its stop: it may be lost
    "engine_log_gap": lambda: build_run(lambda t: 2.0, lambda t: 0.4, steady_gen, engine_log=ADDED, extra_events=[
        {"request_id": None, "kind": "engine_log_gap", "mono_ns": ns(2.3),
         "data": json.dumps({"target": "t0", "from_mono_ns": ns(1.9), "why": "the log was cut short in place"})}]),
    "no_samples": lambda: build_run(lambda t: 2.0, lambda t: 0.4, steady_gen, missing=(0.9, 5.0),
                                    engine_log=[*ADDED, ABORT]),
    "too_few_samples": lambda: build_run(lambda t: 2.0, lambda t: 0.4, steady_gen, hz=1.0),  # sampled slowly
    # a stranger enters as the target leaves: the count never falls to the ledger's
    "other_traffic_logged": lambda: with_max_tokens(build_run(
        alone_first(lambda t: 2.0), lambda t: 0.4, steady_gen, engine_log=[*ADDED, ABORT, ("engine_added", "stranger", 2.04)])),
    # the count falls to the ledger's before the stranger comes
    "released_beside_traffic": lambda: with_max_tokens(build_run(
        alone_first(lambda t: 2.0 if t < 2.05 or t >= 2.1 else 1.0), lambda t: 0.4, steady_gen,
        engine_log=[*ADDED, ABORT, ("engine_added", "stranger", 2.1)])),
    # no abort, a stranger in the window, and 500 tokens at 25 a second (20 alone, a quarter added) take 20 s
    "no_abort_beside_traffic": lambda: with_max_tokens(build_run(
        alone_first(lambda t: 2.0), lambda t: 0.4, steady_gen, engine_log=[*ADDED, ("engine_added", "stranger", 2.1)])),
    "other_traffic_counted": lambda: build_run(step(3.0, 2.0, 2.05), step(0.4, 0.1, 2.05), steady_gen),
    "engine_restarted": lambda: build_run(restarted(lambda t: 2.0), restarted(lambda t: 0.4), restarted(steady_gen),
                                          probe_first_s=3.0),
    "abort_after_grace": lambda: build_run(step(2.0, 1.0, 5.05), step(0.4, 0.1, 5.05), steady_gen,
                                           engine_log=[*ADDED, ("engine_aborted", "tg", 5.0)]),
    "abort_stamp_straddles_grace": lambda: build_run(step(2.0, 1.0, 3.95), step(0.4, 0.1, 3.95), steady_gen, stop_s=1.5,
                                                     abort_s=1.502, resolution_s=1.0,
                                                     engine_log=[*ADDED, ("engine_aborted", "tg", 3.0)]),
    # the log was read and holds not one per-request line: vLLM without --enable-log-requests
    "log_names_no_requests": lambda: build_run(step(2.0, 1.0, 3.0), lambda t: 0.4, steady_gen, engine_log=[]),
    # the target aborted at its stop, then sent again by something on the path: a second Added line
    # (the copy is an engine request of its own: another engine id under the same client id)
    "resubmitted_after_stop": lambda: build_run(lambda t: 2.0, lambda t: 0.4, steady_gen, engine_log=[*ADDED, ABORT],
                                                extra_events=[{"request_id": "tg", "kind": "engine_added",
                                                               "mono_ns": ns(2.03), "data": json.dumps({
                                                                   "engine_request_id": "cmpl-tg-0-fedcba98",
                                                                   "clock": "engine_log", "resolution_s": 0.001,
                                                                   "target": "t0"})}]),
    # the target's client left while a hop still held its request: the engine took it after the stop
    "entered_after_stop": entered_after_stop_run,
    "never_added": lambda: build_run(step(2.0, 1.0, 3.0), lambda t: 0.4, steady_gen,
                                     engine_log=[("engine_added", "nb", 0.1)]),
    "aborted_before_stop": lambda: build_run(step(2.0, 1.0, 1.5), step(0.4, 0.1, 1.5), steady_gen, probe_first_s=2.2,
                                             engine_log=[*ADDED, ("engine_aborted", "tg", 1.5)]),
    # no request log and no abort: the count falls, but the engine does not say why its requests ended
    "gone_may_have_run_out": lambda: build_run(*DROP, steady_gen, probe_first_s=2.3),
    "already_finished": lambda: build_run(step(2.0, 1.0, 1.5), step(0.4, 0.1, 1.5), steady_gen, probe_first_s=2.2,
                                          engine_log=ADDED),
    "no_refresh_after_stop": lambda: build_run(lambda t: 2.0, lambda t: 0.4, flat_from(1.9), engine_log=ADDED),
    "finished_on_its_own": lambda: build_run(step(2.0, 1.0, 2.0), step(0.4, 0.1, 2.0), steady_gen, engine_log=ADDED),
    "ran_out_its_last_tokens": lambda: near_the_end(build_run(step(2.0, 1.0, 2.5), step(0.4, 0.1, 2.5), steady_gen,
                                                              engine_log=ADDED)),
    "no_abort_ran_to_end": lambda: build_run(step(2.0, 1.0, 3.0), step(0.4, 0.1, 3.0), steady_gen, engine_log=ADDED),
    "no_abort_still_there": lambda: build_run(lambda t: 2.0, lambda t: 0.4, steady_gen, engine_log=ADDED),
    "already_finished_no_log": lambda: near_the_end(build_run(step(2.0, 1.0, 1.92), step(0.4, 0.1, 1.92),
                                                              steady_gen)),
    "no_baseline": lambda: build_run(*DROP, steady_gen, missing=(1.0, 2.0)),
    "released": lambda: build_run(*DROP, steady_gen, probe_first_s=2.3, engine_log=[*ADDED, ABORT]),
    "no_samples_in_grace": lambda: build_run(lambda t: 2.0, lambda t: 0.4, steady_gen, missing=(2.0, 5.0)),
    "gauges_not_refreshed": lambda: build_run(step(2.0, 1.0, 2.0), lambda t: 0.4, flat_from(2.0),
                                              engine_log=[*ADDED, ABORT]),
    "kv_did_not_fall": lambda: build_run(step(2.0, 1.0, 2.05), lambda t: 0.4, steady_gen, probe_first_s=2.2),
    "abort_logged_still_generating": lambda: build_run(lambda t: 2.0, lambda t: 0.4, steady_gen,
                                                       engine_log=[*ADDED, ABORT]),
    "abort_logged_gauges_stale": lambda: build_run(lambda t: 2.0, lambda t: 0.4, flat_from(2.0),
                                                   engine_log=[*ADDED, ABORT]),
    "still_counted_generating": lambda: build_run(step(2.0, 1.0, 5.0), lambda t: 0.4, steady_gen),
    "gauges_stale": lambda: build_run(lambda t: 2.0, lambda t: 0.4, flat_from(2.0)),
}


# ------------------------------------------------------------------------------------------ the Triton suite
def stop_of(run, scenario: str) -> pd.Series:
    return (run.events["kind"] == "user_stop") & run.events["data"].str.contains(f'"{scenario}"')


def target_of(run, scenario: str) -> str:
    return run.events[stop_of(run, scenario)]["request_id"].iloc[0]


def stop_data(scenario: str, drop: tuple[str, ...] = (), **data):
    def change(run):
        m = stop_of(run, scenario)
        run.events.loc[m, "data"] = [json.dumps({**{k: v for k, v in json.loads(d).items() if k not in drop}, **data})
                                     for d in run.events.loc[m, "data"]]
    return change


def stop_at(scenario: str, t_s: float):
    def change(run):
        run.events.loc[stop_of(run, scenario), "t_s"] = t_s
    return change


def model_lines(scenario: str, *kinds: str, drop: bool = False, shift_s: float = 0.0, detail: str | None = None):
    """The target's own lines in the model log: dropped, moved later, or saying `detail`."""
    def change(run):
        m = (run.events["request_id"] == target_of(run, scenario)) & run.events["kind"].isin(kinds)
        if drop:
            run.events = run.events[~m].reset_index(drop=True)
            return
        run.events.loc[m, "t_s"] += shift_s
        if detail is not None:
            run.events.loc[m, "data"] = [json.dumps({**json.loads(d), "detail": detail})
                                         for d in run.events.loc[m, "data"]]
    return change


def client_read_the_end(scenario: str, missed_trigger: bool = False):
    def change(run):
        run.ledger.loc[run.ledger["request_id"] == target_of(run, scenario), "terminal_state"] = "completed"
        if missed_trigger:
            row = {**run.events[stop_of(run, scenario)].iloc[0].to_dict(), "kind": "trigger_missed",
                   "data": json.dumps({"trigger": "responses"})}
            run.events = pd.concat([run.events, pd.DataFrame([row])], ignore_index=True)
    return change


def no_series(*metrics: str):
    def change(run):
        run.samples = run.samples[~run.samples["metric"].isin(metrics)].reset_index(drop=True)
    return change


def scrapes_kept(scenario: str, keep: int):
    """Only the first `keep` scrapes from 1 s before the scenario's stop to 2 s after it answered."""
    def change(run):
        t = float(run.events[stop_of(run, scenario)]["t_s"].iloc[0])
        s = run.samples
        w = s[(s["metric"] == "requests_waiting") & (s["t_s"] >= t - 1.0) & (s["t_s"] <= t + 2.0)]
        run.samples = s[~s["scrape_id"].isin(set(w["scrape_id"].iloc[keep:]))].reset_index(drop=True)
    return change


def gauge_held(scenario: str, model: str):
    """The model's active gauge one higher from the scenario's stop on: one request's unit never comes back."""
    def change(run):
        t = float(run.events[stop_of(run, scenario)]["t_s"].iloc[0])
        s = run.samples.copy()
        held = (s["metric"] == "model_active_requests") & (s["labels"].astype(str) == json.dumps({"model": model})) \
            & (s["t_s"] > t)
        s.loc[held, "value"] += 1.0
        run.samples = s
    return change


def buffer_held(scenario: str, model: str):
    """The model's buffer gauge 8 MiB (a request's buffer) higher from the scenario's stop on: the model let
    the request go by its word and its active gauge, and kept what it held."""
    def change(run):
        t = float(run.events[stop_of(run, scenario)]["t_s"].iloc[0])
        s = run.samples.copy()
        held = (s["metric"] == "model_buffer_bytes") & (s["labels"].astype(str) == json.dumps({"model": model})) \
            & (s["t_s"] > t)
        assert held.any(), "the recorded run has no buffer gauge after the stop"
        s.loc[held, "value"] += float(8 << 20)
        run.samples = s
    return change


def closed_with_stop(scenario: str, role: str):
    """The scenario's `role` request closed by its client 50 ms after the stop (within LEDGER_LAG_S)."""
    def change(run):
        t = float(run.events[stop_of(run, scenario)]["t_s"].iloc[0])
        row = (run.ledger["scenario"] == scenario) & (run.ledger["role"] == role)
        run.ledger.loc[row, "closed_mono_ns"] = run.info["started_mono_ns"] + int((t + 0.05) * 1e9)
    return change


def unread(scenario: str, metric: str, from_s: float, to_s: float):
    """No reading of `metric` from `from_s` to `to_s` after the scenario's stop."""
    def change(run):
        t = float(run.events[stop_of(run, scenario)]["t_s"].iloc[0])
        s = run.samples
        gone = (s["metric"] == metric) & (s["t_s"] > t + from_s) & (s["t_s"] < t + to_s)
        run.samples = s[~gone].reset_index(drop=True)
    return change


def another_stopped(scenario: str, model: str):
    """One more request of `model`, sent 10 ms after the scenario's target and let go by its client 30 ms before the
    target's stop, with no answer: the core may have dropped it from its queue in the target's place."""
    def change(run):
        t = float(run.events[stop_of(run, scenario)]["t_s"].iloc[0])
        rows = run.ledger[run.ledger["scenario"] == scenario]
        target = rows[rows["role"] == "target"].iloc[0].to_dict()
        sent = target["sent_mono_ns"] + 10_000_000
        let_go = run.info["started_mono_ns"] + int((t - 0.03) * 1e9)
        row = {**target, "request_id": "another", "role": "neighbour", "sent_mono_ns": sent, "cancel_mono_ns": let_go,
               "closed_mono_ns": let_go, "first_token_mono_ns": None, "terminal_state": "cancelled"}
        run.ledger = pd.concat([run.ledger, pd.DataFrame([row])], ignore_index=True)
        event = {"request_id": "another", "kind": "request_sent", "wall_ns": 0, "mono_ns": sent,
                 "t_s": (sent - run.info["started_mono_ns"]) / 1e9,
                 "data": json.dumps({"scenario": scenario, "role": "neighbour", "model": model})}
        run.events = pd.concat([run.events, pd.DataFrame([event])], ignore_index=True).sort_values("t_s", kind="stable")
    return change


EXEC, DEAF, HTTP = "triton_executing", "triton_deaf", "triton_http_timeout"
# rule -> (the scenario whose target reaches it, the changes to the recorded suite)
TRITON_RUNS = {
    "trigger_never_reached": (EXEC, [client_read_the_end(EXEC, missed_trigger=True)]),
    "completion_won_race": (EXEC, [client_read_the_end(EXEC)]),
    "no_samples": (EXEC, [scrapes_kept(EXEC, 0)]),
    "too_few_samples": (EXEC, [scrapes_kept(EXEC, 3)]),
    "finished_before_stop": (DEAF, [stop_at(DEAF, 40.0)]),  # its `finished` line is at 39.84 s
    "abort_after_grace": (EXEC, [model_lines(EXEC, "engine_aborted", shift_s=3.0)]),
    "model_kept_buffer": (EXEC, [buffer_held(EXEC, "generator")]),
    "model_cancelled_before_stop": (EXEC, [stop_at(EXEC, 7.2)]),  # its `cancelled` line is at 6.96 s
    "model_ended_with_error": (HTTP, [model_lines(HTTP, "engine_finished", detail="error: boom")]),
    "natural_end_with_stop": (HTTP, [stop_at(HTTP, 33.15)]),  # its `finished` line is at 33.20 s
    "http_carries_no_cancel": (HTTP, []),
    "backend_does_not_poll": (DEAF, []),
    "cancel_never_reached_model": (HTTP, [stop_data(HTTP, mode="explicit")]),
    "model_released": (EXEC, []),
    "released_on_log_alone": (EXEC, [no_series("model_active_requests")]),
    "gauge_did_not_fall": (EXEC, [gauge_held(EXEC, "generator")]),
    "dropped_in_queue": ("triton_queued", []),
    "canceled_rise_shared": ("triton_queued", [another_stopped("triton_queued", "slow")]),
    "due_to_end_with_stop": (EXEC, [without_log, stop_data(EXEC, tokens_at_cancel=200)]),
    "gauge_fell_end_unknown": (EXEC, [without_log, stop_data(EXEC, drop=("inputs",))]),
    "gauge_fell_before_natural_end": (EXEC, [without_log]),
    "gauge_up_to_natural_end": (DEAF, [without_log]),
    "gauge_up_through_grace": (DEAF, [without_log, gauge_held(DEAF, "generator_deaf")]),
    "steps_kept_rising": (EXEC, [without_log, stop_data(EXEC, drop=("inputs",)), gauge_held(EXEC, "generator")]),
    "no_server_evidence": (EXEC, [without_log, no_series("model_active_requests", "triton_request_failure_total")]),
    "gauge_within_others": (EXEC, [without_log, closed_with_stop(EXEC, "neighbour")]),
    "gauge_up_no_steps": (EXEC, [without_log, stop_data(EXEC, drop=("inputs",)), gauge_held(EXEC, "generator"),
                                 no_series("model_steps_total")]),
    "no_gauge_reading": (EXEC, [without_log, unread(EXEC, "model_active_requests", 0.0, 3.0)]),
    "never_named": (EXEC, [model_lines(EXEC, "engine_added", "engine_aborted", drop=True),
                           no_series("triton_request_failure_total")]),
    "still_running_at_end": (EXEC, [model_lines(EXEC, "engine_aborted", drop=True),
                                    no_series("triton_request_failure_total")]),
}
# rule -> where it is reached, for a rule no run built here reaches (none today: keep it so)
UNREACHED: dict[str, str] = {
    "finished_unseen": "tests/test_finished_unseen.py: a kept request hidden by a slow reader's end the engine made",
    "renamed_untold": "tests/test_log_ids.py: the shipped sample's burst targets, its engine lines renamed",
    "no_abort_left_among_others": "tests/test_ghosts.py: two lost cancels, the engine idle within the hold of a drop",
    "no_abort_left_oldest_first": "tests/test_verdicts.py: lost requests overlapping under steady load",
    "still_counted_oldest_first": "tests/corpus: the AIPerf and openai SDK watches behind the leaking proxy, vLLM on "
                                  "its defaults (aiperf_proxy_default, watch_sdk_proxy_default); tests/test_verdicts.py",
    "counted_beside_lost": "tests/test_verdicts.py: an older lost cancel kept, this one's aborted, no end of the "
                           "engine's own",
    "ended_by_itself_after_stop": "tests/test_no_log_readings.py: a lost cancel behind a hop, the engine's own ends "
                                  "as many as it held; tests/corpus: aiperf_proxy_default",
}


@pytest.fixture(scope="module")
def suite():
    return load_run(RUN, "latest")


def carries_its_rule(v) -> None:
    """A verdict names a rule of the table, gives that rule's verdict, and says why unless a plain release;
    in the JSON the code stands beside the sentence."""
    assert v.rule in RULES, (v.request_id, v.rule)
    rule = RULES[v.rule]
    assert v.verdict == rule.verdict, (v.rule, v.verdict)
    assert (v.evidence.why is None) == rule.quiet, (v.rule, v.evidence.why)
    keys = list(v.as_json()["evidence"])
    assert keys[-1:] == ["rule"] if rule.quiet else keys[-2:] == ["rule", "why"], keys


def test_the_table_lists_each_code_once_with_its_verdict_and_sentence():
    # a dict literal keeps the last of two equal keys without a word: the source is read for them
    (table,) = [n.value for n in ast.walk(ast.parse(CORE.read_text()))
                if isinstance(n, ast.AnnAssign) and getattr(n.target, "id", None) == "RULES"]
    codes = [k.value for k in table.keys]
    assert len(codes) == len(set(codes)) == len(RULES), [c for c in codes if codes.count(c) > 1]
    for code, rule in RULES.items():
        assert re.fullmatch(r"[a-z]+(_[a-z]+)*", code), code
        assert rule.verdict in VERDICTS and rule.sentence.strip(), code
    sentences = [r.sentence for r in RULES.values()]
    assert len(set(sentences)) == len(sentences), "two codes say the same"


@pytest.mark.parametrize("code", sorted(VLLM_RUNS))
def test_a_vllm_run_reaches_its_rule(code):
    (v,) = judge_run(VLLM_RUNS[code]())
    assert v.rule == code, (v.verdict, v.rule, v.evidence.why)
    carries_its_rule(v)


@pytest.mark.parametrize("outside", ["finished_on_its_own", "already_finished"])
def test_a_request_stopped_in_its_last_tokens_that_left_with_no_abort_ran_them_out(outside):
    """Gone at the first sample after the stop, or before it (the engine ran ahead of its client): outside its
    last tokens the rule of its own; within them the completion won the race, counted apart as a race (CI: the
    default suite's race through a tap, gone 30 ms after the stop with 1 token left)."""
    (far,) = judge_run(VLLM_RUNS[outside]())
    (near,) = judge_run(near_the_end(VLLM_RUNS[outside](), left=1))
    assert far.rule == outside and not far.evidence.race, (far.rule, far.evidence.race)
    assert near.rule == "ran_out_its_last_tokens", (near.verdict, near.rule, near.evidence.why)
    assert "ran its last 1 token(s) out" in near.evidence.why
    assert ("before the stop" in near.evidence.why) == (outside == "already_finished"), near.evidence.why
    carries_its_rule(near)


@pytest.mark.parametrize("code", sorted(TRITON_RUNS))
def test_the_triton_suite_with_its_evidence_changed_reaches_the_rule(suite, code):
    scenario, changes = TRITON_RUNS[code]
    run = copy.deepcopy(suite)
    for change in changes:
        change(run)
    verdicts = judge_run(run)
    assert {v.rule for v in verdicts if v.scenario == scenario} == {code}, \
        [(v.scenario, v.verdict, v.rule) for v in verdicts]
    for v in verdicts:  # every other scenario of the suite too
        carries_its_rule(v)


def test_every_rule_is_reached_by_a_run_here_or_says_where_it_is():
    reached = set(VLLM_RUNS) | set(TRITON_RUNS)
    assert not reached & set(UNREACHED), "reached here: take it off UNREACHED"
    assert all(where.strip() for where in UNREACHED.values())
    assert set(RULES) - reached - set(UNREACHED) == set(), "a rule no run reaches"
    assert reached | set(UNREACHED) <= set(RULES), "a code the table does not list"


def test_the_code_stands_in_the_cancel_table_and_the_protocol_counts_the_cancels_per_rule(suite):
    verdicts = judge_run(suite)
    table = cancel_table(suite, verdicts)
    assert [e.split(" · ")[0] for e in table["evidence"]] == [f"rule: {v.rule}" for v in verdicts]
    text = protocol_markdown(suite, report_document(suite, verdicts=verdicts), None)
    per_rule = text.split("Verdicts per rule")[1].split("\n\n")[1].splitlines()[2:]
    counted = {row.split("|")[1].strip().strip("`"): int(row.split("|")[3]) for row in per_rule}
    assert counted == Counter(v.rule for v in verdicts), per_rule
    assert list(counted) == [code for code in RULES if code in counted]  # in the table's order


def test_every_leak_says_what_it_cost_and_never_more_than_the_engine_made():
    # every leaked verdict of the table carries the engine's tokens after its client left: a copy sent again
    # from its entry, a late abort ending it, an abort the engine ignored ending nothing. The table's engine
    # makes 20 tokens a second for everything it runs: no request's share is more than its span's 20/s
    seen = {}
    for code, make in VLLM_RUNS.items():
        for v in judge_run(make()):
            if v.verdict != "leaked":
                continue
            ev = v.evidence
            seen[code] = (ev.tokens_after_client_left, ev.tokens_after_client_left_is)
            assert ev.tokens_after_client_left_is in ("attributed", "at_most"), (code, seen[code])
            end = v.timepoints["left_scheduler"] or 6.0
            assert 0 < ev.tokens_after_client_left <= 20 * (end - v.timepoints["user_stop"] + 0.05) + 1e-6, \
                (code, seen[code])
    assert {"no_abort_ran_to_end", "resubmitted_after_stop", "abort_after_grace", "entered_after_stop",
            "abort_logged_still_generating"} <= set(seen), seen
