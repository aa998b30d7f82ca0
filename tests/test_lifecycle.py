"""The engine lifecycle every family shares (collectors/engines/lifecycle.py), without any engine: a tiny
Python HTTP server on 127.0.0.1 stands for one. It is started, waited for, refused a second time, stopped
with every process under it, and leaves no state file; a start that fails leaves nothing either.

Every process these tests start ends by itself within a minute, so that a failing test cannot leave one
running for long; the fixture stops whatever a test left.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path

import psutil
import pytest

from cancelwatch.collectors.engines import cpu_limit, lifecycle, triton_server, vllm_server
from cancelwatch.collectors.engines.lifecycle import EngineError, EngineState, PortBusy
from tests.conftest import wait_gone

# an engine stand-in: a child of its own (the tree `stop` ends), then /health answers 200 until killed
SERVER = """
import http.server, subprocess, sys, time
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *args):
        pass
server = http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health)
server.timeout = 0.5
print("serving", flush=True)
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    server.handle_request()
"""

# before serving, it leaves an orphan in a session of its own: outside its tree and its process group
ORPHAN = """
import os, sys, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        open(sys.argv[2] + ".part", "w").write(str(os.getpid()))
        os.replace(sys.argv[2] + ".part", sys.argv[2])
        time.sleep(60)
    os._exit(0)
os.wait()
for _ in range(200):  # until the orphan has said who it is (10 s at most)
    if os.path.exists(sys.argv[2]):
        break
    time.sleep(0.05)
"""


@pytest.fixture
def home(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    yield home
    # what a failing test left, and only what it started itself: a state file's pid is never trusted (pid 1
    # in one would have `stop` end every process on the machine)
    ours = {c.pid for c in psutil.Process().children(recursive=True)}
    for state in lifecycle.all_states(home):
        if state.pid in ours:
            lifecycle.stop(home, state.port, timeout_s=5)


def start_server(home: Path, port: int, script: str = SERVER, args: tuple[str, ...] = (),
                 cpu_cores: float | None = None, timeout_s: float = 30.0) -> EngineState:
    """What a launcher does, with the stand-in's command line and health check."""
    lifecycle.refuse_if_running(home, port)
    cmd = [sys.executable, "-c", script, str(port), *args]
    proc, cgroup = lifecycle.launch(cmd, home, port, dict(os.environ), cpu_cores=cpu_cores)
    state = EngineState(pid=proc.pid, port=port, url=f"http://127.0.0.1:{port}",
                        log_path=str(lifecycle.log_path(home, port)), model="none", served_model_name="none",
                        command=cmd, started_wall_ns=time.time_ns(), kind="test", cgroup=str(cgroup or ""))
    return lifecycle.wait_started(home, state, proc, timeout_s, health_path="/health", poll_s=0.1)


def running_with(port: int) -> list[int]:
    """This test process's live descendants started with `port` on their command line."""
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE and str(port) in child.cmdline():
                found.append(child.pid)
        except psutil.Error:
            pass
    return found


def test_start_wait_refuse_and_stop_the_whole_tree(home):
    port = lifecycle.free_port()
    state = start_server(home, port)
    assert lifecycle.read_state(home, port) == state and lifecycle.all_states(home) == [state]
    assert lifecycle.is_alive(state) and lifecycle.port_in_use(port)
    pids = lifecycle.engine_pids(state)
    assert len(pids) == 2 and pids[0] == state.pid  # the server and its child
    assert "serving" in Path(state.log_path).read_text()

    with pytest.raises(PortBusy) as refused:  # a second start on the same state file
        start_server(home, port)
    assert str(refused.value) == (f"an engine already runs on port {port} (pid {state.pid}): stop it with "
                                  f"`cancelwatch engine down --port {port}` or pick --port")
    assert lifecycle.engine_pids(state) == pids  # the refused start started nothing

    assert lifecycle.stop(home, port) is True
    assert wait_gone(pids, timeout_s=10) == []
    assert not lifecycle.state_path(home, port).exists() and lifecycle.all_states(home) == []
    assert not lifecycle.port_in_use(port)
    assert lifecycle.stop(home, port) is False  # nothing left to stop
    lifecycle.refuse_if_running(home, port)  # and nothing to refuse


def test_the_engine_and_its_session_yield_the_cpu(home):
    """The embedded engine runs at ENGINE_NICE (the processes it starts later inherit it), and so does its
    session's autogroup where the kernel has them: on two cores vLLM's engine core starved the recorder, the
    taps and the clients beside it."""
    port = lifecycle.free_port()
    state = start_server(home, port)
    try:
        assert os.getpriority(os.PRIO_PROCESS, state.pid) == lifecycle.ENGINE_NICE
        engines = autogroup_nice(state.pid)
        if engines is not None:  # the kernel has autogroups and the engine's session got one
            assert engines == lifecycle.ENGINE_NICE
            # not ours: a process never moved to a session of its own (CI's runner) is in the root group, no nice
            assert autogroup_nice("self") != lifecycle.ENGINE_NICE
    finally:
        lifecycle.stop(home, port)


def autogroup_nice(pid) -> int | None:
    """The nice of `pid`'s autogroup; None where it has none of its own. /proc/PID/autogroup reads
    "/autogroup-ID nice N", and reads empty for a process left in the root task group (never in a session made
    while autogroups were on), or is absent where the kernel has no autogroups."""
    try:
        words = Path(f"/proc/{pid}/autogroup").read_text().split()
    except OSError:
        return None
    return int(words[-1]) if words else None


def dead_pid() -> int:
    proc = psutil.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=30)
    return proc.pid


