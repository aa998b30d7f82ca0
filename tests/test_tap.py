"""The tap (collectors/sources/tap.py) on real sockets: bytes pass unchanged, a half-close stays a
half-close, a reset stays a reset, each request of a kept-alive connection is seen with its id, and
what it cannot read passes untouched. The upstreams here are plain sockets, so that what reaches them
(FIN: recv gives b""; RST: ECONNRESET) is exactly what the tap did."""

from __future__ import annotations

import os
import socket
import struct
import threading
import time

import pytest

from cancelwatch.collectors.sources.tap import Hop, TapError, TapSource, check_chain, parse_hop
from tests.conftest import free_port


class Upstream:
    """A one-connection-at-a-time socket server that runs `script(conn)` and keeps what it saw."""

    def __init__(self, script):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        self.script = script
        self.seen: list = []
        self.done = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        conn, _ = self.sock.accept()
        try:
            self.script(conn, self.seen)
        finally:
            conn.close()
            self.done.set()

    def close(self) -> None:
        self.sock.close()


def recv_until(conn: socket.socket, marker: bytes, limit_s: float = 5.0) -> bytes:
    conn.settimeout(limit_s)
    buf = b""
    while marker not in buf:
        chunk = conn.recv(65536)
        if not chunk:
            break
        buf += chunk
    return buf


def read_to_close(conn: socket.socket, limit_s: float = 5.0) -> tuple[bytes, str]:
    """Everything until the peer's close, and how it closed: fin or rst."""
    conn.settimeout(limit_s)
    buf = b""
    while True:
        try:
            chunk = conn.recv(65536)
        except ConnectionResetError:
            return buf, "rst"
        if not chunk:
            return buf, "fin"
        buf += chunk


def rst_close(conn: socket.socket) -> None:
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    conn.close()


def tap_for(upstream_port: int) -> TapSource:
    port = free_port()
    return TapSource(parse_hop(f"gw=127.0.0.1:{port},http://127.0.0.1:{upstream_port}")).start()


def events(tap: TapSource, until=None, limit_s: float = 5.0) -> list:
    got, deadline = [], time.monotonic() + limit_s
    while time.monotonic() < deadline:
        got += tap.take_events()
        if until is None or until(got):
            break
        time.sleep(0.02)
    return got


def kinds(evs) -> list[str]:
    return [e.kind for e in evs]


