"""Shared fixtures. The embedded engine is a real vLLM (CPU build) started once per session."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from cancelwatch.collectors.cancels.load import run_streams
from cancelwatch.collectors.engines import lifecycle
from cancelwatch.collectors.engines import vllm_server as engine_mod
from cancelwatch.console import ENGINE_CPUS_ENV
from cancelwatch.collectors.engines.cpu_limit import CpuLimitError, parse_cores
from cancelwatch.collectors.engines.lifecycle import free_port
from cancelwatch.runstore.reader import load_run
from tests.fixture_server import MetricsFixtureServer
from tests.leaky_proxy import LeakyProxy

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"


def pytest_sessionstart(session):
    """The test process hosts the proxies (tests/proxies.py, tests/leaky_proxy.py) as threads, and waits for
    minutes on `record` in between: on these machines a kernel DAMON context pages out memory it finds cold,
    and the proxies were seen frozen for 5-13 s (a connect timing out on loopback, a stream held back while
    the engine ran on). Its pages are locked where the process may (root; elsewhere nothing changes)."""
    import ctypes
    import ctypes.util

    MCL_CURRENT, MCL_FUTURE = 1, 2
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.mlockall(MCL_CURRENT | MCL_FUTURE)
    except (OSError, AttributeError):
        pass

# Fixtures that start (or stand for) the embedded engine: a test using any of them, directly or through
# another fixture, is marked `engine`, so `-m "not engine"` never starts one.
ENGINE_FIXTURES = frozenset({"engine", "private_engine", "engine_home", "proxy_and_direct_runs", "demo"})
# the same for the embedded Triton (marked `triton`)
TRITON_FIXTURES = frozenset({"triton", "triton_home", "triton_run"})


# the test that ends `make demo` (the `demo` fixture) with Ctrl-C: the last of those that read it
DEMO_ENDS = "test_ctrl_c_ends_the_demo_and_its_engine"


def pytest_collection_modifyitems(config, items):
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        if ENGINE_FIXTURES & names:
            item.add_marker(pytest.mark.engine)
        if TRITON_FIXTURES & names:
            item.add_marker(pytest.mark.triton)
    # the tests on `make demo` run one after another, where the first of them stands, the one that ends it last: its
    # engine and page stay up from the first to the last, and nothing else runs beside them meanwhile
    on_demo = [item for item in items if "demo" in getattr(item, "fixturenames", ())]
    if on_demo:
        block = [i for i in on_demo if i.name != DEMO_ENDS] + [i for i in on_demo if i.name == DEMO_ENDS]
        taken = {id(i) for i in on_demo}
        at = items.index(on_demo[0])  # no test before it reads the demo
        rest = [i for i in items if id(i) not in taken]
        items[:] = rest[:at] + block + rest[at:]


_current = {"engine": False, "triton": False, "nodeid": ""}


@pytest.fixture(autouse=True)
def _no_engine_outside_engine_tests(request, monkeypatch):
    """A test not marked `engine` that tries to start one fails instead (in process, or `engine up`
    through `cli`): the fast subset (-m "not engine") must never start an engine."""
    marked = request.node.get_closest_marker("engine") is not None
    _current.update(engine=marked, triton=request.node.get_closest_marker("triton") is not None,
                    nodeid=request.node.nodeid)
    if not marked:
        def refuse(*args, **kw):
            pytest.fail(f"{request.node.nodeid} starts an engine but is not marked `engine`")

        monkeypatch.setattr(engine_mod, "start", refuse)
    yield
    _current.update(engine=False, triton=False, nodeid="")


def _guard_cli(args: tuple[str, ...]) -> None:
    triton = "triton" in args and _current["triton"]
    if args[:2] == ("engine", "up") and not _current["engine"] and not triton:
        pytest.fail(f"{_current['nodeid']} runs `engine up` but is not marked `engine`")


@pytest.fixture
def metrics_server():
    """`metrics_server(body_or_path, filtered=...)` starts a loopback server of a recorded /metrics body
    (tests/fixture_server.py) and returns it; every one started is shut down after the test."""
    servers: list[MetricsFixtureServer] = []

    def start(body, **kw) -> MetricsFixtureServer:
        server = MetricsFixtureServer(body, **kw).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture(scope="session")
def engine_home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cancelwatch-home")


def engine_cpu_cores() -> float | None:
    """$CANCELWATCH_ENGINE_CPUS, the slow-engine knob `cancelwatch engine up` reads too: the engines the
    tests start get this much CPU time (e.g. 0.4 cores), to show that the suite holds on a slower machine."""
    text = os.environ.get(ENGINE_CPUS_ENV, "").strip()
    try:
        return parse_cores(text) if text else None
    except CpuLimitError as exc:
        pytest.fail(f"{ENGINE_CPUS_ENV}={exc}")


def _start_engine(home: Path, **kw) -> lifecycle.EngineState:
    python = engine_mod.default_engine_python()
    if python == sys.executable:
        pytest.fail("no .venv-engine: run `make engine-venv` (make test does) to install the embedded vLLM")
    return engine_mod.start(home, port=free_port(), timeout_s=600, cpu_cores=engine_cpu_cores(), **kw)


def _alive(pids: list[int]) -> list[int]:
    def alive(p: int) -> bool:
        try:
            return psutil.Process(p).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    return [p for p in pids if alive(p)]


def wait_gone(pids: list[int], timeout_s: float = 30.0) -> list[int]:
    """Those of `pids` still alive (zombies count as gone) once they are all gone or `timeout_s` has passed:
    a process killed a moment ago (SIGKILL to an engine's group) may take the kernel a while to end,
    longer for an engine whose CPU time is capped."""
    deadline = time.monotonic() + timeout_s
    left = _alive(pids)
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = _alive(left)
    return left


def _stop_engine(home: Path, state: lifecycle.EngineState) -> list[int]:
    pids = lifecycle.engine_pids(state)
    lifecycle.stop(home, state.port)
    return wait_gone(pids)


@pytest.fixture(scope="session")
def engine(engine_home):
    """The shared embedded engine; stopped at the end, and nothing of it may be left running."""
    state = _start_engine(engine_home)
    yield state
    left = _stop_engine(engine_home, state)
    assert not left, f"engine down left processes behind: {left}"


@pytest.fixture(scope="session")
def demo(tmp_path_factory):
    """`make demo` to its page, as the README has it: the engine up, the load and its sampling run, the default suite
    (`record --scenario default`, the run tests/test_cancels_engine.py reads), the page (the engine stays up for the
    page's record form). Ended with Ctrl-C by tests/test_readme_commands_engine.py (DEMO_ENDS), the last of the
    tests on it (pytest_collection_modifyitems keeps them together)."""
    from tests.test_readme_commands_engine import DEMO_DEADLINE_S, ctrl_c, start_make, wait_page

    folder = tmp_path_factory.mktemp("demo")
    home, runs = folder / "home", folder / "runs"
    port, page_port = free_port(), free_port()
    env = {"CANCELWATCH_HOME": str(home), "CANCELWATCH_STORE_DIR": str(runs)}
    proc, lines = start_make("demo", {"PORT": str(port), "DASHBOARD_PORT": str(page_port),
                                      "STORE": str(runs / "cancelwatch.db")}, env)
    t0 = time.monotonic()
    try:
        m = lines.wait_for(r"dashboard: (http://127\.0\.0\.1:\d+/\S+)", proc, DEMO_DEADLINE_S, "make demo")
        state = lifecycle.read_state(home, port)
        assert state is not None, lines.text()[-3000:]
        wait_page(page_port, proc, lines, "make demo")
        print(f"make demo: page up after {time.monotonic() - t0:.0f} s")
        yield {"proc": proc, "lines": lines, "url": m.group(1), "folder": folder, "home": home, "runs": runs,
               "port": port, "page_port": page_port, "state": state, "env": env}
    finally:
        if proc.poll() is None:
            ctrl_c(proc, lines)


@pytest.fixture
def private_engine(tmp_path):
    """An engine of the test's own, for tests that kill it."""
    home = tmp_path / "home"
    state = _start_engine(home)
    yield home, state
    left = _stop_engine(home, state)
    assert not left, f"engine down left processes behind: {left}"


def free_triton_port() -> int:
    """A port p on 127.0.0.1 with p, p+1 and p+2 free: Triton's HTTP, gRPC and metrics."""
    for _ in range(50):
        p = free_port()
        if p + 2 < 65536 and not any(lifecycle.port_in_use(p + k) for k in (1, 2)):
            return p
    raise RuntimeError("no three free ports in a row on 127.0.0.1")


@pytest.fixture(scope="session")
def triton_home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("triton-home")


@pytest.fixture(scope="session")
def triton(triton_home):
    """The shared embedded Triton (the real tritonserver of the nvidia-pytriton wheel); stopped at the end,
    with every process under it (the python-backend stubs)."""
    from cancelwatch.collectors.engines import triton_server

    try:
        triton_server.bundled_server()
    except lifecycle.EngineError as exc:
        pytest.fail(str(exc))
    state = triton_server.start(triton_home, port=free_triton_port())
    yield state
    left = _stop_engine(triton_home, state)
    assert not left, f"engine down left Triton processes behind: {left}"


def decode_rate(url: str, model: str, max_tokens: int = 120) -> float:
    """Tokens per second the engine makes for one of two streams of 600-token prompts (a target and its
    neighbour), by the engine's own clock: its `vllm:request_decode_time_seconds` (first token to last,
    stamped in the engine core) over the two requests. Not by the client's: a machine that holds the API
    server up hands the client a backlog of chunks at once, and a pace read from their arrival was 487
    tokens/s where the engine made ~146 (CI: every length sized from it ran past its grace)."""
    before = _decode_seconds(url)
    results = asyncio.run(run_streams(url, model, streams=2, prompt_tokens=600, max_tokens=max_tokens))
    # a chunk may carry several tokens: an API server behind its engine coalesces them (CI: 110 chunks of a
    # 120-token stream). That each stream ran to its length is the engine's token counter's to say, below
    assert all(r.error is None and 0 < r.chunks <= max_tokens for r in results), results
    deadline = time.monotonic() + 30  # the frontend records a finished request's stats a moment after its end
    while (after := _decode_seconds(url))[0] - before[0] < len(results) and time.monotonic() < deadline:
        time.sleep(0.2)
    requests, seconds, tokens = (a - b for a, b in zip(after, before))
    assert requests == len(results) and seconds > 0, f"the engine's decode-time histogram: {before} then {after}"
    assert tokens >= max_tokens * requests, f"the engine made {tokens:.0f} tokens for {requests:.0f} streams of " \
                                            f"{max_tokens}: one stopped short"
    return (max_tokens - 1) * requests / seconds


def _decode_seconds(url: str) -> tuple[float, float, float]:
    """(count, sum) of the engine's vllm:request_decode_time_seconds histogram, and its generation-token counter,
    over their label sets."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    count = total = tokens = 0.0
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        if family.name == "vllm:request_decode_time_seconds":
            for sample in family.samples:
                if sample.name.endswith("_count"):
                    count += sample.value
                elif sample.name.endswith("_sum"):
                    total += sample.value
        elif family.name == "vllm:generation_tokens":
            tokens += sum(sample.value for sample in family.samples if sample.name == "vllm:generation_tokens_total")
    return count, total, tokens



def cli(*args: str, home: Path | None = None, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    """Run the real `cancelwatch` command line in a subprocess, in a session of its own, as a user runs it
    from a terminal. Linux groups CPU time by session (sched_autogroup): the engines the tests start run in
    sessions of their own, so a command left in the test session shared one group's share with pytest, its
    proxy threads and whatever else the suite had running, and on two cores its reads were seen starved for
    seconds (CI: no scrape of an idle engine answered for 1.5 s and 2.9 s, while the recorder's own
    real-time tickers and a monitor in a session of its own kept time)."""
    _guard_cli(args)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if home is not None:
        env["CANCELWATCH_HOME"] = str(home)
    kw.setdefault("start_new_session", True)
    return subprocess.run([sys.executable, "-m", "cancelwatch", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=kw.pop("cwd", ROOT), **kw)


def cli_popen(*args: str, home: Path | None = None, **kw) -> subprocess.Popen:
    _guard_cli(args)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if home is not None:
        env["CANCELWATCH_HOME"] = str(home)
    kw.setdefault("start_new_session", True)
    return subprocess.Popen([sys.executable, "-m", "cancelwatch", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT, **kw)


def wait_recording(store, ok_scrapes: int, timeout_s: float = 60.0) -> None:
    """Until the run being recorded holds `ok_scrapes` good scrapes of the engine: a fixed sleep after starting
    `sample` may end before a slow machine has even imported the command line."""
    deadline = time.monotonic() + timeout_s
    seen = "no store" if not Path(store).exists() else "no run"
    while time.monotonic() < deadline:
        try:
            run = load_run(store, "latest")
        except Exception:  # noqa: BLE001 - no store or no run yet
            run = None
        if run is not None:
            vllm = run.scrapes[run.scrapes["source"] == "vllm"] if len(run.scrapes) else run.scrapes
            good = int((vllm["ok"] == 1).sum()) if len(vllm) else 0
            seen = f"run {run.id} {run.info['status']}, {good} good of {len(vllm)} vLLM scrapes"
            if run.info["status"] == "running" and good >= ok_scrapes:
                return
        time.sleep(0.1)
    raise AssertionError(f"sample did not record {ok_scrapes} good scrapes into {store} within {timeout_s:.0f} s; "
                         f"last seen: {seen}")


# max_tokens well beyond what the engine can generate while the client reads its first 20 tokens: on a
# loaded 2-core machine the API server can deliver chunks seconds behind the engine core, and a
# request the engine already finished leaves on its own (correctly judged released)
SHORT = """
[[scenario]]
name = "decode_short"
trigger = "after_tokens"
trigger_value = 20
prompt_tokens = 600
max_tokens = 1200

[[scenario]]
name = "chat_short"
api = "chat"
trigger = "after_tokens"
trigger_value = 20
prompt_tokens = 600
max_tokens = 1200
"""



@pytest.fixture(scope="session")
def proxy_and_direct_runs(engine, engine_home, tmp_path_factory):
    """Two short runs in one store: run 1 through a proxy that never passes the disconnect on (its
    cancels leak), run 2 straight to the engine (released). Shared by the verdict and dashboard tests."""
    folder = tmp_path_factory.mktemp("proxy-direct")
    scen = folder / "short.toml"
    scen.write_text(SHORT)
    store = folder / "cw.db"
    # recorded once: the verdict must be right on whatever this recording shows. The leaky run waits out each
    # leaked request before the next scenario (as long as the scenario's measured pace says it needs: two
    # 1200-token leaks, ~120 s each under a 0.3-core quota), so the deadlines are about twice that
    proxy = LeakyProxy(engine.url, free_port()).start()
    try:
        proxy_res = cli("record", "--target", proxy.url, "--metrics-url", engine.url, "--scenario", str(scen),
                        "--store", str(store), "--name", "through-leaky-proxy", home=engine_home, timeout=540)
    finally:
        proxy.stop()
    direct_res = cli("record", "--target", engine.url, "--scenario", str(scen), "--store", str(store),
                     "--name", "direct", home=engine_home, timeout=540)
    return store, proxy_res, direct_res
