"""The relay's contract, one test per point, on vLLM's real in-process AsyncLLM where the point involves the engine."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import pytest
from vllm import SamplingParams

from cancelwatch.collectors.engines.relay import AlreadyRan, Relay, RequestCancelled


def prompt(n: int, seed: int = 0) -> str:
    return " ".join(f"w{(seed * 31 + i) % 1000}" for i in range(n))


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)


class Engine:
    """The real AsyncLLM behind the relay, counting what the relay asks of it."""

    def __init__(self, llm, abort_failures: int = 0):
        self.llm = llm
        self.generated: list[str] = []
        self.aborts: list[str] = []
        self.abort_failures = abort_failures

    def generate(self, engine_id, payload):
        self.generated.append(engine_id)
        text, max_tokens = payload
        return self.llm.generate(text, params(max_tokens), engine_id)

    async def abort(self, engine_id):
        self.aborts.append(engine_id)
        if self.abort_failures > 0:
            self.abort_failures -= 1
            raise ConnectionError("engine core unreachable (injected)")
        await self.llm.abort(engine_id)

    def in_engine(self, engine_id: str) -> bool:
        """The engine front end still tracks it (vLLM appends its own suffix to the external id)."""
        op = self.llm.output_processor
        return any(i in op.request_states for i in op.external_req_ids.get(engine_id, []))


def make_relay(engine: Engine, **kw):
    events = []
    relay = Relay(engine.generate, engine.abort, on_event=lambda kind, e, **d: events.append((kind, e.request_id)), **kw)
    return relay, events


async def consume(relay, rid, owner, payload, after=None, got=None):
    n = 0
    async for _ in relay.stream(rid, owner, payload):
        n += 1
        if got is not None:
            got.append(n)
        if after is not None and n == after:
            await asyncio.sleep(0)
    return n


async def cancel_mid_stream(relay, rid, outputs=3, max_tokens=1000):
    """Start `rid` for alice, let `outputs` outputs through, cancel it as alice, and see its serving
    task end cancelled (bounded); returns the outputs counted."""
    got = []
    task = asyncio.create_task(consume(relay, rid, "alice", (prompt(50), max_tokens), got=got))
    assert await until(lambda: len(got) >= outputs), f"{len(got)} outputs within {ENGINE_WAIT_S:.0f} s"
    await relay.cancel(rid, "alice")
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, ENGINE_WAIT_S)
    return got


# a wait for the engine (its first outputs, an abort, a task ending): a deadline for an engine several times
# slower than where these ran in well under a second, and over as soon as what it waits for holds
ENGINE_WAIT_S = 60.0


async def until(cond, timeout=ENGINE_WAIT_S):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        await asyncio.sleep(0.01)
    return cond()


def test_registry_maps_the_request_to_its_engine_id_and_owner(loop, llm):
    async def go():
        eng = Engine(llm)
        relay, _ = make_relay(eng)
        got = []
        task = asyncio.create_task(consume(relay, "reg-1", "alice", (prompt(50), 400), got=got))
        assert await until(lambda: len(got) >= 3), f"{len(got)} outputs within {ENGINE_WAIT_S:.0f} s"
        entry = relay.entries["reg-1"]
        assert entry.owner == "alice" and entry.task is task
        assert entry.engine_request_id.startswith("reg-1-") and eng.in_engine(entry.engine_request_id)
        assert await relay.cancel("reg-1", "alice") == "cancelled"
        with pytest.raises(asyncio.CancelledError):
            await task
    loop.run_until_complete(go())


def test_a_cancel_from_another_owner_is_refused(loop, llm):
    async def go():
        eng = Engine(llm)
        relay, _ = make_relay(eng)
        got = []
        task = asyncio.create_task(consume(relay, "own-1", "alice", (prompt(50), 60), got=got))
        assert await until(lambda: len(got) >= 3), f"{len(got)} outputs within {ENGINE_WAIT_S:.0f} s"
        assert await relay.cancel("own-1", "mallory") == "rejected_not_owner"
        assert await task == 60  # ran to the end
        assert relay.entries["own-1"].state == "completed" and eng.aborts == []
    loop.run_until_complete(go())


def test_a_cancel_before_registration_is_kept_and_the_request_never_starts(loop, llm):
    async def go():
        eng = Engine(llm)
        relay, events = make_relay(eng)
        assert await relay.cancel("early-1", "alice") == "kept_until_registered"
        with pytest.raises(RequestCancelled, match="before it started"):
            await consume(relay, "early-1", "alice", (prompt(50), 50))
        assert eng.generated == [] and eng.aborts == []  # the engine never saw it
        entry = relay.entries["early-1"]
        assert ("cancelled", "early-1") in events and entry.state == "cancelled" and entry.abort is None
        # rejected, and still never started: a client told "rejected" must not see its request run
        strict, _ = make_relay(eng, early_cancel="reject")
        assert await strict.cancel("early-2", "alice") == "rejected_unknown"
        with pytest.raises(RequestCancelled, match="before it started"):
            await consume(strict, "early-2", "alice", (prompt(50), 50))
        assert eng.generated == [] and eng.aborts == []
    loop.run_until_complete(go())


def test_completion_and_cancel_race_through_one_terminal_transition(loop, llm):
    async def go():
        outcomes = set()
        for i in range(6):
            eng = Engine(llm)
            relay, events = make_relay(eng)
            got = []
            rid = f"race-{i}"
            task = asyncio.create_task(consume(relay, rid, "alice", (prompt(20, i), 12), got=got))
            await until(lambda: len(got) >= 10 + (i % 3) or task.done())
            answer = await relay.cancel(rid, "alice")
            try:
                await task
            except asyncio.CancelledError:
                pass
            terminal = [k for k, r in events if r == rid and k in ("completed", "cancelled", "error")]
            assert len(terminal) == 1, events
            state = relay.entries[rid].state
            assert answer == ("cancelled" if state == "cancelled" else f"already_{state}")
            assert (eng.aborts != []) == (state == "cancelled")
            outcomes.add(state)
        assert outcomes <= {"completed", "cancelled"}
    loop.run_until_complete(go())


def test_the_finally_path_awaits_abort_and_closes_the_iterator(loop, llm):
    async def go():
        eng = Engine(llm)
        relay, events = make_relay(eng)
        got, at = [], []
        task = asyncio.create_task(consume(relay, "fin-1", "alice", (prompt(100), 1000), got=got))
        assert await until(lambda: len(got) >= 5), f"{len(got)} outputs within {ENGINE_WAIT_S:.0f} s"
        # the engine's pace on this machine: the time between outputs, measured over the next few
        at.append(time.monotonic())
        assert await until(lambda: len(got) >= 10), f"{len(got)} outputs within {ENGINE_WAIT_S:.0f} s"
        output_s = (time.monotonic() - at[0]) / 5
        engine_id = relay.entries["fin-1"].engine_request_id
        assert eng.in_engine(engine_id)
        await relay.cancel("fin-1", "alice")
        with pytest.raises(asyncio.CancelledError):
            await task
        entry = relay.entries["fin-1"]
        # by the time the serving task is done, abort() has returned and the engine dropped it
        assert eng.aborts == [engine_id] and entry.abort_ok and entry.abort == "sent"
        assert entry.engine_abort_ns >= entry.app_received_ns
        assert not eng.in_engine(engine_id)
        assert ("abort_returned", "fin-1") in events
        # and the engine really stopped: no outputs arrive after the abort, in the time ten more would
        # have taken at the pace measured above (0.3 s at least)
        n = len(got)
        quiet_s = max(0.3, 10 * output_s)
        await asyncio.sleep(quiet_s)
        assert len(got) == n, f"{len(got) - n} outputs in {quiet_s:.2f} s after the abort"
    loop.run_until_complete(go())


def test_a_failing_abort_is_retried_alerted_and_never_released(loop, llm, caplog):
    async def go():
        eng = Engine(llm, abort_failures=5)
        relay, events = make_relay(eng, max_abort_attempts=3, abort_retry_s=0.01)
        await cancel_mid_stream(relay, "fail-1")
        entry = relay.entries["fail-1"]
        assert entry.abort_attempts == 3 and entry.abort_ok is False and entry.abort == "failed"
        assert relay.status("fail-1")["abort"] == "failed" and "released" not in relay.status("fail-1")
        assert ("abort_failed", "fail-1") in events
        await llm.abort(entry.engine_request_id)  # clean up behind the injected failure
        # a transient failure (raised, nothing half done): retried until it goes through, then sent
        eng2 = Engine(llm, abort_failures=2)
        relay2, _ = make_relay(eng2, max_abort_attempts=3, abort_retry_s=0.01)
        await cancel_mid_stream(relay2, "fail-2")
        assert relay2.entries["fail-2"].abort_attempts == 3 and relay2.entries["fail-2"].abort == "sent"
    with caplog.at_level(logging.WARNING, logger="cancelwatch.relay"):
        loop.run_until_complete(go())
    assert any("ALERT" in r.message for r in caplog.records if r.levelno == logging.ERROR)
    assert sum("attempt" in r.message for r in caplog.records if r.levelno == logging.WARNING) >= 3


def test_a_duplicate_cancel_is_idempotent_and_touches_no_other_request(loop, llm):
    async def go():
        eng = Engine(llm)
        relay, _ = make_relay(eng)
        got_a, got_b = [], []
        a = asyncio.create_task(consume(relay, "dup-a", "alice", (prompt(50, 1), 1000), got=got_a))
        b = asyncio.create_task(consume(relay, "dup-b", "alice", (prompt(50, 2), 80), got=got_b))
        assert await until(lambda: len(got_a) >= 3 and len(got_b) >= 3), (len(got_a), len(got_b))
        assert await relay.cancel("dup-a", "alice") == "cancelled"
        assert await relay.cancel("dup-a", "alice") == "already_cancelled"
        with pytest.raises(asyncio.CancelledError):
            await a
        assert await relay.cancel("dup-a", "alice") == "already_cancelled"
        assert await b == 80 and relay.entries["dup-b"].state == "completed"
        assert eng.aborts == [relay.entries["dup-a"].engine_request_id]
    loop.run_until_complete(go())


def test_a_cancelled_request_is_never_retried(loop, llm):
    async def go():
        eng = Engine(llm)
        relay, _ = make_relay(eng)
        await cancel_mid_stream(relay, "once-1")
        calls = len(eng.generated)
        with pytest.raises(RequestCancelled, match="not retried"):
            await consume(relay, "once-1", "alice", (prompt(50), 10))
        assert len(eng.generated) == calls
        await consume(relay, "once-2", "alice", (prompt(10), 3))
        with pytest.raises(AlreadyRan):
            await consume(relay, "once-2", "alice", (prompt(10), 3))
    loop.run_until_complete(go())


class Tracked:
    """The engine's output iterator, remembering whether the relay closed it."""

    def __init__(self, outputs):
        self.outputs = outputs
        self.closed = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await self.outputs.__anext__()

    async def aclose(self):
        self.closed = True
        await self.outputs.aclose()


