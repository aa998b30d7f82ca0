"""The ways a Triton client sends a request and gives up on it, each with tritonclient's own call:

  explicit     `grpc.InferenceServerClient.async_infer(...)` returns a CallContext; `.cancel()` cancels it
  task_cancel  `grpc.aio` stream_infer in an asyncio task; cancelling the task cancels the RPC
  stream_wide  `start_stream` + `async_stream_infer` on one stream; `stop_stream(cancel_requests=True)`
               cancels every in-flight request of that stream
  deadline     `async_infer(..., client_timeout=s)`: gRPC's deadline, enforced by the server as a cancel
  disconnect   the request's own grpc.aio channel is closed, without any cancel call
  http_timeout a non-streaming KServe v2 HTTP POST with a client timeout: HTTP carries no cancel

The client's view ends at once (CANCELLED / DEADLINE_EXCEEDED / a timeout) whatever the server does:
each request records that view in its ledger row, never as evidence that the server stopped.
Every gRPC client is made with retries off, so no transport retry resubmits a cancelled request.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

import httpx
import numpy as np
try:  # the [triton] extra: driving Triton's cancels needs its gRPC client, recording vLLM does not
    import tritonclient.grpc as grpcclient
    import tritonclient.grpc.aio as grpcaio
    from tritonclient.utils import InferenceServerException
except ImportError:  # resolve_triton refuses a Triton run in one line (runstore/extras.py)
    grpcclient = grpcaio = None

    class InferenceServerException(Exception):
        """Stands in for tritonclient's where it is not installed: nothing raises it."""

from cancelwatch.collectors.cancels.streams import now_ns
from cancelwatch.runstore.records import LedgerRecord

REQUEST_TIMEOUT_S = 60.0
# gRPC's transparent retries could resend a request the client cancelled: off for every channel
CHANNEL_ARGS = [("grpc.enable_retries", 0)]

CALL_OBJECTS = {
    "explicit": "tritonclient.grpc CallContext (async_infer)",
    "task_cancel": "asyncio.Task over tritonclient.grpc.aio stream_infer",
    "stream_wide": "tritonclient.grpc stream (start_stream/async_stream_infer)",
    "deadline": "tritonclient.grpc CallContext (async_infer, client_timeout)",
    "disconnect": "tritonclient.grpc.aio client (its own channel)",
    "http_timeout": "httpx POST /v2/models/<model>/infer (timeout)",
    "stream": "asyncio.Task over tritonclient.grpc.aio stream_infer",
    "unary": "tritonclient.grpc.aio infer",
}


@dataclass
class TritonRequest:
    """One request in flight: its ledger row, the model it names and how it is sent and given up on.

    done: set once the client's view of the request ended (completed, cancelled, error)
    client_closed_ns: monotonic instant the client saw its own end of a cancelled request
    """

    row: LedgerRecord
    model: str
    call: str
    inputs: dict  # input name -> int value
    done: asyncio.Event = field(default_factory=asyncio.Event)
    cancel_requested: bool = False
    client_closed_ns: int | None = None
    handle: object = None  # the library object that can cancel it (CallContext, task, client)
    stream: "SharedStream | None" = None
    timeout_s: float | None = None  # deadline / HTTP timeout: their passing is the stop
    last_response_ns: int | None = None

    def step_s(self) -> float | None:
        """Duration, s between responses as the client saw them (the model's step, for its natural end)."""
        first, last, n = self.row.first_token_mono_ns, self.last_response_ns, self.row.chunks
        return (last - first) / 1e9 / (n - 1) if first and last and n >= 2 else None

    @property
    def chunks(self) -> int:
        return self.row.chunks

    def response(self) -> None:
        self.row.chunks += 1
        self.last_response_ns = now_ns()
        if self.row.first_token_mono_ns is None:
            self.row.first_token_mono_ns = now_ns()
        if self.cancel_requested:
            self.row.tokens_after_cancel += 1

    def end(self, state: str, reason: str | None = None, error: str | None = None) -> None:
        if self.done.is_set():
            return
        self.row.terminal_state, self.row.reason, self.row.error = state, reason, error
        self.row.closed_mono_ns = now_ns()
        if self.cancel_requested and state != "completed":
            self.client_closed_ns = self.row.closed_mono_ns
        self.done.set()

    def end_with(self, exc: BaseException) -> None:
        status = exc.status() if isinstance(exc, InferenceServerException) else None
        text = (exc.message() if isinstance(exc, InferenceServerException) else str(exc)) or type(exc).__name__
        if self.cancel_requested:
            # the client's own view: it says nothing of whether the server stopped
            self.end("cancelled", f"client saw {status or type(exc).__name__}", text[:200])
        else:
            self.end("error", None, f"{status or type(exc).__name__}: {text[:200]}")


