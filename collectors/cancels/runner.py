"""The scenario runner: the steps every engine family's scenario takes, written once.

A scenario is the same story on every server: a neighbour that must keep going is sent and seen
streaming; fillers, then the target(s); the stop (the scenario's trigger and cancel, or the client's
own deadline); the probe, sent once the server's count agrees with the client's live requests; the
rest awaited, bounded; the ledger rows; an idle engine; the grace window sampled. `ScenarioRunner`
holds that skeleton and the events it writes (scenario_start/end, probe_sent, engine_not_idle); a
family (driver.py: vLLM over HTTP; triton_driver.py: Triton) subclasses it with how its requests are
built, sent and given up on, its trigger, what its stop events carry, and its scenario table.
Every wait here is bounded in time, every loop in count.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

from cancelwatch.collectors.cancels.pace import IdleWait
from cancelwatch.collectors.cancels.streams import now_ns
from cancelwatch.runstore.records import EventRecord


def event_record(kind: str, request_id: str | None, at_ns: int | None, metrics_target: str, data: dict) -> EventRecord:
    """A trace or scenario event at `at_ns` (monotonic; now when None), its wall time derived from now."""
    data.setdefault("metrics_target", metrics_target)
    mono = at_ns or now_ns()
    wall = time.time_ns() - (now_ns() - mono)
    return EventRecord(kind=kind, wall_ns=wall, mono_ns=mono, request_id=request_id, data=data)


async def until(cond, timeout_s: float) -> bool:
    """Poll `cond` every 5 ms for at most `timeout_s`; its last value."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        await asyncio.sleep(0.005)
    return cond()


