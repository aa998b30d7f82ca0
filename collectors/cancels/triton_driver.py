"""Scripted cancels against Triton Inference Server: the scenarios, and the driver that runs them.

The scenario's steps are the runner's (runner.py), as for vLLM: a neighbour on its own stream that
must keep going, the target(s) cancelled by the scenario's call (triton_calls), then a probe that
must be served. This module holds what is Triton's: the scenario table, the requests and their
calls, the trigger, what a stop event carries. Events and ledger rows are the same records; the
verdict comes from the server's evidence (analysis), never from the client's CANCELLED. Every
request loop is bounded in count and time.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from dataclasses import dataclass

from cancelwatch.collectors.cancels.runner import ScenarioRunner, until
from cancelwatch.collectors.cancels.streams import now_ns
from cancelwatch.collectors.cancels.triton_calls import CALL_OBJECTS, REQUEST_TIMEOUT_S, Calls, SharedStream, TritonRequest
from cancelwatch.runstore.extras import lacking
from cancelwatch.runstore.records import LedgerRecord

IDLE_WAIT_S = 30.0
NEIGHBOUR_TOKENS = 80  # 4 s at the generators' 50 ms step: it spans every cancel's window


@dataclass(frozen=True)
class TritonScenario:
    """One Triton cancel. `call` is how the client gives up (triton_calls); `model` which model serves it.

    tokens: the generator's N; ms: the slow model's execution time; trigger_responses: responses
    received before the stop (generators); trigger_ms: time after sending before the stop (slow);
    fillers: slow requests sent ahead so that the target waits in the core's queue; targets: requests
    cancelled together (one stream for stream_wide); timeout_s: the deadline or HTTP timeout;
    expect: the verdict the scenario is built to show.
    """

    name: str
    proves: str
    model: str
    call: str
    tokens: int = 200
    ms: int = 3000
    trigger_responses: int = 10
    trigger_ms: float = 400.0
    fillers: int = 0
    filler_ms: int = 700
    targets: int = 1
    timeout_s: float = 1.0
    expect: str = "released"
    phase: str = "executing"
    repeats: int = 1


TRITON_SCENARIOS: dict[str, TritonScenario] = {s.name: s for s in (
    TritonScenario("triton_queued", "a request cancelled while it waits in the core's queue is dropped there "
                   "(failure CANCELED +1, pending -1) and never reaches the model",
                   model="slow", call="explicit", ms=500, fillers=4, filler_ms=700, trigger_ms=400, phase="queued"),
    TritonScenario("triton_executing", "a request cancelled while the model runs it: the model sees is_cancelled, "
                   "its steps stop", model="generator", call="task_cancel", tokens=200, trigger_responses=10),
    TritonScenario("triton_stream_wide", "stop_stream(cancel_requests=True) cancels every request of that stream; "
                   "a neighbour on another stream continues", model="generator", call="stream_wide", tokens=200,
                   trigger_responses=10, targets=2),
    TritonScenario("triton_deadline", "a gRPC deadline that passes while the model runs is a cancel the server "
                   "enforces", model="slow", call="deadline", ms=3000, timeout_s=1.0, phase="in_flight"),
    TritonScenario("triton_disconnect", "the client's channel closed without a cancel call: the server cancels "
                   "the request", model="generator", call="disconnect", tokens=200, trigger_responses=10),
    TritonScenario("triton_http_timeout", "a non-streaming HTTP request whose client timed out runs to its end: "
                   "HTTP carries no cancel", model="slow", call="http_timeout", ms=2500, timeout_s=0.8,
                   expect="leaked", phase="in_flight"),
    TritonScenario("triton_deaf", "a backend that never polls is_cancelled runs on for nobody after a real cancel",
                   model="generator_deaf", call="stream_wide", tokens=60, trigger_responses=10, expect="leaked"),
    TritonScenario("triton_hoard", "a backend that sees the cancel and says so, and stops counting the request, but "
                   "keeps its buffer: the model's word alone is not a release", model="generator_hoard",
                   call="task_cancel", tokens=200, trigger_responses=10, expect="leaked"),
)}
SUITE = list(TRITON_SCENARIOS)


def resolve_triton(spec: str) -> list[TritonScenario]:
    """`triton` (the suite), a scenario name, or a comma-separated list of them."""
    # tritonclient[grpc]: the client and grpcio, which tritonclient alone does not bring
    if (need := lacking("triton", ("tritonclient", "grpc"), "Triton's gRPC cancels")) is not None:
        raise ValueError(need)
    out: list[TritonScenario] = []
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        if part in ("triton", "default"):
            out += [TRITON_SCENARIOS[n] for n in SUITE]
        elif part in TRITON_SCENARIOS:
            out.append(TRITON_SCENARIOS[part])
        else:
            raise ValueError(f"--scenario {part!r} is not a Triton scenario: use triton or one of {', '.join(SUITE)}")
    return out


class TritonDriver(ScenarioRunner):
    """Runs Triton scenarios one after another; `emit` receives EventRecords and LedgerRecords.

    `scheduler_now()` returns the latest sampled (running, waiting) of the Triton target: the models'
    active requests and the core's pending ones."""

    IDLE_WAIT_S = IDLE_WAIT_S
    NEIGHBOUR_WAIT_S = 10
    REQUEST_TIMEOUT_S = REQUEST_TIMEOUT_S

    def __init__(self, grpc_url: str, http_url: str, emit, scheduler_now, grace_s: float = 2.0,
                 metrics_target: str = "t0"):
        super().__init__(emit, scheduler_now, grace_s=grace_s, metrics_target=metrics_target)
        self.calls = Calls(grpc_url, http_url)

    @contextlib.asynccontextmanager
    async def session(self):
        await self.calls.open()
        try:
            yield
        finally:
            await self.calls.close()

    # ------------------------------------------------------------------ requests
    def new(self, s: TritonScenario, role: str, model: str, call: str, inputs: dict,
            stream: SharedStream | None = None) -> TritonRequest:
        rid = f"cw-{s.name}-{role}-{uuid.uuid4().hex[:8]}"
        max_tokens = int(inputs.get("N", 1))
        row = LedgerRecord(request_id=rid, scenario=s.name, role=role, max_tokens=max_tokens)
        return TritonRequest(row=row, model=model, call=call, inputs=dict(inputs), stream=stream)

    def send(self, req: TritonRequest, protocol: str = "grpc") -> TritonRequest:
        # the request's identity beside the library call object it maps to
        self.event("request_sent", req.row.request_id, scenario=req.row.scenario, role=req.row.role, model=req.model,
                   call=req.call, call_object=CALL_OBJECTS[req.call], protocol=protocol)
        self.calls.send(req)
        return req

    def ended(self, req: TritonRequest) -> bool:
        return req.done.is_set()

    def ending(self, req: TritonRequest) -> asyncio.Task:
        return asyncio.create_task(req.done.wait())

    def _target_inputs(self, s: TritonScenario) -> dict:
        if s.model == "slow":
            inputs = {"MS": s.ms}
            if s.call == "deadline":
                inputs["_deadline_s"] = s.timeout_s
            if s.call == "http_timeout":
                inputs["_timeout_s"] = s.timeout_s
            return inputs
        return {"N": s.tokens}

    def send_neighbour(self, s: TritonScenario, seed: int) -> TritonRequest:
        return self.send(self.new(s, "neighbour", "generator", "stream", {"N": NEIGHBOUR_TOKENS}))

    async def send_fillers(self, s: TritonScenario, seed: int, reqs: list[TritonRequest]) -> None:
        for i in range(s.fillers):
            reqs.append(self.send(self.new(s, "filler", "slow", "unary", {"MS": s.filler_ms})))
            await asyncio.sleep(0.05)  # in order: the target queues behind all of them

    def send_targets(self, s: TritonScenario, seed: int) -> tuple[list[TritonRequest], list[TritonRequest]]:
        stream = SharedStream(self.calls) if s.call == "stream_wide" else None
        targets = [self.send(self.new(s, "target", s.model, s.call, self._target_inputs(s), stream=stream),
                             protocol="http" if s.call == "http_timeout" else "grpc")
                   for _ in range(s.targets)]
        return targets, targets  # every target is stopped

    def send_probe(self, s: TritonScenario, seed: int, chosen: list[TritonRequest]) -> TritonRequest:
        probe_inputs = {"MS": 50} if s.model == "slow" else {"N": 3}
        return self.send(self.new(s, "probe", "slow" if s.model == "slow" else "generator",
                                  "unary" if s.model == "slow" else "stream", probe_inputs))

    async def give_up(self, reqs: list[TritonRequest]) -> None:
        for r in reqs:
            if not r.done.is_set():
                r.end("error", None, "the driver's time for the scenario ran out")
                if isinstance(r.handle, asyncio.Task):
                    r.handle.cancel()

    def idle_after(self, reqs: list[TritonRequest]) -> float:
        return IDLE_WAIT_S

    # ------------------------------------------------------------------ stops
    def stops_at_client_deadline(self, s: TritonScenario) -> bool:
        return s.call in ("deadline", "http_timeout")

    async def await_deadlines(self, s: TritonScenario, chosen: list[TritonRequest]) -> None:
        # the client's own timeout is the stop: wait for it to fire (or the request to end)
        await asyncio.wait([asyncio.create_task(t.done.wait()) for t in chosen], timeout=REQUEST_TIMEOUT_S)
        for t in chosen:
            self._stop_events(s, t, t.row.cancel_mono_ns or now_ns(), uuid.uuid4().hex[:8])

    async def trigger(self, s: TritonScenario, targets: list[TritonRequest]) -> None:
        if s.model == "slow":
            await asyncio.sleep(s.trigger_ms / 1000.0)
            hit = not any(t.done.is_set() for t in targets)
        else:
            hit = await until(lambda: all(t.chunks >= s.trigger_responses or t.done.is_set() for t in targets),
                                    30)
            hit = hit and not any(t.done.is_set() for t in targets)
        if not hit:
            running, waiting = self.scheduler_now()
            self.event("trigger_missed", targets[0].row.request_id, scenario=s.name, trigger="responses"
                       if s.model != "slow" else "after_ms", chunks=[t.chunks for t in targets],
                       done=[t.done.is_set() for t in targets], running=running, waiting=waiting)

    async def cancel(self, s: TritonScenario, chosen: list[TritonRequest]) -> None:
        t_stop = now_ns()
        ids = [uuid.uuid4().hex[:8] for _ in chosen]
        for t in chosen:
            t.cancel_requested = True
            t.row.cancel_mono_ns = t_stop
        if s.call == "stream_wide":
            await self.calls.cancel(chosen[0])  # one call: the whole stream goes
        else:
            await asyncio.gather(*(self.calls.cancel(t) for t in chosen))
        await asyncio.wait([asyncio.create_task(t.done.wait()) for t in chosen], timeout=5)
        for t, cid in zip(chosen, ids):
            self._stop_events(s, t, t_stop, cid)

    def _stop_events(self, s: TritonScenario, t: TritonRequest, t_stop: int, cancel_id: str) -> None:
        rid = t.row.request_id
        # what the request would have done on its own, for telling a release from a natural end
        inputs = {k: v for k, v in t.inputs.items() if not k.startswith("_")}
        self.event("user_stop", rid, t_stop, scenario=s.name, phase=s.phase, cancel_id=cancel_id, mode=s.call,
                   model=t.model, tokens_at_cancel=t.chunks, expect=s.expect, engine="triton", inputs=inputs,
                   step_s=t.step_s(), sent_mono_ns=t.row.sent_mono_ns)
        if t.client_closed_ns:
            # the client's own view of its end (CANCELLED, a deadline, a timeout): never server evidence
            self.event("client_closed", rid, t.client_closed_ns, cancel_id=cancel_id, source="client",
                       client_saw=t.row.reason)
