"""A test-only loopback proxy in front of the engine whose misbehaviour is chosen at construction.

It forwards every path (/v1/* streamed or not, /metrics, /health) to the engine, one request per
connection, and watches each client: the client went when its socket reads EOF or a write to it fails
(as tests/leaky_proxy.py). What it does then, and around it, is the behaviour:

- default: the disconnect is passed on at once (the upstream stream is closed, the engine aborts);
- `leak=True`: the disconnect is never passed on, upstream is read to its end (the lost cancel);
  with `leak_only="target"` (a role, matched as "-target-" in X-Request-Id, or a predicate on the
  id) only the FIRST such request whose client goes leaks; every other one is passed on;
- `late_s`: upstream is read at full speed into a queue and each chunk is handed to the client only
  `late_s` after it arrived, each SSE event `LATE_PACE_S` after the one before, so a short request is finished
  in the engine long before the client sees its tokens; with `late_only` (a role, as for `leak_only`) only
  those requests are late, as a client that reads slowly is;
- `foreign_after_stop_s`: that long after the first target's client went, ONE unrelated streamed
  completion (X-Request-Id `foreign-<hex>`) goes straight to the engine and is read to its end;
- `metrics_down=(k, s)`: from the moment the proxy has handed the first target's k-th event to its
  client, /metrics answers nothing (the connection is dropped without a response) until s seconds
  after that target's client went (or s seconds after the k-th event, if it has not gone by then). A
  client that stops after more than k tokens stops inside the outage, whatever the machine's load
  (starting it when the proxy saw the client go began it up to 0.6 s late on a loaded machine; ending
  it a fixed time after the k-th event let a recorder stalled for 13 s on a loaded CI machine stop
  after the outage was over);
- `retry_upstream_s`: a request the engine refuses (nothing listens: it is restarting) is tried again
  for up to that many seconds, as a gateway in front of a restarting engine would.
- `mint_ids`: every request goes upstream with an X-Request-Id of the proxy's own (`gw-<12 hex>`, kept in
  `minted` by the client's id), as gateways that mint their own ids do; the proxy's records keep the
  client's id.
- `drop_cancels`: an app's explicit cancel (`POST /cancel/<id>`) is answered `{"result": "cancelled"}` by
  the proxy and never passed on, as a gateway route that swallows the call (`cancels_dropped`);
- `cancel_upstream`: an app's explicit cancel goes to that upstream instead (another replica of the app),
  as a balancer without affinity sends it; the answer is that replica's (`cancels_rerouted`);
- `resubmit_after_gone`: the disconnect of the FIRST target whose client goes is passed on, and then the
  same request (its body and headers, its `X-Request-Id`) is sent upstream once more and read to its
  end, as a gateway retrying upstream after its client left does (`resubmitted`, `resubmit_done_at`).

Everything it did is counted (`client_gone`, `leaked`, `passed_on`, `foreign_sent`, `metrics_down_at`,
`metrics_refused`, and per request `requests[id]` with monotonic instants, the same clock as a run's
`*_mono_ns`), so that a test can fail when its proxy did not misbehave as meant.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from tests.leaky_proxy import read_request

HOP_HEADERS = {"host", "content-length", "connection", "transfer-encoding", "accept-encoding", "keep-alive"}
HEAD_TIMEOUT_S = 10.0
REQUEST_DEADLINE_S = 180.0  # no proxied exchange lives longer, whatever the engine does
FOREIGN_DEADLINE_S = 90.0
LATE_PACE_S = 0.02  # with late_s, SSE events reach the client at least this far apart
FOREIGN_PROMPT = " ".join(f"w{i}" for i in range(300))


def _events(raw: bytes) -> list[bytes]:
    """A body read cut after each blank line (the end of an SSE event); the bytes are unchanged."""
    parts = [p + b"\n\n" for p in raw.split(b"\n\n")]
    parts[-1] = parts[-1][:-2]
    return [p for p in parts if p]


@dataclass
class Seen:
    """One proxied request; instants are time.monotonic() seconds."""

    request_id: str
    path: str
    received_at: float
    status: int | None = None
    first_chunk_at: float | None = None  # upstream's first body chunk
    upstream_done_at: float | None = None  # upstream's body read to its end
    upstream_closed_at: float | None = None  # upstream closed before its end (the disconnect passed on)
    client_gone_at: float | None = None
    delivered_done: bool = False  # the stream's end marker (`data: [DONE]`) reached the client
    leaked: bool = False
    chunks_up: int = 0
    chunks_down: int = 0
    events_down: int = 0  # SSE events (`data: ` lines) handed to the client
    errors: list[str] = field(default_factory=list)
    sent: tuple | None = None  # (method, path, body, headers) as sent upstream: what a resubmit sends again


class ProxyBehaviour:
    def __init__(self, upstream: str, port: int, *, leak: bool = False,
                 leak_only: str | Callable[[str], bool] | None = None, late_s: float = 0.0,
                 late_only: str | None = None,
                 foreign_after_stop_s: float | None = None, foreign_max_tokens: int = 200,
                 metrics_down: tuple[int, float] | None = None, retry_upstream_s: float = 0.0,
                 resubmit_after_gone: bool = False, mint_ids: bool = False, drop_cancels: bool = False,
                 cancel_upstream: str | None = None):
        self.upstream = upstream.rstrip("/")
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.leak = leak or leak_only is not None
        if isinstance(leak_only, str):
            role = leak_only
            leak_only = lambda rid: f"-{role}-" in rid
        self.leak_only = leak_only
        self.late_s = float(late_s)
        self.late_only = late_only
        self.foreign_after_stop_s = foreign_after_stop_s
        self.foreign_max_tokens = foreign_max_tokens
        self.metrics_down = metrics_down
        self.retry_upstream_s = float(retry_upstream_s)
        self.upstream_retries = 0  # connection attempts the engine refused and that were tried again
        self.resubmit_after_gone = resubmit_after_gone
        self.mint_ids = mint_ids
        self.drop_cancels = drop_cancels
        self.cancel_upstream = cancel_upstream.rstrip("/") if cancel_upstream else None
        self.cancels_dropped: list[str] = []  # paths of the cancel calls answered and not passed on
        self.cancels_rerouted: list[tuple[str, int, str]] = []  # (path, status, body) of those sent elsewhere
        self.minted: dict[str, str] = {}  # the client's X-Request-Id -> the one sent upstream in its place
        self.resubmitted: list[str] = []  # ids sent upstream again after their client went
        self.resubmit_done_at: float | None = None
        self.resubmit_error: str | None = None
        # what happened
        self.requests: dict[str, Seen] = {}
        self.client_gone = 0
        self.leaked: list[str] = []
        self.passed_on: list[str] = []
        self.first_target_gone_at: float | None = None
        self.foreign_sent = 0
        self.foreign_ids: list[str] = []
        self.foreign_sent_at: float | None = None
        self.foreign_done_at: float | None = None
        self.foreign_chunks = 0
        self.foreign_error: str | None = None
        self.metrics_down_at: float | None = None
        self.metrics_down_until: float | None = None
        self._down_for: str | None = None  # the target whose k-th event began the outage
        self.metrics_refused = 0
        self._model: str | None = None
        self._anon = 0
        self._tasks: set[asyncio.Task] = set()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True, name=f"proxy-{port}")

    # ------------------------------------------------------------------ what the tests read
    def target_ids(self) -> list[str]:
        return [rid for rid in self.requests if "-target-" in rid]

    def summary(self) -> dict:
        return {"client_gone": self.client_gone, "leaked": list(self.leaked), "passed_on": list(self.passed_on),
                "foreign_sent": self.foreign_sent, "foreign_ids": list(self.foreign_ids),
                "foreign_chunks": self.foreign_chunks, "foreign_error": self.foreign_error,
                "metrics_down_at": self.metrics_down_at, "metrics_down_until": self.metrics_down_until,
                "metrics_refused": self.metrics_refused, "cancels_dropped": list(self.cancels_dropped),
                "cancels_rerouted": list(self.cancels_rerouted),
                "requests": {k: vars(v) for k, v in self.requests.items()}}

    # ------------------------------------------------------------------ decisions
    def _leaks(self, rid: str) -> bool:
        if not self.leak:
            return False
        if self.leak_only is None:
            return True
        return not self.leaked and bool(self.leak_only(rid))

    def _late_for(self, seen: Seen) -> float:
        if self.late_only is not None and f"-{self.late_only}-" not in seen.request_id:
            return 0.0
        return self.late_s

    def _metrics_down(self) -> bool:
        return self.metrics_down_until is not None and time.monotonic() < self.metrics_down_until

    def _maybe_metrics_down(self, seen: Seen) -> None:
        if self.metrics_down is None or self.metrics_down_at is not None or "-target-" not in seen.request_id:
            return
        k, duration_s = self.metrics_down
        if seen.events_down >= k:
            self.metrics_down_at = time.monotonic()
            self.metrics_down_until = self.metrics_down_at + duration_s
            self._down_for = seen.request_id

    def _on_gone(self, seen: Seen) -> None:
        seen.client_gone_at = time.monotonic()
        if self.metrics_down is not None and seen.request_id == self._down_for:
            # the outage lasts past the stop however long the client took to get there
            self.metrics_down_until = max(self.metrics_down_until, seen.client_gone_at + self.metrics_down[1])
        self.client_gone += 1
        if "-target-" not in seen.request_id or self.first_target_gone_at is not None:
            return
        self.first_target_gone_at = seen.client_gone_at
        if self.foreign_after_stop_s is not None:
            self._spawn(self._foreign())
        if self.resubmit_after_gone and seen.sent is not None:
            self._spawn(self._resubmit(seen))

    def _spawn(self, coro) -> asyncio.Task:
        task = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # ------------------------------------------------------------------ the foreign request
    async def _foreign(self) -> None:
        await asyncio.sleep(self.foreign_after_stop_s)
        rid = f"foreign-{uuid.uuid4().hex[:8]}"
        self.foreign_ids.append(rid)
        self.foreign_sent += 1
        self.foreign_sent_at = time.monotonic()
        try:
            async with asyncio.timeout(FOREIGN_DEADLINE_S):
                model = self._model
                if model is None:
                    model = (await self._client.get(self.upstream + "/v1/models")).json()["data"][0]["id"]
                body = {"model": model, "prompt": FOREIGN_PROMPT, "max_tokens": self.foreign_max_tokens,
                        "ignore_eos": True, "stream": True}
                async with self._client.stream("POST", self.upstream + "/v1/completions", json=body,
                                               headers={"X-Request-Id": rid}) as resp:
                    if resp.status_code != 200:
                        self.foreign_error = f"HTTP {resp.status_code}"
                    async for line in resp.aiter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            self.foreign_chunks += 1
            self.foreign_done_at = time.monotonic()
        except (httpx.HTTPError, TimeoutError, ValueError, KeyError, IndexError) as exc:
            self.foreign_error = f"{type(exc).__name__}: {exc}"

    async def _resubmit(self, seen: Seen) -> None:
        """The same request once more, read to its end: a gateway that retries after its client left."""
        method, path, body, fwd = seen.sent
        self.resubmitted.append(seen.request_id)
        try:
            async with asyncio.timeout(FOREIGN_DEADLINE_S):
                async with self._client.stream(method, self.upstream + path, content=body, headers=fwd) as resp:
                    if resp.status_code != 200:
                        self.resubmit_error = f"HTTP {resp.status_code}"
                    async for _ in resp.aiter_raw():
                        pass
            self.resubmit_done_at = time.monotonic()
        except (httpx.HTTPError, TimeoutError) as exc:
            self.resubmit_error = f"{type(exc).__name__}: {exc}"

    # ------------------------------------------------------------------ one connection
    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await self._exchange(reader, writer)
        except asyncio.CancelledError:
            # stop(): the connection goes with the proxy (a cancelled handler task makes asyncio's
            # stream callback raise in 3.11, so the handler ends normally)
            writer.transport.abort()

    async def _exchange(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(HEAD_TIMEOUT_S):
                method, path, headers, body = await read_request(reader)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, TimeoutError, ValueError):
            writer.transport.abort()
            return
        if path.startswith("/metrics") and self._metrics_down():
            self.metrics_refused += 1
            writer.transport.abort()  # no answer at all: the scrape fails as on a dead endpoint
            return
        if method == "POST" and path.startswith("/cancel/") and (self.drop_cancels or self.cancel_upstream):
            await self._cancel_call(path, body, headers, writer)
            return
        rid = headers.get("x-request-id")
        if not rid:
            self._anon += 1
            rid = f"anon-{self._anon}"
        seen = self.requests[rid] = Seen(rid, path, time.monotonic())
        if method == "POST" and path.startswith("/v1/") and self._model is None:
            try:
                self._model = json.loads(body or b"{}").get("model")
            except (ValueError, AttributeError):
                pass
        fwd = {k: v for k, v in headers.items() if k not in HOP_HEADERS}
        # bodies are relayed raw, without their Content-Encoding header: ask upstream for none
        fwd["accept-encoding"] = "identity"
        if self.mint_ids and "x-request-id" in fwd:
            fwd["x-request-id"] = self.minted[rid] = f"gw-{uuid.uuid4().hex[:12]}"
        seen.sent = (method, path, body, fwd)
        try:
            async with asyncio.timeout(REQUEST_DEADLINE_S):
                await self._relay(seen, method, path, body, fwd, reader, writer)
        except TimeoutError:
            seen.errors.append("deadline")
        finally:
            if seen.client_gone_at is not None:
                writer.transport.abort()
            else:
                writer.close()

    async def _cancel_call(self, path: str, body: bytes, headers: dict, writer: asyncio.StreamWriter) -> None:
        if self.drop_cancels:
            status, answer = 200, json.dumps({"result": "cancelled", "status": {}}).encode()
            self.cancels_dropped.append(path)
        else:
            fwd = {k: v for k, v in headers.items() if k not in HOP_HEADERS}
            try:
                resp = await self._client.post(self.cancel_upstream + path, content=body, headers=fwd)
                status, answer = resp.status_code, resp.content
            except httpx.HTTPError as exc:
                status, answer = 502, f"proxy: upstream failed ({type(exc).__name__})".encode()
            self.cancels_rerouted.append((path, status, answer.decode(errors="replace")))
        writer.write(b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                     b"Connection: close\r\n\r\n%s" % (status, b"OK" if status == 200 else b"Error", len(answer),
                                                      answer))
        await writer.drain()
        writer.close()

    async def _relay(self, seen: Seen, method: str, path: str, body: bytes, fwd: dict,
                     reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        queue: asyncio.Queue = asyncio.Queue()
        head: asyncio.Future = self._loop.create_future()

        async def connect() -> httpx.Response:
            retry_until = time.monotonic() + self.retry_upstream_s
            while True:
                try:
                    return await self._client.send(self._client.build_request(
                        method, self.upstream + path, content=body, headers=fwd), stream=True)
                except httpx.ConnectError:
                    if time.monotonic() >= retry_until:
                        raise
                    self.upstream_retries += 1
                    await asyncio.sleep(0.25)

        async def pump() -> None:
            """Upstream at full speed into the queue; cancelled = the upstream stream closed."""
            resp = None
            try:
                resp = await connect()
                seen.status = resp.status_code
                head.set_result(resp)
                async for chunk in resp.aiter_raw():
                    if not chunk:
                        continue
                    seen.chunks_up += 1
                    seen.first_chunk_at = seen.first_chunk_at or time.monotonic()
                    queue.put_nowait((time.monotonic(), chunk))
                seen.upstream_done_at = time.monotonic()
            except asyncio.CancelledError:
                seen.upstream_closed_at = time.monotonic()
                raise
            except Exception as exc:  # noqa: BLE001 - whatever upstream did, the client gets an answer
                seen.errors.append(f"upstream {type(exc).__name__}: {exc}")
                if not head.done():
                    head.set_exception(exc)
            finally:
                if resp is not None:
                    await asyncio.shield(resp.aclose())  # closing the stream is what tells the engine
                queue.put_nowait(None)

        async def deliver() -> None:
            try:
                resp = await head
            except Exception as exc:  # noqa: BLE001 - upstream failed: a 502, as a gateway says it
                msg = f"proxy: upstream failed ({type(exc).__name__})".encode()
                writer.write(b"HTTP/1.1 502 Bad Gateway\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n"
                             b"Connection: close\r\n\r\n%s" % (len(msg), msg))
                await writer.drain()
                return
            ctype = resp.headers.get("content-type", "application/octet-stream")
            # the app's own headers pass (the relay app's X-Relay-Request-Id: the id its cancel call needs)
            own = "".join(f"{k}: {v}\r\n" for k, v in resp.headers.items() if k.lower().startswith("x-"))
            writer.write(f"HTTP/1.1 {resp.status_code} {resp.reason_phrase or 'OK'}\r\nContent-Type: {ctype}\r\n"
                         f"{own}Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n".encode())
            await writer.drain()
            handed = 0.0
            while (item := await queue.get()) is not None:
                arrived, raw = item
                # paced per SSE event: an API server that ran behind sends many events in one read, and
                # handed over at once the client would read them all before any trigger could fire
                late_s = self._late_for(seen)
                for chunk in (_events(raw) if late_s else [raw]):
                    wait = arrived + late_s - time.monotonic()
                    if late_s:
                        wait = max(wait, handed + LATE_PACE_S - time.monotonic())
                    if wait > 0:
                        await asyncio.sleep(wait)
                    if writer.is_closing() or reader.at_eof():
                        raise ConnectionResetError("client went")
                    writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    await writer.drain()
                    handed = time.monotonic()
                    seen.chunks_down += 1
                    seen.events_down += chunk.count(b"data: ")
                    self._maybe_metrics_down(seen)
                    seen.delivered_done = seen.delivered_done or b"data: [DONE]" in chunk
            writer.write(b"0\r\n\r\n")
            await writer.drain()

        pump_task = self._spawn(pump())
        deliver_task = self._spawn(deliver())
        # the client sends nothing more on this connection: a read that ends is the client going
        watch_task = self._spawn(reader.read(1))
        try:
            await asyncio.wait({deliver_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
            # EOF (b"") or a reset: the client went before it had the whole answer
            gone = watch_task.done() and not deliver_task.done()
            if deliver_task.done() and deliver_task.exception() is not None:
                exc = deliver_task.exception()
                if isinstance(exc, (ConnectionError, RuntimeError)):
                    gone = True
                else:
                    seen.errors.append(f"deliver {type(exc).__name__}: {exc}")
            if not gone or seen.delivered_done:
                # a client that closes once it has the end marker finished, it did not go away
                await asyncio.gather(pump_task, return_exceptions=True)
                return
            self._on_gone(seen)
            deliver_task.cancel()
            if not pump_task.done() and self._leaks(seen.request_id):
                # the leak: the client is gone, upstream is still read to its end
                seen.leaked = True
                self.leaked.append(seen.request_id)
                await pump_task
            else:
                if not pump_task.done():
                    self.passed_on.append(seen.request_id)
                pump_task.cancel()
                await asyncio.gather(pump_task, return_exceptions=True)
        finally:
            for t in (pump_task, deliver_task, watch_task):
                t.cancel()
            await asyncio.gather(pump_task, deliver_task, watch_task, return_exceptions=True)

    # ------------------------------------------------------------------ lifecycle
    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(120.0, connect=5.0),
                                         limits=httpx.Limits(max_keepalive_connections=0))
        self._server = self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", self.port))
        self._ready.set()
        self._loop.run_forever()

    def start(self) -> ProxyBehaviour:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError(f"proxy on port {self.port} did not start")
        return self

    def wait_foreign_done(self, timeout_s: float = 60.0) -> bool:
        """Block until the foreign request (if one was sent) has ended."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.foreign_sent and (self.foreign_done_at is not None or self.foreign_error is not None):
                return True
            time.sleep(0.1)
        return False

    def stop(self) -> None:
        async def close():
            self._server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.wait(tasks, timeout=5) if tasks else None
            await self._client.aclose()

        if self._loop.is_running():
            asyncio.run_coroutine_threadsafe(close(), self._loop).result(15)
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        if not self._thread.is_alive():
            self._loop.close()
