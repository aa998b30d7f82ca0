"""A bounded streaming load: N concurrent completions of known token length against an OpenAI-compatible server.

The tiny model's words `w0`..`w999` are one token each, so `prompt_tokens` words make a prompt of
exactly that many tokens there; `ignore_eos` keeps random weights from ending a stream early.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import httpx


@dataclass
class StreamResult:
    index: int
    chunks: int
    first_chunk_s: float | None
    total_s: float
    error: str | None = None


def make_prompt(n_tokens: int, seed: int = 0) -> str:
    return " ".join(f"w{(seed * 7919 + j * 31) % 1000}" for j in range(n_tokens))


async def _one(client: httpx.AsyncClient, url: str, model: str, index: int, prompt_tokens: int, max_tokens: int) -> StreamResult:
    body = {
        "model": model,
        "prompt": make_prompt(prompt_tokens, seed=index + 1),
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
    }
    t0 = time.monotonic()
    chunks, first = 0, None
    try:
        async with client.stream("POST", url.rstrip("/") + "/v1/completions", json=body,
                                 headers={"X-Request-Id": f"load-{index}"}) as resp:
            resp.raise_for_status()
            async for line in resp.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks += 1
                    first = first if first is not None else time.monotonic() - t0
    except httpx.HTTPError as exc:
        return StreamResult(index, chunks, first, time.monotonic() - t0, f"{type(exc).__name__}: {exc}")
    return StreamResult(index, chunks, first, time.monotonic() - t0)


async def run_streams(
    url: str,
    model: str,
    streams: int = 6,
    prompt_tokens: int = 1450,
    max_tokens: int = 50,
    timeout_s: float = 120.0,
    headers: dict[str, str] | None = None,
) -> list[StreamResult]:
    """Run `streams` concurrent streams; every stream is bounded by `timeout_s`. `headers`: the engine's
    Authorization, when it wants one."""
    limits = httpx.Limits(max_connections=streams + 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits, headers=headers or {}) as client:
        return list(
            await asyncio.wait_for(
                asyncio.gather(*(_one(client, url, model, i, prompt_tokens, max_tokens) for i in range(streams))),
                timeout_s,
            )
        )


def served_model(url: str, timeout_s: float = 5.0, auth: dict[str, str] | None = None) -> str:
    """The first model id the server lists at /v1/models."""
    resp = httpx.get(url.rstrip("/") + "/v1/models", timeout=timeout_s, headers=auth or {})
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]
