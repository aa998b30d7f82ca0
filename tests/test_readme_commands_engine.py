"""The README's commands that need the embedded engines, run as written (tests/readme_commands.py): `make
demo` to its page in a real browser, then the replicas and notebook commands on what it recorded, Ctrl-C
ending it; `make demo-triton`; the Triton commands by hand; the relay engine.

Only ports and store paths are overridden (ports by the README's numbers swapped for free ones; store paths
by running in a folder of the test's own, so `runs/...` stays as written; CANCELWATCH_HOME keeps the
engine state out of the checkout). Every wait has a deadline far beyond what an engine several times
slower needs and fails saying what was seen.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from cancelwatch.collectors.engines.lifecycle import free_port, read_state
from cancelwatch.runstore.reader import list_runs, load_run
from tests.conftest import free_triton_port
from tests.readme_commands import ROOT, RUN, words
from tests.test_dashboard_browser import browser  # noqa: F401 - a fixture
from tests.test_readme_commands import assert_page_shows_the_run

VENV_BIN = Path(sys.executable).parent
# the demo: engine start, a 30 s sampling run, the default suite; minutes on a fast machine, several times
# that on a slow one. A deadline, not a duration: the test goes on the moment the page is up
DEMO_DEADLINE_S = 2400


def readme(prefix: str) -> list[str]:
    """The README commands of RUN that begin with `prefix`, in the README's order."""
    return [c for c in RUN if c.startswith(prefix)]


def run_as_written(cmd: str, cwd: Path, env: dict[str, str], ports: dict[int, int] | None = None,
                   timeout: float = 900) -> subprocess.CompletedProcess:
    """The README's command through the venv's console script (`cancelwatch ...`), its ports swapped."""
    argv = words(cmd, ports)
    argv[0] = str(VENV_BIN / argv[0])
    return subprocess.run(argv, cwd=cwd, env={**os.environ, "PYTHONUNBUFFERED": "1", **env}, capture_output=True,
                          text=True, timeout=timeout)


class Lines:
    """A process's output, read as it comes (a pipe nobody reads fills and blocks the writer)."""

    def __init__(self, proc: subprocess.Popen):
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self._thread.start()

    def _read(self, proc):
        for line in proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, pattern: str, proc: subprocess.Popen, deadline_s: float, what: str) -> re.Match:
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            for line in list(self.lines):
                m = re.search(pattern, line)
                if m:
                    return m
            if proc.poll() is not None:
                time.sleep(0.5)  # the reader's last lines
                pytest.fail(f"{what} exited {proc.returncode} before printing {pattern!r}: "
                            + "\n".join(self.lines[-40:]))
            time.sleep(0.5)
        pytest.fail(f"{what} did not print {pattern!r} within {deadline_s:.0f} s; it printed: "
                    + "\n".join(self.lines[-40:]))

    def text(self) -> str:
        return "\n".join(self.lines)


