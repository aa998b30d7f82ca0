"""Real clients through `cancelwatch watch` to the real engine: a stream read to its end is never a cancel, however the
client closes after it (the `openai` SDK closes once `data: [DONE]` has passed, before the chunked body's last bytes;
some clients stop at the chunk that carries the finish_reason), and a stream broken off is always one. The clients:
the `openai` SDK (sync and async, chat), `curl`, `httpx` and `aiohttp`, each reading streams to their end and
breaking others off a few chunks in; one more client closes at the finish_reason, before `data: [DONE]`."""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections import Counter

import aiohttp
import httpx
import openai

from cancelwatch.runstore.reader import load_run
from tests.test_watch_engine import watching

FULL, BROKEN = 6, 2  # streams each client reads to the end, and breaks off
SHORT, LONG = 12, 400  # tokens of a stream read to its end, and of one broken off 3 chunks in
AFTER = 3


def body(model: str, rid: str, tokens: int, chat: bool = False) -> dict:
    prompt = {"messages": [{"role": "user", "content": f"Say {rid}"}]} if chat else {"prompt": f"Say {rid}"}
    return {"model": model, **prompt, "max_tokens": tokens, "stream": True, "ignore_eos": True}


def sdk_sync(url: str, model: str, rid: str, tokens: int, brk: bool) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": f"Say {rid}"}],
                                            max_tokens=tokens, stream=True, extra_body={"ignore_eos": True},
                                            extra_headers={"X-Request-Id": rid})
    for i, _ in enumerate(stream):
        if brk and i >= AFTER:
            break
    stream.close()
    client.close()


def sdk_async(url: str, model: str, rid: str, tokens: int, brk: bool) -> None:
    async def go():
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        stream = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": f"Say {rid}"}],
                                                      max_tokens=tokens, stream=True, extra_body={"ignore_eos": True},
                                                      extra_headers={"X-Request-Id": rid})
        i = 0
        async for _ in stream:
            i += 1
            if brk and i > AFTER:
                break
        await stream.close()
        await client.close()
    asyncio.run(go())


def curl(url: str, model: str, rid: str, tokens: int, brk: bool) -> None:
    # broken off the way a script does it: curl's --max-time, a moment into the stream
    limit = ["--max-time", "0.8"] if brk else []
    res = subprocess.run(["curl", "-sN", *limit, "-H", "content-type: application/json", "-H", f"X-Request-Id: {rid}",
                          "-d", json.dumps(body(model, rid, tokens)), f"{url}/v1/completions"],
                         capture_output=True, timeout=60)
    assert res.returncode == (28 if brk else 0), res
    assert brk or b"data: [DONE]" in res.stdout


def with_httpx(url: str, model: str, rid: str, tokens: int, brk: bool) -> None:
    with httpx.Client(timeout=30) as client, client.stream("POST", f"{url}/v1/completions", json=body(model, rid, tokens),
                                                           headers={"X-Request-Id": rid}) as resp:
        for i, line in enumerate(resp.iter_lines()):
            if (brk and i >= 2 * AFTER) or line == "data: [DONE]":
                break


def with_aiohttp(url: str, model: str, rid: str, tokens: int, brk: bool) -> None:
    async def go():
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{url}/v1/completions", json=body(model, rid, tokens, chat=False),
                                    headers={"X-Request-Id": rid}) as resp:
                i = 0
                async for line in resp.content:
                    i += 1
                    if (brk and i >= 2 * AFTER) or line.strip() == b"data: [DONE]":
                        break
    asyncio.run(go())


def at_the_finish(url: str, model: str, rid: str, tokens: int, brk: bool) -> None:
    """Stops reading at the chunk that carries the finish_reason, before `data: [DONE]`, and closes."""
    with httpx.Client(timeout=30) as client, client.stream("POST", f"{url}/v1/completions", json=body(model, rid, tokens),
                                                           headers={"X-Request-Id": rid}) as resp:
        for i, line in enumerate(resp.iter_lines()):
            if brk and i >= 2 * AFTER:
                break
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0].get("finish_reason"):
                break


CLIENTS = {"openai-sync": sdk_sync, "openai-async": sdk_async, "curl": curl, "httpx": with_httpx,
           "aiohttp": with_aiohttp, "at-the-finish": at_the_finish}


def test_streams_read_to_their_end_are_never_cancels_and_streams_broken_off_always_are(engine, engine_home, tmp_path):
    model = engine.served_model_name
    sent: dict[str, str] = {}
    with watching(engine, engine_home, tmp_path, engine.url, duration_s=600, end_timeout_s=90) as w:
        url = f"http://127.0.0.1:{w.port}"
        for name, client in CLIENTS.items():
            for i in range(FULL + BROKEN):
                brk = i >= FULL
                rid = f"{name}-{'broken' if brk else 'full'}-{i}"
                client(url, model, rid, LONG if brk else SHORT, brk)
                sent[rid] = name
    run = load_run(w.store, "latest")
    rows = run.ledger.set_index("request_id")
    stops = set(run.events.loc[run.events["kind"] == "user_stop", "request_id"])
    assert set(sent) <= set(rows.index), set(sent) - set(rows.index)
    counted: Counter = Counter()
    for rid, name in sent.items():
        cancelled = rows.at[rid, "terminal_state"] == "cancelled"
        counted[(name, "broken" in rid, cancelled)] += 1
        assert cancelled == (rid in stops), (rid, rows.loc[rid].to_dict())
    print("streams (client, broken off, counted as a cancel): how many", dict(counted))
    for name in CLIENTS:
        assert counted[(name, False, False)] == FULL, (name, counted)  # read to the end: no cancel
        assert counted[(name, True, True)] == BROKEN, (name, counted)  # broken off: every one a cancel
    assert len(stops) == BROKEN * len(CLIENTS)  # and no other request was taken for one
