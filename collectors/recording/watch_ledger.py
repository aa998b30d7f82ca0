"""The ledger of real traffic, built from what a tap saw (`cancelwatch watch`): one row per request that
passed the tap asking the engine for work (engine_work), and for each request its client gave up on, the cancel's events (`user_stop`,
`client_closed`), so that a watched cancel is judged by the same rules as a scripted one.

A request is a cancel when its client closed or reset the connection before the response ended. A
half-close (FIN) is not one on its own: clients send their request, half-close and wait. So a FIN with
the response open is held until the connection tells: the response passing to its end (not a cancel),
or the connection ending without it (a cancel, stamped at the FIN: the instant the client left). A
reset is a cancel at once. A complete answer is never a cancel: a client that closes once the stream's last
event (`data: [DONE]`), or each choice's last chunk (its `finish_reason`), has passed read it whole, whatever the
transport's framing did after (the `openai` SDK closes before the chunked body's last bytes come).

Pure bookkeeping over the tap's events (runstore/event_kinds.py: tap_*), on the tap's monotonic clock:
`feed` returns the records to write, the tap's own events first; nothing here reads a socket or a clock.
"""

from __future__ import annotations

import uuid
from collections import deque
from dataclasses import dataclass

from cancelwatch.collectors.sources.tap import APP_RECEIPT_PATH, PAGE_STOP_PATH
from cancelwatch.runstore.records import WATCHED_SCENARIO, EventRecord, LedgerRecord

SCENARIO = WATCHED_SCENARIO  # every watched request's ledger scenario: real traffic, one stream of it
CANCELLED = "target"  # the role of a request its client gave up on (the scripted target's role)
WATCHED = "watched"  # the role of every other request the watch saw
MODE = "client_gone"  # the user_stop's mode: how a real client gives up
# a row handed to the writer is in the store a commit later, or, on a starved host, seconds later: a live judge
# reading the store in that moment would find the request in neither the store nor the open rows, and count
# the engine's request as traffic it does not know. Closed rows stay at hand until the store surely holds
# them (live_rows), and at most this long after they were handed out
RECENT_NS = 120_000_000_000
# the ids of this many latest requests are kept to tell a client reusing its id (a row of its own, `id~xxxxxx`):
# a watch runs for days and every id kept forever grows without end (~130 bytes each). A reuse further apart
# than this is not told: its row replaces the earlier one in the store
ID_MEMORY = 100_000


@dataclass
class _Open:
    row: LedgerRecord
    status: int | None = None
    fin_ns: int | None = None  # the client half-closed then, the response still open
    fin_chunks: int = 0
    fin_wall_ns: int | None = None
    ended_ns: int | None = None  # its response passed to its end after the client's FIN


# POSTs of vLLM's server that schedule nothing (they answer from the tokenizer or change the server's state), and a
# page's report of a Stop: no ledger rows
NO_ENGINE_WORK = frozenset({PAGE_STOP_PATH, APP_RECEIPT_PATH, "/tokenize", "/detokenize", "/v1/load_lora_adapter",
                            "/v1/unload_lora_adapter", "/reset_prefix_cache", "/sleep", "/wake_up"})
# a GET that does: vLLM's Realtime API, a WebSocket upgraded from a GET, runs engine requests
ENGINE_GETS = frozenset({"/v1/realtime"})


def engine_work(method: str | None, path: str | None) -> bool:
    """Whether a request asks the engine for work it schedules: vLLM schedules POSTs (completions, chat,
    responses, embeddings, ...), but for NO_ENGINE_WORK, and the Realtime API's GET; any other GET (a page,
    /v1/models, /health, /metrics) holds no place in it, and is no ledger row. A request whose method the tap did
    not say counts."""
    route = (path or "").split("?")[0]
    if route in ENGINE_GETS:
        return True
    return method in (None, "POST") and route not in NO_ENGINE_WORK