def test_the_state_file_keeps_its_format(home):
    state = EngineState(pid=dead_pid(), port=8000, url="http://127.0.0.1:8000", log_path="/h/engine-8000.log", model="m",
                        served_model_name="tiny", command=["python", "-m", "x"], started_wall_ns=5)
    lifecycle.write_state(home, state)
    path = home / "engine-8000.json"
    assert lifecycle.state_path(home, 8000) == path and lifecycle.log_path(home, 8000) == home / "engine-8000.log"
    assert list(json.loads(path.read_text())) == ["pid", "port", "url", "log_path", "model", "served_model_name",
                                                  "command", "started_wall_ns", "shape", "kind", "urls", "cgroup"]
    assert path.read_text() == json.dumps(asdict(state), indent=1)
    # a state file from before Triton (no kind, no urls, no cgroup) is a vLLM engine's
    old = {k: v for k, v in asdict(state).items() if k not in ("kind", "urls", "cgroup")}
    (home / "engine-8001.json").write_text(json.dumps(old | {"port": 8001}))
    (home / "engine-8002.json").write_text("{not json")
    legacy = lifecycle.read_state(home, 8001)
    assert vllm_server.owns(legacy) and not triton_server.owns(legacy) and lifecycle.read_state(home, 8002) is None
    assert [s.port for s in lifecycle.all_states(home)] == [8000, 8001]  # the unreadable one is skipped


def test_a_dead_engines_state_file_does_not_refuse_a_start(home):
    port = lifecycle.free_port()
    lifecycle.write_state(home, EngineState(pid=dead_pid(), port=port, url="", log_path="", model="",
                                            served_model_name="", command=[], started_wall_ns=0))
    assert not lifecycle.is_alive(lifecycle.read_state(home, port))
    state = start_server(home, port)
    assert lifecycle.read_state(home, port).pid == state.pid
    pids = lifecycle.engine_pids(state)
    lifecycle.stop(home, port)
    assert wait_gone(pids, timeout_s=10) == []


def test_a_state_file_naming_no_engine_stops_nothing(home, tmp_path):
    """A hand-written or corrupt state file must not have `engine down` end the machine's processes (init's
    tree, this process's) or a cgroup `launch` did not make: its file goes, nothing is signalled."""
    blank = dict(url="", log_path="", model="", served_model_name="", command=[], started_wall_ns=0)
    assert lifecycle._names_no_engine(EngineState(pid=1, port=1, **blank))  # never handed to stop: too dear
    lifecycle.write_state(home, EngineState(pid=os.getpid(), port=8000, **blank))
    assert lifecycle.stop(home, 8000) is False and lifecycle.read_state(home, 8000) is None
    elsewhere = tmp_path / "not-ours"  # an empty folder: `stop` would remove it as the engine's cgroup
    elsewhere.mkdir()
    lifecycle.write_state(home, EngineState(pid=dead_pid(), port=8001, cgroup=str(elsewhere), **blank))
    assert lifecycle.stop(home, 8001) is False and elsewhere.exists() and lifecycle.all_states(home) == []


def test_an_engine_that_exits_while_starting_leaves_nothing(home):
    port = lifecycle.free_port()
    with pytest.raises(EngineError) as exc:
        start_server(home, port, script="import sys; print('no model here', flush=True); sys.exit(3)")
    log = lifecycle.log_path(home, port)
    assert str(exc.value) == f"the engine exited with code 3 while starting; log {log}: no model here"
    assert lifecycle.all_states(home) == [] and running_with(port) == []


def test_an_engine_that_never_answers_is_stopped_at_the_deadline(home):
    port = lifecycle.free_port()
    t0 = time.monotonic()
    with pytest.raises(EngineError) as exc:
        start_server(home, port, script="import time; time.sleep(60)", timeout_s=1.0)
    assert time.monotonic() - t0 < 25  # the wait (1 s) and the stop, not the sleep
    assert str(exc.value) == (f"the engine did not answer http://127.0.0.1:{port}/health within 1 s; "
                              f"see its log {lifecycle.log_path(home, port)}")
    assert lifecycle.all_states(home) == [] and running_with(port) == []


def test_a_command_that_cannot_run_is_its_os_error(home):
    # the launcher turns it into its own message, naming its setting (vLLM: --engine-python)
    with pytest.raises(FileNotFoundError) as exc:
        lifecycle.launch([str(home / "no-such-python"), "-c", "pass"], home, 8000, dict(os.environ))
    assert exc.value.filename == str(home / "no-such-python") and lifecycle.all_states(home) == []


def test_under_a_cpu_quota_stop_ends_every_member_of_the_cgroup_orphans_too(home, tmp_path):
    """An orphan in a session of its own is neither in the tree nor in the group: only the cgroup holds it."""
    port, pid_file = lifecycle.free_port(), tmp_path / "orphan.pid"
    try:
        state = start_server(home, port, script=ORPHAN + SERVER, args=(str(pid_file),), cpu_cores=1.0)
    except EngineError as exc:  # no writable cgroup tree here (not root, no cpu controller)
        pytest.skip(str(exc))
    orphan = None
    try:
        cgroup = Path(state.cgroup)
        assert cpu_limit.quota_cores(cgroup) == pytest.approx(1.0)
        orphan = int(pid_file.read_text())
        assert orphan not in lifecycle.engine_pids(state)
        assert {state.pid, orphan} <= set(cpu_limit.members(cgroup))
        pids = lifecycle.engine_pids(state)
        assert lifecycle.stop(home, port) is True
        assert wait_gone([*pids, orphan], timeout_s=10) == []
        assert not cgroup.exists() and lifecycle.all_states(home) == []
    finally:
        if orphan is not None and wait_gone([orphan], timeout_s=0):
            os.kill(orphan, signal.SIGKILL)
