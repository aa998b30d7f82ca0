"""A loopback proxy in front of a real engine's /metrics that can be told to misbehave.

It forwards the real body, and on the requests a test chooses answers 500, garbage or a body cut
in half (inside a line); `down()` closes its socket (connection refused) until `up()`.
"""

from __future__ import annotations

import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx


class MetricsProxy:
    def __init__(self, upstream: str, port: int, faults: dict[int, str] | None = None):
        self.upstream = upstream.rstrip("/")
        self.port = port
        self.faults = dict(faults or {})  # request index -> "500" | "garbage" | "truncated"
        self.count = 0
        self.served: dict[str, int] = {}
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._client = httpx.Client(timeout=5.0)
        self._connections: set = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _handler(self):
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def setup(self):
                super().setup()
                proxy._connections.add(self.connection)

            def finish(self):
                proxy._connections.discard(self.connection)
                super().finish()

            def _send(self, code: int, body: bytes):
                self.send_response(code)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                with proxy._lock:
                    index = proxy.count
                    proxy.count += 1
                fault = proxy.faults.get(index, "ok") if self.path.startswith("/metrics") else "ok"
                with proxy._lock:
                    proxy.served[fault] = proxy.served.get(fault, 0) + 1
                if fault == "500":
                    return self._send(500, b"Internal Server Error\n")
                upstream = proxy._client.get(proxy.upstream + self.path)
                body = upstream.content
                if fault == "garbage":
                    body = b"vllm:num_requests_running{engine=\"0\" \x00\xff garbage {{{\n" * 5
                elif fault == "truncated":
                    # cut inside a line: a body cut just after a newline is a shorter, valid exposition that
                    # no reader can tell from a whole one (text format 0.0.4 has no end marker), and an idle
                    # engine's body is the same length each time, so a cut at half could land there every time
                    cut = len(body) // 2
                    while cut > 1 and body[cut - 1:cut] == b"\n":
                        cut -= 1
                    body = body[:cut]
                self._send(upstream.status_code, body)

        return Handler

    def up(self) -> None:
        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), self._handler())
        self._server.daemon_threads = True
        # a short poll: down() waits for the serving loop to notice, and the test times the outage from it
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True)
        self._thread.start()

    def down(self) -> None:
        """Stop listening and drop kept-alive connections, as a server that went away would."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        for conn in list(self._connections):
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self.down()
        self._client.close()
