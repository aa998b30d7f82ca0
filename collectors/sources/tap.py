"""A transparent tap in front of one component of the path (a gateway, an app, the engine): a byte relay
that records, per connection, what crossed it and who closed which side, how and when.

HTTP/1.1 has no per-request cancel: a hop passes a cancel on only by closing (FIN) or resetting (RST) its
upstream connection before the response ended. So the tap keeps close semantics exactly: bytes pass
unchanged both ways as soon as they are read (backpressure is the socket's own), a half-close from one
side is a half-close to the other at once, a reset is a reset (SO_LINGER 0). A tap built on an HTTP
framework would change what it measures (it buffers, or answers a disconnect itself), so HTTP is only
read, passively, with h11: the request heads (method, path, `X-Request-Id`; each request on a kept-alive
connection apart) and where each response starts and ends. Bytes that are not HTTP/1.1 (TLS, HTTP/2,
an upgraded connection) still pass untouched; the connection is marked unparsed, with why.

The relay runs on its own event loop in a thread of the recorder, on the recorder's monotonic clock. It
is a source: the sampler reads its connection counts, and its events (kinds `tap_*`, runstore/event_kinds.py)
are handed over by `take_events()` like the engine log's.
"""

from __future__ import annotations

import asyncio
import errno
import json
import math
import re
import socket
import struct
import threading
import time
import uuid
from dataclasses import dataclass
from urllib.parse import urlparse

import h11

from cancelwatch.collectors.sources.base import Source
from cancelwatch.runstore.records import EventRecord, Sample

SOURCE_NAME = "tap"
READ_BYTES = 64 * 1024
UPSTREAM_CONNECT_S = 5.0
REFUSE_READ_S = 1.0  # a connection past the bound: how long its first bytes are waited for, and its 503 written
ENCRYPTED = "encrypted: no request id"
BODY_BYTES = 64 * 1024  # a request body read for what it asks (model, stream, max_tokens, n), at most
_SSE_DONE = b"\ndata: [DONE]"
# a choice's last chunk: its finish_reason a non-empty string, not null (vLLM writes no spaces; a gateway that
# re-serialises the JSON may). A client may close once every choice has one, before `data: [DONE]` passes: it read
# the answer whole
_FINISHED = re.compile(rb'"finish_reason"\s*:\s*"[^"]')
LINE_BYTES = 256 * 1024  # an SSE line longer than this is not read for its finish_reason (the stream then ends at [DONE])
_REQUEST_LINE = re.compile(rb"[A-Z]+ \S+ HTTP/1\.[01]")  # the first line of a head an id may be added to


def request_doc(body: bytes) -> dict | None:
    """An OpenAI-style request body as JSON; None for one that is not a JSON object (or cut at BODY_BYTES)."""
    try:
        doc = json.loads(body) if body else None
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


# where a page reports its user's Stop (the chat page of collectors/engines/apps.py posts here, and the app answers
# it): a tap on the way reads the report as evidence (analysis/page_stops.py)
PAGE_STOP_PATH = "/cancelwatch/stop"
# where an app reports that its client left before the answer's end (collectors/engines/apps.py posts it upstream,
# toward the engine, which need not answer it): a tap behind the app reads the app's own word on its receipt
APP_RECEIPT_PATH = "/cancelwatch/received"
# each report a tap reads: its path -> the event kind it writes and the field holding the instant reported
REPORTS = {PAGE_STOP_PATH: ("page_stop", "clicked_wall_ms"), APP_RECEIPT_PATH: ("app_receipt", "received_wall_ms")}
PAGE_TEXT = 200  # a report's ids, at most this many characters each


def page_report(doc: dict | None, at: str = "clicked_wall_ms") -> dict:
    """What a report (request_doc of its body) says: the request it names, the page's task id, the reported
    instant (`at`: a page's click, an app's receipt) and the report's sending, wall times on the reporter's clock
    (ms since 1970); `why` where it cannot be read."""
    if doc is None:
        return {"why": "not a JSON object"}

    def text(key):
        v = doc.get(key)
        return v[:PAGE_TEXT] if isinstance(v, str) else None

    def ms(key):  # a finite float (an int too large for one, NaN or a bool is no time)
        v = doc.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return None
        try:
            v = float(v)
        except OverflowError:
            return None
        return v if math.isfinite(v) else None
    return {"named": text("request_id"), "task_id": text("task_id"), at: ms(at), "sent_wall_ms": ms("sent_wall_ms")}


