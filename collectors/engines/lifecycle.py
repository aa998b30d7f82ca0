"""An embedded engine's life, whatever its family: the state file, the start, the wait until healthy and
the stop of its whole process tree.

The launchers (vllm_server.py, triton_server.py) hold what is their family's: the command line, the
model, the health URL, the log format. Everything else about a server cancelwatch starts lives here
once, so `engine down` and `engine status` treat every family alike and a new family copies nothing:
one state file per port (`HOME/engine-PORT.json`), the server's output in `HOME/engine-PORT.log`, the
server in a session of its own (its pid is its process group), optionally in a CPU-quota cgroup
(cpu_limit.py), and a start refused where an engine of either family still runs.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import psutil

from cancelwatch.collectors.engines import cpu_limit

CGROUP_PREFIX = "cancelwatch-engine-"  # + the port: the cgroup of an engine started with a CPU quota
# the embedded engine yields the CPU to whatever else wants it: on two cores vLLM's engine core busy-waits on
# its worker through every step, and the recorder, the taps and the clients beside it waited for a CPU most of
# the time (measured: the watch's threads waited 20 to 34 s for a CPU over a 9 s stream, summed; its stamps
# whole seconds late, cancels passed on after the request had ended). At this nice (its session's autogroup
# too) they waited 0.05 to 0.3 s, and the stream took 5 % longer (bench/engine_nice.py)
ENGINE_NICE = 10


class EngineError(Exception):
    """Starting, finding or stopping the engine failed; the message says what to do."""


class PortBusy(EngineError):
    pass


@dataclass
class EngineState:
    """What the state file holds: enough to find, judge and stop the engine from another process."""

    pid: int
    port: int
    url: str
    log_path: str
    model: str
    served_model_name: str
    command: list[str]
    started_wall_ns: int
    shape: dict = field(default_factory=dict)
    # the launcher's KIND (each launcher's `owns` reads it); "" in a state file written before Triton came,
    # when every embedded engine was a vLLM (vllm_server.owns says so)
    kind: str = ""
    urls: dict = field(default_factory=dict)  # Triton: its gRPC address and metrics URL
    cgroup: str = ""  # the CPU-quota cgroup the engine runs in (CANCELWATCH_ENGINE_CPUS), removed at stop


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def state_path(home: Path, port: int) -> Path:
    return home / f"engine-{port}.json"


def log_path(home: Path, port: int) -> Path:
    return home / f"engine-{port}.log"


def write_state(home: Path, state: EngineState) -> None:
    state_path(home, state.port).write_text(json.dumps(asdict(state), indent=1))


def read_state(home: Path, port: int) -> EngineState | None:
    p = state_path(home, port)
    if not p.exists():
        return None
    try:
        return EngineState(**json.loads(p.read_text()))
    except (ValueError, TypeError):
        return None


def all_states(home: Path) -> list[EngineState]:
    out = []
    for p in sorted(home.glob("engine-*.json")):
        try:
            out.append(EngineState(**json.loads(p.read_text())))
        except (ValueError, TypeError):
            continue
    return out


def is_alive(state: EngineState) -> bool:
    try:
        proc = psutil.Process(state.pid)
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def refuse_if_running(home: Path, port: int) -> None:
    """PortBusy when an embedded engine (of either kind) still runs under this port's state file."""
    prior = read_state(home, port)
    if prior is not None and is_alive(prior):
        raise PortBusy(f"an engine already runs on port {port} (pid {prior.pid}): stop it with "
                       f"`cancelwatch engine down --port {port}` or pick --port")


def launch(cmd: list[str], home: Path, port: int, env: dict[str, str],
           cpu_cores: float | None = None) -> tuple[subprocess.Popen, Path | None]:
    """Start `cmd` in `home`, its output to the port's log, in a session of its own (so that `stop` can end
    its process group); with `cpu_cores`, inside a new cgroup of that CPU quota. The process and its
    cgroup (None without a quota). EngineError when the quota cannot be set; the OSError of a command
    that cannot run (the launcher knows which of its settings names the fix), its cgroup removed."""
    log = open(log_path(home, port), "w")  # noqa: SIM115 - handed to the child, closed below
    try:
        cgroup = None
        if cpu_cores:
            try:
                cgroup = cpu_limit.create(f"{CGROUP_PREFIX}{port}", cpu_cores)
            except cpu_limit.CpuLimitError as exc:
                raise EngineError(f"CANCELWATCH_ENGINE_CPUS={cpu_cores:g}: {exc}") from None
        try:
            proc = subprocess.Popen(cpu_limit.wrapped(cgroup, cmd) if cgroup else cmd, stdout=log,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                    cwd=str(home), env=env)
        except OSError:
            if cgroup:
                cpu_limit.remove(cgroup)
            raise
    finally:
        log.close()
    yield_cpu(proc.pid)
    return proc, cgroup


