"""The hop trace (analysis/hops.py) on hand-built runs: where a cancel went through the taps, where it
stopped, how the request was found at each tap, and what it adds to the verdict (never the verdict
itself). The taps themselves are tested on sockets in test_tap.py and on real gateways in
test_gateways_engine.py."""

from __future__ import annotations

import json

import pandas as pd

from cancelwatch.analysis.hops import AMBIGUOUS_S, hop_story, hop_traces, stopped_at
from cancelwatch.analysis.verdicts import judge_run
from tests.test_verdicts import ADDED, T0, build_run, steady_gen

HOPS = [
    {"name": "nginx", "listen_host": "127.0.0.1", "listen_port": 9001, "upstream": "http://127.0.0.1:8080",
     "upstream_host": "127.0.0.1", "upstream_port": 8080},
    {"name": "vllm", "listen_host": "127.0.0.1", "listen_port": 9002, "upstream": "http://x:80",
     "upstream_host": "x", "upstream_port": 80},
]


def tap_event(kind: str, hop: str, at: float, rid: str | None = None, **data) -> dict:
    return {"request_id": rid, "kind": kind, "mono_ns": T0 + int(at * 1e9), "wall_ns": 0, "t_s": at,
            "data": json.dumps({"hop": hop, **data})}


def through(hop: str, conn: int, rid: str | None, sent: float) -> list[dict]:
    return [tap_event("tap_accepted", hop, sent, conn=conn),
            tap_event("tap_request", hop, sent + 0.001, rid, conn=conn, seq=0, method="POST", path="/v1/completions")]


def closed(hop: str, conn: int, rid: str, at: float, side="client", how="rst", open_seq=0) -> dict:
    return tap_event("tap_closed", hop, at, rid, conn=conn, side=side, how=how, open_seq=open_seq,
                     response_ended=open_seq is None)


def run_with(taps: list[dict], hops=HOPS, abort_s: float | None = 2.01, kept: bool = False, no_log: bool = False,
             finished=None):
    """`kept`: the engine holds the request on past the grace; `no_log`: vLLM on its defaults, no request log read;
    `finished`: its own-ends counter (build_run's)."""
    log = [*ADDED, *([("engine_aborted", "tg", abort_s)] if abort_s is not None else [])]
    drop = 1e9 if kept else 2.05
    run = build_run(lambda t: 2 if t < drop else 1, lambda t: 0.5 if t < drop else 0.3, steady_gen,
                    engine_log=log, probe_first_s=2.3, finished=finished)
    if no_log:
        run.info.pop("engine", None)
        run.events = run.events[~run.events["kind"].str.startswith("engine_")]
    run.info.update(settings={"hops": hops}, started_wall_ns=1_790_000_000_000_000_000, name="hops")
    run.scrapes = pd.DataFrame(columns=["source", "target", "ok", "mono_ns", "n_samples", "duration_ns", "t_s"])
    run.events = pd.concat([run.events, pd.DataFrame(taps)], ignore_index=True).sort_values("mono_ns")
    return run


def both_hops(nginx_rid="tg", vllm_rid="tg") -> list[dict]:
    """The neighbour and the target through nginx and the tap before vLLM, each with its id (or not)."""
    return [*through("nginx", 1, "nb", 0.1), *through("vllm", 1, "nb" if vllm_rid else None, 0.102),
            *through("nginx", 2, nginx_rid, 0.5), *through("vllm", 2, vllm_rid, 0.502)]


def test_a_cancel_passed_on_at_every_hop_is_traced_to_the_engine():
    run = run_with([*both_hops(), closed("nginx", 2, "tg", 2.001), closed("vllm", 2, "tg", 2.004, how="fin")])
    (v,) = judge_run(run)
    assert v.verdict == "released"  # the verdict is the engine's: the taps add where the cancel went
    nginx, vllm = v.hops
    assert (nginx.matched, nginx.reached_s, nginx.reached_how, nginx.passed_s, nginx.passed_by) == \
        ("id", 2.001, "rst", 2.004, "tap vllm")
    assert (vllm.feeds_engine, vllm.reached_s, vllm.passed_by) == (True, 2.004, "engine log")
    assert abs(vllm.passed_s - 2.01) < 1e-6 and nginx.held_ms == 3.0 and vllm.held_ms == 6.0
    assert stopped_at(v.hops, 2.0) is None and v.evidence.stopped_at is None
    assert v.evidence.path.startswith("the cancel passed every hop")
    # the app nearest the client had its connection closed: app_received, on the tap's word, said so
    assert v.timepoints["app_received"] == 2.001
    assert v.sources["app_received"] == {"source": "tap", "reason": "the app's connection from its client closed"}
    doc = v.as_json()
    assert [h["hop"] for h in doc["hops"]] == ["nginx", "vllm"] and doc["hops"][0]["reached_ms"] == 1.0


