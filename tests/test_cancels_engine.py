"""Scripted cancels against the real embedded engine, the default suite as `make demo` records it: every built-in
scenario releases, and the run records what it did on the way. Every built-in scenario through a proxy that never
passes the disconnect on is a corpus run (tests/corpus/: proxy_log, proxy_default), each cancel known leaked by
construction."""

from __future__ import annotations

import json
import subprocess

import pytest

from cancelwatch.analysis.series import scheduler_frame, series_frame
from cancelwatch.analysis.verdicts import LOST_CANCEL_RULES
from cancelwatch.collectors.cancels.scenarios import SUITES, resolve
from cancelwatch.runstore.reader import list_runs, load_run
from tests.conftest import cli

# the default suite is the one `make demo` records (tests/conftest.py: demo), in the setup of the first test that reads
# it: <= 180 s where the suite was tuned, ~400 s on an engine capped at 0.3 CPU (CANCELWATCH_ENGINE_CPUS=0.3), so
# pytest's 600 s would cut it on an engine slower still
pytestmark = pytest.mark.timeout(1800)


@pytest.fixture(scope="module")
def default_store(demo):
    return demo["runs"] / "cancelwatch.db"


@pytest.fixture(scope="module")
def default_run(demo, default_store):
    """The default suite as `make demo` records it (`record --scenario default` on the embedded engine: the run named
    demo-cancels), with its report. make prints `record`'s output but not its exit code: the report's stands for it
    (record exits with its report's code: cancel_commands.report_recorded; make demo goes on to its page only on 0
    or 1)."""
    runs = list_runs(default_store)
    run_id = int(runs[runs["name"] == "demo-cancels"]["id"].iloc[-1])
    rep = cli("report", str(run_id), "--json", "--store", str(default_store))
    run = load_run(default_store, run_id)
    res = subprocess.CompletedProcess(["make", "demo"], rep.returncode, stdout=demo["lines"].text(), stderr="")
    return res, json.loads(rep.stdout), run, rep


def by_scenario(doc, name):
    return [c for c in doc["cancels"] if c["scenario"] == name]


# the rules of a cancel the engine had ended before the stop: it ran ahead of the client, aborted the
# request itself, or the scenario's trigger was never reached
AWKWARD = ("already_finished", "already_finished_no_log", "aborted_before_stop", "trigger_never_reached")
# the rules of a cancel that never reached the engine: no abort line for the request in its log
LOST_CANCEL = LOST_CANCEL_RULES


# the rules of a cancel with too few scheduler samples to be judged on, and of an abort whose whole-second
# stamp cannot be placed inside the grace: the truth about a machine that stalled (the recorder's scrapes or
# the engine's step held up for a second or more), said only where the recorded scrapes show the hole
STALLED = ("no_samples", "no_samples_in_grace", "too_few_samples", "no_baseline", "abort_stamp_straddles_grace")
HOLE_S = 0.5  # ten ticks at 20 Hz with no scrape answered


def scrape_hole_s(run, c) -> float:
    """The longest stretch with no answered scrape of the cancel's metrics target from 1 s before its stop
    to the end of its grace after the abort: read from the recorded scrapes, not from the verdict."""
    sc = run.scrapes[(run.scrapes["ok"] == 1) & (run.scrapes["target"] == c["evidence"].get("metrics_target"))]
    stop = c["timepoints"]["user_stop"]
    end = max(stop, c["timepoints"]["engine_abort"] or stop) + c["evidence"]["grace_s"]
    times = sorted([stop - 1.0, end, *sc["t_s"][(sc["t_s"] > stop - 1.0) & (sc["t_s"] < end)]])
    return max(b - a for a, b in zip(times, times[1:]))


def awkward(doc, run=None) -> list[dict]:
    """Cancels the tool calls inconclusive because the engine ended the request before the stop (it ran
    ahead of the client, or the trigger was never reached), or because the machine stalled across it (a
    hole in the recorded scrapes, or an abort logged so late its whole-second stamp straddles the grace):
    the truth about an awkward case on a busy machine, said with the engine's evidence, not a release nor
    a leak. The race scenario's completion is its own case."""
    def stalled(c) -> bool:
        rule = c["evidence"].get("rule")
        if rule == "abort_stamp_straddles_grace":
            return True
        return run is not None and rule in STALLED and scrape_hole_s(run, c) >= HOLE_S

    return [c for c in doc["cancels"] if c["verdict"] == "inconclusive" and not c["evidence"].get("race")
            and (c["evidence"].get("rule") in AWKWARD or stalled(c))]