def start_make(target: str, variables: dict[str, str], env: dict[str, str]) -> tuple[subprocess.Popen, Lines]:
    proc = subprocess.Popen(["make", "--no-print-directory", target, *(f"{k}={v}" for k, v in variables.items())],
                            cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1", **env}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    return proc, Lines(proc)


def ctrl_c(proc: subprocess.Popen, lines: Lines, deadline_s: float = 120) -> int:
    """Ctrl-C in the terminal make runs in: SIGINT to its whole process group; its exit code."""
    try:
        os.killpg(proc.pid, signal.SIGINT)
    except ProcessLookupError:
        pass
    try:
        return proc.wait(deadline_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        pytest.fail(f"make did not end within {deadline_s:.0f} s of Ctrl-C: " + "\n".join(lines.lines[-20:]))


def wait_page(port: int, proc: subprocess.Popen, lines: Lines, what: str, deadline_s: float = 120) -> None:
    """Until the page make started answers (streamlit starts after the dashboard line is printed)."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/_stcore/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            pytest.fail(f"{what} exited {proc.returncode} instead of serving the page: {lines.text()[-3000:]}")
        time.sleep(0.3)
    pytest.fail(f"{what}'s page did not answer on port {port} within {deadline_s:.0f} s: {lines.text()[-3000:]}")


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


# --- make demo, then the commands that run on what it recorded --------------------------------------------
# (the `demo` fixture is the session's, in tests/conftest.py: tests/test_cancels_engine.py reads its default suite)

@pytest.mark.engine
@pytest.mark.browser
def test_make_demo_ends_in_the_page_with_its_runs(demo, browser, tmp_path):  # noqa: F811 - the fixture
    runs = list_runs(demo["runs"] / "cancelwatch.db")
    assert list(runs["name"]) == ["demo-load", "demo-cancels"], runs
    assert list(runs["status"]) == ["completed", "completed"], runs
    assert "12 cancels" in demo["lines"].text() or "cancels" in demo["lines"].text(), demo["lines"].text()[-3000:]
    # the URL make demo prints, as printed: the latest run (the default suite) on the page
    assert demo["url"].endswith("&run=latest"), demo["url"]
    assert_page_shows_the_run(browser, demo["url"], demo["runs"] / "cancelwatch.db", int(runs["id"].iloc[-1]),
                              tmp_path / "make-demo.png")


@pytest.mark.slow
@pytest.mark.engine
def test_the_notebook_commands_as_written(demo):
    """In the folder the demo recorded into, `runs/cancelwatch.db` is the README's default store."""
    for cmd in readme("cancelwatch notebook capacity_review") + readme("cancelwatch notebook vram_plateau"):
        res = run_as_written(cmd, demo["folder"], demo["env"], timeout=600)
        assert res.returncode == 0, (cmd, res.stdout[-2000:], res.stderr[-2000:])
        html = demo["folder"] / words(cmd)[words(cmd).index("--html") + 1]
        assert html.stat().st_size > 10_000 and "demo-cancels" in html.read_text(), (cmd, html)


@pytest.mark.slow
@pytest.mark.engine
def test_two_labelled_replicas_sampled_as_written(demo, engine, engine_home):
    """`--target a=http://127.0.0.1:8000 --target b=http://127.0.0.1:8001`: two real vLLMs on loopback, the
    suite's engine as a and the demo's (still up for its page) as b, for the default 30 s."""
    (cmd,) = readme("cancelwatch sample --target a=")
    before = len(list_runs(demo["runs"] / "cancelwatch.db"))
    res = run_as_written(cmd, demo["folder"], demo["env"], ports={8000: engine.port, 8001: demo["port"]})
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    run = load_run(demo["runs"] / "cancelwatch.db", "latest")  # the default store, as written, in this folder
    assert run.id == before + 1 and run.info["status"] == "completed", run.info
    # both replicas sampled, each under its label, through the run (the default 30 s at 20 Hz)
    good = run.scrapes[(run.scrapes["source"] == "vllm") & (run.scrapes["ok"] == 1)]
    per_target = good.groupby("target").size().to_dict()
    assert set(per_target) == {"a", "b"} and min(per_target.values()) > 20 * 30 * 0.8, per_target
    kv = run.samples[run.samples["metric"] == "kv_cache_usage_ratio"]
    assert set(kv["target"]) == {"a", "b"}, set(kv["target"])


@pytest.mark.engine
def test_ctrl_c_ends_the_demo_and_its_engine(demo):
    pid = demo["state"].pid
    assert alive(pid)
    code = ctrl_c(demo["proc"], demo["lines"])
    # make passes Ctrl-C on and ends by it (its recipe's shell exits 130 on it, after `engine down`)
    assert code in (130, 2, -signal.SIGINT), (code, demo["lines"].text()[-2000:])
    deadline = time.monotonic() + 60
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not alive(pid), "Ctrl-C left the demo's engine running"
    assert read_state(demo["home"], demo["port"]) is None  # `engine down` ran: its state file is gone
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{demo['page_port']}/_stcore/health", timeout=2)


# --- Triton ----------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.triton
@pytest.mark.browser
def test_make_demo_triton_ends_in_the_page_with_its_run(browser, tmp_path):  # noqa: F811 - the fixture
    home, runs = tmp_path / "home", tmp_path / "runs"
    port, page_port = free_triton_port(), free_port()
    proc, lines = start_make("demo-triton", {"TRITON_PORT": str(port), "DASHBOARD_PORT": str(page_port),
                                             "TRITON_STORE": str(runs / "triton.db")},
                             {"CANCELWATCH_HOME": str(home), "CANCELWATCH_STORE_DIR": str(runs)})
    try:
        m = lines.wait_for(r"dashboard: (http://127\.0\.0\.1:\d+/\S+)", proc, 1200, "make demo-triton")
        wait_page(page_port, proc, lines, "make demo-triton")
        run = load_run(runs / "triton.db", "latest")
        assert run.info["status"] == "completed" and run.info["name"] == "demo-triton", run.info
        assert_page_shows_the_run(browser, m.group(1), runs / "triton.db", run.id, tmp_path / "demo-triton.png")
        pid = read_state(home, port).pid
    finally:
        ctrl_c(proc, lines)
    deadline = time.monotonic() + 60
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not alive(pid) and read_state(home, port) is None, "Ctrl-C left the demo's Triton running"


@pytest.mark.slow
@pytest.mark.triton
def test_the_triton_commands_as_written(tmp_path):
    """Up, the suite into runs/triton.db, status, down: the README's lines with the three ports swapped."""
    port = free_triton_port()
    ports = {8100: port, 8101: port + 1}
    env = {"CANCELWATCH_HOME": str(tmp_path / "home")}
    up, record, down, status = (readme("cancelwatch engine up --engine triton")[0],
                                readme("cancelwatch record --target grpc://127.0.0.1:8101")[0],
                                readme("cancelwatch engine down")[0], readme("cancelwatch engine status")[0])
    res = run_as_written(up, tmp_path, env, ports, timeout=400)
    try:
        assert res.returncode == 0, res.stdout + res.stderr
        assert f"grpc 127.0.0.1:{port + 1}" in res.stdout, res.stdout
        st = run_as_written(status, tmp_path, env)
        assert st.returncode == 0 and "triton" in st.stdout and "healthy" in st.stdout, st.stdout + st.stderr
        rec = run_as_written(record, tmp_path, env, ports, timeout=900)
        assert rec.returncode == 0, rec.stdout[-3000:] + rec.stderr[-3000:]
        run = load_run(tmp_path / "runs" / "triton.db", "latest")  # runs/triton.db, as written, in this folder
        assert run.info["status"] == "completed" and len(run.ledger), run.info
    finally:
        gone = run_as_written(down, tmp_path, env, ports)
    assert gone.returncode == 0 and f"stopped {port}" in gone.stdout, gone.stdout + gone.stderr
    st = run_as_written(status, tmp_path, env)
    assert st.returncode == 1 and "no embedded engine" in st.stdout, st.stdout


# --- the relay engine ------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.engine
def test_the_relay_engine_as_written(engine, engine_home, tmp_path):
    """`cancelwatch engine up --relay --port 8100`, then `record --relay-url` at it (the README's use): the
    explicit cancel of the `inproc` scenario goes through the relay, and the engine is down after."""
    (cmd,) = readme("cancelwatch engine up --relay")
    port = free_port()
    env = {"CANCELWATCH_HOME": str(tmp_path / "home")}
    up = run_as_written(cmd, tmp_path, env, {8100: port}, timeout=900)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200
        rec = subprocess.run([str(VENV_BIN / "cancelwatch"), "record", "--target", engine.url,
                              "--relay-url", f"http://127.0.0.1:{port}", "--scenario", "inproc",
                              "--store", "runs/relay.db"], cwd=tmp_path, env={**os.environ, **env},
                             capture_output=True, text=True, timeout=600)
        assert rec.returncode == 0, rec.stdout[-3000:] + rec.stderr[-3000:]
        doc = json.loads(subprocess.run([str(VENV_BIN / "cancelwatch"), "report", "latest", "--json", "--store",
                                         "runs/relay.db"], cwd=tmp_path, capture_output=True, text=True,
                                        timeout=120).stdout)
        assert [c["verdict"] for c in doc["cancels"]] == ["released"], doc["cancels"]
    finally:
        down = run_as_written(f"cancelwatch engine down --port {port}", tmp_path, env)
    assert down.returncode == 0 and f"stopped {port}" in down.stdout, down.stdout + down.stderr