class ScenarioRunner:
    """Runs a family's scenarios one after another; `emit` receives EventRecords and LedgerRecords.

    `scheduler_now()` returns the latest sampled (running, waiting) of the metrics target: the probe
    waits for it to agree with the client, and the next scenario for it to show an idle engine.

    A family sets the class constants and implements the hooks below the line; a request is whatever
    its family sends, with `.row` (its LedgerRecord) and `.chunks`.
    """

    IDLE_WAIT_S: float  # the wait for an idle engine before the first scenario (and where no pace is known)
    NEIGHBOUR_WAIT_S: float  # how long the neighbour may take to its first chunk
    REQUEST_TIMEOUT_S: float  # the longest the scenario waits for its requests to end

    def __init__(self, emit, scheduler_now, grace_s: float = 2.0, metrics_target: str = "t0"):
        self.emit = emit
        self.scheduler_now = scheduler_now
        self.grace_s = grace_s
        self.metrics_target = metrics_target

    def event(self, kind: str, request_id: str | None = None, at_ns: int | None = None, **data) -> None:
        self.emit(event_record(kind, request_id, at_ns, self.metrics_target, data))

    # ------------------------------------------------------------------ the skeleton
    async def run(self, scenarios: list) -> None:
        async with self.session():
            await self.wait_idle()
            for s in scenarios:
                runner = await self.runner_for(s)
                for repeat in range(s.repeats):
                    await runner.run_scenario(s, repeat)

    async def run_scenario(self, s, repeat: int) -> list:
        # a scenario type that names the verdict it is built to show (Triton's) says it at the start
        expected = {} if getattr(s, "expect", None) is None else {"expect": s.expect}
        self.event("scenario_start", None, scenario=s.name, repeat=repeat, proves=s.proves, **expected)
        seed = hash((s.name, repeat, uuid.uuid4().hex)) % 10_000  # the prompts' seed, for a family that writes them
        neighbour = self.send_neighbour(s, seed)
        reqs = [neighbour]
        await until(lambda: neighbour.chunks > 0 or self.ended(neighbour), self.NEIGHBOUR_WAIT_S)
        await self.send_fillers(s, seed, reqs)
        targets, chosen = self.send_targets(s, seed)
        reqs += targets
        if self.stops_at_client_deadline(s):
            await self.await_deadlines(s, chosen)
        else:
            await self.trigger(s, targets)
            await self.cancel(s, chosen)
        reqs.append(await self._probe(s, seed, reqs, chosen))
        await self._end_rest(reqs, chosen)
        self.write_rows(reqs)
        await self.wait_idle(self.idle_after(reqs))
        await asyncio.sleep(max(0.0, self.grace_s - 0.2))  # the verdict's grace window is sampled, not guessed
        self.event("scenario_end", None, scenario=s.name, repeat=repeat)
        return reqs

    async def _probe(self, s, seed: int, reqs: list, chosen: list):
        """The probe: must be admitted into the capacity the cancel freed. It is sent once the server's
        count matches the client's in-flight requests (or the grace is over), so that while the verdict
        is open no request of unknown whereabouts stands in for one that never left."""
        def reconciled() -> bool:
            running, waiting = self.scheduler_now()
            return running + waiting <= sum(r.row.n for r in reqs if r not in chosen and not self.ended(r))

        await until(reconciled, self.grace_s)
        probe = self.send_probe(s, seed, chosen)
        self.event("probe_sent", probe.row.request_id, scenario=s.name)
        return probe

    async def _end_rest(self, reqs: list, chosen: list) -> None:
        """Wait for the requests not stopped (bounded), then end what is still open."""
        await asyncio.wait([self.ending(r) for r in reqs if r not in chosen], timeout=self.REQUEST_TIMEOUT_S)
        await self.give_up(reqs)

    def write_rows(self, reqs: list) -> None:
        for r in reqs:
            self.emit(r.row)

    async def wait_idle(self, wait: IdleWait | float | None = None) -> bool:
        """Until the scheduler shows nothing running or waiting, for at most `wait` (an IdleWait derived
        from a scenario's pace, or seconds; IDLE_WAIT_S when None)."""
        wait = self.IDLE_WAIT_S if wait is None else wait
        timeout_s = wait.timeout_s if isinstance(wait, IdleWait) else wait

        def idle() -> bool:
            running, waiting = self.scheduler_now()
            return running == 0 and waiting == 0
        await asyncio.sleep(0.2)
        ok = await until(idle, timeout_s)
        if not ok:
            # the next scenario starts beside work the client does not know of: the run says so, with
            # what the wait was derived from
            running, waiting = self.scheduler_now()
            derived = {} if not isinstance(wait, IdleWait) else {
                "token_s": wait.token_s, "first_token_s": wait.first_token_s, "left_tokens": wait.left_tokens}
            self.event("engine_not_idle", None, waited_s=round(timeout_s, 1), running=running, waiting=waiting,
                       **derived)
        return ok

    # ------------------------------------------------------------------ what a family supplies
    def session(self) -> contextlib.AbstractAsyncContextManager:
        """The family's clients, open for the whole run (and what is left to write when it ends early)."""
        raise NotImplementedError

    async def runner_for(self, s) -> "ScenarioRunner":
        """Who runs scenario `s`: this runner, or one of another target (vLLM's relay app)."""
        return self

    def ended(self, req) -> bool:
        """Whether the client's view of `req` has ended."""
        raise NotImplementedError

    def ending(self, req) -> asyncio.Future:
        """An awaitable done once `req` ends (for asyncio.wait)."""
        raise NotImplementedError

    def send_neighbour(self, s, seed: int):
        raise NotImplementedError

    async def send_fillers(self, s, seed: int, reqs: list) -> None:
        """Send the scenario's fillers (appended to `reqs`) and wait as the family's queueing needs."""
        raise NotImplementedError

    def send_targets(self, s, seed: int) -> tuple[list, list]:
        """(the targets sent, those of them the scenario stops)."""
        raise NotImplementedError

    def stops_at_client_deadline(self, s) -> bool:
        """Whether the stop is the client's own deadline (a timeout) rather than a trigger and a cancel."""
        raise NotImplementedError

    async def await_deadlines(self, s, chosen: list) -> None:
        """Wait for the client's deadlines to pass (bounded) and write the stop events."""
        raise NotImplementedError

    async def trigger(self, s, targets: list) -> None:
        """Wait for the scenario's trigger (bounded); `trigger_missed` where it never held."""
        raise NotImplementedError

    async def cancel(self, s, chosen: list) -> None:
        """Give up on `chosen` the scenario's way and write the stop events."""
        raise NotImplementedError

    def send_probe(self, s, seed: int, chosen: list):
        raise NotImplementedError

    async def give_up(self, reqs: list) -> None:
        """End every request of `reqs` still open once the scenario's time for them is over."""
        raise NotImplementedError

    def idle_after(self, reqs: list) -> IdleWait | float:
        """How long the engine may stay busy after the scenario of `reqs`."""
        raise NotImplementedError