def asked_for(doc: dict | None) -> dict:
    """What a request body (request_doc) asks of the engine: model, stream, max_tokens (or max_completion_tokens),
    n; None for each it does not say."""
    out = {"model": None, "stream": None, "max_tokens": None, "n": None}
    if doc is None:
        return out
    maxt = doc.get("max_tokens", doc.get("max_completion_tokens"))
    out.update(model=doc.get("model") if isinstance(doc.get("model"), str) else None,
               stream=doc.get("stream") if isinstance(doc.get("stream"), bool) else None,
               max_tokens=maxt if isinstance(maxt, int) and not isinstance(maxt, bool) else None,
               n=doc.get("n") if isinstance(doc.get("n"), int) and not isinstance(doc.get("n"), bool) else None)
    if out["model"] is not None:
        out["model"] = out["model"][:200]
    return out


def choices_asked(doc: dict | None) -> int | None:
    """How many choices the answer to a request body (request_doc) holds: its n (1 unless it says), times the prompts
    of a batched completion (`prompt` a list of strings or of token lists); None where that cannot be told (no body
    read, an n that is not a whole number)."""
    if doc is None:
        return None
    n = doc.get("n", 1)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        return None
    prompt = doc.get("prompt")
    batch = isinstance(prompt, list) and bool(prompt) and all(isinstance(p, (str, list)) for p in prompt)
    return n * len(prompt) if batch else n


def finished_choices(line: bytes) -> set[int]:
    """The choices an SSE `data:` line ends (a non-empty finish_reason), by index; read only where the line names one
    (the last chunk of each choice)."""
    if not line.startswith(b"data:") or not _FINISHED.search(line):
        return set()
    try:
        doc = json.loads(line[5:])
    except ValueError:
        return set()
    out = set()
    for choice in (doc.get("choices") or []) if isinstance(doc, dict) else []:
        if isinstance(choice, dict) and isinstance(choice.get("index"), int) and choice.get("finish_reason") \
                and isinstance(choice.get("finish_reason"), str):
            out.add(choice["index"])
    return out


class TapError(Exception):
    """A tap that cannot be set up (bad --hop, address in use, upstream silent): one line, names the fix."""


@dataclass(frozen=True)
class Hop:
    """One tap: `name` is the component it feeds (its upstream), `listen` where the previous component
    (or the client) connects, `upstream` the component's own address."""

    name: str
    listen_host: str
    listen_port: int
    upstream: str  # the URL as given, without credentials
    upstream_host: str
    upstream_port: int

    @property
    def listen_url(self) -> str:
        return f"http://{self.listen_host}:{self.listen_port}"


def parse_hop(value: str) -> Hop:
    """`NAME=LISTEN,UPSTREAM_URL` (LISTEN: `[HOST:]PORT`, 127.0.0.1 unless told) -> Hop; TapError names the fix."""
    example = "e.g. --hop nginx=127.0.0.1:9001,http://127.0.0.1:8080"
    name, eq, rest = value.partition("=")
    listen, comma, upstream = rest.partition(",")
    if not eq or not comma or not name.strip() or not listen.strip() or not upstream.strip():
        raise TapError(f"--hop {value!r} is not NAME=LISTEN,UPSTREAM_URL: {example}")
    name = name.strip()
    if not all(ch.isalnum() or ch in "-_." for ch in name):
        raise TapError(f"--hop name {name!r}: use letters, digits, '-', '_' or '.' ({example})")
    host, _, port = listen.strip().rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise TapError(f"--hop {name}: listen address {listen!r} has no port: {example}")
    u = urlparse(upstream.strip())
    if u.scheme not in ("http", "https") or not u.hostname:
        raise TapError(f"--hop {name}: upstream {upstream!r} is not an http(s) URL: {example}")
    uport = u.port or (443 if u.scheme == "https" else 80)
    clean = f"{u.scheme}://{u.hostname}:{uport}{u.path.rstrip('/')}"
    return Hop(name, host, int(port), clean, u.hostname, uport)