def test_a_gateway_that_keeps_its_upstream_open_is_where_the_cancel_stopped():
    # nginx with proxy_ignore_client_abort: its client went at 2.001, its upstream ran to the response's end
    taps = [*both_hops(), closed("nginx", 2, "tg", 2.001),
            tap_event("tap_response_end", "vllm", 5.0, "tg", conn=2, seq=0),
            closed("vllm", 2, "tg", 5.001, how="fin", open_seq=None)]
    (v,) = judge_run(run_with(taps, abort_s=None))
    nginx, vllm = v.hops
    assert nginx.reached_s == 2.001 and nginx.passed_s is None and nginx.upstream_end_s == 5.0
    assert vllm.reached_s is None and vllm.note == "its response had passed to its end before its client side closed"
    assert v.evidence.stopped_at == "nginx"
    assert v.evidence.path == ("the cancel stopped at `nginx`: its client side closed at 2.00 s (rst), its upstream "
                               "stayed open 3.0 s more")


def test_a_late_pass_past_the_grace_is_a_stop_too():
    taps = [*both_hops(), closed("nginx", 2, "tg", 2.001), closed("vllm", 2, "tg", 4.5, how="fin")]
    steps = hop_traces(run_with(taps, abort_s=4.51), judge_run(run_with(taps, abort_s=4.51)))["tg"]
    assert stopped_at(steps, 2.0).hop == "nginx" and stopped_at(steps, 3.0) is None


def test_a_gateway_that_drops_the_id_is_matched_by_time_and_says_so():
    taps = [*both_hops(vllm_rid=None), closed("nginx", 2, "tg", 2.001), closed("vllm", 2, None, 2.004)]
    (v,) = judge_run(run_with(taps))
    assert [h.matched for h in v.hops] == ["id", "time"] and v.hops[1].conn == 2
    assert v.hops[0].passed_s == 2.004


def test_requests_sent_too_close_together_are_not_matched_by_time():
    taps = [*both_hops(vllm_rid=None), closed("nginx", 2, "tg", 2.001), closed("vllm", 2, None, 2.004)]
    run = run_with(taps)
    # the neighbour sent within AMBIGUOUS_S of the target: arrival order cannot tell them apart
    run.ledger.loc[run.ledger["request_id"] == "nb", "sent_mono_ns"] = T0 + int((0.5 - AMBIGUOUS_S / 2) * 1e9)
    (v,) = judge_run(run)
    assert v.hops[1].matched is None and v.hops[1].note
    assert v.hops[0].passed_s is None  # not traced to the next tap: not said to have passed


def test_a_run_without_taps_has_no_hops_and_no_path():
    run = run_with([], hops=[])
    (v,) = judge_run(run)
    assert v.hops == [] and v.as_json()["hops"] == [] and v.evidence.path is None
    assert v.sources["app_received"]["source"] is None
    assert hop_story([], 2.0) is None


def test_the_table_the_timeline_the_story_and_the_protocol_show_the_path():
    from cancelwatch.analysis.cancel_table import cancel_table
    from cancelwatch.analysis.explain import memory_story
    from cancelwatch.analysis.protocol import protocol_markdown
    from cancelwatch.analysis.timeline import hop_label, timeline_figure
    from cancelwatch.analysis.verdicts import report_document

    taps = [*both_hops(), closed("nginx", 2, "tg", 2.001),
            tap_event("tap_response_end", "vllm", 5.0, "tg", conn=2, seq=0)]
    run = run_with(taps, abort_s=None)
    verdicts = judge_run(run)
    table = cancel_table(run, verdicts)
    assert table["hops (ms)"].tolist() == ["nginx kept · vllm -"]
    fig = timeline_figure(run, verdicts)
    rows = list(fig.layout.yaxis5.categoryarray)
    assert rows[-3:] == [hop_label("vllm"), hop_label("nginx"), "user stop"], rows
    kept = [t for t in fig.data if t.name == "cancel kept at a hop"]
    assert kept and list(kept[0].x[:2]) == [2.001, 5.0] and kept[0].y[0] == hop_label("nginx")
    story = " ".join(memory_story(run, verdicts, verdicts[0]))
    assert "Hop by hop: the cancel stopped at `nginx`" in story
    doc = report_document(run, verdicts=verdicts)
    md = protocol_markdown(run, doc)
    assert "### The path, hop by hop" in md and "`nginx` (listening on 127.0.0.1:9001" in md
    assert "| request | scenario | nginx | vllm | stopped at |" in md
    assert "| tg | s | reached +1 ms (rst), not passed on | not seen | nginx |" in md