class WatchLedger:
    """Tap events in, ledger rows and cancel events out. `metrics_target`: the label of the scheduler the
    cancels are judged against (the events carry it, as the drivers' do)."""

    def __init__(self, metrics_target: str):
        self.metrics_target = metrics_target
        self._open: dict[tuple[int, int], _Open] = {}  # (conn, seq) -> the request in flight
        self._ids: dict[str, None] = {}  # the latest ID_MEMORY request ids, oldest first (an ordered set)
        self._held: dict[int, tuple] = {}  # conn -> the request held for its connection's end
        self.requests = 0
        self.passed = 0  # requests that ask the engine for no work (a page, /v1/models, a page's report): no rows
        self.cancels = 0  # how many cancels were decided
        self._recent: deque[tuple[int, LedgerRecord]] = deque()  # (handed out at, row) of rows just written

    def open_rows(self) -> list[LedgerRecord]:
        """The rows of requests still in flight (not yet written): a live judge counts them in the engine."""
        return [o.row for o in self._open.values()]

    def live_rows(self, committed_ns: int | None = None) -> list[LedgerRecord]:
        """The rows a live judge adds to the store's: those in flight, and those handed out that the store may
        not hold yet: all handed out at or after `committed_ns`, the instant the store holds everything put
        before (StoreWriter.committed_through_ns, read before the store is). The store's row wins where it
        has one."""
        while self._recent and committed_ns is not None and self._recent[0][0] < committed_ns:
            self._recent.popleft()
        return [row for _, row in self._recent] + self.open_rows()

    def feed(self, events: list[EventRecord]) -> list:
        out: list = []
        for ev in events:
            out.append(ev)
            out += self._one(ev)
        return out

    def handed_out(self, records: list, now_ns: int) -> None:
        """`records` (of feed) were put to the writer, all of them before `now_ns` (the recorder's monotonic
        clock, read after the last put): their rows stay live until the store surely holds them."""
        self._recent.extend((now_ns, rec) for rec in records if isinstance(rec, LedgerRecord))
        while self._recent and self._recent[0][0] < now_ns - RECENT_NS:
            self._recent.popleft()

    def finish(self, why: str = "the watch ended") -> list:
        """Rows of the requests still open when the watch ends, written as interrupted (a held half-close
        stays what it was: not known to be a cancel)."""
        out = []
        for key in list(self._open):
            o = self._open.pop(key)
            o.row.terminal_state, o.row.reason = "interrupted", why
            out.append(o.row)
        return out

    # ------------------------------------------------------------------ one event
    def _one(self, ev: EventRecord) -> list:
        d, kind = ev.data, ev.kind
        key = (d.get("conn"), d.get("seq") if "seq" in d else d.get("open_seq"))
        if kind == "tap_connection_end" and d.get("conn") in self._held:
            key = self._held[d.get("conn")]
        if kind == "tap_request":
            if not engine_work(d.get("method"), d.get("path")):
                self.passed += 1
                return []
            return self._request(ev, key)
        o = self._open.get(key)
        if o is None:
            return []
        if kind == "tap_request_body":
            if d.get("max_tokens") is not None:
                o.row.max_tokens = int(d["max_tokens"])
            if d.get("n") is not None:
                o.row.n = int(d["n"])
        elif kind == "tap_response":
            o.status = d.get("status")
        elif kind == "tap_response_end":
            self._body(o, d)
            if o.fin_ns is not None:
                # the response passed after the client's FIN: delivered to a client half-closed and
                # reading, or to a closed socket; the connection's end tells (its client_gone)
                o.ended_ns = ev.mono_ns
                self._held[d.get("conn")] = key
                return []
            return self._ended(key, o, ev.mono_ns)
        elif kind == "tap_closed" and d.get("side") == "client":
            self._body(o, d)
            if d.get("sse_done"):
                return self._ended(key, o, ev.mono_ns)  # the answer passed whole: no cancel
            if d.get("how") == "rst":
                return self._cancel(key, o, ev.mono_ns, ev.wall_ns, int(d.get("chunks") or 0), "client reset")
            o.fin_ns, o.fin_wall_ns, o.fin_chunks = ev.mono_ns, ev.wall_ns, int(d.get("chunks") or 0)
        elif kind == "tap_connection_end" and o.ended_ns is not None:
            self._held.pop(d.get("conn"), None)
            if d.get("client_gone"):
                return self._cancel(key, o, o.fin_ns, o.fin_wall_ns, o.fin_chunks, "client closed")
            return self._ended(key, o, o.ended_ns)
        elif kind == "tap_closed" and o.ended_ns is not None:
            return []
        elif kind in ("tap_closed", "tap_connection_end"):
            # the upstream closed, or the connection is over, and the response never ended
            self._body(o, d)
            if kind == "tap_connection_end" and set(d.get("by_tap") or ()) >= {"client", "upstream"}:
                return self._done(key, "interrupted", ev.mono_ns, "the watch ended")  # the tap closed both
            if o.fin_ns is not None:
                return self._cancel(key, o, o.fin_ns, o.fin_wall_ns, o.fin_chunks, "client closed")
            if kind == "tap_connection_end" and "client" in (d.get("closed") or {}):
                return self._cancel(key, o, ev.mono_ns, ev.wall_ns, int(d.get("chunks") or 0), "client closed")
            return self._done(key, "error", ev.mono_ns, "the upstream closed before the response ended")
        return []

    def _request(self, ev: EventRecord, key) -> list:
        self.requests += 1
        rid = ev.request_id or f"tap-{key[0]}-{key[1]}"
        if rid in self._ids:  # a client reusing its id: the ledger keeps one row per request
            rid = f"{rid}~{uuid.uuid4().hex[:6]}"
        self._ids[rid] = None
        if len(self._ids) > ID_MEMORY:
            del self._ids[next(iter(self._ids))]
        row = LedgerRecord(request_id=rid, scenario=SCENARIO, role=WATCHED, max_tokens=None,
                           sent_mono_ns=ev.mono_ns)
        self._open[key] = _Open(row)
        return []

    @staticmethod
    def _body(o: _Open, d: dict) -> None:
        if d.get("first_body_mono_ns") is not None and o.row.first_token_mono_ns is None:
            o.row.first_token_mono_ns = int(d["first_body_mono_ns"])
        if d.get("chunks") is not None:
            o.row.chunks = max(o.row.chunks or 0, int(d["chunks"]))

    def _ended(self, key, o: _Open, at_ns: int) -> list:
        ok = o.status is not None and o.status < 400
        return self._done(key, "completed" if ok else "error", at_ns,
                          f"HTTP {o.status}" if o.status is not None else None)

    def _done(self, key, state: str, at_ns: int, reason: str | None) -> list:
        o = self._open.pop(key)
        o.row.terminal_state, o.row.reason, o.row.closed_mono_ns = state, reason, at_ns
        return [o.row]

    def _cancel(self, key, o: _Open, at_ns: int, wall_ns: int | None, chunks: int, how: str) -> list:
        self._open.pop(key)
        row = o.row
        row.role, row.cancel_mono_ns, row.closed_mono_ns = CANCELLED, at_ns, at_ns
        row.terminal_state, row.reason = "cancelled", how
        row.tokens_after_cancel = 0  # the tap passes nothing on after the client left
        self.cancels += 1
        cancel_id = uuid.uuid4().hex[:8]
        phase = "decode" if row.first_token_mono_ns is not None and row.first_token_mono_ns <= at_ns else "in_flight"
        wall = wall_ns if wall_ns is not None else 0
        return [
            EventRecord("user_stop", wall, at_ns, row.request_id,
                        {"scenario": SCENARIO, "phase": phase, "cancel_id": cancel_id, "mode": MODE,
                         "tokens_at_cancel": chunks, "metrics_target": self.metrics_target}),
            EventRecord("client_closed", wall, at_ns, row.request_id,
                        {"cancel_id": cancel_id, "source": "tap", "metrics_target": self.metrics_target}),
            row,
        ]
