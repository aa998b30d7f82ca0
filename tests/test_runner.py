"""The scenario runner's skeleton (collectors/cancels/runner.py) without an engine: a family whose calls
are in-process and instant shows the order of the steps, the events and the ledger rows; the vLLM driver
runs one scenario on it against an in-test HTTP transport (httpx.MockTransport) streaming SSE."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass, field

import httpx
import pytest

from cancelwatch.collectors.cancels.driver import Driver
from cancelwatch.collectors.cancels.pace import IdleWait
from cancelwatch.collectors.cancels.runner import ScenarioRunner
from cancelwatch.collectors.cancels.scenarios import Scenario
from cancelwatch.collectors.cancels.streams import now_ns
from cancelwatch.collectors.cancels.triton_driver import TritonDriver
from cancelwatch.runstore.records import EventRecord, LedgerRecord


@dataclass(frozen=True)
class FakeScenario:
    name: str = "fake"
    proves: str = "the skeleton's order"
    fillers: int = 2
    targets: int = 2
    stopped: int = 1  # how many of the targets are stopped
    deadline: bool = False  # the stop is the client's own deadline
    hang: bool = False  # the target left running never ends: the runner gives up on it
    repeats: int = 1


@dataclass(eq=False)
class FakeRequest:
    row: LedgerRecord
    done: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def chunks(self) -> int:
        return self.row.chunks

    def end(self, state: str) -> None:
        self.row.terminal_state, self.row.closed_mono_ns = state, now_ns()
        self.done.set()


class FakeFamily(ScenarioRunner):
    """A family whose requests live in the test: sent, they stream one chunk at once; a neighbour,
    filler or probe then completes, a target stays until stopped. `steps` says which hook ran when."""

    IDLE_WAIT_S = 0.3
    NEIGHBOUR_WAIT_S = 1.0
    REQUEST_TIMEOUT_S = 0.3

    def __init__(self, emit, scheduler_now, grace_s: float = 0.3):
        super().__init__(emit, scheduler_now, grace_s=grace_s, metrics_target="fake")
        self.steps: list[str] = []
        self.sent: list[FakeRequest] = []

    @property
    def live(self) -> int:
        """The requests sent and not yet ended, stopped ones included (the server's view, had it no lag)."""
        return sum(not r.done.is_set() for r in self.sent)

    @contextlib.asynccontextmanager
    async def session(self):
        self.steps.append("open")
        try:
            yield
        finally:
            self.steps.append("close")

    def _send(self, s, role: str, i: int = 0, *, ends: bool = True) -> FakeRequest:
        self.steps.append(role)
        req = FakeRequest(LedgerRecord(f"cw-{s.name}-{role}-{i}", s.name, role, max_tokens=4))
        req.row.sent_mono_ns = req.row.first_token_mono_ns = now_ns()
        req.row.chunks = 1
        self.sent.append(req)
        if ends:
            asyncio.get_running_loop().call_later(0.02, req.end, "completed")
        return req

    def ended(self, req):
        return req.done.is_set()

    def ending(self, req):
        return asyncio.create_task(req.done.wait())

    def send_neighbour(self, s, seed):
        return self._send(s, "neighbour")

    async def send_fillers(self, s, seed, reqs):
        reqs += [self._send(s, "filler", i) for i in range(s.fillers)]

    def send_targets(self, s, seed):
        targets = [self._send(s, "target", i, ends=False) for i in range(s.targets)]
        if not s.hang:  # the targets not stopped run to their end
            for t in targets[s.stopped:]:
                asyncio.get_running_loop().call_later(0.05, t.end, "completed")
        return targets, targets[: s.stopped]

    def stops_at_client_deadline(self, s):
        return s.deadline

    async def await_deadlines(self, s, chosen):
        self.steps.append("deadline")
        for t in chosen:
            t.end("cancelled")
            self.event("user_stop", t.row.request_id, scenario=s.name)

    async def trigger(self, s, targets):
        self.steps.append("trigger")

    async def cancel(self, s, chosen):
        self.steps.append("cancel")
        for t in chosen:
            t.row.cancel_mono_ns = now_ns()
            t.end("cancelled")
            self.event("user_stop", t.row.request_id, scenario=s.name)

    def send_probe(self, s, seed, chosen):
        return self._send(s, "probe")

    async def give_up(self, reqs):
        self.steps.append("give_up")
        for r in reqs:
            if not r.done.is_set():
                r.end("error")

    def idle_after(self, reqs):
        return IdleWait(timeout_s=0.3, token_s=0.01, first_token_s=0.1, left_tokens=len(reqs))


def kinds(out: list) -> list[str]:
    """What was emitted, in order: an event's kind, or `row:<role>` for a ledger row."""
    return [o.kind if isinstance(o, EventRecord) else f"row:{o.role}" for o in out]


def test_one_scenario_runs_the_steps_in_order_and_writes_every_row_once():
    out: list = []
    family = FakeFamily(out.append, scheduler_now=lambda: (0, 0))
    reqs = asyncio.run(family.run_scenario(FakeScenario(), repeat=3))
    assert family.steps == ["neighbour", "filler", "filler", "target", "target", "trigger", "cancel", "probe",
                            "give_up"]
    assert kinds(out) == ["scenario_start", "user_stop", "probe_sent", "row:neighbour", "row:filler", "row:filler",
                          "row:target", "row:target", "row:probe", "scenario_end"]
    start, end = out[0], out[-1]
    assert start.data == {"scenario": "fake", "repeat": 3, "proves": "the skeleton's order", "metrics_target": "fake"}
    assert end.data == {"scenario": "fake", "repeat": 3, "metrics_target": "fake"}
    assert out[2].request_id == reqs[-1].row.request_id  # probe_sent names the probe
    rows = [o for o in out if isinstance(o, LedgerRecord)]
    assert [r.terminal_state for r in rows] == ["completed"] * 3 + ["cancelled", "completed", "completed"]


def test_a_deadline_scenario_waits_for_the_deadline_instead_of_a_trigger():
    family = FakeFamily(lambda _: None, scheduler_now=lambda: (0, 0))
    asyncio.run(family.run_scenario(FakeScenario(deadline=True, fillers=0), repeat=0))
    assert family.steps == ["neighbour", "target", "target", "deadline", "probe", "give_up"]


def test_the_probe_waits_until_the_servers_count_matches_the_clients_live_requests():
    # the server counts what the client has live, and the stopped target for 0.2 s after the client let go
    released_at: list[float] = []
    out: list = []

    def scheduler_now():
        stopped = [o for o in out if isinstance(o, EventRecord) and o.kind == "user_stop"]
        if stopped and not released_at:
            released_at.append(time.monotonic() + 0.2)
        lingering = not released_at or time.monotonic() < released_at[0]
        return family.live + lingering, 0

    family = FakeFamily(out.append, scheduler_now, grace_s=2.0)
    asyncio.run(family.run_scenario(FakeScenario(fillers=0, targets=1), repeat=0))
    probe = next(o for o in out if isinstance(o, EventRecord) and o.kind == "probe_sent")
    assert probe.mono_ns >= released_at[0] * 1e9 - 5e6  # not before the server let go (5 ms of clock rounding)
    assert probe.mono_ns < released_at[0] * 1e9 + 0.5e9  # and not only once the grace was over


def test_a_count_that_never_matches_sends_the_probe_when_the_grace_is_over_and_says_the_engine_is_busy():
    out: list = []
    family = FakeFamily(out.append, scheduler_now=lambda: (5, 1), grace_s=0.3)
    t0 = now_ns()
    asyncio.run(family.run_scenario(FakeScenario(fillers=0, targets=1), repeat=0))
    probe = next(o for o in out if isinstance(o, EventRecord) and o.kind == "probe_sent")
    assert (probe.mono_ns - t0) / 1e9 >= 0.3
    (busy,) = [o for o in out if isinstance(o, EventRecord) and o.kind == "engine_not_idle"]
    assert busy.data == {"waited_s": 0.3, "running": 5, "waiting": 1, "token_s": 0.01, "first_token_s": 0.1,
                         "left_tokens": 3, "metrics_target": "fake"}
    assert kinds(out).index("engine_not_idle") > kinds(out).index("row:probe")  # after the rows, before the end
    assert kinds(out)[-1] == "scenario_end"


def test_a_request_that_never_ends_is_given_up_after_the_families_time_and_keeps_its_row():
    out: list = []
    family = FakeFamily(out.append, scheduler_now=lambda: (0, 0))
    t0 = time.monotonic()
    asyncio.run(family.run_scenario(FakeScenario(fillers=0, targets=2, hang=True), repeat=0))
    assert time.monotonic() - t0 >= family.REQUEST_TIMEOUT_S
    rows = {o.request_id: o for o in out if isinstance(o, LedgerRecord)}
    assert rows["cw-fake-target-1"].terminal_state == "error"  # the runner's give_up, not a completion


def test_run_opens_the_session_once_waits_for_idle_and_runs_every_repeat():
    out: list = []
    family = FakeFamily(out.append, scheduler_now=lambda: (0, 0))
    asyncio.run(family.run([FakeScenario(name="a", repeats=2, fillers=0), FakeScenario(name="b", fillers=0)]))
    assert family.steps[0] == "open" and family.steps[-1] == "close" and family.steps.count("open") == 1
    starts = [(o.data["scenario"], o.data["repeat"]) for o in out if getattr(o, "kind", None) == "scenario_start"]
    assert starts == [("a", 0), ("a", 1), ("b", 0)]


def test_the_session_closes_when_a_scenario_fails():
    class Failing(FakeFamily):
        async def trigger(self, s, targets):
            raise RuntimeError("the target went away")

    family = Failing(lambda _: None, scheduler_now=lambda: (0, 0))
    with pytest.raises(RuntimeError, match="went away"):
        asyncio.run(family.run([FakeScenario(fillers=0)]))
    assert family.steps[-1] == "close"


@pytest.mark.parametrize("family", [Driver, TritonDriver])
def test_each_family_supplies_every_step(family):
    hooks = [name for name, fn in vars(ScenarioRunner).items() if callable(fn) and _raises_not_implemented(fn)]
    assert len(hooks) >= 10
    assert [h for h in hooks if getattr(family, h) is getattr(ScenarioRunner, h)] == []


def _raises_not_implemented(fn) -> bool:
    try:
        code = fn.__code__
    except AttributeError:
        return False
    return "NotImplementedError" in code.co_names


def sse_server(slow_roles: tuple[str, ...] = ("target",)):
    """An OpenAI-compatible completions endpoint: one-token chunks, 5 ms apart (50 ms for `slow_roles`),
    up to the request's max_tokens, then the finish marker and [DONE]."""

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        role = request.headers["X-Request-Id"].split("-")[2]

        async def stream():
            for i in range(body["max_tokens"]):
                await asyncio.sleep(0.05 if role in slow_roles else 0.005)
                last = i == body["max_tokens"] - 1
                chunk = {"choices": [{"index": 0, "text": f" w{i}", "finish_reason": "length" if last else None}]}
                yield f"data: {json.dumps(chunk)}\n\n".encode()
            yield b"data: [DONE]\n\n"

        return httpx.Response(200, content=stream())

    return httpx.MockTransport(handler)


async def run_one_vllm_scenario(s: Scenario, out: list) -> list:
    driver = Driver("http://127.0.0.1:9", "tiny", out.append, scheduler_now=lambda: (0, 0), grace_s=0.3)
    async with httpx.AsyncClient(transport=sse_server()) as client:
        driver.client = client
        reqs = await driver.run_scenario(s, repeat=0)
    assert driver.open == []  # every row written: nothing left for write_open_rows
    return reqs


def test_the_vllm_driver_runs_a_cancel_on_the_runner():
    s = Scenario("decode", "cancelled after streamed tokens", trigger="after_tokens", trigger_value=3,
                 prompt_tokens=20, max_tokens=200, fillers=1, filler_max_tokens=5, neighbour_max_tokens=10,
                 probe_max_tokens=3)
    out: list = []
    reqs = asyncio.run(run_one_vllm_scenario(s, out))
    assert kinds(out) == ["scenario_start", "user_stop", "client_closed", "probe_sent", "row:neighbour",
                          "row:filler", "row:target", "row:probe", "scenario_end"]
    stop = out[1]
    assert stop.data["mode"] == "cancel" and stop.data["phase"] == "decode" and stop.data["tokens_at_cancel"] >= 3
    assert out[2].data == {"cancel_id": stop.data["cancel_id"], "source": "client", "metrics_target": "t0"}
    rows = {r.row.role: r.row for r in reqs}
    assert rows["target"].terminal_state == "cancelled" and rows["target"].cancel_mono_ns == stop.mono_ns
    assert all(rows[r].terminal_state == "completed" for r in ("neighbour", "filler", "probe"))
    assert rows["neighbour"].chunks == 10 and rows["probe"].chunks == 3