class TrackedEngine(Engine):
    def __init__(self, llm, abort_failures: int = 0, abort_hangs: int = 0):
        super().__init__(llm, abort_failures)
        self.abort_hangs = abort_hangs
        self.streams: list[Tracked] = []

    def generate(self, engine_id, payload):
        if isinstance(payload, dict):  # relay_app's payload: prompt and SamplingParams
            self.generated.append(engine_id)
            stream = Tracked(self.llm.generate(payload["prompt"], payload["params"], engine_id))
        else:
            stream = Tracked(super().generate(engine_id, payload))
        self.streams.append(stream)
        return stream

    async def abort(self, engine_id):
        if self.abort_hangs > 0:
            self.abort_hangs -= 1
            self.aborts.append(engine_id)
            await asyncio.sleep(3600)  # an engine core that never answers
        await super().abort(engine_id)


def scheduled() -> float | None:
    """Running + waiting requests on the engine core's scheduler, as its stats reach this process's own
    gauges (what relay_app serves on /metrics): the scheduler itself, not the front end's state."""
    from cancelwatch.collectors.engines.relay_app import scheduler_count

    return scheduler_count()


async def beside_a_neighbour(relay, rid, seen=None):
    """`rid` cancelled while a long neighbour runs beside it (its steps keep the gauges fresh); the
    neighbour is cancelled after. Returns its entry; `seen["count"]`: the scheduler's count at the cancel."""
    got = []
    neighbour = asyncio.create_task(consume(relay, f"{rid}-nb", "bob", (prompt(40, 7), 3000), got=got))
    assert await until(lambda: len(got) >= 3), f"{len(got)} neighbour outputs within {ENGINE_WAIT_S:.0f} s"
    assert await until(lambda: (scheduled() or 0) >= 1), scheduled()
    try:
        got_tg = []
        task = asyncio.create_task(consume(relay, rid, "alice", (prompt(50), 400), got=got_tg))
        assert await until(lambda: len(got_tg) >= 3 and (scheduled() or 0) >= 2), (len(got_tg), scheduled())
        if seen is not None:
            seen["count"] = scheduled()
        await relay.cancel(rid, "alice")
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, ENGINE_WAIT_S)
        return relay.entries[rid]
    finally:
        await relay.cancel(f"{rid}-nb", "bob")
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(neighbour, ENGINE_WAIT_S)