def request(rid: str, body: bytes = b"") -> bytes:
    return (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Request-Id: {rid}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


# ------------------------------------------------------------------ the hop's words


def test_a_hop_reads_name_listen_and_upstream():
    h = parse_hop("nginx=127.0.0.1:9001,http://127.0.0.1:8080/")
    assert (h.name, h.listen_host, h.listen_port, h.upstream, h.upstream_port) == \
        ("nginx", "127.0.0.1", 9001, "http://127.0.0.1:8080", 8080)
    assert parse_hop("vllm=9002,http://localhost:8000").listen_host == "127.0.0.1"  # loopback unless told


@pytest.mark.parametrize("bad", ["nginx", "nginx=9001", "=9001,http://x:1", "nginx=x,http://a:1",
                                 "nginx=9001,ftp://a:1", "ng inx=9001,http://a:1"])
def test_a_bad_hop_is_one_line_naming_the_form(bad):
    with pytest.raises(TapError) as e:
        parse_hop(bad)
    assert "\n" not in str(e.value) and "--hop" in str(e.value)


def test_hops_that_do_not_form_a_chain_are_refused():
    a = parse_hop("app=9001,http://127.0.0.1:7000")
    b = parse_hop("vllm=9002,http://127.0.0.1:8000")
    check_chain([a, b])
    for hops, said in (([a, parse_hop("app=9003,http://127.0.0.1:8000")], "unique"),
                       ([a, parse_hop("vllm=9001,http://127.0.0.1:8000")], "own port"),
                       ([parse_hop("x=9001,http://127.0.0.1:9001")], "itself"),
                       ([a, parse_hop("vllm=9002,http://127.0.0.1:9001")], "nearer the client")):
        with pytest.raises(TapError, match=said):
            check_chain(hops)


def test_a_listen_address_in_use_is_one_line():
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    try:
        hop = parse_hop(f"gw=127.0.0.1:{busy.getsockname()[1]},http://127.0.0.1:1")
        with pytest.raises(TapError, match="in use"):
            TapSource(hop).start()
    finally:
        busy.close()


def test_an_upstream_that_does_not_answer_is_named_by_check():
    port = free_port()
    tap = TapSource(parse_hop(f"litellm=127.0.0.1:{free_port()},http://127.0.0.1:{port}"))
    problem = tap.check()
    assert problem and "litellm" in problem and "does not answer" in problem and "\n" not in problem


# ------------------------------------------------------------------ faithful


def test_bytes_pass_unchanged_and_each_kept_alive_request_is_seen_with_its_id():
    payload = os.urandom(200_000)  # more than one read, in both directions

    def script(conn, seen):
        for rid in ("r-1", "r-2"):
            head = recv_until(conn, b"\r\n\r\n")
            body = head.split(b"\r\n\r\n", 1)[1]
            while len(body) < len(payload):
                body += conn.recv(65536)
            seen.append(body == payload)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(payload), payload))
        seen.append(read_to_close(conn)[1])  # the client's close, passed on

    up = Upstream(script)
    tap = tap_for(up.port)
    try:
        c = socket.create_connection(("127.0.0.1", tap.hop.listen_port))
        for rid in ("r-1", "r-2"):
            c.sendall(request(rid, payload))
            got = recv_until(c, b"\r\n\r\n")
            body = got.split(b"\r\n\r\n", 1)[1]
            while len(body) < len(payload):
                body += c.recv(65536)
            assert body == payload
        c.close()
        assert up.done.wait(5) and up.seen == [True, True, "fin"]
        evs = events(tap, lambda got: kinds(got).count("tap_closed") == 2)
    finally:
        tap.close()
        up.close()
    reqs = [e for e in evs if e.kind == "tap_request"]
    assert [(e.request_id, e.data["seq"], e.data["path"]) for e in reqs] == \
        [("r-1", 0, "/v1/completions"), ("r-2", 1, "/v1/completions")]
    ends = [e for e in evs if e.kind == "tap_response_end"]
    assert [(e.request_id, e.data["seq"]) for e in ends] == [("r-1", 0), ("r-2", 1)]
    closed = [e for e in evs if e.kind == "tap_closed"]
    # the client's close after both answers: nothing was open, so it was no cancel
    assert [(e.data["side"], e.data["how"], e.data["open_seq"], e.data["response_ended"]) for e in closed] == \
        [("client", "fin", None, True), ("upstream", "fin", None, True)]
    assert all(e.data["hop"] == "gw" for e in evs)
    assert [e.mono_ns for e in evs] == sorted(e.mono_ns for e in evs)


def test_a_half_close_reaches_upstream_as_a_half_close_and_the_answer_still_comes_back():
    def script(conn, seen):
        seen.append(recv_until(conn, b"\r\n\r\n"))
        seen.append(read_to_close(conn)[1])  # the client's FIN, passed on as a FIN
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello")

    up = Upstream(script)
    tap = tap_for(up.port)
    try:
        c = socket.create_connection(("127.0.0.1", tap.hop.listen_port))
        c.sendall(request("half"))
        c.shutdown(socket.SHUT_WR)
        answer, how = read_to_close(c)
        assert answer.endswith(b"hello") and how == "fin", (answer, how)
        assert up.done.wait(5) and up.seen[1] == "fin"
        evs = events(tap, lambda got: kinds(got).count("tap_closed") == 2)
    finally:
        tap.close()
        up.close()
    closes = [(e.data["side"], e.data["how"], e.data["open_seq"]) for e in evs if e.kind == "tap_closed"]
    assert closes == [("client", "fin", 0), ("upstream", "fin", None)], closes


