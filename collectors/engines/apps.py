"""Apps as people write them in front of vLLM, for the apps rows of the gateway matrix (collectors/engines/gateways.py):
a FastAPI app that relays every request to the engine with `httpx`, streaming the answer back, in the variants
users run. Started on loopback with uvicorn, in the embedded engine's venv (FastAPI, Starlette, uvicorn and httpx are
vLLM's own dependencies there); which variant, and where the engine is, come from the environment:

  plain          the relay alone: Starlette ends a streamed response when its client goes, and closing the
                 generator closes the upstream stream
  base_http      the same behind a `BaseHTTPMiddleware` (a line of logging, as a user adds one)
  pure_asgi      the same behind a pure ASGI middleware
  background     the upstream read handed to a background task that fills a queue the response streams from:
                 the client leaving ends the response, never the task

Every variant also serves the chat page cancelwatch ships (chat.html, beside this file) at `/`: a real browser's Stop
starts a cancel there, and the page reports the click with a POST to /cancelwatch/stop, which the app answers (204)
and the taps on the way read (analysis/page_stops.py).

Each variant gives its own word on receiving a cancel: where its client leaves before the answer's end, the code
that streams the answer reports it with a POST to /cancelwatch/received, sent upstream (the engine answers it 404;
a tap behind the app reads it). The background variant reports it too, and its task reads on: the app received the
cancel and did not pass it on.

Nothing here decides what the matrix finds: each row's verdict is measured on the engine's evidence.
"""

from __future__ import annotations

import asyncio
import os
import time

from pathlib import Path

import httpx
from fastapi import FastAPI, Request
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.responses import HTMLResponse, Response, StreamingResponse

UPSTREAM = os.environ.get("CANCELWATCH_APP_UPSTREAM", "http://127.0.0.1:8000")
KIND = os.environ.get("CANCELWATCH_APP_KIND", "plain")
KINDS = ("plain", "base_http", "pure_asgi", "background")
if KIND not in KINDS:  # an app that would run as another than asked must not start: its row would say the wrong thing
    raise SystemExit(f"CANCELWATCH_APP_KIND={KIND!r} is no app here: use one of {', '.join(KINDS)}")
PASSED = ("content-type", "x-request-id", "authorization")  # the request headers the app sends on

app = FastAPI()
client = httpx.AsyncClient(base_url=UPSTREAM, timeout=httpx.Timeout(None, connect=5.0))
# the reports of a client leaving go on a pool of their own: waiting for one of the streams' connections would
# place the receipt late by that wait
reporter = httpx.AsyncClient(base_url=UPSTREAM, timeout=5.0)


class LogLine(BaseHTTPMiddleware):
    async def dispatch(self, request, call_next):
        return await call_next(request)


class PureAsgi:
    def __init__(self, inner):
        self.inner = inner

    async def __call__(self, scope, receive, send):
        await self.inner(scope, receive, send)


if KIND == "base_http":
    app.add_middleware(LogLine)
elif KIND == "pure_asgi":
    app.add_middleware(PureAsgi)


async def _upstream(request: Request) -> httpx.Response:
    headers = {k: v for k, v in request.headers.items() if k.lower() in PASSED}
    sent = client.build_request(request.method, request.url.path, content=await request.body(), headers=headers)
    return await client.send(sent, stream=True)


PAGE = Path(__file__).with_name("chat.html")
RECEIPT_PATH = "/cancelwatch/received"  # collectors/sources/tap.py: APP_RECEIPT_PATH (this file runs on its own)


def _client_left(request: Request) -> None:
    """Report, upstream, that this request's client left before its answer's end: its id, when the app saw it and
    when the report went (wall ms; the interval between them on the monotonic clock). Sent from a task of its own:
    the streaming code it is called from is being cancelled. The report is evidence, never a reason to fail."""
    rid = request.headers.get("x-request-id")
    if not rid:
        return
    seen, wall_ms = time.monotonic(), time.time() * 1000

    async def report():
        body = {"request_id": rid, "received_wall_ms": wall_ms,
                "sent_wall_ms": wall_ms + (time.monotonic() - seen) * 1000}
        try:
            await reporter.post(RECEIPT_PATH, json=body)
        except httpx.HTTPError:
            pass
    _keep(asyncio.get_running_loop().create_task(report()))


def _keep(task: asyncio.Task) -> None:
    """Hold a task until it is done (the loop keeps only weak references to tasks)."""
    app.state.tasks = getattr(app.state, "tasks", set())
    app.state.tasks.add(task)
    task.add_done_callback(app.state.tasks.discard)


@app.get("/")
async def page():
    return HTMLResponse(PAGE.read_text())


@app.post("/cancelwatch/stop")
async def page_stop(request: Request):
    # the page's word on its Stop: the taps in front read it on its way here; the app has only to take it
    await request.body()
    return Response(status_code=204)


@app.api_route("/{path:path}", methods=["GET", "POST"])
async def relay(path: str, request: Request):
    upstream = await _upstream(request)
    media = upstream.headers.get("content-type")
    if KIND == "background":
        queue: asyncio.Queue = asyncio.Queue()

        async def pump():  # reads the engine's answer to its end, whoever is listening
            try:
                async for chunk in upstream.aiter_raw():
                    await queue.put(chunk)
            finally:
                await upstream.aclose()
                await queue.put(None)

        _keep(asyncio.create_task(pump()))

        async def from_queue():
            try:
                while (chunk := await queue.get()) is not None:
                    yield chunk
            except (asyncio.CancelledError, GeneratorExit):  # its client left: the task reads on
                _client_left(request)
                raise
        return StreamingResponse(from_queue(), status_code=upstream.status_code, media_type=media)

    async def chunks():
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        except (asyncio.CancelledError, GeneratorExit):  # its client left (an upstream that failed is no cancel)
            _client_left(request)
            raise
        finally:
            await upstream.aclose()
    return StreamingResponse(chunks(), status_code=upstream.status_code, media_type=media)