def _grpc_inputs(mod, values: dict) -> list:
    out = []
    for name, value in values.items():
        shape = [1, 1] if name == "MS" else [1]
        inp = mod.InferInput(name, shape, "INT32")
        inp.set_data_from_numpy(np.array(value, dtype=np.int32).reshape(shape))
        out.append(inp)
    return out


def _took_last(req: "TritonRequest") -> bool:
    """The generators send N responses, the last with the final flag: the count tells the end (the
    grpc.aio client cannot ask for the empty final response that would mark it)."""
    return req.row.chunks >= int(req.inputs.get("N", 1))


class Calls:
    """The clients of one run against one Triton (gRPC address, HTTP URL) and the loop they report to."""

    def __init__(self, grpc_url: str, http_url: str):
        self.grpc_url = grpc_url
        self.http_url = http_url.rstrip("/")
        self.loop: asyncio.AbstractEventLoop | None = None
        self.sync = grpcclient.InferenceServerClient(grpc_url, channel_args=CHANNEL_ARGS)
        self.aio: grpcaio.InferenceServerClient | None = None
        self.http: httpx.AsyncClient | None = None

    async def open(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.aio = grpcaio.InferenceServerClient(self.grpc_url, channel_args=CHANNEL_ARGS)
        self.http = httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S)

    async def close(self) -> None:
        if self.aio is not None:
            await self.aio.close()
        if self.http is not None:
            await self.http.aclose()
        self.sync.close()

    def _threadsafe(self, fn, *args) -> None:
        self.loop.call_soon_threadsafe(fn, *args)

    # ------------------------------------------------------------------ sending
    def send(self, req: TritonRequest) -> None:
        """Start the request the way its call says; it ends (req.done) on its own."""
        req.row.sent_mono_ns = now_ns()
        if req.call in ("explicit", "deadline"):
            if req.call == "deadline":
                req.timeout_s = float(req.inputs.pop("_deadline_s"))
            req.handle = self.sync.async_infer(
                req.model, _grpc_inputs(grpcclient, req.inputs), request_id=req.row.request_id,
                client_timeout=req.timeout_s,
                callback=lambda result, error: self._threadsafe(self._unary_done, req, result, error))
        elif req.call in ("task_cancel", "stream", "disconnect"):
            client = self.aio
            if req.call == "disconnect":
                client = grpcaio.InferenceServerClient(self.grpc_url, channel_args=CHANNEL_ARGS)
                req.handle = client
            req_task = asyncio.create_task(self._aio_stream(client, req))
            if req.call != "disconnect":
                req.handle = req_task
        elif req.call == "unary":
            req.handle = asyncio.create_task(self._aio_unary(req))
        elif req.call == "http_timeout":
            req.timeout_s = float(req.inputs.pop("_timeout_s"))
            req.handle = asyncio.create_task(self._http(req, req.timeout_s))
        elif req.call == "stream_wide":
            req.stream.add(req)
        else:
            raise ValueError(f"unknown call {req.call!r}")

    def _unary_done(self, req: TritonRequest, result, error) -> None:
        if error is not None:
            if req.call == "deadline" and not req.cancel_requested:
                req.cancel_requested = True  # the deadline is this mode's cancel: its passing is the stop
                req.row.cancel_mono_ns = req.row.sent_mono_ns + int(req.timeout_s * 1e9)
            req.end_with(error)
        else:
            req.response()
            req.end("completed", "done")

    async def _aio_stream(self, client, req: TritonRequest) -> None:
        inputs = _grpc_inputs(grpcaio, req.inputs)

        async def one():
            yield {"model_name": req.model, "inputs": inputs, "request_id": req.row.request_id}
            await asyncio.sleep(REQUEST_TIMEOUT_S)  # the stream stays open until the request ends

        try:
            async for result, error in client.stream_infer(one(), stream_timeout=REQUEST_TIMEOUT_S):
                if error is not None:
                    req.end_with(error)
                    return
                req.response()
                if _took_last(req):
                    req.end("completed", "all responses")
                    return
            req.end("error" if not req.cancel_requested else "cancelled", "stream ended without a final response")
        except asyncio.CancelledError:
            req.end("cancelled", "client task cancelled")
            raise
        except Exception as exc:  # noqa: BLE001 - grpc raises its own types on a closed channel
            req.end_with(exc)

    async def _aio_unary(self, req: TritonRequest) -> None:
        try:
            await self.aio.infer(req.model, _grpc_inputs(grpcaio, req.inputs), request_id=req.row.request_id,
                                 client_timeout=REQUEST_TIMEOUT_S)
            req.response()
            req.end("completed", "done")
        except asyncio.CancelledError:
            req.end("cancelled", "client task cancelled")
            raise
        except Exception as exc:  # noqa: BLE001
            req.end_with(exc)

    async def _http(self, req: TritonRequest, timeout_s: float) -> None:
        body = {"id": req.row.request_id,
                "inputs": [{"name": k, "shape": [1, 1] if k == "MS" else [1], "datatype": "INT32", "data": [v]}
                           for k, v in req.inputs.items()]}
        try:
            resp = await self.http.post(f"{self.http_url}/v2/models/{req.model}/infer", content=json.dumps(body),
                                        timeout=timeout_s)
            if resp.status_code == 200:
                req.response()
                req.end("completed", "done")
            else:
                req.end("error", None, f"HTTP {resp.status_code}: {resp.text[:200]}")
        except httpx.TimeoutException as exc:
            # the client's timeout is this mode's cancel: the moment it passed is the user stop
            req.cancel_requested = True
            req.row.cancel_mono_ns = req.row.sent_mono_ns + int(timeout_s * 1e9)
            req.end("cancelled", "client timeout (HTTP carries no cancel)", type(exc).__name__)
        except httpx.HTTPError as exc:
            req.end("error", None, f"{type(exc).__name__}: {exc}")

    # ------------------------------------------------------------------ giving up
    async def cancel(self, req: TritonRequest) -> None:
        """The scenario's stop for this request, by its call."""
        req.cancel_requested = True
        if req.call == "explicit":
            req.handle.cancel()
        elif req.call == "task_cancel":
            req.handle.cancel()
        elif req.call == "disconnect":
            await req.handle.close()  # the channel goes, no cancel call is made
        elif req.call == "stream_wide":
            await req.stream.stop()
        else:
            raise ValueError(f"a {req.call} request is not cancelled by the client")