def test_an_abort_that_hangs_is_cut_off_retried_and_sent_once_the_scheduler_lets_it_go(loop, llm, caplog):
    async def go():
        eng = TrackedEngine(llm, abort_hangs=1)
        relay, events = make_relay(eng, abort_timeout_s=0.3, abort_retry_s=0.01, scheduler_count=scheduled,
                                   confirm_s=ENGINE_WAIT_S / 4)
        entry = await beside_a_neighbour(relay, "hang-1")
        assert entry.abort_attempts == 2 and entry.abort == "sent" and not eng.in_engine(entry.engine_request_id)
        assert eng.streams[0].closed
    with caplog.at_level(logging.WARNING, logger="cancelwatch.relay"):
        loop.run_until_complete(go())
    assert any("no answer within 0.3 s" in r.message for r in caplog.records)
    assert not any("ALERT" in r.message for r in caplog.records), [r.message for r in caplog.records]


class HollowEngine(TrackedEngine):
    """An abort whose first attempt drops the request from AsyncLLM's front end and then hangs before the
    engine core is told: the retry's abort() finds nothing left to abort there and returns."""

    async def abort(self, engine_id):
        self.aborts.append(engine_id)
        if len(self.aborts) == 1:
            self.llm.output_processor.abort_requests([engine_id], False)
            await asyncio.sleep(3600)
        await self.llm.abort(engine_id)


