"""A loopback HTTP server that serves recorded /metrics bodies (tests/fixtures/vllm/...), for tests
that need a real socket but no engine.

    with MetricsFixtureServer(FIXTURES / "vllm" / "0.32" / "idle.txt") as server:
        VllmMetricsSource(server.url, "t0").sample(0, 0)
        server.paths  # every request path, in order

`GET /metrics` answers the body. `GET /metrics/?name[]=...` (the filtered scrape) answers, by
`filtered`: "serve" (only the lines of the named samples, as prometheus_client's exposition app
does), or an HTTP status code (e.g. 404: a server without that route). Anything else is 404.
The server binds 127.0.0.1 on a free port and runs in daemon threads until `stop()`.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit


def filter_body(body: str, names: set[str]) -> str:
    """The lines of a Prometheus text body whose sample name is in `names`, with the HELP and TYPE
    lines of their families (a family's samples share its name as prefix)."""
    out = []
    for line in body.splitlines():
        if line.startswith("# HELP ") or line.startswith("# TYPE "):
            family = line.split(" ", 3)[2]
            if any(n == family or n.startswith(family + "_") for n in names):
                out.append(line)
        elif line and not line.startswith("#") and line.split("{", 1)[0].split(" ", 1)[0] in names:
            out.append(line)
    return "\n".join(out) + "\n"


class MetricsFixtureServer:
    def __init__(self, body: str | Path, filtered: str | int = "serve", version: str = "0.32.0",
                 require_auth: str | None = None):
        self.body = body.read_text() if isinstance(body, Path) else body
        self.require_auth = require_auth  # an Authorization value every request must carry, else 401
        self.auths: list[str | None] = []  # the Authorization header of every request, in order
        self.filtered = filtered
        self.version = version
        self.paths: list[str] = []
        self._lock = threading.Lock()
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._gone = False

    @property
    def url(self) -> str:
        assert self._httpd is not None, "not started"
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def answer(self, path: str) -> tuple[int, str]:
        parts = urlsplit(path)
        if parts.path == "/metrics" and not parts.query:
            return 200, self.body
        if parts.path == "/metrics/":
            if self.filtered != "serve":
                return int(self.filtered), "not here\n"
            names = set(parse_qs(parts.query).get("name[]", []))
            return 200, filter_body(self.body, names) if names else self.body
        if parts.path == "/version":
            return 200, '{"version": "%s"}\n' % self.version
        return 404, "not found\n"

    def start(self) -> MetricsFixtureServer:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # kept-alive connections, like uvicorn's

            def do_GET(self):  # noqa: N802 - http.server's name
                if server._gone:  # stopped: a kept-alive connection gets no answer, as from a dead server
                    self.close_connection = True
                    return
                auth = self.headers.get("Authorization")
                with server._lock:
                    server.paths.append(self.path)
                    server.auths.append(auth)
                if server.require_auth is not None and auth != server.require_auth:
                    status, text = 401, "unauthorized\n"
                else:
                    status, text = server.answer(self.path)
                data = text.encode()
                self.send_response(status)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):  # quiet
                pass

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="metrics-fixture-server", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._gone = True
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._thread.join(5)
            self._httpd = None

    def __enter__(self) -> MetricsFixtureServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