def test_a_client_reset_mid_response_reaches_upstream_as_a_reset():
    started = threading.Event()

    def script(conn, seen):
        recv_until(conn, b"\r\n\r\n")
        conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        conn.settimeout(5)
        try:
            for _ in range(500):  # an SSE stream the client walks away from
                conn.sendall(b"6\r\ndata: \r\n")
                started.set()
                time.sleep(0.01)
            seen.append("ran to its end")
        except (ConnectionResetError, BrokenPipeError):
            seen.append("rst")

    up = Upstream(script)
    tap = tap_for(up.port)
    try:
        c = socket.create_connection(("127.0.0.1", tap.hop.listen_port))
        c.sendall(request("gone"))
        assert started.wait(5)
        time.sleep(0.1)
        rst_close(c)
        assert up.done.wait(10) and up.seen == ["rst"], up.seen
        evs = events(tap, lambda got: "tap_closed" in kinds(got))
    finally:
        tap.close()
        up.close()
    (closed,) = [e for e in evs if e.kind == "tap_closed"]
    assert (closed.data["side"], closed.data["how"], closed.data["open_seq"], closed.request_id) == \
        ("client", "rst", 0, "gone")
    assert closed.data["response_ended"] is False
    assert "tap_response_end" not in kinds(evs)


def test_an_upstream_reset_reaches_the_client_as_a_reset():
    def script(conn, seen):
        recv_until(conn, b"\r\n\r\n")
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial")
        time.sleep(0.1)
        rst_close(conn)

    up = Upstream(script)
    tap = tap_for(up.port)
    try:
        c = socket.create_connection(("127.0.0.1", tap.hop.listen_port))
        c.sendall(request("cut"))
        got, how = read_to_close(c)
        assert got.endswith(b"partial") and how == "rst", (got, how)
        evs = events(tap, lambda got: "tap_closed" in kinds(got))
    finally:
        tap.close()
        up.close()
    assert [(e.data["side"], e.data["how"]) for e in evs if e.kind == "tap_closed"][0] == ("upstream", "rst")


def test_encrypted_bytes_pass_untouched_and_say_so():
    hello = b"\x16\x03\x01\x00\x05hello"

    def script(conn, seen):
        seen.append(conn.recv(100))
        conn.sendall(b"\x16\x03\x03\x00\x02ok")

    up = Upstream(script)
    tap = tap_for(up.port)
    try:
        c = socket.create_connection(("127.0.0.1", tap.hop.listen_port))
        c.sendall(hello)
        assert recv_until(c, b"ok") == b"\x16\x03\x03\x00\x02ok"
        assert up.done.wait(5) and up.seen == [hello]
        c.close()
        evs = events(tap, lambda got: "tap_closed" in kinds(got))
    finally:
        tap.close()
        up.close()
    (unparsed,) = [e for e in evs if e.kind == "tap_unparsed"]
    assert unparsed.data["why"] == "encrypted: no request id" and "tap_request" not in kinds(evs)


def test_an_upstream_that_refuses_resets_the_client_and_is_recorded():
    tap = TapSource(parse_hop(f"gw=127.0.0.1:{free_port()},http://127.0.0.1:{free_port()}")).start()
    try:
        c = socket.create_connection(("127.0.0.1", tap.hop.listen_port))
        try:
            c.sendall(request("x"))
            how = read_to_close(c)[1]
        except ConnectionResetError:  # the reset came before the send
            how = "rst"
        assert how == "rst"
        evs = events(tap, lambda got: "tap_connection_end" in kinds(got))
    finally:
        tap.close()
    assert kinds(evs) == ["tap_accepted", "tap_upstream_failed", "tap_connection_end"]
    assert tap.sample(0, 0)[0].value == 0.0  # no connection left open


