"""The request modes of the driver against an in-test HTTP transport (httpx.MockTransport): what
the ledger says when a cancel comes at the very end of a stream."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from cancelwatch.collectors.cancels.streams import build_request, run_request
from cancelwatch.runstore.records import LedgerRecord


def server_that_stops_before_the_finish_marker(tokens: int):
    """Streams `tokens` one-token chunks, then holds the stream open: the finish chunk and [DONE] are
    still on their way when the client gives up (a loaded API server hands them over late)."""

    async def body():
        for i in range(tokens):
            chunk = {"choices": [{"index": 0, "text": f" w{i}", "finish_reason": None}]}
            yield f"data: {json.dumps(chunk)}\n\n".encode()
        await asyncio.sleep(3600)

    return httpx.MockTransport(lambda request: httpx.Response(200, content=body()))


async def cancel_after_all_chunks(max_tokens: int, sent: int) -> LedgerRecord:
    row = LedgerRecord("cw-race-target-1", "race", "target", max_tokens=max_tokens)
    req = build_request(row, "tiny", "w1 w2", stream=True)
    async with httpx.AsyncClient(transport=server_that_stops_before_the_finish_marker(sent)) as client:
        task = asyncio.create_task(run_request(client, "http://127.0.0.1:9", req))
        for _ in range(500):
            if row.chunks >= sent:
                break
            await asyncio.sleep(0.01)
        req.cancel_requested = True
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    return row


@pytest.mark.parametrize("max_tokens, state", [(5, "completed"), (6, "cancelled")])
def test_a_cancel_after_the_last_token_is_a_completion(max_tokens, state):
    row = asyncio.run(cancel_after_all_chunks(max_tokens, sent=5))
    assert row.chunks == 5 and row.terminal_state == state, row
    assert row.reason == ("length (finish marker not read before the cancel)" if state == "completed"
                          else "task cancelled")


async def time_out_against_a_silent_server(timeout_s: float) -> tuple:
    """A real loopback server that reads the request and never answers; it notes when it sees the close."""
    seen_close: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while (await reader.read(65536)) != b"":
            pass
        seen_close.append(time.monotonic_ns())
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    row = LedgerRecord("cw-nonstream_timeout-target-1", "nonstream_timeout", "target", max_tokens=50)
    req = build_request(row, "tiny", "w1 w2", stream=False, timeout_s=timeout_s)
    req.cancel_requested = True
    async with server, httpx.AsyncClient() as client:
        await run_request(client, f"http://127.0.0.1:{port}", req)
        for _ in range(200):
            if seen_close:
                break
            await asyncio.sleep(0.01)
    return req, seen_close


def test_a_client_timeout_is_stamped_at_its_deadline_which_precedes_the_close_the_server_sees():
    # httpx closes the connection before it raises: the stamp taken when it raises can come after
    # the server (the engine) saw the close. The deadline cannot.
    req, seen_close = asyncio.run(time_out_against_a_silent_server(0.3))
    row = req.row
    assert row.terminal_state == "cancelled" and row.reason == "client timeout", row
    assert req.body_sent_ns is not None and row.sent_mono_ns <= req.body_sent_ns
    assert req.deadline_ns == req.body_sent_ns + 300_000_000
    assert seen_close and req.deadline_ns <= seen_close[0], (req.deadline_ns, seen_close)
    assert req.deadline_ns <= req.timeout_fired_ns