def check_chain(hops: list[Hop]) -> None:
    """Hops in order from the client form a chain: names and listen addresses unique, no tap feeding itself,
    none feeding a tap nearer the client (a loop). TapError names the hop."""
    names = [h.name for h in hops]
    if len(set(names)) != len(names):
        raise TapError(f"--hop names must be unique, got {names}: name each tap for the component it feeds")
    listens = {}
    for i, h in enumerate(hops):
        key = (h.listen_host, h.listen_port)
        if key in listens:
            raise TapError(f"--hop {h.name} listens on {h.listen_host}:{h.listen_port} like {listens[key]}: "
                           "give each tap its own port")
        listens[key] = h.name
    for i, h in enumerate(hops):
        for j, other in enumerate(hops[: i + 1]):
            if (h.upstream_host, h.upstream_port) == (other.listen_host, other.listen_port):
                where = "itself" if i == j else f"tap {other.name}, nearer the client"
                raise TapError(f"--hop {h.name}: its upstream {h.upstream} is {where}: the hops do not form a "
                               "chain (list them in order from the client, each upstream a component)")


def _rst(writer: asyncio.StreamWriter | None) -> None:
    """Close with a reset, as the peer did: SO_LINGER 0 makes close() send RST, not FIN."""
    if writer is None or writer.transport.is_closing():
        return
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    writer.transport.abort()


TCP_CLOSE = 7  # tcp_info's tcpi_state of a socket its peer reset (linux/tcp_states.h)
FIN_PROBE_S = 0.2  # how long a connection whose client sent a FIN is watched for the reset of a closed socket


async def _reset_after_fin(writer: asyncio.StreamWriter) -> bool:
    """After a client's FIN, whether it had closed its socket (not only its sending side): the bytes the tap
    passed it after the FIN then meet a reset from its kernel, which leaves its error on the tap's socket.
    Watched for up to FIN_PROBE_S (a read says nothing here: after a FIN it gives b"" even past a reset)."""
    sock = writer.get_extra_info("socket")
    if sock is None:
        return False
    deadline = time.monotonic() + FIN_PROBE_S
    while True:
        try:
            if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) in (errno.ECONNRESET, errno.EPIPE):
                return True
            state = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0]
        except OSError:
            return False
        if state == TCP_CLOSE or time.monotonic() >= deadline:
            return False  # closed in order both ways (its error would have shown), or still reading
        await asyncio.sleep(0.01)