def assert_recorded(res, doc, run) -> list[dict]:
    """`record` exits 0 when every cancel was released; 1 only for one awkward cancel it says the truth
    about (printed with its evidence for the log). Any leak, stale gauge or other inconclusive fails."""
    odd = awkward(doc, run)
    # first the one line pytest's summary (-rf) keeps: CI shows only the tail of a long log
    head = "not released: " + ", ".join(f"{c['scenario']} {c['verdict']} {c['evidence'].get('rule')}"
                                        for c in doc["cancels"] if c["verdict"] != "released") \
        + f"; neighbours ok {doc.get('neighbours_ok')}; resubmits {[r for r in doc.get('server_requests', []) if not r['ok']]}\n"
    assert len(odd) <= 1, head + res.stdout + diagnose(doc, run)
    assert res.returncode == (1 if odd else 0), head + f"exit {res.returncode}\n" + res.stdout + res.stderr + diagnose(doc, run)
    if odd:
        print("awkward case, said as such:\n" + diagnose(doc, run))
    return odd


def diagnose(doc, run) -> str:
    """For a failing assertion: each cancel that was not released, with its evidence, its ledger row, the
    engine log's lines for it and the scheduler samples around its stop (what CI's log needs to tell
    an awkward case from a fault)."""
    out = []
    t0 = run.info["started_mono_ns"]
    sched = scheduler_frame(run)
    for c in doc["cancels"]:
        if c["verdict"] == "released":
            continue
        rid = c["request_id"]
        ledger = run.ledger[run.ledger["scenario"] == c["scenario"]].to_dict("records")
        ev = run.events[(run.events["request_id"] == rid) | run.events["kind"].isin(["trigger_missed"])]
        stop = c["timepoints"]["user_stop"]
        around = sched[(sched["t_s"] > stop - 1.0) & (sched["t_s"] < stop + 2.5)] if stop is not None else sched[:0]
        out.append(f"--- {c['scenario']} {rid} {c['verdict']}: evidence {json.dumps(c['evidence'])}\n"
                   f"ledger {ledger}\nevents {ev[['kind', 't_s', 'data']].to_dict('records')}\n"
                   f"scheduler around the stop {around.to_dict('records')} (t0 {t0})")
    return "\n".join(out)


def test_every_builtin_scenario_is_released(default_run, demo):

    res, doc, run, rep = default_run
    odd = [c["request_id"] for c in assert_recorded(res, doc, run)]
    # the report is of this run, driven at the engine, and its sampling table counts the run's own scrapes
    assert doc["run_id"] == run.id and doc["target"] == demo["state"].url
    assert doc["status"] == "completed" and doc["neighbours_ok"] is True
    sc = run.scrapes
    vllm_ok = sc[(sc["source"] == "vllm") & (sc["target"] == "t0") & (sc["ok"] == 1)]
    sampling = {(s["source"], s["target"]): s for s in doc["sampling"]}
    assert sampling[("vllm", "t0")]["scrapes_ok"] == len(vllm_ok) > 0
    names = {c["scenario"] for c in doc["cancels"]}
    assert names == set(SUITES["default"])
    # one cancel per cancelled request: cancel_count of each scenario, times its repeats
    per = {s.name: s.cancel_count * s.repeats for s in resolve("default")}
    assert {n: len(by_scenario(doc, n)) for n in names} == per
    for c in doc["cancels"]:
        tp, src = c["timepoints"], c["timepoint_sources"]
        assert set(tp) == set(src) == {"user_stop", "app_received", "engine_abort", "left_scheduler", "reusable"}
        if c["scenario"] == "race" and c["verdict"] == "inconclusive":
            assert c["evidence"]["race"], c  # the completion won: said as such, not called released
            continue
        if c["request_id"] in odd:
            continue
        assert c["verdict"] == "released", c
        assert tp["reusable"] is not None, f"{c['scenario']}: the probe was not admitted"
        assert src["user_stop"]["source"] == "client" and src["left_scheduler"]["source"] == "samples"
        if c["scenario"] == "inproc":
            assert src["app_received"]["source"] == src["engine_abort"]["source"] == "relay", c
            continue
        # every HTTP path: the engine's own abort line, and no app between client and engine
        assert src["engine_abort"] == {"source": "engine_log", "reason": None}, c
        assert tp["app_received"] is None and src["app_received"]["reason"] == "no app on this path", c
        # the log is stamped to the millisecond on the engine's clock: the abort follows the stop
        assert tp["user_stop"] - 0.002 <= tp["engine_abort"] <= tp["left_scheduler"], c
    # neighbours all finished untouched, probes all completed
    ledger = run.ledger
    assert (ledger[ledger["role"] == "neighbour"]["terminal_state"] == "completed").all()
    assert (ledger[ledger["role"] == "probe"]["terminal_state"] == "completed").all()


