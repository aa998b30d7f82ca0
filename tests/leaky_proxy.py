"""A test-only HTTP proxy that forwards to the engine but keeps reading upstream after its client
disconnects: the lost cancel of a gateway that never passes the disconnect on. With `hold_s`, a request
whose body holds `hold_if` is sent on only that long after it came (a hop, or a starved API server, that
gets a request to the engine seconds late: CI saw over 5 s); `held` names them (X-Request-Id), and
`upstream_done` says when the engine's answer to each request was read to its end (time.monotonic()).
"""

from __future__ import annotations

import asyncio
import threading
import time

import httpx

HOP_HEADERS = {"host", "content-length", "connection", "transfer-encoding", "accept-encoding"}


async def read_request(reader: asyncio.StreamReader) -> tuple[str, str, dict[str, str], bytes]:
    """(method, path, lower-cased headers, body) of one HTTP/1.1 request off the socket."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    method, path, _ = lines[0].split(" ", 2)
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            headers[k.strip().lower()] = v.strip()
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return method, path, headers, body


class LeakyProxy:
    def __init__(self, upstream: str, port: int, hold_s: float = 0.0, hold_if: bytes = b""):
        self.upstream = upstream.rstrip("/")
        self.port = port
        self.hold_s, self.hold_if = hold_s, hold_if
        self.held: list[str] = []
        self.upstream_done: dict[str, float] = {}
        self.url = f"http://127.0.0.1:{port}"
        self.client_gone = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            method, path, headers, body = await read_request(reader)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            writer.close()
            return
        fwd = {k: v for k, v in headers.items() if k not in HOP_HEADERS}
        rid = headers.get("x-request-id", "")
        if self.hold_s and self.hold_if and self.hold_if in body:
            self.held.append(rid)
            await asyncio.sleep(self.hold_s)
        gone = False
        if True:
            async with self._client.stream(method, self.upstream + path, content=body, headers=fwd) as resp:
                ctype = resp.headers.get("content-type", "application/octet-stream")
                writer.write(f"HTTP/1.1 {resp.status_code} OK\r\nContent-Type: {ctype}\r\n"
                             "Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n".encode())
                async for chunk in resp.aiter_raw():
                    if gone or not chunk:
                        continue  # the leak: the client is gone, upstream keeps being read to the end
                    try:
                        writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                        await writer.drain()
                        if writer.is_closing() or reader.at_eof():
                            raise ConnectionResetError
                    except (ConnectionError, RuntimeError):
                        gone = True
                        self.client_gone += 1
            self.upstream_done[rid] = time.monotonic()
        try:
            if not gone:
                writer.write(b"0\r\n\r\n")
                await writer.drain()
            writer.close()
        except (ConnectionError, RuntimeError):
            pass

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        # one client for all requests: building one per request (SSL context, pool) blocks the loop
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=httpx.Limits(max_keepalive_connections=0))
        self._server = self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", self.port))
        self._ready.set()
        self._loop.run_forever()

    def start(self) -> "LeakyProxy":
        self._thread.start()
        self._ready.wait(10)
        return self

    def stop(self) -> None:
        async def close():
            self._server.close()
            await self._client.aclose()

        if self._loop.is_running():
            asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