class _Http:
    """Passive HTTP/1.1 reading of one connection: h11 as the server side for what the client sends and
    as the client side for what comes back (fed the same requests), so that each request on a kept-alive
    connection and the end of each response are known. Never changes a byte; on anything h11 cannot
    read, `broken` says why and reading stops."""

    def __init__(self):
        self.req = h11.Connection(h11.SERVER)
        self.resp = h11.Connection(h11.CLIENT)
        self.broken: str | None = None
        self.first = True
        self.seq = -1  # the latest request seen
        self.ids: dict[int, str | None] = {}  # seq -> its X-Request-Id
        self.answered = -1  # the latest request whose response started
        self.ended = -1  # the latest request whose response ended
        # seq -> [first body byte's mono ns or None, SSE data events, whether the answer passed whole (`data: [DONE]`,
        # or a finish_reason for each of its choices), the indices of the choices finished]
        self.body: dict[int, list] = {}
        self.choices: dict[int, int | None] = {}  # seq -> the choices its answer holds (choices_asked)
        self.reports: dict[int, str | None] = {}  # seq -> the report it is (a REPORTS path), None: no report
        self._line = b""  # the response's SSE line still being read (its finish_reason is read once it is whole)
        self._request_body = bytearray()  # the body of the request being read, up to BODY_BYTES
        self._sse_tail = b""  # the end of the last response chunk: an SSE line split between two reads
        self.now = 0  # the instant of the bytes being read (the tap's clock), set by the tap

    def body_of(self, seq: int | None) -> dict:
        """What passed of a request's response body: `first_body_mono_ns`, `chunks` (SSE data events, a token
        each on a stream; `[DONE]` not counted) and `sse_done` (the stream's `data: [DONE]` passed, or a chunk with
        a finish_reason for each of its choices: the answer whole)."""
        first, chunks, done, _ = self.body.get(seq, (None, 0, False, None)) if seq is not None else (None, 0, False, None)
        return {"first_body_mono_ns": first, "chunks": chunks, "sse_done": done}

    def open_seq(self) -> int | None:
        """The request whose response has not ended, if any."""
        return self.seq if self.seq > self.ended else None

    def client_bytes(self, data: bytes) -> list[tuple[str, dict]]:
        if self.broken:
            return []
        first, self.first = self.first, False
        if first and data[:1] == b"\x16":  # a TLS handshake record: nothing in it to read
            return self._broke(ENCRYPTED)
        try:
            self.req.receive_data(data)
            return self._requests()
        except h11.ProtocolError as exc:
            return self._broke(f"not HTTP/1.1 from the client ({exc})")

    def client_eof(self) -> None:
        if not self.broken:
            try:
                self.req.receive_data(b"")
            except h11.ProtocolError:
                pass

    def upstream_bytes(self, data: bytes) -> list[tuple[str, dict]]:
        if self.broken:
            return []
        try:
            self.resp.receive_data(data)
            return self._responses()
        except h11.ProtocolError as exc:
            return self._broke(f"not HTTP/1.1 from upstream ({exc})")

    def upstream_eof(self) -> list[tuple[str, dict]]:
        """Upstream closed: a response read to the close (no length given) ends here."""
        if self.broken:
            return []
        try:
            self.resp.receive_data(b"")
            return self._responses()
        except h11.ProtocolError:
            return []

    def _broke(self, why: str) -> list[tuple[str, dict]]:
        self.broken = why
        return [("unparsed", {"why": why})]

    def _requests(self) -> list[tuple[str, dict]]:
        out = []
        while True:
            ev = self.req.next_event()
            if ev is h11.NEED_DATA or ev is h11.PAUSED or isinstance(ev, h11.ConnectionClosed):
                return out
            if isinstance(ev, h11.Request):
                self.seq += 1
                headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in ev.headers}
                rid = headers.get("x-request-id")
                self.ids[self.seq] = rid
                route = ev.target.split(b"?")[0].decode("latin-1")
                self.reports[self.seq] = route if ev.method == b"POST" and route in REPORTS else None
                self.reports.pop(self.seq - 8, None)
                # h11 sends HTTP/1.1 only: an HTTP/1.0 request (nginx's default upstream) is fed to the response
                # side as 1.1 closing the connection, which is how a 1.0 exchange is framed
                fed = [(k, v) for k, v in ev.headers if k != b"connection"] + [(b"connection", b"close")] \
                    if ev.http_version == b"1.0" else list(ev.headers)
                if not any(k == b"host" for k, _ in fed):
                    fed.append((b"host", b"unknown"))
                self.resp.send(h11.Request(method=ev.method, target=ev.target, headers=fed))
                out.append(("request", {"seq": self.seq, "method": ev.method.decode("latin-1"),
                                        "path": ev.target.decode("latin-1")[:200], "request_id": rid}))
            elif isinstance(ev, h11.Data):
                self.resp.send(h11.Data(data=ev.data))
                if len(self._request_body) < BODY_BYTES:
                    self._request_body += ev.data[: BODY_BYTES - len(self._request_body)]
            elif isinstance(ev, h11.EndOfMessage):
                self.resp.send(h11.EndOfMessage())
                doc = request_doc(bytes(self._request_body))
                self.choices[self.seq] = choices_asked(doc) if len(self._request_body) < BODY_BYTES else None
                self.choices.pop(self.seq - 8, None)
                out.append(("request_body", {"seq": self.seq, "request_id": self.ids.get(self.seq), **asked_for(doc)}))
                if self.reports.get(self.seq):
                    kind, at = REPORTS[self.reports[self.seq]]
                    out.append((kind, {"seq": self.seq, **page_report(
                        doc if len(self._request_body) < BODY_BYTES else None, at)}))
                self._request_body = bytearray()

    def _responses(self) -> list[tuple[str, dict]]:
        out = []
        while True:
            ev = self.resp.next_event()
            if ev is h11.NEED_DATA or ev is h11.PAUSED or isinstance(ev, h11.ConnectionClosed):
                return out
            if isinstance(ev, h11.Response):
                self.answered = self.seq
                self.body[self.seq] = [None, 0, False, set()]
                self._sse_tail = b"\n"  # the body starts a line
                self._line = b""
                self.body.pop(self.seq - 8, None)  # a kept-alive connection's old requests: bounded
                out.append(("response", {"seq": self.seq, "status": ev.status_code,
                                         "request_id": self.ids.get(self.seq)}))
            elif isinstance(ev, h11.Data):
                stats = self.body.setdefault(self.seq, [None, 0, False, set()])
                if stats[0] is None and ev.data:
                    stats[0] = self.now
                events, done = self._sse_events(bytes(ev.data))
                stats[1] += events
                stats[3] |= self._finished(bytes(ev.data))
                expected = self.choices.get(self.seq)
                stats[2] = stats[2] or done or (expected is not None and stats[3] >= set(range(expected)))
            elif isinstance(ev, h11.InformationalResponse) and ev.status_code == 101:
                return out + self._broke("switched protocols (an upgrade): no further request ids")
            elif isinstance(ev, h11.EndOfMessage):
                self.ended = self.seq
                out.append(("end", {"seq": self.seq, "request_id": self.ids.get(self.seq),
                                    **self.body_of(self.seq)}))
                if self._next_cycle():
                    out += self._requests()  # a request the client sent on before this response ended

    def _finished(self, data: bytes) -> set[int]:
        """The choices whose last chunk (finished_choices) ends in `data`: whole lines only, the one still being read
        kept for the next read (dropped past LINE_BYTES)."""
        if b"\n" not in data:
            self._line = self._line + data if len(self._line) + len(data) <= LINE_BYTES else b""
            return set()
        *lines, rest = (self._line + data).split(b"\n")
        self._line = rest if len(rest) <= LINE_BYTES else b""
        out: set[int] = set()
        for line in lines:
            out |= finished_choices(line.rstrip(b"\r"))
        return out

    def _sse_events(self, data: bytes) -> tuple[int, bool]:
        """SSE data events that end in `data` (a token each on a stream): `data:` at a line's start, less
        `data: [DONE]`; the tail of the last read kept, so an event split between two reads counts once. And whether
        `data: [DONE]` ends in it: the stream's last event, the answer whole."""
        text = self._sse_tail + data
        skip = len(self._sse_tail)
        def new(pattern: bytes) -> int:  # occurrences that end in `data`: the tail's were counted before
            n, at = 0, text.find(pattern)
            while at >= 0:
                n += at + len(pattern) > skip
                at = text.find(pattern, at + 1)
            return n

        self._sse_tail = text[-(len(_SSE_DONE) - 1):]
        done = new(_SSE_DONE)
        return new(b"\ndata:") - done, done > 0

    def _next_cycle(self) -> bool:
        """Both messages of the exchange are done and the connection is kept alive: read the next one."""
        if not (self.req.their_state is h11.DONE and self.resp.our_state is h11.DONE
                and self.resp.their_state is h11.DONE):
            return False
        if self.req.our_state is h11.SEND_RESPONSE:
            # the server side of the reading never answers (the real upstream did): its response is
            # marked sent, so that h11 reads the next request
            self.req.send(h11.Response(status_code=200, headers=[("content-length", "0")]))
            self.req.send(h11.EndOfMessage())
        if self.req.our_state is not h11.DONE:
            return False  # the exchange ends the connection (HTTP/1.0, Connection: close)
        self.req.start_next_cycle()
        self.resp.start_next_cycle()
        return True