def test_a_run_without_taps_keeps_its_table_and_protocol_as_they_were():
    from cancelwatch.analysis.cancel_table import cancel_table
    from cancelwatch.analysis.protocol import protocol_markdown
    from cancelwatch.analysis.verdicts import report_document

    run = run_with([], hops=[])
    verdicts = judge_run(run)
    assert cancel_table(run, verdicts)["hops (ms)"].tolist() == [""]
    assert "hop by hop" not in protocol_markdown(run, report_document(run, verdicts=verdicts))


# client -> tap -> nginx -> tap -> LiteLLM -> vLLM: no tap between LiteLLM and the engine (users tap where they can)
UNTAPPED = [HOPS[0], {"name": "litellm", "listen_host": "127.0.0.1", "listen_port": 9002,
                      "upstream": "http://127.0.0.1:4000", "upstream_host": "127.0.0.1", "upstream_port": 4000}]


def through_litellm(**run_kw):
    taps = [*through("nginx", 1, "nb", 0.1), *through("litellm", 1, "nb", 0.102), *through("nginx", 2, "tg", 0.5),
            *through("litellm", 2, "tg", 0.502), closed("nginx", 2, "tg", 2.001),
            closed("litellm", 2, "tg", 2.004, how="fin")]
    (v,) = judge_run(run_with(taps, hops=UNTAPPED, **run_kw))
    return v


def test_the_last_tapped_component_passed_the_cancel_on_where_the_engine_shows_the_request_gone():
    v = through_litellm()  # the engine's abort line at 2.01
    nginx, litellm = v.hops
    assert v.verdict == "released" and not litellm.feeds_engine and litellm.untapped
    assert (litellm.reached_s, litellm.passed_by) == (2.004, "engine log") and abs(litellm.passed_s - 2.01) < 1e-6
    assert v.evidence.stopped_at is None and stopped_at(v.hops, 2.0) is None
    assert "`litellm` 6 ms (no tap behind it: at most, by the engine's abort line)" in v.evidence.path
    # vLLM on its defaults, no request log: the count that showed it gone says so instead
    bare = through_litellm(no_log=True, finished=lambda t: 0.0)  # the engine ended none of its own
    assert bare.verdict == "released" and bare.hops[1].passed_by == "engine's count"
    assert bare.evidence.stopped_at is None and "by the engine's count" in bare.evidence.path


def test_past_the_last_tap_a_kept_request_is_a_stop_there_or_further_on_and_an_open_case_is_not_observed():
    kept = through_litellm(no_log=True, kept=True)
    assert kept.verdict == "leaked" and kept.evidence.stopped_at == "litellm"
    assert kept.evidence.path.startswith("the cancel stopped at `litellm` or past it (no tap between it and the engine")
    assert kept.hops[1].passed_s is None and not kept.hops[1].unobserved
    # nothing tells (no request log, and the engine does not say why its requests end): no stop is named, the trace
    # says where the cancel was last seen
    open_ = through_litellm(no_log=True)
    assert open_.verdict == "inconclusive" and open_.hops[1].unobserved and open_.evidence.stopped_at is None
    assert open_.evidence.path == ("the cancel reached `litellm` at 2.00 s (fin) and was not observed past it: no tap "
                                   "between it and the engine, and the engine's evidence does not say")


def test_a_hop_the_engine_contradicts_is_not_where_the_cancel_stopped():
    """The next tap saw no close for the request (a component that hands cancels on some other way), yet the
    engine's abort line came 10 ms after the stop: the cancel went through; the trace says what it saw and what the
    engine says."""
    taps = [*both_hops(), closed("nginx", 2, "tg", 2.001)]
    (v,) = judge_run(run_with(taps))
    assert v.verdict == "released" and v.hops[0].passed_s is None
    assert v.evidence.stopped_at is None
    assert v.evidence.path == ("the taps did not see `nginx` pass the cancel on, but the engine's abort line shows "
                               "the request gone at 2.01 s")


def test_a_tap_in_front_of_the_engine_names_no_stop_where_the_engine_cannot_say():
    """A review's counterexample: the tap right in front of vLLM, no request log, the count falling 46 ms after the
    cancel reached it, and nothing telling an abort from a run-out (inconclusive). The trace names no stop there; it
    says the cancel was not observed past the engine's tap. And a request kept past an abort line 3 s late, with no
    tap behind LiteLLM, stopped at LiteLLM or past it: no tap saw which."""
    taps = [*both_hops(), closed("nginx", 2, "tg", 2.001), closed("vllm", 2, "tg", 2.004, how="fin")]
    (v,) = judge_run(run_with(taps, no_log=True))
    assert v.verdict == "inconclusive" and v.hops[1].unobserved and v.evidence.stopped_at is None
    assert v.evidence.path.endswith("was not observed past it: the engine's evidence does not say whether it left")
    late = through_litellm(abort_s=5.0, kept=True)
    assert late.verdict == "leaked" and late.evidence.stopped_at == "litellm"
    assert late.evidence.path.startswith("the cancel stopped at `litellm` or past it")
