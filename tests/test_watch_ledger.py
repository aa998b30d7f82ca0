"""The watch's ledger (collectors/recording/watch_ledger.py) from what a real tap saw on real sockets: a
client that resets or closes before its response ended is a cancel, stamped when it left; a half-close
that waits for its answer is not; and the only change the watch makes to the bytes, an X-Request-Id where
the client sent none, is made to the head alone and only when asked."""

from __future__ import annotations

import socket
import threading
import time

from cancelwatch.collectors.recording import watch_ledger
from cancelwatch.collectors.recording.watch_ledger import CANCELLED, WATCHED, WatchLedger
from cancelwatch.collectors.sources.tap import TapSource, parse_hop
from cancelwatch.runstore.records import EventRecord, LedgerRecord
from tests.conftest import free_port
from tests.test_tap import Upstream, kinds, read_to_close, recv_until, request, rst_close


def watched_tap(upstream_port: int, ids: str | None = None) -> TapSource:
    hop = parse_hop(f"watch=127.0.0.1:{free_port()},http://127.0.0.1:{upstream_port}")
    return TapSource(hop, request_ids=ids).start()


def ledger_of(tap: TapSource, until, limit_s: float = 10.0) -> tuple[list, WatchLedger]:
    """Everything the ledger writes from the tap's events, until `until(records)` or the limit."""
    led, out = WatchLedger("t0"), []
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        out += led.feed(tap.take_events())
        if until(out):
            break
        time.sleep(0.02)
    return out, led


def rows(records) -> list[LedgerRecord]:
    return [r for r in records if isinstance(r, LedgerRecord)]


def stops(records) -> list[EventRecord]:
    return [r for r in records if isinstance(r, EventRecord) and r.kind == "user_stop"]


