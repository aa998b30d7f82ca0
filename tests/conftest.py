"""Shared fixtures. The embedded engine is a real vLLM (CPU build) started once per session."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from collectors import engine as engine_mod
from collectors.engine import free_port

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"


@pytest.fixture(scope="session")
def engine_home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cancelwatch-home")


def _start_engine(home: Path) -> engine_mod.EngineState:
    python = engine_mod.default_engine_python()
    if python == sys.executable:
        pytest.fail("no .venv-engine: run `make engine-venv` (make test does) to install the embedded vLLM")
    return engine_mod.start(home, port=free_port(), timeout_s=600)


def _stop_engine(home: Path, state: engine_mod.EngineState) -> list[int]:
    pids = engine_mod.engine_pids(state)
    engine_mod.stop(home, state.port)
    return [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


@pytest.fixture(scope="session")
def engine(engine_home):
    """The shared embedded engine; stopped at the end, and nothing of it may be left running."""
    state = _start_engine(engine_home)
    yield state
    left = _stop_engine(engine_home, state)
    assert not left, f"engine down left processes behind: {left}"


@pytest.fixture
def private_engine(tmp_path):
    """An engine of the test's own, for tests that kill it."""
    home = tmp_path / "home"
    state = _start_engine(home)
    yield home, state
    left = _stop_engine(home, state)
    assert not left, f"engine down left processes behind: {left}"


def cli(*args: str, home: Path | None = None, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    """Run the real `cancelwatch` command line in a subprocess."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if home is not None:
        env["CANCELWATCH_HOME"] = str(home)
    return subprocess.run([sys.executable, "-m", "collectors.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=kw.pop("cwd", ROOT), **kw)


def cli_popen(*args: str, home: Path | None = None, **kw) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if home is not None:
        env["CANCELWATCH_HOME"] = str(home)
    return subprocess.Popen([sys.executable, "-m", "collectors.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT, **kw)
