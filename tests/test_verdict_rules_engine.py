"""The verdict rule that needs the real engine live: an engine killed and restarted during a cancel (a proxy
that retries upstream keeps the run going across the restart) is inconclusive, "engine restarted", and the
restarted engine leaves nothing behind. The helpers here (a scenario file, one record run and its report, the
engine's log lines, a dump for failures) serve the other engine tests.

The rules shown on one recorded situation each (the engine finished before the stop, a cancel lost inside the
grace, a slow reader beside a lost cancel, a gateway minting ids, a waiting target, a shared prefix, foreign
traffic, a burst with one leak, /metrics down, races through a leaking proxy, a resubmitting gateway) are
corpus runs (tests/corpus/record.py's `case_*`), judged by tests/test_corpus.py and tests/test_corpus_cases.py.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import psutil
import pytest

from cancelwatch.collectors.engines import lifecycle
from cancelwatch.runstore.reader import load_run
from tests.conftest import cli, cli_popen, free_port, wait_gone
from tests.proxies import ProxyBehaviour

# far more tokens than the engine can make while its API server hands the client the first 20: on a
# loaded 2-core machine the server runs seconds behind the engine core, and a 600-token target was
# seen finished in the engine before the client's stop (no abort to wait for, nothing to judge here)
LONG = 1200


def scenarios(folder: Path, *specs: dict) -> Path:
    """One scenario file holding each of `specs` (keys as in a [[scenario]] table), in order."""
    path = folder / "scenario.toml"
    lines = []
    for keys in specs:
        lines += ["[[scenario]]"] + [f"{k} = {json.dumps(v)}" for k, v in keys.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def scenario(folder: Path, **keys) -> Path:
    return scenarios(folder, keys)


def record(target: str, toml: Path, store: Path, home: Path, *, metrics_url: str | None = None, extra=()):
    """One record run and its report; the run itself for the checks of what happened."""
    args = ["record", "--target", target, "--scenario", str(toml), "--store", str(store), *extra]
    if metrics_url is not None:
        args += ["--metrics-url", metrics_url]
    res = cli(*args, home=home, timeout=540)  # 150 s for the burst case under a 0.3-core quota
    # a verdict other than released exits 1: the report, not the exit code, is what these tests read
    assert res.returncode in (0, 1), res.stdout[-3000:] + res.stderr[-3000:]
    rep = cli("report", "latest", "--json", "--store", str(store))
    assert rep.returncode in (0, 1), rep.stderr
    return res, json.loads(rep.stdout), load_run(store, "latest")


def engine_lines(run, kind: str) -> dict[str, list[float]]:
    """Client id -> the run-clock instants of its `engine_added` / `engine_aborted` lines."""
    ev = run.events[run.events["kind"] == kind]
    out: dict[str, list[float]] = {}
    for rid, t in zip(ev["request_id"], ev["t_s"]):
        out.setdefault(rid, []).append(float(t))
    return out



def run_clock(run, mono_s: float | None) -> float | None:
    """A proxy instant (time.monotonic) on the run's clock (seconds since the run started)."""
    return None if mono_s is None else (mono_s * 1e9 - run.info["started_mono_ns"]) / 1e9


def dump(doc, proxy: ProxyBehaviour | None = None, run=None) -> str:
    text = json.dumps(doc["cancels"], indent=1)
    if proxy is not None:
        text += "\nproxy: " + json.dumps(proxy.summary(), indent=1, default=str)
    if run is not None:
        # last, so that a long dump cut in its middle still shows them: what the client saw of each
        # request, and what the driver said of its stops and triggers
        cols = [c for c in ("request_id", "role", "sent_mono_ns", "first_token_mono_ns", "closed_mono_ns",
                            "chunks", "terminal_state", "reason") if c in run.ledger.columns]
        text += "\nledger: " + run.ledger[cols].to_json(orient="records", lines=True)
        ev = run.events[run.events["kind"].isin(["trigger_missed", "engine_not_idle", "user_stop"])]
        text += "\nevents: " + ev.to_json(orient="records", lines=True, default_handler=str)
    return text











# --------------------------------------------------------------------------- e: engine restarted


def _wait_for_line(path: str, offset: int, needle: str, also: str, proc, timeout_s: float) -> bool:
    """Tail the log from `offset`, reading only what was appended, every few ms: the tests that act on the
    line (freeze or kill the engine) race the engine's next step, so they must hear of it at once."""
    deadline = time.monotonic() + timeout_s
    pending = ""
    with open(path, errors="replace") as f:
        f.seek(offset)
        while time.monotonic() < deadline and proc.poll() is None:
            pending += f.read()
            *lines, pending = pending.split("\n")
            if any(needle in line and also in line for line in lines):
                return True
            time.sleep(0.003)
    return False