def sse_stream(conn, seen, tokens: int = 400, step_s: float = 0.01, started: threading.Event | None = None):
    """A streamed completion: an SSE event per token, until the client is gone."""
    recv_until(conn, b"\r\n\r\n")
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
    conn.settimeout(5)
    try:
        for i in range(tokens):
            event = b'data: {"i": %d}\n\n' % i
            conn.sendall(b"%x\r\n%s\r\n" % (len(event), event))
            if started is not None and i == 4:
                started.set()
            time.sleep(step_s)
        conn.sendall(b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")
        seen.append("ended")
        read_to_close(conn)
    except (ConnectionResetError, BrokenPipeError, TimeoutError):
        seen.append("gone")


def left_after(script, rid: str, body: bytes, seen: bytes, leave=lambda c: c.close(),
               settle_s: float = 0.0) -> tuple[list, WatchLedger]:
    """A client that asks through the watch's tap an upstream playing `script`, reads until `seen` has passed (and
    `settle_s` more) and leaves by `leave(socket)`: (what the ledger wrote, the ledger)."""
    up = Upstream(script)
    tap = watched_tap(up.port)
    try:
        c = socket.create_connection(("127.0.0.1", tap.hop.listen_port))
        c.sendall(request(rid, body))
        recv_until(c, seen)
        time.sleep(settle_s)
        leave(c)
        return ledger_of(tap, lambda out: rows(out))
    finally:
        tap.close()
        up.close()


def left_mid_stream(rid: str, body: bytes, leave) -> tuple[list, WatchLedger, int]:
    """A client that asks for a stream and, a few tokens in, leaves by `leave(socket)`: (what the ledger
    wrote, the ledger, when it began to leave). The upstream must see it gone."""
    started = threading.Event()
    up = Upstream(lambda conn, seen: sse_stream(conn, seen, started=started))
    tap = watched_tap(up.port)
    try:
        c = socket.create_connection(("127.0.0.1", tap.hop.listen_port))
        c.sendall(request(rid, body))
        assert started.wait(5)
        time.sleep(0.05)
        t_left = time.monotonic_ns()
        leave(c)
        got, led = ledger_of(tap, lambda out: rows(out))
        assert up.done.wait(10) and up.seen == ["gone"]
    finally:
        tap.close()
        up.close()
    return got, led, t_left


def test_a_client_reset_mid_stream_is_a_cancel_stamped_when_it_left():
    got, led, t_left = left_mid_stream("r-reset", b'{"model": "m", "stream": true, "max_tokens": 400}', rst_close)
    (row,) = rows(got)
    (stop,) = stops(got)
    assert (row.request_id, row.role, row.terminal_state, row.reason) == ("r-reset", CANCELLED, "cancelled",
                                                                          "client reset")
    assert row.max_tokens == 400 and row.first_token_mono_ns is not None
    assert abs(row.cancel_mono_ns - t_left) < 200e6 and stop.mono_ns == row.cancel_mono_ns
    assert stop.request_id == "r-reset" and stop.data["phase"] == "decode" and stop.data["mode"] == "client_gone"
    assert 5 <= stop.data["tokens_at_cancel"] == row.chunks < 400
    closed = [r for r in got if isinstance(r, EventRecord) and r.kind == "client_closed"]
    assert [(c.data["source"], c.data["cancel_id"]) for c in closed] == [("tap", stop.data["cancel_id"])]
    assert led.cancels == 1 and led.requests == 1 and led.open_rows() == []


def test_a_half_close_then_gone_mid_stream_is_a_cancel_stamped_at_the_half_close():
    def half_close_then_go(c: socket.socket) -> None:
        c.shutdown(socket.SHUT_WR)  # a FIN: held, it may be a client waiting for its answer
        time.sleep(0.3)
        c.close()  # gone, with tokens unread (Linux sends a reset): the response never ends

    got, _, t_left = left_mid_stream("r-close", b'{"stream": true}', half_close_then_go)
    (row,) = rows(got)
    assert (row.terminal_state, row.reason, row.max_tokens) == ("cancelled", "client closed", None)
    assert abs(row.cancel_mono_ns - t_left) < 200e6
    assert len(stops(got)) == 1


def test_a_half_close_that_waits_for_its_answer_is_no_cancel():
    def script(conn, seen):
        recv_until(conn, b"\r\n\r\n")
        seen.append(read_to_close(conn)[1])  # the client's half-close
        time.sleep(0.2)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello")

    up = Upstream(script)
    tap = watched_tap(up.port)
    try:
        c = socket.create_connection(("127.0.0.1", tap.hop.listen_port))
        c.sendall(request("r-half", b'{"stream": false, "max_tokens": 5}'))
        c.shutdown(socket.SHUT_WR)
        answer, _ = read_to_close(c)
        assert answer.endswith(b"hello")
        got, led = ledger_of(tap, lambda out: rows(out))
    finally:
        tap.close()
        up.close()
    (row,) = rows(got)
    assert (row.role, row.terminal_state, row.reason, row.cancel_mono_ns) == (WATCHED, "completed", "HTTP 200", None)
    assert stops(got) == [] and led.cancels == 0


def test_a_client_that_closes_once_the_last_event_passed_read_a_whole_answer_and_made_no_cancel():
    """The `openai` SDK reads a stream to its `data: [DONE]` and closes before the chunked body's last bytes
    come: the answer was whole, whatever the framing did after. A client that closes one event short of it,
    or resets there, made a cancel."""
    def script(conn, seen):
        recv_until(conn, b"\r\n\r\n")
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        for i in range(3):
            event = b'data: {"i": %d}\n\n' % i
            conn.sendall(b"%x\r\n%s\r\n" % (len(event), event))
        conn.sendall(b"e\r\ndata: [DONE]\n\n\r\n")
        time.sleep(0.5)  # the terminating chunk comes late: the client is gone by then
        try:
            conn.sendall(b"0\r\n\r\n")
            read_to_close(conn)
        except OSError:
            pass
        seen.append("ended")

    outcomes = {}
    for name, leave in (("close", lambda c: c.close()), ("reset", rst_close)):
        got, led = left_after(script, f"r-done-{name}", b'{"stream": true, "max_tokens": 3}', b"data: [DONE]\n\n",
                              leave)
        (row,) = rows(got)
        outcomes[name] = (row.role, row.terminal_state, row.chunks, len(stops(got)), led.cancels)
    assert outcomes == {"close": (WATCHED, "completed", 3, 0, 0), "reset": (WATCHED, "completed", 3, 0, 0)}
    # one event short of the end: a cancel
    started = threading.Event()
    up = Upstream(lambda conn, seen: sse_stream(conn, seen, tokens=40, step_s=0.05, started=started))
    tap = watched_tap(up.port)
    try:
        c = socket.create_connection(("127.0.0.1", tap.hop.listen_port))
        c.sendall(request("r-short", b'{"stream": true, "max_tokens": 40}'))
        assert started.wait(5)
        c.close()
        got, led = ledger_of(tap, lambda out: rows(out))
    finally:
        tap.close()
        up.close()
    (row,) = rows(got)
    assert (row.terminal_state, len(stops(got))) == ("cancelled", 1)


def test_a_client_that_closes_once_each_choice_finished_read_a_whole_answer_and_made_no_cancel():
    """Some clients stop at the chunk that carries a choice's finish_reason, before `data: [DONE]` comes: with every
    choice the request asked for (its body's n) finished, the answer was whole. The marker split between two reads
    counts once; a request of two choices left after the first one finished made a cancel."""
    def script(conn, seen):
        recv_until(conn, b"\r\n\r\n")
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        events = [b'data: {"choices":[{"index":%d,"text":"w","finish_reason":null}]}\n\n' % (i % 2) for i in range(4)]
        events += [b'data: {"choices":[{"index":0,"text":"w","finish_reason":"length"}]}\n\n',
                   b'data: {"choices": [{"index": 1, "text": "w", "finish_reason": "stop"}]}\n\n']
        try:
            for k, event in enumerate(events):
                if k == len(events) - 1:
                    time.sleep(0.5)  # the second choice finishes later: a client may leave in between
                half = event.index(b"finish_reason") + 5  # each marker cut in two reads
                for part in (event[:half], event[half:]):
                    conn.sendall(b"%x\r\n%s\r\n" % (len(part), part))
                    time.sleep(0.02)
            time.sleep(1.0)  # [DONE] comes late: the client is gone by then
            conn.sendall(b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")
            read_to_close(conn)
        except OSError:
            pass
        seen.append("ended")

    outcomes = {}
    for n, wait_for in ((1, b'"length"'), (2, b'"stop"'), (2, b'"length"')):
        # 0.1 s more: the rest of that chunk
        got, _ = left_after(script, f"r-fin-{n}", b'{"stream": true, "max_tokens": 3, "n": %d}' % n, wait_for,
                            settle_s=0.1)
        (row,) = rows(got)
        outcomes[(n, wait_for)] = (row.terminal_state, len(stops(got)))
    assert outcomes == {(1, b'"length"'): ("completed", 0), (2, b'"stop"'): ("completed", 0),
                        (2, b'"length"'): ("cancelled", 1)}


def test_a_non_streaming_client_that_times_out_is_a_cancel_when_the_connection_ends():
    answered = threading.Event()

    def script(conn, seen):  # a server that answers 0.5 s later, to a client long gone
        recv_until(conn, b"\r\n\r\n")
        time.sleep(0.5)
        try:
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello")
        except OSError:
            pass
        answered.set()

    up = Upstream(script)
    tap = watched_tap(up.port)
    try:
        c = socket.create_connection(("127.0.0.1", tap.hop.listen_port))
        c.sendall(request("r-timeout", b'{"stream": false, "max_tokens": 50}'))
        time.sleep(0.1)
        t_left = time.monotonic_ns()
        c.close()
        got, _ = ledger_of(tap, lambda out: rows(out))
        assert answered.is_set()
    finally:
        tap.close()
        up.close()
    (row,) = rows(got)
    (stop,) = stops(got)
    assert row.terminal_state == "cancelled" and abs(row.cancel_mono_ns - t_left) < 200e6
    assert stop.data["phase"] == "in_flight" and stop.data["tokens_at_cancel"] == 0


def test_kept_alive_requests_are_rows_of_their_own_and_a_reused_id_is_kept_apart():
    def script(conn, seen):
        for _ in range(2):
            recv_until(conn, b"\r\n\r\n")
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        read_to_close(conn)

    up = Upstream(script)
    tap = watched_tap(up.port)
    try:
        c = socket.create_connection(("127.0.0.1", tap.hop.listen_port))
        for _ in range(2):
            c.sendall(request("same"))
            assert recv_until(c, b"ok").endswith(b"ok")
        c.close()
        got, led = ledger_of(tap, lambda out: len(rows(out)) == 2)
    finally:
        tap.close()
        up.close()
    ids = [r.request_id for r in rows(got)]
    assert ids[0] == "same" and ids[1].startswith("same~") and len(set(ids)) == 2
    assert all(r.terminal_state == "completed" for r in rows(got)) and led.cancels == 0


def test_the_watch_ending_writes_every_open_request_as_interrupted():
    started = threading.Event()
    up = Upstream(lambda conn, seen: sse_stream(conn, seen, started=started))
    tap = watched_tap(up.port)
    c = socket.create_connection(("127.0.0.1", tap.hop.listen_port))
    try:
        c.sendall(request("r-open", b'{"stream": true}'))
        assert started.wait(5)
        led, got = WatchLedger("t0"), []
        got += led.feed(tap.take_events())
        assert [r.request_id for r in led.open_rows()] == ["r-open"]
        tap.close()  # the watch's end: the tap resets both sides
        got += led.feed(tap.take_events())
        got += led.finish()
    finally:
        c.close()
        up.close()
    (row,) = rows(got)
    assert (row.request_id, row.terminal_state) == ("r-open", "interrupted") and stops(got) == []


def upstream_heads(n: int):
    def script(conn, seen):
        for _ in range(n):
            head = recv_until(conn, b"\r\n\r\n")
            seen.append(head)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        read_to_close(conn)
    return Upstream(script)


def test_a_request_without_an_id_gets_one_in_its_head_and_nothing_else_changes():
    up = upstream_heads(2)
    tap = watched_tap(up.port, ids="cw-w")
    try:
        c = socket.create_connection(("127.0.0.1", tap.hop.listen_port))
        # the head in two pieces: held until whole, then given its id
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        time.sleep(0.1)
        c.sendall(b"Content-Length: 2\r\n\r\n{}")
        assert recv_until(c, b"ok").endswith(b"ok")
        c.sendall(request("mine"))  # a client's own id is kept as it is
        assert recv_until(c, b"ok").endswith(b"ok")
        c.close()
        assert up.done.wait(5)
        evs = []
        deadline = time.monotonic() + 5
        while kinds(evs).count("tap_request") < 2 and time.monotonic() < deadline:
            evs += tap.take_events()
            time.sleep(0.02)
    finally:
        tap.close()
        up.close()
    first, second = up.seen
    lines = first.split(b"\r\n")
    added = [line for line in lines if line.lower().startswith(b"x-request-id:")]
    assert len(added) == 1 and added[0].startswith(b"X-Request-Id: cw-w1-")
    assert [line for line in lines if line not in added] == [b"POST /v1/completions HTTP/1.1", b"Host: x",
                                                             b"Content-Length: 2", b"", b"{}"]
    assert second == request("mine")
    ids = [e.request_id for e in evs if e.kind == "tap_request"]
    assert ids == [added[0].split(b": ")[1].decode(), "mine"]


def test_without_request_ids_the_bytes_pass_unchanged():
    up = upstream_heads(1)
    tap = watched_tap(up.port, ids=None)
    try:
        c = socket.create_connection(("127.0.0.1", tap.hop.listen_port))
        raw = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}"
        c.sendall(raw)
        assert recv_until(c, b"ok").endswith(b"ok")
        c.close()
        assert up.done.wait(5)
    finally:
        tap.close()
        up.close()
    assert up.seen == [raw]


def read_to_eof(conn, seen):
    """An upstream that keeps every byte until its client's FIN, then closes."""
    conn.settimeout(5)
    buf = b""
    while chunk := conn.recv(65536):
        buf += chunk
    seen.append(buf)


def test_garbage_and_a_head_past_the_limit_pass_as_they_came_marked_unparsed():
    big_head = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n"
    for raw in (b"\x00\x01 not http at all\r\n\r\nmore", big_head):
        up = Upstream(read_to_eof)
        tap = watched_tap(up.port, ids="cw-w")  # the watch's default: ids added to the heads it reads
        try:
            c = socket.create_connection(("127.0.0.1", tap.hop.listen_port))
            c.sendall(raw)
            c.shutdown(socket.SHUT_WR)
            assert read_to_close(c)[1] == "fin"
            c.close()
            assert up.done.wait(5)
            got, _ = ledger_of(tap, lambda out: "tap_connection_end" in kinds(out))
        finally:
            tap.close()
            up.close()
        assert up.seen == [raw], up.seen[0][:200]  # not a byte changed, no id added
        assert "tap_unparsed" in kinds(got) and not rows(got) and not stops(got), kinds(got)


def test_a_row_handed_to_the_writer_stays_live_until_the_store_surely_holds_it():
    """A live judge reads the store plus the ledger's live rows: a request that ended a moment before (its
    row put to the writer, not yet committed; on a starved host, seconds later) must be in one of them, or
    the judge counts its entry in the engine as traffic nobody sent (seen with AIPerf through the watch)."""
    def ev(kind, t_s, rid=None, **data):
        return EventRecord(kind, 0, int(t_s * 1e9), rid, {"conn": 1, "seq": 0, **data})

    led = WatchLedger("t0")
    led.handed_out(led.feed([ev("tap_request", 1.0, "r-done"), ev("tap_response", 1.1, status=200)]), int(1.2e9))
    assert [r.request_id for r in led.live_rows()] == ["r-done"]
    written = led.feed([ev("tap_response_end", 2.0)])
    led.handed_out(written, int(9.0e9))  # handed out late: the watch's loop was held up
    assert [r.request_id for r in rows(written)] == ["r-done"] and led.open_rows() == []
    # the store is held through 8.5 s: put at 9.0 s, the row may not be in it yet, however old its events
    assert [r.request_id for r in led.live_rows(committed_ns=int(8.5e9))] == ["r-done"]
    assert led.live_rows(committed_ns=int(9.5e9)) == []  # surely in the store: the store's row is the one


def test_the_ledger_keeps_the_latest_ids_only_and_counts_its_cancels(monkeypatch):
    # a watch runs for days: an id kept for every request grows without end. The latest ID_MEMORY are kept,
    # enough to tell a client reusing its id from one request to the next; an older one is forgotten
    monkeypatch.setattr(watch_ledger, "ID_MEMORY", 3)
    led, t = WatchLedger("t0"), 0

    def one(rid: str, conn: int, reset: bool = False) -> str:
        nonlocal t
        t += 1_000_000
        out = led.feed([EventRecord("tap_request", t, t, rid, {"conn": conn, "seq": 0}),
                        EventRecord("tap_response", t, t + 1, rid, {"conn": conn, "seq": 0, "status": 200})])
        end = EventRecord("tap_closed", t, t + 2, rid, {"conn": conn, "seq": 0, "side": "client", "how": "rst"}) \
            if reset else EventRecord("tap_response_end", t, t + 2, rid, {"conn": conn, "seq": 0, "chunks": 3})
        (row,) = rows(out + led.feed([end]))
        return row.request_id

    assert [one(r, i) for i, r in enumerate("abcd")] == ["a", "b", "c", "d"]
    assert one("b", 4, reset=True).startswith("b~")  # among the latest three: a row of its own
    assert one("a", 5) == "a"  # forgotten: taken as a new id
    assert led.requests == 6 and led.cancels == 1 and led.open_rows() == []


def _exchange(body: bytes, events: list[bytes]) -> list[bool]:
    """A streamed exchange read by the tap's HTTP reader alone: sse_done after each of `events` (raw body reads)."""
    from cancelwatch.collectors.sources.tap import _Http

    h = _Http()
    h.client_bytes(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Request-Id: r1\r\nContent-Type: application/json"
                   b"\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    h.upstream_bytes(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
    states = []
    for e in events:
        h.upstream_bytes(b"%x\r\n%s\r\n" % (len(e), e))
        states.append(h.body_of(0)["sse_done"])
    return states


def _ev(index: int, finish, text: str = "w", **more) -> bytes:
    import json

    return b"data: " + json.dumps({"choices": [{"index": index, "text": text, "finish_reason": finish}], **more},
                                  separators=(",", ":")).encode() + b"\n\n"


def test_the_answer_is_whole_once_every_choice_it_holds_has_finished_and_no_sooner():
    """A review's counterexamples: a batch of prompts holds a choice per prompt; a body past what the tap reads leaves
    n unknown (only `data: [DONE]` ends it then); a choice's finish_reason said twice is one choice; an empty
    finish_reason ends nothing; the marker in a choice's text (escaped) is text."""
    import json

    def body(**kw) -> bytes:
        return json.dumps({"model": "m", "prompt": "p", "stream": True, **kw}).encode()

    assert _exchange(body(), [_ev(0, None), _ev(0, "length")]) == [False, True]
    assert _exchange(body(n=2), [_ev(0, "stop"), _ev(1, None), _ev(1, "length")]) == [False, False, True]
    batch = body(prompt=["one", "two"])
    assert _exchange(batch, [_ev(0, "stop"), _ev(1, None), _ev(1, "stop")]) == [False, False, True]
    big = body(prompt="x " * 40000, n=1)  # past BODY_BYTES: what it asks cannot be read
    assert _exchange(big, [_ev(0, "length"), b"data: [DONE]\n\n"]) == [False, True]
    assert _exchange(body(n=2), [_ev(0, "stop"), _ev(0, "stop", usage={"completion_tokens": 3}), _ev(1, None)]) \
        == [False, False, False]
    assert _exchange(body(), [_ev(0, ""), _ev(0, "")]) == [False, False]
    assert _exchange(body(), [_ev(0, None, text='{"finish_reason":"length"}')]) == [False]
    # a marker cut across three reads is read once the line is whole
    line = b'data: {"choices": [{"index": 0, "text": "w", "finish_reason" :  "stop"}]}\n\n'
    assert _exchange(body(n=2), [line[:40], line[40:44], line[44:], _ev(1, "stop")]) == [False, False, False, True]


def test_only_requests_that_ask_the_engine_for_work_are_rows():
    """A page, /v1/models, a health check, a page's report of its Stop and the tokenizer's endpoints take no place in
    the engine: no rows, and a client leaving one is no cancel; POSTs that schedule work and vLLM's Realtime API are
    rows (a request whose method the tap did not say too)."""
    led = WatchLedger("t0")
    asked = [("GET", "/"), ("GET", "/v1/models"), ("GET", "/health"), ("POST", "/cancelwatch/stop"),
             ("POST", "/tokenize?x=1"), ("POST", "/v1/chat/completions"), ("POST", "/v1/completions?stream=1"),
             ("GET", "/v1/realtime"), (None, None)]
    out = []
    for conn, (method, path) in enumerate(asked):
        data = {"conn": conn, "seq": 0, **({"method": method, "path": path} if method else {})}
        out += led.feed([EventRecord("tap_request", 0, conn, f"r{conn}", data),
                         EventRecord("tap_closed", 0, conn + 1, f"r{conn}", {"conn": conn, "seq": 0, "side": "client",
                                                                            "how": "rst", "open_seq": 0})])
    assert sorted(r.request_id for r in rows(out)) == ["r5", "r6", "r7", "r8"], rows(out)
    assert led.requests == 4 and led.passed == 5 and led.cancels == 4
