"""Tests that run inside the engine's venv (.venv-engine), against vLLM's in-process AsyncLLM.

`make test` runs them with `.venv-engine/bin/python -m pytest tests_engine`.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cancelwatch.console import ENGINE_CPUS_ENV  # noqa: E402
from cancelwatch.collectors.engines import cpu_limit  # noqa: E402
from cancelwatch.collectors.engines.tiny_model import build  # noqa: E402

_quota: dict[str, Path] = {}


def pytest_sessionstart(session):
    """$CANCELWATCH_ENGINE_CPUS, the slow-engine knob of tests/: AsyncLLM runs in this process (its engine
    core in a child it spawns), so this process goes into a cgroup with that CPU quota, and everything it
    starts with it."""
    text = os.environ.get(ENGINE_CPUS_ENV, "").strip()
    if not text:
        return
    try:
        path = cpu_limit.create(f"cancelwatch-tests-engine-{os.getpid()}", cpu_limit.parse_cores(text))
        cpu_limit.join(path)
    except (cpu_limit.CpuLimitError, OSError) as exc:
        raise pytest.UsageError(f"{ENGINE_CPUS_ENV}={text}: {exc}") from None
    _quota["path"] = path


def pytest_sessionfinish(session, exitstatus):
    """Back into the parent cgroup, and the quota's cgroup removed. What this process started and still runs
    (multiprocessing's resource tracker lives as long as this process) goes back with it: every member of
    the cgroup is this process or one it started."""
    path = _quota.pop("path", None)
    if path is None:
        return
    cpu_limit.join(path.parent)
    deadline = time.monotonic() + 10
    while path.exists() and time.monotonic() < deadline:
        for pid in cpu_limit.members(path):
            try:
                (path.parent / "cgroup.procs").write_text(str(pid))
            except OSError:
                pass  # gone meanwhile
        cpu_limit.remove(path)
        if path.exists():
            time.sleep(0.1)
    if path.exists():
        print(f"\n{ENGINE_CPUS_ENV}: could not remove {path} (members {cpu_limit.members(path)})")


@pytest.fixture(scope="session")
def loop():
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


@pytest.fixture(scope="session")
def llm(loop, tmp_path_factory):
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    model = build(tmp_path_factory.mktemp("model") / "tiny-llama")
    args = AsyncEngineArgs(
        model=str(model), load_format="dummy", dtype="float32", max_num_seqs=4, num_gpu_blocks_override=64,
        block_size=128, max_model_len=4096, max_num_batched_tokens=512, gpu_memory_utilization=0.3,
        enforce_eager=True, disable_log_stats=False,
    )

    async def make():
        return AsyncLLM.from_engine_args(args)

    engine = loop.run_until_complete(make())
    yield engine
    engine.shutdown()
    # let the engine's output task see the shutdown before the loop closes
    loop.run_until_complete(asyncio.sleep(0.2))
    for task in asyncio.all_tasks(loop):
        task.cancel()
    loop.run_until_complete(asyncio.sleep(0.1))