class SharedStream:
    """One gRPC stream (tritonclient.grpc start_stream) carrying several requests; stopping it with
    cancel_requests=True cancels all of them at once."""

    def __init__(self, calls: Calls):
        self.calls = calls
        self.client = grpcclient.InferenceServerClient(calls.grpc_url, channel_args=CHANNEL_ARGS)
        self.reqs: dict[str, TritonRequest] = {}
        self.client.start_stream(callback=self._callback)

    def add(self, req: TritonRequest) -> None:
        self.reqs[req.row.request_id] = req
        self.client.async_stream_infer(req.model, _grpc_inputs(grpcclient, req.inputs), request_id=req.row.request_id)

    def _callback(self, result, error) -> None:
        self.calls._threadsafe(self._on, result, error)

    def _on(self, result, error) -> None:
        if error is not None:
            # a stream-level error names no request: every one still open on the stream ends with it
            for req in self.reqs.values():
                req.end_with(error)
            return
        rid = result.get_response().id
        req = self.reqs.get(rid)
        if req is None:
            return
        req.response()
        if _took_last(req):
            req.end("completed", "all responses")

    async def stop(self) -> None:
        await asyncio.to_thread(self.client.stop_stream, cancel_requests=True)
        for req in self.reqs.values():
            req.cancel_requested = True
            req.end("cancelled", "client stopped the stream (cancel_requests=True)")
        self.client.close()