def test_past_its_bound_the_tap_answers_503_itself_and_counts_it():
    # an upstream that accepts (its backlog) and never answers: each connection through the tap stays open
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    tap = TapSource(parse_hop(f"gw=127.0.0.1:{free_port()},http://127.0.0.1:{silent.getsockname()[1]}"),
                    max_connections=2).start()
    held = []
    try:
        for i in range(2):
            c = socket.create_connection(("127.0.0.1", tap.hop.listen_port))
            c.sendall(request(f"held-{i}"))
            held.append(c)
        deadline = time.monotonic() + 5
        while tap.sample(0, 0)[0].value < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        third = socket.create_connection(("127.0.0.1", tap.hop.listen_port))
        third.sendall(request("third"))
        answer, how = read_to_close(third)
        third.close()
        assert answer.startswith(b"HTTP/1.1 503 Service Unavailable\r\n") and b"Retry-After: 1" in answer, answer
        assert b"--max-connections" in answer.split(b"\r\n\r\n", 1)[1] and how == "fin", (answer, how)
        evs = events(tap, lambda got: "tap_refused" in kinds(got))
        (refused,) = [e for e in evs if e.kind == "tap_refused"]
        assert refused.data["open"] == 2 and "third" not in str(evs), evs
        # under the bound again (a client reset: the tap passes it on and the connection is over at once; a FIN
        # would wait for this upstream's own), a connection passes on as before
        gone = held.pop()
        gone.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        gone.close()
        while tap.sample(0, 0)[0].value > 1 and time.monotonic() < deadline + 5:
            time.sleep(0.02)
        fourth = socket.create_connection(("127.0.0.1", tap.hop.listen_port))
        fourth.sendall(request("fourth"))
        evs = events(tap, lambda got: "tap_request" in kinds(got))
        assert [e.request_id for e in evs if e.kind == "tap_request"] == ["fourth"], evs
        held.append(fourth)
        open_, requests, refused_total = (x.value for x in tap.sample(0, 0))
        assert (open_, refused_total) == (2.0, 1.0), tap.sample(0, 0)
    finally:
        for c in held:
            c.close()
        tap.close()
        silent.close()


def test_a_closed_tap_leaves_nothing_listening():
    up = Upstream(lambda conn, seen: None)
    tap = tap_for(up.port)
    tap.close()
    up.close()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", tap.hop.listen_port), timeout=1)
    assert isinstance(tap.hop, Hop)


def test_an_http_1_0_request_is_read_with_its_response_to_the_close():
    """nginx speaks HTTP/1.0 to its upstream unless told: the request is seen with its id, and its response,
    framed by the close, ends where the upstream closes."""
    def script(conn, seen):
        recv_until(conn, b"\r\n\r\n")
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\ndata: 1\n\ndata: 2\n\n")
        conn.shutdown(socket.SHUT_WR)
        seen.append(read_to_close(conn)[1])

    up = Upstream(script)
    tap = tap_for(up.port)
    try:
        c = socket.create_connection(("127.0.0.1", tap.hop.listen_port))
        c.sendall(b"POST /v1/completions HTTP/1.0\r\nHost: x\r\nX-Request-Id: old\r\nConnection: close\r\n"
                  b"Content-Length: 2\r\n\r\n{}")
        body, how = read_to_close(c)
        assert body.endswith(b"data: 2\n\n") and how == "fin"
        c.close()
        evs = events(tap, lambda got: kinds(got).count("tap_closed") == 2)
    finally:
        tap.close()
        up.close()
    assert "tap_unparsed" not in kinds(evs), evs
    assert [(e.kind, e.request_id) for e in evs if e.kind.startswith(("tap_request", "tap_response"))] == \
        [("tap_request", "old"), ("tap_request_body", "old"), ("tap_response", "old"), ("tap_response_end", "old")]
    end = next(e for e in evs if e.kind == "tap_response_end")
    assert end.data["chunks"] == 2 and end.data["first_body_mono_ns"] is not None
