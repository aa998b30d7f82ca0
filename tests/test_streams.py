"""The request modes of the driver against an in-test HTTP transport (httpx.MockTransport): what
the ledger says when a cancel comes at the very end of a stream."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from collectors.cancels.streams import build_request, run_request
from runstore.records import LedgerRecord


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