def yield_cpu(pid: int, nice: int = ENGINE_NICE) -> None:
    """Best effort: `pid` (its children inherit it) and its session's autogroup at `nice`. Under Linux's
    autogroups a nice counts only within a session, and the engine runs in a session of its own: its
    autogroup's nice is what weighs against the recorder's. Popen returns after the child's exec, so its
    setsid is done and the autogroup is the engine's own."""
    try:
        os.setpriority(os.PRIO_PROCESS, pid, nice)
    except OSError:
        pass
    for attempt in range(2):
        try:
            Path(f"/proc/{pid}/autogroup").write_text(str(nice))
            return
        except OSError as e:
            # Without CAP_SYS_ADMIN the kernel takes one autogroup nice per 100 ms, machine-wide (EAGAIN): two
            # engines started together would leave the second at 0. Anything else is no autogroup (a kernel
            # without them, the root group, not Linux): the process's nice is what there is.
            if e.errno != errno.EAGAIN or attempt:
                return
            time.sleep(0.11)


def wait_healthy(url: str, proc: subprocess.Popen | None, timeout_s: float, log_path: Path | None = None, *,
                 path: str, poll_s: float = 0.5) -> None:
    """Until `url + path` answers 200 (the launcher's health check: vLLM's /health, Triton's
    /v2/health/ready); EngineError, with the log's last lines, when the process exits first or the time
    runs out."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=2.0) as client:
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                tail = log_path.read_text(errors="replace").strip().splitlines()[-3:] if log_path else []
                raise EngineError(f"the engine exited with code {proc.returncode} while starting; log {log_path}: {' | '.join(tail)}")
            try:
                if client.get(url + path).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(poll_s)
    raise EngineError(f"the engine did not answer {url}{path} within {timeout_s:.0f} s; see its log {log_path}")


def wait_started(home: Path, state: EngineState, proc: subprocess.Popen, timeout_s: float, *, health_path: str,
                 poll_s: float = 0.5) -> EngineState:
    """Record the started engine in its state file, then wait until it is healthy. A start that fails (or
    is interrupted) stops everything it started and removes the state file: no half-started engine stays."""
    write_state(home, state)
    try:
        wait_healthy(state.url, proc, timeout_s, Path(state.log_path), path=health_path, poll_s=poll_s)
    except BaseException:
        stop(home, state.port)
        raise
    return state


def _tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def engine_pids(state: EngineState) -> list[int]:
    return [p.pid for p in _tree(state.pid)]


def _names_no_engine(state: EngineState) -> bool:
    """A state file (hand-written, corrupt, a test's) whose pid no started engine can have (init, this process,
    one of its parents) or whose cgroup is not one `launch` made: stopping it would end every process under
    it, the machine's included."""
    if state.cgroup and not Path(state.cgroup).name.startswith(CGROUP_PREFIX):
        return True
    if state.pid <= 1:
        return True
    me = psutil.Process()
    return state.pid == me.pid or state.pid in {p.pid for p in me.parents()}


def stop(home: Path, port: int, timeout_s: float = 20.0) -> bool:
    """Stop the engine on `port` and every process under it. True when one was running."""
    home = Path(home)
    state = read_state(home, port)
    if state is None:
        return False
    if _names_no_engine(state):
        state_path(home, port).unlink(missing_ok=True)
        return False
    procs = _tree(state.pid)
    try:
        os.killpg(state.pid, signal.SIGTERM)  # started with start_new_session: its pid is the group
    except (ProcessLookupError, PermissionError):
        pass
    for p in procs:
        try:
            p.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=5)
    try:
        os.killpg(state.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if state.cgroup:  # every process of the engine is in it, orphans too: none outlives `down`
        cpu_limit.end_members(Path(state.cgroup))
        cpu_limit.remove(Path(state.cgroup))
    state_path(home, port).unlink(missing_ok=True)
    return bool(procs)