def test_a_retry_behind_a_half_done_abort_is_sent_only_on_the_schedulers_word(loop, llm, caplog):
    # the retry itself is hollow here; on this vLLM the request still leaves the scheduler (the generator's
    # own cancellation aborts it in the core): the relay says `sent` because the gauges show it gone, not
    # because abort() returned. Where they do not, it says `unconfirmed` (tests/test_relay_contract.py)
    async def go():
        eng = HollowEngine(llm)
        relay, _ = make_relay(eng, abort_timeout_s=0.3, abort_retry_s=0.01, scheduler_count=scheduled,
                              confirm_s=ENGINE_WAIT_S / 4)
        before = {}
        entry = await beside_a_neighbour(relay, "hollow-1", seen=before)
        assert entry.abort_attempts == 2 and entry.abort == "sent", relay.status("hollow-1")
        assert before["count"] >= 2, before  # the neighbour and the target, in the scheduler at the cancel
    with caplog.at_level(logging.WARNING, logger="cancelwatch.relay"):
        loop.run_until_complete(go())
    assert not any("ALERT" in r.message for r in caplog.records), [r.message for r in caplog.records]


def test_every_cancel_is_logged_in_arrival_order_with_its_outcome(loop, llm, caplog):
    async def go():
        eng = Engine(llm)
        relay, _ = make_relay(eng)
        got = []
        task = asyncio.create_task(consume(relay, "log-1", "alice", (prompt(50), 400), got=got))
        assert await until(lambda: len(got) >= 3), f"{len(got)} outputs within {ENGINE_WAIT_S:.0f} s"
        answers = [await relay.cancel("log-1", "mallory"), await relay.cancel("log-1", "alice"),
                   await relay.cancel("log-1", "alice"), await relay.cancel("log-2", "alice")]
        with pytest.raises(asyncio.CancelledError):
            await task
        return answers
    with caplog.at_level(logging.INFO, logger="cancelwatch.relay"):
        answers = loop.run_until_complete(go())
    assert answers == ["rejected_not_owner", "cancelled", "already_cancelled", "kept_until_registered"]
    lines = [r.message for r in caplog.records if r.message.startswith("cancel ")]
    assert lines == ["cancel log-1 from mallory: rejected_not_owner", "cancel log-1 from alice: cancelled",
                     "cancel log-1 from alice: already_cancelled", "cancel log-2 from alice: kept_until_registered"]