def abort_line_or_fail(state, offset: int, proc, needle: str = "-target-", timeout_s: float = 120) -> None:
    """Wait for the engine to log the abort of a request whose id holds `needle`; else fail with what
    `record` printed (its report, when it already ended)."""
    if not _wait_for_line(state.log_path, offset, "Aborted request(s)", needle, proc, timeout_s):
        ended = proc.poll() is not None
        out, err = proc.communicate(timeout=30) if ended else ("", "")
        pytest.fail(f"no abort line for {needle} in the engine's log; record "
                    f"{'exited ' + str(proc.returncode) if ended else 'still running'}\n{out[-4000:]}\n{err[-2000:]}")


@pytest.mark.slow
def test_an_engine_killed_and_restarted_during_a_cancel_is_inconclusive(private_engine, tmp_path):
    home, state = private_engine
    toml = scenario(tmp_path, name="restart_window", trigger="after_tokens", trigger_value=20, prompt_tokens=600,
                    max_tokens=LONG)
    store = tmp_path / "cw.db"
    # a gateway that retries a refused connection: the probe waits for the new engine, so the run goes
    # on until the engine is back (and --lost-after outlasts the restart)
    proxy = ProxyBehaviour(state.url, free_port(), retry_upstream_s=240).start()
    offset = os.path.getsize(state.log_path)
    proc = cli_popen("record", "--target", proxy.url, "--metrics-url", state.url, "--scenario", str(toml),
                     "--store", str(store), "--lost-after", "300", home=home)
    killed_at = None
    new_state = None
    try:
        # the engine logs the target's abort: the cancel reached it. Kill it there, all of it at once.
        abort_line_or_fail(state, offset, proc)
        tree = [psutil.Process(p) for p in lifecycle.engine_pids(state)]
        os.killpg(state.pid, signal.SIGKILL)  # started in a session of its own: the group is the engine
        killed_at = time.monotonic()
        alive = psutil.wait_procs(tree, timeout=30)[1]  # SIGKILL'd, under a CPU quota perhaps: not at once
        assert not alive, f"still alive after SIGKILL: {alive}"
        up = cli("engine", "up", "--port", str(state.port), home=home, timeout=600)
        assert up.returncode == 0, up.stdout + up.stderr
        back_at = time.monotonic()
        new_state = lifecycle.read_state(home, state.port)
        assert new_state is not None and new_state.pid != state.pid
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
        proxy.stop()
    assert proc.returncode in (0, 1), out[-3000:] + err[-3000:]
    run = load_run(store, "latest")
    doc = json.loads(cli("report", "latest", "--json", "--store", str(store)).stdout)
    (c,) = doc["cancels"]
    rid = c["request_id"]
    t_stop, t_kill, t_back = c["timepoints"]["user_stop"], run_clock(run, killed_at), run_clock(run, back_at)
    print(f"stop {t_stop:.3f} s, killed {t_kill:.3f} s, engine back {t_back:.3f} s (run clock)")
    # it happened: the engine aborted the target, was killed right after, and the run went on past the
    # restart (the sampler read the new engine's /metrics). Whether the probe went to the old engine just
    # before the kill or waited for the new one is the machine's timing, and not what is judged here
    # killed once the abort line was read (a proxy and a busy engine can log it seconds after the stop),
    # inside the window the rule reads: up to the grace after the later of the stop and the abort
    (t_abort,) = engine_lines(run, "engine_aborted")[rid]
    assert t_abort - 0.05 <= t_kill <= max(t_abort, t_stop) + c["evidence"]["grace_s"], (t_stop, t_abort, t_kill)
    assert run.info["status"] == "completed", run.info["status"]
    sc = run.scrapes
    assert ((sc["source"] == "vllm") & (sc["ok"] == 1) & (sc["t_s"] > t_back)).any(), dump(doc, proxy, run)
    g = run.gaps
    assert ((g["source"] == "vllm") & (g["t_s"] < t_back) & (g["end_t_s"] > t_kill)).any(), g
    assert c["verdict"] == "inconclusive", dump(doc, proxy, run)
    assert c["evidence"]["rule"] == "engine_restarted", dump(doc, proxy, run)
    # the restarted engine is brought down here (the fixture would too) and leaves nothing behind
    tree = lifecycle.engine_pids(new_state)
    down = cli("engine", "down", "--port", str(state.port), home=home)
    assert down.returncode == 0, down.stderr
    left = wait_gone(tree)
    assert not left, f"processes left after engine down: {left}"

