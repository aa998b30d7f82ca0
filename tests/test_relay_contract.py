"""The relay's word where no real engine shows the case: an abort() that returns on a retry while the
scheduler's gauges never bear it out (an AsyncLLM whose front end forgot the request while its core kept
it; on vLLM 0.32 the generator's own cancellation aborts it in the core, so tests_engine shows the
confirmed case on the real AsyncLLM). The engine here is scripted: its outputs, its abort and its gauge."""

from __future__ import annotations

import asyncio
import logging

import pytest

from cancelwatch.collectors.engines.relay import Relay


class Scripted:
    """A request that yields outputs until told; abort's first attempt hangs, the next return; the gauge
    (`count`) falls only when `drops` is set."""

    def __init__(self, drops: bool):
        self.drops, self.count, self.aborts = drops, 1.0, 0

    async def generate_outputs(self):
        while True:
            await asyncio.sleep(0.01)
            yield object()

    def generate(self, engine_id, payload):
        return self.generate_outputs()

    async def abort(self, engine_id):
        self.aborts += 1
        if self.aborts == 1:
            await asyncio.sleep(3600)
        if self.drops:
            self.count = 0.0


async def cancelled_after_a_hang(eng: Scripted, **kw) -> Relay:
    relay = Relay(eng.generate, eng.abort, abort_timeout_s=0.05, abort_retry_s=0.0, confirm_s=0.3,
                  scheduler_count=lambda: eng.count, **kw)

    async def consume():
        async for _ in relay.stream("r-1", "alice", None):
            pass

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.05)
    assert await relay.cancel("r-1", "alice") == "cancelled"
    with pytest.raises(asyncio.CancelledError):
        await task
    return relay


@pytest.mark.parametrize("drops, said", [(True, "sent"), (False, "unconfirmed")])
def test_a_retry_behind_a_hung_abort_is_sent_only_when_the_gauges_fall(drops, said, caplog):
    with caplog.at_level(logging.WARNING, logger="cancelwatch.relay"):
        relay = asyncio.run(cancelled_after_a_hang(Scripted(drops)))
    st = relay.status("r-1")
    assert (st["abort"], st["abort_attempts"]) == (said, 2) and "released" not in st, st
    alerts = [r.message for r in caplog.records if "ALERT" in r.message]
    assert bool(alerts) == (not drops) and all("scheduler" in a for a in alerts), alerts


def test_without_gauges_a_retry_behind_a_hung_abort_cannot_be_borne_out():
    eng = Scripted(drops=True)

    async def go():
        relay = Relay(eng.generate, eng.abort, abort_timeout_s=0.05, abort_retry_s=0.0)

        async def consume():
            async for _ in relay.stream("r-2", "alice", None):
                pass

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.05)
        await relay.cancel("r-2", "alice")
        with pytest.raises(asyncio.CancelledError):
            await task
        return relay.status("r-2")["abort"]

    assert asyncio.run(go()) == "unconfirmed"


def test_the_worst_case_covers_every_attempt_and_the_confirmation():
    relay = Relay(None, None)
    assert relay.abort_worst_case_s == pytest.approx(3 * 2.0 + 0.05 * (1 + 2 + 3))  # 6.3 s: /cancel waits that
    assert Relay(None, None, scheduler_count=lambda: 0.0).abort_worst_case_s == pytest.approx(6.3 + 5.0)


def test_ids_carry_their_replica_and_another_replicas_cancel_is_not_kept():
    a, b = Relay(None, None, replica="a"), Relay(None, None, replica="b")
    rid = a.issue_id()
    assert rid.startswith("a-") and Relay.replica_of(rid) == "a" and Relay.replica_of("0123abcd") is None
    assert asyncio.run(b.cancel(rid, "alice")) == "not_here" and b.early == {}
    assert asyncio.run(a.cancel(rid, "alice")) == "kept_until_registered" and rid in a.early
    with pytest.raises(ValueError, match="without '-'"):
        Relay(None, None, replica="a-b")