def test_a_replica_answers_not_here_for_another_replicas_request(loop, llm):
    async def go():
        eng = Engine(llm)
        a, _ = make_relay(eng, replica="a")
        b, _ = make_relay(eng, replica="b")
        rid = a.issue_id()
        assert rid.startswith("a-") and a.replica_of(rid) == "a"
        got = []
        task = asyncio.create_task(consume(a, rid, "alice", (prompt(50), 60), got=got))
        assert await until(lambda: len(got) >= 3), f"{len(got)} outputs within {ENGINE_WAIT_S:.0f} s"
        # never kept as an early cancel (the request would never start there: it never comes there)
        assert await b.cancel(rid, "alice") == "not_here" and b.early == {}
        assert await task == 60 and eng.aborts == []  # nothing reached the replica that holds it
    loop.run_until_complete(go())


def test_finished_entries_and_tombstones_are_pruned_but_running_ones_kept(loop, llm):
    async def five(relay) -> float:
        """Five short requests, each with an early cancel's tombstone beside it; how long they took."""
        t0 = time.monotonic()
        for i in range(5):
            await consume(relay, f"done-{i}", "alice", (prompt(10, i), 2))
            assert await relay.cancel(f"never-{i}", "alice") == "kept_until_registered"
        return time.monotonic() - t0

    async def go():
        eng = TrackedEngine(llm)
        # keep_s outlasts the five requests on this engine (measured on a relay of their own; 0.2 s where they
        # took well under a tenth of it), so that the first prune forgets by max_entries only, not by age
        keep_s = max(0.2, 2 * await five(make_relay(eng)[0]) + 0.1)
        relay, _ = make_relay(eng, keep_s=keep_s, max_entries=3)
        five_s = await five(relay)
        relay.prune()
        assert five_s < keep_s, (five_s, keep_s)
        assert sorted(relay.entries) == ["done-2", "done-3", "done-4"]  # the oldest beyond max_entries went
        assert sorted(relay.early) == ["never-2", "never-3", "never-4"]
        got = []
        running = asyncio.create_task(consume(relay, "running-1", "alice", (prompt(50), 1000), got=got))
        assert await until(lambda: len(got) >= 2), f"{len(got)} outputs within {ENGINE_WAIT_S:.0f} s"
        await asyncio.sleep(keep_s + 0.1)
        relay.prune()
        assert list(relay.entries) == ["running-1"] and relay.early == {}  # past keep_s; running is kept
        await relay.cancel("running-1", "alice")
        with pytest.raises(asyncio.CancelledError):
            await running
        assert relay.issue_id() != relay.issue_id()
    loop.run_until_complete(go())


