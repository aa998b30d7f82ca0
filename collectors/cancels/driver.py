"""Drives scenarios against an OpenAI-compatible server and records the ledger and the cancel trace.

The scenario's steps are the runner's (runner.py); this module holds what is vLLM's: requests over
HTTP/SSE (streams.py), the triggers, the three ways to stop, the relay app for via_relay scenarios.
Per cancel it stores three of the five timepoints as events (the other two come from the samples
and the ledger, in analysis): `user_stop` (the driver decides to cancel), `app_received` (the
cancel reached the request's task), `engine_abort` (the connection to the engine is closed).
Every request loop is bounded in count and time.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid

import httpx

from cancelwatch.collectors.cancels.load import make_prompt
from cancelwatch.collectors.cancels.pace import FLOOR_S, IdleWait, idle_wait
from cancelwatch.collectors.cancels.runner import ScenarioRunner, event_record, until
from cancelwatch.collectors.cancels.scenarios import NEIGHBOUR_PROMPT_TOKENS, Scenario
from cancelwatch.collectors.cancels.streams import (
    REQUEST_TIMEOUT_S,
    Request,
    build_request,
    cancel_in_app,
    disconnect,
    now_ns,
    run_request,
)
from cancelwatch.runstore.records import LedgerRecord

# event_record and until live in runner.py now; importers of this module keep finding them here
__all__ = ["IDLE_WAIT_S", "Driver", "event_record", "until"]

# before the first scenario the engine must be idle; between scenarios the wait follows the pace the
# scenario measured (collectors/cancels/pace.py): a request whose cancel was lost runs to its end first
IDLE_WAIT_S = FLOOR_S


class Driver(ScenarioRunner):
    """Runs scenarios one after another; `emit` receives EventRecords and LedgerRecords.

    `scheduler_now()` returns the latest sampled (running, waiting) of the metrics target, used by
    the `while_queued` trigger and to wait for the engine to go idle between scenarios.
    """

    IDLE_WAIT_S = IDLE_WAIT_S
    NEIGHBOUR_WAIT_S = 30
    REQUEST_TIMEOUT_S = REQUEST_TIMEOUT_S

    def __init__(self, base_url: str, model: str, emit, scheduler_now, grace_s: float = 2.0,
                 metrics_target: str = "t0", relay: "Driver | None" = None, relay_factory=None, relay_cleanup=None,
                 auth: dict[str, str] | None = None):
        super().__init__(emit, scheduler_now, grace_s=grace_s, metrics_target=metrics_target)
        self.base_url = base_url.rstrip("/")
        self.auth = dict(auth or {})  # the Authorization header of base_url's server, sent to it alone
        self.model = model
        self.relay = relay  # the driver of the relay app, for scenarios with via_relay
        # started on first need and stopped at the end: an idle second engine costs CPU all run long
        self.relay_factory = relay_factory
        self.relay_cleanup = relay_cleanup
        self.client: httpx.AsyncClient | None = None
        self.open: list[Request] = []  # sent in the scenario under way, their ledger rows not yet written
        # called just before each stop (the recorder lifts the scheduler source to its burst rate)
        self.stop_soon = None
        # told of the chunks this driver's clients read: the recorder's count (collectors/sources/clients.py: its add)
        self.delivered = None

    # ------------------------------------------------------------------ the run
    @contextlib.asynccontextmanager
    async def session(self):
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=0)
        timeout = httpx.Timeout(REQUEST_TIMEOUT_S, connect=5.0)
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
            self.client = client
            try:
                yield
            finally:
                for d in (self, self.relay):
                    if d is not None and d.open:
                        await d.write_open_rows()
                if self.relay_cleanup is not None:
                    await self.relay_cleanup()

    async def runner_for(self, s: Scenario) -> "Driver":
        if not s.via_relay:
            return self
        if self.relay is None and self.relay_factory is not None:
            self.relay = await self.relay_factory()
        if self.relay is None:
            raise RuntimeError(f"scenario {s.name} needs the relay app (--relay-url)")
        self.relay.client = self.client
        await self.relay.wait_idle()
        return self.relay

    async def write_open_rows(self, why: str = "run interrupted") -> None:
        """The ledger rows of requests still open when the run ends early (Ctrl-C, the target lost, the
        store failed): written, so a cancel already made keeps its row. A request the run's end cut
        off, not a cancel of the scenario's, says so."""
        reqs, self.open = self.open, []
        for r in reqs:
            if r.task is not None and not r.task.done():
                r.task.cancel()
        await asyncio.gather(*(r.task for r in reqs if r.task is not None), return_exceptions=True)
        for r in reqs:
            # not stopped by the scenario yet (a timeout still before its deadline counts too)
            if r.row.cancel_mono_ns is None and r.row.terminal_state != "completed":
                r.row.terminal_state, r.row.reason = "interrupted", why
            self.emit(r.row)

    # ------------------------------------------------------------------ requests
    def new_request(self, scenario: Scenario, role: str, prompt_tokens: int, max_tokens: int, seed: int,
                    *, n: int = 1, api: str = "completions", stream: bool = True, prompt: str | None = None,
                    timeout_s: float = REQUEST_TIMEOUT_S) -> Request:
        rid = f"cw-{scenario.name}-{role}-{uuid.uuid4().hex[:8]}"
        row = LedgerRecord(request_id=rid, scenario=scenario.name, role=role, n=n, prompt_tokens=prompt_tokens,
                           max_tokens=max_tokens)
        req = build_request(row, self.model, prompt or make_prompt(prompt_tokens, seed), api=api, stream=stream,
                            timeout_s=timeout_s)
        req.auth = self.auth
        return req

    def send(self, req: Request) -> Request:
        req.delivered = self.delivered
        req.task = asyncio.create_task(run_request(self.client, self.base_url, req))
        self.open.append(req)
        return req

    def ended(self, req: Request) -> bool:
        return req.task.done()

    def ending(self, req: Request) -> asyncio.Task:
        return req.task

    def send_neighbour(self, s: Scenario, seed: int) -> Request:
        return self.send(self.new_request(s, "neighbour", NEIGHBOUR_PROMPT_TOKENS, s.neighbour_max_tokens, seed + 1))

    async def send_fillers(self, s: Scenario, seed: int, reqs: list[Request]) -> None:
        for i in range(s.fillers):
            reqs.append(self.send(self.new_request(s, "filler", 100, s.filler_max_tokens, seed + 10 + i)))
        if s.fillers:
            await until(lambda: all(r.chunks > 0 or r.task.done() for r in reqs), 30)

    def send_targets(self, s: Scenario, seed: int) -> tuple[list[Request], list[Request]]:
        def prompt(i: int) -> str | None:
            # sharing: the neighbour's whole prompt, then its own words (the prefix cache hands the
            # neighbour's blocks to the target; they stay held by the neighbour when the target goes)
            if not s.share_prefix:
                return None
            own = make_prompt(s.prompt_tokens - NEIGHBOUR_PROMPT_TOKENS, seed + 100 + i)
            return make_prompt(NEIGHBOUR_PROMPT_TOKENS, seed + 1) + " " + own

        targets = [
            self.send(self.new_request(s, "target", s.prompt_tokens, s.max_tokens, seed + 100 + i, n=s.n, api=s.api,
                                       stream=s.stream, prompt=prompt(i),
                                       timeout_s=s.timeout_s if s.mode == "timeout" else REQUEST_TIMEOUT_S))
            for i in range(s.concurrency)
        ]
        return targets, targets[: s.cancel_count]

    def send_probe(self, s: Scenario, seed: int, chosen: list[Request]) -> Request:
        probe_prompt = chosen[0].body.get("prompt") if s.resubmit else None
        return self.send(self.new_request(s, "probe", s.prompt_tokens if s.resubmit else 100,
                                          s.probe_max_tokens, seed + 999, prompt=probe_prompt))

    async def give_up(self, reqs: list[Request]) -> None:
        for r in reqs:
            if not r.task.done():
                r.task.cancel()
        await asyncio.gather(*(r.task for r in reqs), return_exceptions=True)

    def write_rows(self, reqs: list[Request]) -> None:
        super().write_rows(reqs)
        self.open = [r for r in self.open if r not in reqs]

    def idle_after(self, reqs: list[Request]) -> IdleWait:
        return idle_wait(reqs)

    def _stopping(self) -> None:
        if self.stop_soon is not None:
            self.stop_soon()

    # ------------------------------------------------------------------ client timeouts
    def stops_at_client_deadline(self, s: Scenario) -> bool:
        return s.mode == "timeout"

    async def _stopping_before_deadline(self, chosen: list[Request], lead_s: float = 0.1) -> None:
        """Client timeouts: the stop is each one's deadline, known in advance."""
        await asyncio.sleep(0)  # the requests' tasks have started: their deadlines are known
        deadlines = [t.deadline_ns for t in chosen if t.deadline_ns is not None]
        if deadlines:
            await asyncio.sleep(max(0.0, (min(deadlines) - now_ns()) / 1e9 - lead_s))
        self._stopping()

    async def await_deadlines(self, s: Scenario, chosen: list[Request]) -> None:
        for t in chosen:
            t.cancel_requested = True
        t_stop = chosen[0].row.sent_mono_ns or now_ns()
        burst = asyncio.create_task(self._stopping_before_deadline(chosen))
        await asyncio.gather(*(asyncio.shield(t.task) for t in chosen), return_exceptions=True)
        burst.cancel()
        for t in chosen:
            cid = uuid.uuid4().hex[:8]
            # the stop is the client's deadline. Not the instant httpx raised: it closes the
            # connection before it raises, and a loaded machine let the engine log the abort
            # milliseconds before that stamp
            stop_at = t.deadline_ns or t_stop + int(s.timeout_s * 1e9)
            t.row.cancel_mono_ns = stop_at
            # a non-streaming client sees no tokens: the request was somewhere in the engine
            self.event("user_stop", t.row.request_id, stop_at, scenario=s.name, phase="in_flight",
                       cancel_id=cid, mode=s.mode, tokens_at_cancel=0,
                       raised_after_deadline_ms=None if t.timeout_fired_ns is None
                       else round((t.timeout_fired_ns - stop_at) / 1e6, 1))
            self._trace_after_stop(t, cid)

    # ------------------------------------------------------------------ triggers and cancels
    async def trigger(self, s: Scenario, targets: list[Request]) -> None:
        first = targets[0]
        v = s.trigger_value
        hit = True
        if s.trigger == "after_ms":
            await asyncio.sleep(v / 1000.0)
        elif s.trigger == "after_tokens":
            hit = await until(lambda: all(t.chunks >= v or t.task.done() for t in targets), 60)
        elif s.trigger == "near_completion_tokens":
            hit = await until(lambda: all(t.chunks >= t.row.max_tokens - v or t.task.done() for t in targets), 60)
        elif s.trigger == "before_first_token":
            await asyncio.sleep(v / 1000.0)
        elif s.trigger == "while_queued":
            def queued() -> bool:
                running, waiting = self.scheduler_now()
                return waiting >= 1 and first.row.first_token_mono_ns is None

            def gone_past() -> bool:
                # once it has a token or an end it will never queue again: waiting longer only lets it finish
                return first.row.first_token_mono_ns is not None or first.task.done()
            await asyncio.sleep(0.1)
            hit = await until(lambda: queued() or gone_past(), 20) and queued()
        if not hit or any(t.task.done() for t in targets):
            # the cancel goes out anyway, and the run says that it did not land where the scenario meant
            running, waiting = self.scheduler_now()
            self.event("trigger_missed", first.row.request_id, scenario=s.name, trigger=s.trigger,
                       trigger_value=v, chunks=[t.chunks for t in targets],
                       done=[t.task.done() for t in targets], running=running, waiting=waiting)

    def _phase(self, s: Scenario, req: Request) -> str:
        if req.task.done():
            return "completed"
        if req.chunks > 0 or req.row.first_token_mono_ns is not None:
            return "decode"
        if s.trigger == "while_queued":
            return "queued"
        return "prefill"

    async def cancel(self, s: Scenario, chosen: list[Request]) -> None:
        self._stopping()
        await asyncio.gather(*(self._cancel(s, t, uuid.uuid4().hex[:8]) for t in chosen))

    async def _cancel(self, s: Scenario, req: Request, cancel_id: str) -> None:
        phase = self._phase(s, req)
        t_stop = now_ns()
        req.cancel_requested = True
        req.row.cancel_mono_ns = t_stop
        self.event("user_stop", req.row.request_id, t_stop, scenario=s.name, phase=phase, cancel_id=cancel_id,
                   mode=s.mode, tokens_at_cancel=req.chunks)
        if s.mode == "explicit":
            explicit = await cancel_in_app(self.client, self.base_url, req)
            req.app_received_ns, req.engine_abort_ns = explicit
        elif s.mode == "disconnect":
            await disconnect(req)
        elif s.mode == "cancel":
            req.task.cancel()
        try:
            await asyncio.wait_for(asyncio.shield(req.task), REQUEST_TIMEOUT_S)
        except (asyncio.CancelledError, asyncio.TimeoutError):
            pass
        if s.mode == "explicit":
            req.app_received_ns, req.engine_abort_ns = explicit  # not the client's view of the closing stream
        if req.row.terminal_state == "completed":
            req.app_received_ns = req.engine_abort_ns = None  # the request won the race
        self._trace_after_stop(req, cancel_id)

    def _trace_after_stop(self, req: Request, cancel_id: str) -> None:
        """What the client side knows after a stop, each under the name of who measured it: the relay's
        own readings (app received, engine abort) in explicit mode; on the HTTP paths only the client's
        stamp of its closed connection. The engine's abort comes from the engine's log, not from here."""
        rid = req.row.request_id
        if req.app_answer is not None:
            self.event("app_answered", rid, req.app_answered_ns, cancel_id=cancel_id, answer=req.app_answer,
                       source="app")
        if req.app_received_ns:
            self.event("app_received", rid, req.app_received_ns, cancel_id=cancel_id, source="relay")
        if req.engine_abort_ns:
            self.event("engine_abort", rid, req.engine_abort_ns, cancel_id=cancel_id, source="relay")
        if req.client_closed_ns:
            self.event("client_closed", rid, req.client_closed_ns, cancel_id=cancel_id, source="client")
