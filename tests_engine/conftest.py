"""Tests that run inside the engine's venv (.venv-engine), against vLLM's in-process AsyncLLM.

`make test` runs them with `.venv-engine/bin/python -m pytest tests_engine`.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from collectors.engines.tiny_model import build  # noqa: E402


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
