"""Faults on the real engine during a cancel; each must lose nothing recorded and end with a clear status.

- SIGSTOP: the engine freezes right after it aborted the target. Scrapes time out into gaps, the
  cancel is `inconclusive` (no samples to judge it on), and the run goes on once the engine resumes.
- SIGKILL (no restart): the run ends as `target_lost` with one line saying so; the cancel and the
  samples before the kill are kept and `report` works on the run.
- Ctrl-C during `record`: the run ends as `interrupted`; the cancels already made are kept, the one
  in flight too, and `report` works on it.
"""

from __future__ import annotations

import json
import os
import signal
import time

import psutil
import pytest

from cancelwatch.collectors.engines import lifecycle
from cancelwatch.runstore.reader import load_run
from tests.conftest import SHORT, cli, cli_popen
from tests.test_verdict_rules_engine import LONG, abort_line_or_fail, dump, engine_lines, run_clock, scenario


def finish(proc, timeout_s=300):
    try:
        return proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)


def test_an_engine_stopped_during_a_cancel_gives_gaps_and_inconclusive_and_the_run_goes_on(engine, engine_home,
                                                                                           tmp_path):
    toml = scenario(tmp_path, name="frozen_window", trigger="after_tokens", trigger_value=20, prompt_tokens=600,
                    max_tokens=LONG)
    store = tmp_path / "cw.db"
    offset = os.path.getsize(engine.log_path)
    proc = cli_popen("record", "--target", engine.url, "--scenario", str(toml), "--store", str(store),
                     "--lost-after", "60", home=engine_home)
    stopped_at = resumed_at = None
    try:
        abort_line_or_fail(engine, offset, proc)
        os.killpg(engine.pid, signal.SIGSTOP)  # the whole engine: API server and engine core
        stopped_at = time.monotonic()
        time.sleep(4.0)
    finally:
        os.killpg(engine.pid, signal.SIGCONT)
        resumed_at = time.monotonic()
    out, err = finish(proc)
    assert proc.returncode in (0, 1), out[-3000:] + err[-3000:]
    run = load_run(store, "latest")
    doc = json.loads(cli("report", "latest", "--json", "--store", str(store)).stdout)
    (c,) = doc["cancels"]
    t_stop, t_frozen, t_back = c["timepoints"]["user_stop"], run_clock(run, stopped_at), run_clock(run, resumed_at)
    assert t_stop < t_frozen, (t_stop, t_frozen)
    print(f"the engine was frozen {t_frozen - t_stop:.3f} s after the stop")
    assert run.info["status"] == "completed"
    # the scrapes in the freeze timed out into a gap, and sampling came back after it. A gap ends where the read
    # that ended it began: one begun in the freeze (a garbled answer is retried at the next tick, with no backoff)
    # is answered once the engine is back (CI: a gap 2.45 to 5.45 s, the freeze 2.42 to 6.42 s, its read answered
    # at 6.4 s)
    g = run.gaps[run.gaps["source"] == "vllm"]
    sc = run.scrapes[run.scrapes["source"] == "vllm"]
    answered = sc["t_s"].to_numpy() + sc["duration_ns"].to_numpy(dtype=float) / 1e9

    def back_by(t: float) -> float:  # when the read begun at `t` was answered (`t` where none began there)
        near = abs(sc["t_s"].to_numpy() - t) < 0.002
        return float(answered[near].max()) if near.any() else t

    ends = g["end_t_s"].map(back_by)
    assert ((g["t_s"] <= t_frozen + 1.5) & (ends >= t_back - 0.5)).any(), (g, sc[sc["t_s"] > t_frozen].head())
    assert ((sc["ok"] == 1) & (sc["t_s"] > t_back)).any()
    # the engine had aborted it, but nothing sampled across the grace says it left: not called released.
    # Unless a scrape between the abort line and the freeze already showed it gone (the engine's step beat
    # the test's signal on a busy machine): then released is the truth, and it must rest on that sample
    assert c["request_id"] in engine_lines(run, "engine_aborted")
    if c["verdict"] == "released":
        left = c["timepoints"].get("left_scheduler")
        assert left is not None and t_stop < left < t_frozen, dump(doc)
        print(f"the release was sampled {t_frozen - left:.3f} s before the freeze: released, on that sample")
    else:
        # a freeze the test sent late (CI: 1.5 s, the test process held up) left the window sampled: then
        # only a release sampled before it is the truth, above
        assert t_frozen < t_stop + 1.0, (t_stop, t_frozen, dump(doc))
        assert c["verdict"] == "inconclusive", dump(doc)
        # a scrape outage: across the grace, or over the whole window
        assert c["evidence"]["rule"] in ("no_samples_in_grace", "no_samples"), dump(doc)
    # the run went on: the probe and the neighbour were served once the engine resumed
    ledger = run.ledger.set_index("role")
    assert ledger.loc["probe", "terminal_state"] == "completed", run.ledger
    assert ledger.loc["neighbour", "terminal_state"] == "completed", run.ledger


