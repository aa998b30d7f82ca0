"""The HTTP request modes a scenario uses against an OpenAI-compatible server: a streamed or a plain
completion (or chat completion), and the three ways a client gives up on one: cancelling its task
(the connection closes under it), closing the stream itself, or asking the app (`POST /cancel/ID`,
cancelwatch's relay app). Each request keeps its ledger row up to date as it goes.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from cancelwatch.runstore.records import LedgerRecord

REQUEST_TIMEOUT_S = 120.0
OWNER = "cancelwatch-driver"


def now_ns() -> int:
    return time.monotonic_ns()


@dataclass
class Request:
    """One request in flight: its ledger row plus what the trigger watchers look at.

    client_closed_ns: monotonic instant the client had closed its connection after the cancel (its
        own stamp: it says nothing of whether the server noticed)
    timeout_fired_ns: monotonic instant the client's timeout fired (non-streaming timeout mode), as
        stamped once httpx raised: it has closed the connection by then, so the engine may see the
        close before this stamp
    body_sent_ns: monotonic instant the request body was written (httpx's read timer starts there:
        the deadline is body_sent_ns + timeout_s)
    app_received_ns, engine_abort_ns: the relay app's own readings (explicit mode), on this clock
    app_answer: what the app answered the explicit cancel (`cancelled`, `rejected_not_owner`, ... or
        `HTTP 404`), and app_answered_ns when its answer came
    """

    row: LedgerRecord
    api: str
    body: dict
    stream: bool = True
    timeout_s: float = REQUEST_TIMEOUT_S
    finished_choices: set = field(default_factory=set)
    response: httpx.Response | None = None
    task: asyncio.Task | None = None
    cancel_requested: bool = False
    client_closed_ns: int | None = None
    timeout_fired_ns: int | None = None
    body_sent_ns: int | None = None
    auth: dict = field(default_factory=dict, repr=False)  # the target's Authorization header, if it wants one
    app_received_ns: int | None = None
    engine_abort_ns: int | None = None
    app_answer: str | None = None
    app_answered_ns: int | None = None
    delivered: Callable[[int], None] | None = None  # told of the chunks read: the run's count of what its clients got

    @property
    def chunks(self) -> int:
        """Content chunks received so far (one token each on the tiny model's streams)."""
        return self.row.chunks

    @property
    def deadline_ns(self) -> int | None:
        """When the client's timeout was due: from the body written (or, unseen, from the send)."""
        start = self.body_sent_ns or self.row.sent_mono_ns
        return None if start is None else start + int(self.timeout_s * 1e9)

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.api == "chat" else "/v1/completions"


def build_request(row: LedgerRecord, model: str, prompt: str, *, api: str = "completions", stream: bool = True,
                timeout_s: float = REQUEST_TIMEOUT_S) -> Request:
    body: dict = {"model": model, "max_tokens": row.max_tokens, "stream": stream, "ignore_eos": True, "n": row.n}
    if api == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return Request(row=row, api=api, body=body, stream=stream, timeout_s=timeout_s)


async def run_request(client: httpx.AsyncClient, base_url: str, req: Request) -> None:
    """Send the request and read it to its end, whatever that end is; the ledger row says which."""
    row = req.row
    row.sent_mono_ns = now_ns()
    try:
        if req.stream:
            await _stream(client, base_url, req)
        else:
            await _plain(client, base_url, req)
    except asyncio.CancelledError:
        # the client's own cancel: closing the response closes its connection to the server
        if req.response is not None:
            await req.response.aclose()
        req.client_closed_ns = now_ns()
        if req.stream and row.max_tokens and row.chunks >= row.max_tokens * row.n:
            # every token the request could give had arrived: it ended by length in the engine, and
            # only the finish marker was still on its way when the cancel came. A completion.
            row.terminal_state, row.reason = "completed", "length (finish marker not read before the cancel)"
        else:
            row.terminal_state, row.reason = "cancelled", "task cancelled"
    except httpx.TimeoutException as exc:
        req.timeout_fired_ns = now_ns()
        row.terminal_state, row.reason = ("cancelled", "client timeout") if req.cancel_requested else ("error", "timeout")
        row.error = type(exc).__name__
        req.client_closed_ns = now_ns()  # httpx has dropped the connection by the time it raises
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        if req.cancel_requested:
            row.terminal_state, row.reason = "cancelled", "stream closed by client"
        else:
            row.terminal_state, row.error = "error", f"{type(exc).__name__}: {exc}"
    finally:
        row.closed_mono_ns = now_ns()
        if row.terminal_state is None:
            row.terminal_state = "error"


def _count(req: Request, payload: dict) -> None:
    row = req.row
    for choice in payload.get("choices", []):
        text = choice.get("text")
        if text is None:
            text = (choice.get("delta") or {}).get("content")
        if text:
            row.chunks += 1
            if req.delivered is not None:
                req.delivered(1)
            if row.first_token_mono_ns is None:
                row.first_token_mono_ns = now_ns()
            if req.cancel_requested:
                row.tokens_after_cancel += 1
        if choice.get("finish_reason"):
            req.finished_choices.add(choice.get("index", 0))
            row.reason = choice["finish_reason"]


async def _stream(client: httpx.AsyncClient, base_url: str, req: Request) -> None:
    async with client.stream("POST", base_url + req.path, json=req.body,
                             headers={"X-Request-Id": req.row.request_id, "X-Owner": OWNER, **req.auth}) as resp:
        req.response = resp
        if resp.status_code != 200:
            await resp.aread()
            req.row.terminal_state, req.row.error = "error", f"HTTP {resp.status_code}: {resp.text[:200]}"
            return
        try:
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                _count(req, json.loads(data))
        except asyncio.CancelledError:
            raise
    done = len(req.finished_choices) >= req.row.n
    req.row.terminal_state = "completed" if done else ("cancelled" if req.cancel_requested else "error")


async def _plain(client: httpx.AsyncClient, base_url: str, req: Request) -> None:
    async def trace(event: str, info: dict) -> None:
        if event == "http11.send_request_body.complete":
            req.body_sent_ns = now_ns()

    resp = await client.post(base_url + req.path, json=req.body, timeout=req.timeout_s,
                             headers={"X-Request-Id": req.row.request_id, **req.auth}, extensions={"trace": trace})
    if resp.status_code != 200:
        req.row.terminal_state, req.row.error = "error", f"HTTP {resp.status_code}: {resp.text[:200]}"
        return
    payload = resp.json()
    req.row.first_token_mono_ns = now_ns()
    req.row.chunks = int(payload.get("usage", {}).get("completion_tokens", 0))
    if req.delivered is not None:
        req.delivered(req.row.chunks)
    req.row.terminal_state, req.row.reason = "completed", payload["choices"][0].get("finish_reason")


async def disconnect(req: Request) -> None:
    """No cancel call: the client just closes the stream under the reader."""
    if req.response is not None:
        await req.response.aclose()
    req.client_closed_ns = now_ns()


async def cancel_in_app(client: httpx.AsyncClient, base_url: str, req: Request) -> tuple[int | None, int | None]:
    """The app's own cancel call, for the id the app issued (its `X-Relay-Request-Id` header): the relay
    checks the owner and cancels the serving task, whose finally awaits AsyncLLM.abort(). Keeps the app's
    answer on `req` (an answer is only the app's word: the verdict weighs what the engine did after it).
    Returns the relay's (app received, engine abort) readings."""
    app_id = req.response.headers.get("x-relay-request-id") if req.response is not None else None
    try:
        resp = await client.post(f"{base_url}/cancel/{app_id or req.row.request_id}", headers={"X-Owner": OWNER})
    except httpx.HTTPError as exc:
        req.app_answer, req.app_answered_ns = f"no answer: {type(exc).__name__}", now_ns()
        return None, None
    req.app_answered_ns = now_ns()
    try:
        doc = resp.json()
    except ValueError:
        doc = None
    if not isinstance(doc, dict) or "result" not in doc:
        req.app_answer = f"HTTP {resp.status_code}"
        return None, None
    req.app_answer = str(doc["result"])  # an app's refusal may come with an error status (not_here: 404)
    status = doc.get("status") or {}
    return status.get("app_received_ns"), status.get("engine_abort_ns")