def test_record_judges_each_cancel_live_on_its_window_as_the_report_judges_the_whole_run(default_run, default_store):
    """`record`'s live judge (cancelwatch/live_judge.py) judged each cancel on its own window once the scenarios in
    that window had ended and the store held them (the relay app's scenario among them, whose source leaves the
    run), printed it and kept it with the run: every cancel whose window closes before the last scenario's end
    (LiveJudge.drain waits for the store to hold that end), each as the report, judging the whole run, says."""
    from cancelwatch.analysis.verdicts.stored import usable
    from cancelwatch.analysis.watching import window_of
    from cancelwatch.runstore.reader import load_verdicts

    res, doc, run, rep = default_run
    live = usable(load_verdicts(default_store, run.id))
    ev = run.events
    last_end = ev[ev["kind"] == "scenario_end"]["t_s"].max()
    due = [c for c in doc["cancels"] if window_of(c["timepoints"]["user_stop"], c["evidence"]["grace_s"])[1]
           < last_end]
    print(f"judged live: {len(live)} of {len(doc['cancels'])} cancels; due before the last scenario's end {len(due)}")
    assert len(due) >= len(doc["cancels"]) - 3 and due, (len(due), len(doc["cancels"]))
    missing = [c["scenario"] for c in due if c["request_id"] not in live]
    assert not missing, f"not judged live: {missing}\n{res.stderr[-2000:]}"
    for c in doc["cancels"]:
        v = live.get(c["request_id"])
        if v is not None:
            assert (v.verdict, v.rule) == (c["verdict"], c["evidence"].get("rule")), (c["scenario"], v.as_json(), c)
            assert f"record: cancel {c['request_id']} {v.verdict}" in res.stdout


def test_queued_cancel_drops_waiting_not_running_or_kv(default_run):
    _, doc, run, _ = default_run
    (c,) = by_scenario(doc, "queued")
    assert c["phase_at_cancel"] == "queued"
    sched = scheduler_frame(run, "t0")
    stop, left = c["timepoints"]["user_stop"], c["timepoints"]["left_scheduler"]
    before = sched[sched["t_s"] < stop].iloc[-1]
    after = sched[sched["t_s"] >= left].iloc[0]
    assert before["waiting"] >= 1 and after["waiting"] == before["waiting"] - 1
    assert after["running"] == before["running"]
    # a waiting request holds no KV blocks: cancelling it frees none. Usage may still rise between the
    # two samples, as the running requests grow by a block every 128 tokens
    assert after["kv"] >= before["kv"]


def test_decode_kv_drop_within_two_sample_periods(default_run):
    _, doc, run, _ = default_run
    (c,) = by_scenario(doc, "decode")
    tp, ev = c["timepoints"], c["evidence"]
    period = 1 / run.info["settings"]["hz"]
    # the engine's step, as this run saw it: the target's time per token before its stop. The abort frees the
    # blocks once the step under way ends, and the gauge shows it after the next one: two steps
    row = run.ledger.set_index("request_id").loc[c["request_id"]]
    tokens = max(1, row["chunks"] - row["tokens_after_cancel"] - 1)
    step_s = (row["cancel_mono_ns"] - row["first_token_mono_ns"]) / 1e9 / tokens
    # the first sample with KV usage below its level at the stop comes within two sample periods and two steps
    assert ev["kv_drop_s"] is not None and ev["kv_drop_s"] - tp["engine_abort"] <= 2 * period + 2 * step_s, \
        (tp, ev, f"engine step {step_s * 1000:.1f} ms")
    kv = series_frame(run, "kv_cache_usage_ratio")
    kv = kv[kv["target"] == "t0"]
    assert kv[kv["t_s"] >= ev["kv_drop_s"]]["value"].iloc[0] < ev["kv_before"]


def test_resubmit_shows_prefix_cache_hits_rising(default_run):
    _, doc, run, _ = default_run
    (c,) = by_scenario(doc, "resubmit")
    hits = series_frame(run, "prefix_cache_hits_tokens_total").sort_values("t_s")
    ledger = run.ledger
    probe = ledger[(ledger["scenario"] == "resubmit") & (ledger["role"] == "probe")].iloc[0]
    t0 = run.info["started_mono_ns"]
    sent, done = (probe["sent_mono_ns"] - t0) / 1e9, (probe["closed_mono_ns"] - t0) / 1e9
    before = hits[hits["t_s"] <= sent]["value"].iloc[-1]
    after = hits[hits["t_s"] >= done + 0.2]["value"].iloc[0]
    assert after - before >= 512, (before, after)  # the cancelled prompt's blocks were reused


def test_race_ledger_says_which_terminal_state_won(default_run):
    _, doc, run, _ = default_run
    (c,) = by_scenario(doc, "race")
    row = run.ledger.set_index("request_id").loc[c["request_id"]]
    assert row["terminal_state"] in ("completed", "cancelled")
    assert c["terminal_state"] == row["terminal_state"]
    if row["terminal_state"] == "completed":
        assert row["chunks"] == row["max_tokens"]
    else:
        assert row["chunks"] < row["max_tokens"]