@contextlib.asynccontextmanager
async def serving(llm, relay):
    """relay_app around `llm` and `relay` under uvicorn on a free loopback port: its completions URL."""
    import socket

    import uvicorn

    from cancelwatch.collectors.engines.relay_app import build_app

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(build_app(llm, "tiny", relay=relay), host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="off"))
    running = asyncio.create_task(server.serve())
    try:
        assert await until(lambda: server.started), f"uvicorn not started within {ENGINE_WAIT_S:.0f} s"
        yield f"http://127.0.0.1:{port}/v1/completions"
    finally:
        server.should_exit = True
        await asyncio.wait_for(running, ENGINE_WAIT_S)


def test_a_client_that_goes_away_from_relay_app_is_aborted_and_its_iterator_closed(loop, llm):
    """A real HTTP client disconnects mid-stream from relay_app under uvicorn: Starlette cancels the
    streaming task through anyio, which cancels every later await in that scope; the abort still runs
    (retried after an injected failure) and the engine's iterator is still closed."""
    import httpx

    async def go():
        eng = TrackedEngine(llm, abort_failures=1)
        relay, events = make_relay(eng, abort_retry_s=0.01)
        async with serving(llm, relay) as url:
            async with httpx.AsyncClient(timeout=30) as client:
                async with client.stream("POST", url,
                                         json={"model": "tiny", "prompt": prompt(60), "max_tokens": 2000,
                                               "ignore_eos": True},
                                         headers={"X-Request-Id": "chosen-by-client", "X-Owner": "alice"}) as resp:
                    rid = resp.headers["x-relay-request-id"]
                    assert rid != "chosen-by-client" and resp.headers["x-client-request-id"] == "chosen-by-client"
                    chunks = 0
                    async for line in resp.aiter_lines():
                        chunks += line.startswith("data: ")
                        if chunks >= 5:
                            break
                # the response is closed unread: the connection goes, nothing is sent to /cancel
            assert await until(lambda: relay.status(rid)["abort_ok"] is not None), relay.status(rid)
            st = relay.status(rid)
            assert st["state"] == "cancelled" and st["abort_attempts"] == 2 and st["abort"] == "sent", st
            engine_id = st["engine_request_id"]
            assert eng.aborts == [engine_id, engine_id] and not eng.in_engine(engine_id)
            assert await until(lambda: eng.streams[-1].closed), "the engine's iterator was never closed"
            assert ("abort_returned", rid) in events
    loop.run_until_complete(go())


def test_a_non_streaming_client_that_gives_up_on_relay_app_is_aborted(loop, llm):
    """`"stream": false`: relay_app answers with one JSON body once the engine is done, and watches the client while
    it works: a client that times out before has its request aborted (a handler that only awaited the answer would
    keep it running for nobody); one that waits gets the whole answer."""
    import httpx

    async def go():
        eng = TrackedEngine(llm)
        relay, _ = make_relay(eng, abort_retry_s=0.01)
        async with serving(llm, relay) as url:
            async with httpx.AsyncClient(timeout=30) as client:
                whole = await client.post(url, json={"model": "tiny", "prompt": prompt(10), "max_tokens": 8,
                                                     "ignore_eos": True, "stream": False})
                assert whole.status_code == 200 and whole.json()["choices"][0]["finish_reason"] == "length", whole.text
                with pytest.raises(httpx.ReadTimeout):
                    await client.post(url, json={"model": "tiny", "prompt": prompt(60), "max_tokens": 5000,
                                                 "ignore_eos": True, "stream": False}, timeout=1.0)
            rid = next(r for r in relay.entries if relay.status(r)["state"] != "completed")
            assert await until(lambda: relay.status(rid)["abort_ok"] is not None), relay.status(rid)
            st = relay.status(rid)
            assert st["state"] == "cancelled" and st["abort"] == "sent", st
            assert not eng.in_engine(st["engine_request_id"])
            assert await until(lambda: eng.streams[-1].closed), "the engine's iterator was never closed"
    loop.run_until_complete(go())
