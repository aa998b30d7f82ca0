"""The wait for an idle engine between scenarios follows the pace the scenario measured: a lost cancel's
request on a slow engine outlasts a fixed 90 s, and the next scenario would meet it (inconclusive)."""

from __future__ import annotations

import asyncio

import pytest

from cancelwatch.collectors.cancels.driver import Driver
from cancelwatch.collectors.cancels.pace import CEILING_S, FLOOR_S, IdleWait, idle_wait
from cancelwatch.collectors.cancels.streams import build_request
from cancelwatch.runstore.records import LedgerRecord

S = 1_000_000_000


def req(role: str, *, max_tokens: int, chunks: int, state: str, n: int = 1, stream: bool = True,
        sent_s: float = 0.0, first_s: float | None = None, closed_s: float | None = None):
    row = LedgerRecord(f"cw-x-{role}", "x", role, n=n, max_tokens=max_tokens, chunks=chunks, terminal_state=state,
                       sent_mono_ns=int(sent_s * S),
                       first_token_mono_ns=None if first_s is None else int(first_s * S),
                       closed_mono_ns=None if closed_s is None else int(closed_s * S))
    return build_request(row, "tiny", "w", stream=stream)


def test_a_slow_engine_gets_the_time_its_leaked_request_needs():
    # the neighbour: 101 tokens, first after 2 s, the last 10 s later: 0.1 s a token
    neighbour = req("neighbour", max_tokens=101, chunks=101, state="completed", first_s=2, closed_s=12)
    target = req("target", max_tokens=1200, chunks=50, state="cancelled", first_s=1, closed_s=6)
    wait = idle_wait([neighbour, target])
    assert wait.token_s == pytest.approx(0.1)
    assert wait.first_token_s == pytest.approx(2.0)
    assert wait.left_tokens == 1150
    # 1150 tokens at 0.1 s and 2 s to the first: 117 s, given half again and 10 s
    assert wait.timeout_s == pytest.approx(1.5 * 117 + 10)
    assert wait.timeout_s > FLOOR_S


def test_the_slowest_stream_sets_the_pace_and_a_fast_engine_keeps_the_floor():
    fast = req("neighbour", max_tokens=101, chunks=101, state="completed", first_s=0.1, closed_s=1.1)
    slower = req("probe", max_tokens=11, chunks=11, state="completed", first_s=0.3, closed_s=0.5)
    target = req("target", max_tokens=1500, chunks=10, state="cancelled")
    wait = idle_wait([fast, slower, target])
    assert wait.token_s == pytest.approx(0.02)  # the probe's 0.02 s a token, not the neighbour's 0.01
    assert wait.first_token_s == pytest.approx(0.3)
    # 1490 x 0.02 s + 0.3 s = 30 s: x 1.5 + 10 = 55 s, under the floor the driver always allowed
    assert wait.timeout_s == FLOOR_S


def test_sequences_of_an_n_request_count_apart_and_a_plain_request_has_all_left():
    neighbour = req("neighbour", max_tokens=101, chunks=202, n=2, state="completed", first_s=1, closed_s=21)
    assert idle_wait([neighbour]).token_s == pytest.approx(0.2)  # 101 tokens a sequence in 20 s
    streamed = req("target", max_tokens=1500, chunks=200, n=2, state="cancelled")
    assert idle_wait([neighbour, streamed]).left_tokens == 1400  # 100 of each sequence's 1500 had come
    plain = req("target", max_tokens=1500, chunks=0, state="cancelled", stream=False)
    wait = idle_wait([neighbour, plain])
    assert wait.left_tokens == 1500
    assert wait.timeout_s == min(CEILING_S, 1.5 * (1500 * 0.2 + 1) + 10)


def test_nothing_left_keeps_the_floor_and_a_huge_request_the_ceiling():
    neighbour = req("neighbour", max_tokens=101, chunks=101, state="completed", first_s=2, closed_s=12)
    won = req("target", max_tokens=1200, chunks=1200, state="completed", first_s=1, closed_s=121)
    assert idle_wait([neighbour, won]).left_tokens == 0
    assert idle_wait([neighbour, won]).timeout_s == FLOOR_S
    huge = req("target", max_tokens=100_000, chunks=5, state="cancelled")
    assert idle_wait([neighbour, huge]).timeout_s == CEILING_S
    # a neighbour cut by the client's own timeout may still run too: it counts as left, not as pace
    cut = req("neighbour", max_tokens=2000, chunks=300, state="cancelled", first_s=1, closed_s=120)
    assert idle_wait([neighbour, cut]).left_tokens == 1700
    wait = idle_wait([cut])
    assert wait.token_s is None and wait.timeout_s == FLOOR_S  # no completed stream: no pace to go by


def test_a_wait_that_runs_out_says_what_it_was_derived_from():
    events = []
    driver = Driver("http://127.0.0.1:9", "tiny", events.append, scheduler_now=lambda: (1, 0))
    wait = IdleWait(timeout_s=0.3, token_s=0.1, first_token_s=2.0, left_tokens=1150)
    assert asyncio.run(driver.wait_idle(wait)) is False
    (ev,) = [e for e in events if e.kind == "engine_not_idle"]
    assert ev.data["waited_s"] == 0.3 and ev.data["running"] == 1
    assert (ev.data["token_s"], ev.data["first_token_s"], ev.data["left_tokens"]) == (0.1, 2.0, 1150)
    idle = Driver("http://127.0.0.1:9", "tiny", events.append, scheduler_now=lambda: (0, 0))
    assert asyncio.run(idle.wait_idle(wait)) is True