class _Flow:
    """One connection through the tap: its two sockets, its HTTP reading, and which side closed how."""

    def __init__(self, conn: int, client_w: asyncio.StreamWriter):
        self.conn = conn
        self.client_w = client_w
        self.upstream_w: asyncio.StreamWriter | None = None
        self.http = _Http()
        self.closed: dict[str, str] = {}  # side -> fin | rst, as the tap saw it
        self.reset_by_tap: set[str] = set()  # sides the tap reset on the other's behalf
        self.held = bytearray()  # a request head not yet whole, held to add its X-Request-Id
        # after the client's FIN: whether its socket turned out gone (a write met its reset) or was only
        # half-closed, still reading (None: not known)
        self.client_gone: bool | None = None


class TapSource(Source):
    """The tap of one hop; `start()` binds it (TapError when the address is taken), `close()` ends it."""

    name = SOURCE_NAME
    critical = False

    def __init__(self, hop: Hop, clock=time.monotonic_ns, request_ids: str | None = None,
                 max_connections: int | None = None):
        """`request_ids`: a prefix; when given, a request that comes without an X-Request-Id gets one
        (`<prefix><n>-<8 hex>`), so that the engine's log names it. None: bytes pass unchanged.
        `max_connections`: past this many open at once, a new connection is answered 503 by the tap itself
        and never reaches the upstream (a flood must not take the watch's memory, nor the engine); None:
        no bound (a hop of `record`, whose traffic the run makes)."""
        self.hop = hop
        self.request_ids = request_ids
        self.max_connections = max_connections
        self._refused = 0
        self._ids_added = 0
        self.target = hop.name
        self._clock = clock
        self._events: list[EventRecord] = []
        self._lock = threading.Lock()
        self._conns = 0
        self._open = 0
        self._requests = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.AbstractServer | None = None
        self._flows: set[_Flow] = set()

    # ------------------------------------------------------------------ the source
    def check(self) -> str | None:
        """None when the hop's upstream accepts a connection now; else one line naming the fix."""
        try:
            with socket.create_connection((self.hop.upstream_host, self.hop.upstream_port), timeout=2.0):
                return None
        except OSError as exc:
            return (f"--hop {self.hop.name}: its upstream {self.hop.upstream} does not answer "
                    f"({exc.strerror or exc}): start {self.hop.name} first, or fix the hop's UPSTREAM_URL")

    def sample(self, wall_ns: int, mono_ns: int) -> list[Sample]:
        return [Sample(self.name, "tap_connections_open", float(self._open), (), wall_ns, mono_ns),
                Sample(self.name, "tap_requests_total", float(self._requests), (), wall_ns, mono_ns),
                Sample(self.name, "tap_refused_total", float(self._refused), (), wall_ns, mono_ns)]

    def take_events(self) -> list[EventRecord]:
        with self._lock:
            out, self._events = self._events, []
        return out

    def start(self) -> TapSource:
        sock = socket.socket(socket.AF_INET6 if ":" in self.hop.listen_host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.hop.listen_host, self.hop.listen_port))
            sock.listen(256)
        except OSError as exc:
            sock.close()
            why = "in use" if exc.errno == errno.EADDRINUSE else (exc.strerror or str(exc))
            raise TapError(f"--hop {self.hop.name}: cannot listen on {self.hop.listen_host}:{self.hop.listen_port} "
                           f"({why}): pick a free port") from None
        sock.setblocking(False)
        ready = threading.Event()
        self._loop = asyncio.new_event_loop()

        def serve() -> None:
            asyncio.set_event_loop(self._loop)
            self._server = self._loop.run_until_complete(
                asyncio.start_server(self._handle, sock=sock, limit=READ_BYTES))
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=serve, name=f"tap-{self.hop.name}", daemon=True)
        self._thread.start()
        ready.wait(10)
        return self

    def close(self) -> None:
        """Stop listening; connections still open are reset (the recording is over)."""
        loop = self._loop
        if loop is None or not loop.is_running():
            return

        async def shut() -> None:
            if self._server is not None:
                self._server.close()
            for f in list(self._flows):
                f.reset_by_tap |= {"client", "upstream"}  # the recording's end, not either side's doing
                _rst(f.client_w)
                _rst(f.upstream_w)
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            if tasks:
                await asyncio.wait(tasks, timeout=2)

        try:
            asyncio.run_coroutine_threadsafe(shut(), loop).result(5)
        except Exception:  # noqa: BLE001 - closing: nothing more to record
            pass
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(5)
        if not loop.is_running():
            loop.close()

    # ------------------------------------------------------------------ one connection
    def _event(self, kind: str, flow: _Flow, at_ns: int, request_id: str | None = None, **data) -> None:
        self._record(kind, flow.conn, at_ns, request_id, **data)

    def _record(self, kind: str, conn: int, at_ns: int, request_id: str | None = None, **data) -> None:
        """One event of connection `conn` (a refused one has no flow)."""
        wall = time.time_ns() - (self._clock() - at_ns)
        with self._lock:
            self._events.append(EventRecord(kind=kind, wall_ns=wall, mono_ns=at_ns, request_id=request_id,
                                            data={"hop": self.hop.name, "conn": conn, **data}))

    def _http_events(self, flow: _Flow, at_ns: int, found: list[tuple[str, dict]]) -> None:
        """What the HTTP reading found, as events (the row's request id: the request's X-Request-Id)."""
        for what, d in found:
            if what == "request":
                self._requests += 1
                self._event("tap_request", flow, at_ns, d["request_id"], seq=d["seq"], method=d["method"],
                            path=d["path"])
            elif what == "response":
                self._event("tap_response", flow, at_ns, d["request_id"], seq=d["seq"], status=d["status"])
            elif what == "end":
                self._event("tap_response_end", flow, at_ns, d["request_id"], seq=d["seq"],
                            chunks=d["chunks"], first_body_mono_ns=d["first_body_mono_ns"], sse_done=d["sse_done"])
            elif what == "request_body":
                self._event("tap_request_body", flow, at_ns, d["request_id"], seq=d["seq"], model=d["model"],
                            stream=d["stream"], max_tokens=d["max_tokens"], n=d["n"])
            elif what == "page_stop":
                self._event("page_stop", flow, at_ns, d.get("named"), seq=d["seq"], task_id=d.get("task_id"),
                            clicked_wall_ms=d.get("clicked_wall_ms"), sent_wall_ms=d.get("sent_wall_ms"),
                            why=d.get("why"))
            elif what == "app_receipt":
                self._event("app_receipt", flow, at_ns, d.get("named"), seq=d["seq"],
                            received_wall_ms=d.get("received_wall_ms"), sent_wall_ms=d.get("sent_wall_ms"),
                            why=d.get("why"))
            else:
                self._event("tap_unparsed", flow, at_ns, why=d["why"])

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._conns += 1
        if self.max_connections is not None and self._open >= self.max_connections:
            await self._refuse(self._conns, reader, writer)
            return
        flow = _Flow(self._conns, writer)
        self._flows.add(flow)
        self._open += 1
        self._event("tap_accepted", flow, self._clock())
        try:
            try:
                up_r, up_w = await asyncio.wait_for(
                    asyncio.open_connection(self.hop.upstream_host, self.hop.upstream_port, limit=READ_BYTES),
                    UPSTREAM_CONNECT_S)
            except (OSError, TimeoutError) as exc:
                # the client gets the refusal as it was: its connection is reset
                self._event("tap_upstream_failed", flow, self._clock(), why=f"{type(exc).__name__}: {exc}"[:200])
                _rst(writer)
                return
            flow.upstream_w = up_w
            await asyncio.gather(self._pump(flow, reader, up_w, "client"), self._pump(flow, up_r, writer, "upstream"))
        finally:
            self._open -= 1
            self._flows.discard(flow)
            if flow.closed.get("client") == "fin" and flow.client_gone is None and "client" not in flow.reset_by_tap:
                flow.client_gone = await _reset_after_fin(writer)
            seq = flow.http.open_seq()
            body = flow.http.body_of(seq)
            self._event("tap_connection_end", flow, self._clock(), flow.http.ids.get(seq) if seq is not None else None,
                        open_seq=seq, closed=dict(flow.closed), by_tap=sorted(flow.reset_by_tap),
                        client_gone=flow.client_gone, chunks=body["chunks"],
                        first_body_mono_ns=body["first_body_mono_ns"], sse_done=body["sse_done"])
            for w in (writer, flow.upstream_w):
                if w is not None and not w.transport.is_closing():
                    w.transport.close()

    async def _refuse(self, conn: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A connection past the bound: answered 503 by the tap (Retry-After, Connection: close), recorded,
        closed. What the client sent first is read (briefly): closing on unread bytes would reset the
        connection before the client read the answer."""
        self._refused += 1
        self._record("tap_refused", conn, self._clock(), open=self._open)
        body = (f"cancelwatch: {self._open} connections open through this tap, its bound "
                f"(--max-connections); try again\n").encode()
        try:
            await asyncio.wait_for(reader.read(READ_BYTES), REFUSE_READ_S)
        except (TimeoutError, ConnectionError, OSError):
            pass
        try:
            writer.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\nRetry-After: 1\r\n"
                         b"Connection: close\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            await asyncio.wait_for(writer.drain(), REFUSE_READ_S)
        except (TimeoutError, ConnectionError, OSError):
            pass
        writer.transport.close()

    async def _pump(self, flow: _Flow, reader: asyncio.StreamReader, out: asyncio.StreamWriter, side: str) -> None:
        """One direction, bytes as they come; `side` is who sends them (client or upstream)."""
        other = "upstream" if side == "client" else "client"
        while True:
            try:
                data = await reader.read(READ_BYTES)
            except (ConnectionError, OSError):
                if side not in flow.reset_by_tap:  # not the tap's own reset of that side
                    self._closed(flow, side, "rst", out, other)
                return
            now = self._clock()
            if not data and side == "client" and flow.held:
                data, flow.held = bytes(flow.held), bytearray()  # a head cut short by the close: as it came
                self._http_events(flow, now, flow.http.client_bytes(data))
                try:
                    out.write(data)
                except (ConnectionError, OSError, RuntimeError):
                    pass
                data = b""
            if not data:
                if side in flow.reset_by_tap:
                    return  # the tap reset it on the other side's behalf: nothing came from this side
                self._closed(flow, side, "fin", out, other)
                return
            if side == "client":
                if self.request_ids is not None:
                    data = self._with_request_id(flow, data)
                    if not data:
                        continue  # a request head still coming in: held until it is whole
                self._http_events(flow, now, flow.http.client_bytes(data))
            else:
                flow.http.now = now
                self._http_events(flow, now, flow.http.upstream_bytes(data))
            try:
                out.write(data)
                await out.drain()
            except (ConnectionError, OSError):
                if other in flow.reset_by_tap:
                    return  # the tap reset it (the recording's end): not that side's doing
                # the receiving side is gone with a reset the tap had not read yet
                if side == "upstream":
                    flow.client_gone = True
                self._closed(flow, other, "rst", None, side)
                _rst(flow.upstream_w if side == "upstream" else flow.client_w)
                flow.reset_by_tap.add(side)
                return

    def _with_request_id(self, flow: _Flow, data: bytes) -> bytes:
        """The client's bytes, with an `X-Request-Id` added to a request head that has none (the only change
        the tap ever makes, and only when asked): a head is held until it is whole (at most READ_BYTES;
        past that it passes as it came). Only a head that starts a read while the reading waits for a new
        request is touched: a pipelined head behind a body in the same read passes unchanged."""
        if flow.held:
            data, flow.held = bytes(flow.held) + data, bytearray()
        elif flow.http.broken or flow.http.req.their_state is not h11.IDLE or data[:1] == b"\x16":
            return data
        end = data.find(b"\r\n\r\n")
        if end < 0:
            if len(data) < READ_BYTES:
                flow.held += data
                return b""
            return data
        head, rest = data[: end + 2], data[end + 2:]
        lines = head.split(b"\r\n")
        if not _REQUEST_LINE.fullmatch(lines[0]):
            return data  # not an HTTP/1.x request head (garbage, another protocol): passed as it came
        if any(line.lower().startswith(b"x-request-id:") for line in lines[1:]):
            return data
        self._ids_added += 1
        rid = f"{self.request_ids}{self._ids_added}-{uuid.uuid4().hex[:8]}"
        return head + b"X-Request-Id: " + rid.encode() + b"\r\n" + rest

    def _closed(self, flow: _Flow, side: str, how: str, out: asyncio.StreamWriter | None, other: str) -> None:
        """`side` closed its sending direction (fin) or the connection (rst): recorded once, mirrored at once."""
        if side in flow.closed:
            return
        flow.closed[side] = how
        now = self._clock()
        if side == "client":
            flow.http.client_eof()
        else:
            self._http_events(flow, now, flow.http.upstream_eof())
        seq = flow.http.open_seq()
        rid = flow.http.ids.get(seq if seq is not None else flow.http.seq)  # the request open, else the last
        body = flow.http.body_of(seq)
        self._event("tap_closed", flow, now, rid, side=side, how=how,
                    open_seq=seq, response_ended=seq is None and flow.http.ended >= 0 and not flow.http.broken,
                    chunks=body["chunks"], first_body_mono_ns=body["first_body_mono_ns"], sse_done=body["sse_done"])
        if out is None:
            return
        if how == "rst":
            flow.reset_by_tap.add(other)
            _rst(out)
        else:
            try:
                if out.can_write_eof():
                    out.write_eof()
            except (ConnectionError, OSError, RuntimeError):
                pass