@pytest.mark.slow
def test_an_engine_killed_during_a_cancel_ends_the_run_as_target_lost_keeping_the_cancel(private_engine, tmp_path):
    home, state = private_engine
    toml = scenario(tmp_path, name="killed_window", trigger="after_tokens", trigger_value=20, prompt_tokens=600,
                    max_tokens=LONG)
    store = tmp_path / "cw.db"
    offset = os.path.getsize(state.log_path)
    proc = cli_popen("record", "--target", state.url, "--scenario", str(toml), "--store", str(store),
                     "--lost-after", "4", home=home)
    try:
        abort_line_or_fail(state, offset, proc)
        tree = [psutil.Process(p) for p in lifecycle.engine_pids(state)]
        os.killpg(state.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        assert not psutil.wait_procs(tree, timeout=30)[1]  # SIGKILL'd, under a CPU quota perhaps: not at once
    finally:
        out, err = finish(proc, 120)
    assert proc.returncode == 3, out[-3000:] + err[-3000:]  # EXIT_TARGET_LOST
    assert "target_lost" in out + err
    run = load_run(store, "latest")
    assert run.info["status"] == "target_lost"
    assert (run.scrapes[(run.scrapes["source"] == "vllm")]["ok"] == 1).sum() >= 10  # what came before is kept
    assert run_clock(run, killed_at) < run.scrapes["t_s"].max() + 6
    rep = cli("report", "latest", "--json", "--store", str(store))
    assert rep.returncode in (0, 1), rep.stderr
    doc = json.loads(rep.stdout)
    (c,) = doc["cancels"]
    assert c["request_id"] in set(run.ledger["request_id"])  # the ledger row of the cancelled request is kept
    assert c["verdict"] == "inconclusive", dump(doc)


def test_ctrl_c_during_record_keeps_the_cancels_made_and_report_works(engine, engine_home, tmp_path):
    scen = tmp_path / "short.toml"
    scen.write_text(SHORT)  # decode_short, then chat_short
    store = tmp_path / "cw.db"
    offset = os.path.getsize(engine.log_path)
    proc = cli_popen("record", "--target", engine.url, "--scenario", str(scen), "--store", str(store),
                     home=engine_home)
    try:
        # the first scenario's cancel is made; Ctrl-C as the second one's target is being cancelled
        abort_line_or_fail(engine, offset, proc, "-decode_short-target-")
        abort_line_or_fail(engine, offset, proc, "-chat_short-target-")
        proc.send_signal(signal.SIGINT)
    finally:
        out, err = finish(proc, 120)
    assert proc.returncode == 130, out[-3000:] + err[-3000:]
    assert "interrupted" in out + err
    run = load_run(store, "latest")
    assert run.info["status"] == "interrupted"
    rep = cli("report", "latest", "--json", "--store", str(store))
    assert rep.returncode in (0, 1), rep.stderr
    doc = json.loads(rep.stdout)
    by = {c["scenario"]: c for c in doc["cancels"]}
    assert set(by) == {"decode_short", "chat_short"}, dump(doc)
    assert by["decode_short"]["verdict"] == "released", dump(doc)  # judged whole: its window was recorded
    roles = set(zip(run.ledger["scenario"], run.ledger["role"]))
    assert {("decode_short", "target"), ("decode_short", "probe"), ("chat_short", "target")} <= roles, run.ledger