def test_default_suite_run_spans_its_scenarios_in_order(default_run):
    """Every scenario of the default suite has its start and end event, in the suite's order, one after
    the other; the run (as the store has it) holds them all, and every cancel lies inside its scenario.
    The suite's wall time is printed for the closing note (a benchmark figure, <= 180 s, not a gate)."""

    res, doc, run, _ = default_run
    assert_recorded(res, doc, run)
    ev = run.events[run.events["kind"].isin(["scenario_start", "scenario_end"])]
    marks = [(kind, json.loads(data)["scenario"], json.loads(data)["repeat"])
             for kind, data in zip(ev["kind"], ev["data"])]
    expected = [(kind, s.name, r) for s in resolve("default") for r in range(s.repeats)
                for kind in ("scenario_start", "scenario_end")]
    assert marks == expected
    starts = ev[ev["kind"] == "scenario_start"]
    ends = ev[ev["kind"] == "scenario_end"]
    spans = {(n, r): (a, b) for (_, n, r), a, b in zip(expected[::2], starts["t_s"], ends["t_s"])}
    assert all(a < b for a, b in spans.values()), spans
    run_s = (run.info["ended_wall_ns"] - run.info["started_wall_ns"]) / 1e9
    in_scenarios = sum(b - a for a, b in spans.values())
    assert starts["wall_ns"].iloc[0] >= run.info["started_wall_ns"]
    assert ends["wall_ns"].iloc[-1] <= run.info["ended_wall_ns"]
    assert in_scenarios <= run_s
    for c in doc["cancels"]:
        stop = c["timepoints"]["user_stop"]
        assert any(a <= stop <= b for (n, _), (a, b) in spans.items() if n == c["scenario"]), (c, spans)
    print(f"default suite: run {run_s:.1f} s in the store, {in_scenarios:.1f} s inside scenarios")


@pytest.mark.slow
def test_a_proxy_that_keeps_reading_leaks_and_direct_releases(proxy_and_direct_runs):
    """Recorded once, whatever the machine's timing: the engine log names each lost cancel."""
    store, proxy_res, direct_res = proxy_and_direct_runs
    assert proxy_res.returncode == 1, proxy_res.stdout + proxy_res.stderr
    doc = json.loads(cli("report", "1", "--json", "--store", str(store)).stdout)
    assert [c["verdict"] for c in doc["cancels"]] == ["leaked", "leaked"], json.dumps(doc["cancels"], indent=1)
    for c in doc["cancels"]:
        assert c["evidence"]["rule"] in LOST_CANCEL, c
        assert c["timepoint_sources"]["engine_abort"] == {"source": None, "reason": "no abort in the engine log"}
    assert direct_res.returncode == 0, direct_res.stdout + direct_res.stderr
    doc = json.loads(cli("report", "2", "--json", "--store", str(store)).stdout)
    assert [c["verdict"] for c in doc["cancels"]] == ["released", "released"]


def test_inproc_through_the_relay_app_is_released(default_run):
    """The default suite's inproc scenario: record started the relay app (AsyncLLM in process) itself."""
    res, doc, run, _ = default_run
    (c,) = by_scenario(doc, "inproc")
    assert c["verdict"] == "released", c
    assert c["evidence"]["metrics_target"] == "relay"
    tp = c["timepoints"]
    # app_received and engine_abort are the relay's own clock readings: cancel seen, then abort() returned
    assert tp["user_stop"] <= tp["app_received"] <= tp["engine_abort"] <= tp["left_scheduler"]
    assert c["timepoint_sources"]["engine_abort"]["source"] == "relay"
    assert {t["label"]: t["family"] for t in run.info["targets"]} == {"t0": "vllm", "relay": "vllm"}
    relay_running = series_frame(run, "requests_running")
    assert (relay_running["target"] == "relay").any()


def test_the_chunks_each_engines_clients_got_are_counted_as_the_ledger_has_them(default_run):
    """record counts the content chunks its clients read, per engine (client_chunks_total, source `clients`): the
    relay app's clients apart from the target's. By the run's end each count is the ledger's chunks of the requests
    sent to that engine, and it never goes back."""
    _, _, run, _ = default_run
    relay = {s.name for s in resolve("default") if s.via_relay}
    ledger = run.ledger
    to_relay = ledger["scenario"].isin(relay)
    for target, rows in (("t0", ledger[~to_relay]), ("relay", ledger[to_relay])):
        counted = run.series("client_chunks_total", source="clients", target=target).sort_values("t_s")["value"]
        assert len(counted) > 10, target
        assert (counted.diff().dropna() >= 0).all(), target
        assert counted.iloc[-1] == rows["chunks"].sum() > 0, (target, counted.iloc[-1], rows["chunks"].sum())
