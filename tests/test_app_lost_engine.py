"""Explicit cancels through an app, lost on the real engine (issue: verdicts on users' stacks, point 8).

The relay app (an in-process AsyncLLM, `cancelwatch engine up --relay`) behind tests/proxies.py, the
`inproc` kind of scenario sized to end soon after a lost cancel: the client asks the app to cancel and reads
on until the app ends the stream. A gateway that answers the cancel call itself and passes nothing on, and
a balancer that sends the cancel to a replica not holding the request, both lose it: the engine goes on to
the request's end, and the verdict is `leaked` on the engine's own samples, naming what the app answered.
The same path with nothing lost is released, and so is the cancel a replica passes on to the one that holds
the request (relay_app --replica/--peer). Each test checks that its proxy did what it was meant to do."""

from __future__ import annotations

import json
import math

import pytest

from tests.conftest import _start_engine, _stop_engine, decode_rate, free_port
from tests.test_cancels_engine import scrape_hole_s
from tests.proxies import ProxyBehaviour
from tests.test_verdict_rules_engine import dump, record, scenario

pytestmark = pytest.mark.timeout(900)
EXPLICIT = dict(name="explicit", mode="explicit", via_relay=True, trigger="after_tokens", trigger_value=20,
                prompt_tokens=300)
# wider than record's 2 s: a cancel passed on through the test's proxy reached the app 2.5 s after the stop
# once (CI: the machine held the proxy up), honestly leaked under 2 s; these tests are about who loses a cancel
GRACE_S = 6.0
# a lost cancel must leave the target running this long past the grace at the measured pace: CI saw 380
# tokens after the stop end 2.4 s later at ~160 tokens/s, inside a hole in the app's /metrics, undecidable
PAST_GRACE_S = 4.0
# the pace is measured minutes before the streams go, and CI's pace moves: a target sized at the main engine's
# pace once ran to its end inside the grace on the replica (CI), a race the completion won (honestly
# inconclusive); sized at the replicas' own pace, with this much to spare
PACE_SPARE = 1.5
SIZED: dict = {}  # how the target was sized, for the failure messages


@pytest.fixture(scope="module")
def explicit(replicas):
    """The explicit scenario, its target sized by the pace of the replicas its streams go to (the faster of
    the two, each read on its own engine's clock, two streams as in the scenario; at least 600 tokens)."""
    rates = {name: decode_rate(r.url, r.served_model_name) for name, r in zip("ab", replicas)}
    tokens = EXPLICIT["trigger_value"] + math.ceil(max(rates.values()) * (GRACE_S + PAST_GRACE_S) * PACE_SPARE)
    SIZED.update(rates_tokens_per_s={k: round(v, 1) for k, v in rates.items()},
                 max_tokens=min(3500, max(600, tokens)))
    return EXPLICIT | {"max_tokens": SIZED["max_tokens"]}


@pytest.fixture(scope="module")
def replicas(engine, tmp_path_factory):
    """Two replicas of the relay app, each its own AsyncLLM: `a`, which knows no other replica, and `b`,
    which passes a cancel for `a`'s ids on to it. Stopped at the end, nothing left running."""
    started = []
    try:
        home = tmp_path_factory.mktemp("replica-a")
        started.append((home, _start_engine(home, relay=True, extra_args=["--replica", "a"])))
        home = tmp_path_factory.mktemp("replica-b")
        started.append((home, _start_engine(home, relay=True,
                                            extra_args=["--replica", "b", "--peer", f"a={started[0][1].url}"])))
        yield [state for _, state in started]
    finally:
        left = [p for home, state in started for p in _stop_engine(home, state)]
        assert not left, f"relay apps left processes behind: {left}"


def explicit_run(engine, explicit: dict, relay_url: str, tmp_path):
    toml = scenario(tmp_path, **explicit)
    _, doc, run = record(engine.url, toml, tmp_path / "cw.db", tmp_path / "home",
                         extra=("--relay-url", relay_url, "--grace", str(GRACE_S)))
    (c,) = doc["cancels"]
    answers = [json.loads(d) for k, d in zip(run.events["kind"], run.events["data"]) if k == "app_answered"]
    return c, answers, run


@pytest.mark.parametrize("lost", [False, True], ids=["passed_on", "swallowed"])
def test_a_cancel_a_gateway_answers_itself_is_leaked_and_one_it_passes_on_is_released(engine, replicas, explicit,
                                                                                      tmp_path, lost):
    proxy = ProxyBehaviour(replicas[0].url, free_port(), drop_cancels=lost).start()
    try:
        c, answers, run = explicit_run(engine, explicit, proxy.url, tmp_path)
    finally:
        proxy.stop()
    # the relay app's own word once abort() returned; the gateway's made-up one
    assert [a["answer"] for a in answers] == ["cancelled" if lost else "abort_sent"], answers
    row = run.ledger.set_index("request_id").loc[c["request_id"]]
    if not lost:
        assert proxy.cancels_dropped == [], proxy.summary()
        assert c["verdict"] == "released", dump(doc_of(c), proxy, run)
        assert c["timepoint_sources"]["engine_abort"]["source"] == "relay", c
        return
    assert len(proxy.cancels_dropped) == 1, proxy.summary()
    # the gateway lost it: the client read the request to its end
    assert row["terminal_state"] == "completed" and row["tokens_after_cancel"] > 100, row.to_dict()
    if assert_lost(c, row, run, proxy) == "leaked":
        assert c["evidence"]["app_answer"] == "cancelled" and c["evidence"]["kept_running_ms"] > GRACE_S * 1000, \
            c["evidence"]


@pytest.mark.slow
def test_a_lost_cancel_is_leaked_though_the_engine_had_run_ahead_on_the_neighbour(engine, replicas, explicit, tmp_path):
    # CI once: the engine ended the neighbour just before the stop while its last tokens were still on their
    # way, so at the stop it counted one request where the client had two open. Here on purpose: the proxy
    # hands the neighbour's tokens on 3 s late, and the neighbour is short (the engine ends it about when its
    # first token reaches the client, and the target is sent then); once its end is read, the target is the
    # run's only open request and the engine's count shows it kept it
    proxy = ProxyBehaviour(replicas[0].url, free_port(), drop_cancels=True, late_s=3.0, late_only="neighbour").start()
    try:
        c, answers, run = explicit_run(engine, explicit | {"neighbour_max_tokens": 100}, proxy.url, tmp_path)
    finally:
        proxy.stop()
    assert [a["answer"] for a in answers] == ["cancelled"] and len(proxy.cancels_dropped) == 1, answers
    assert ahead_at_stop(c, run), "the engine was not ahead of the client at the stop\n" + dump(doc_of(c), proxy, run)
    row = run.ledger.set_index("request_id").loc[c["request_id"]]
    assert row["terminal_state"] == "completed" and row["tokens_after_cancel"] > 100, row.to_dict()
    assert assert_lost(c, row, run, proxy) in ("leaked", "race", "hole"), dump(doc_of(c), proxy, run)


@pytest.mark.slow
def test_a_cancel_sent_to_a_replica_that_cannot_pass_it_on_is_leaked(engine, replicas, explicit, tmp_path):
    # streams go to replica b; the balancer sends the cancel call to replica a, which knows no other replica
    a, b = replicas
    proxy = ProxyBehaviour(b.url, free_port(), cancel_upstream=a.url).start()
    try:
        c, answers, run = explicit_run(engine, explicit, proxy.url, tmp_path)
    finally:
        proxy.stop()
    assert [(st, '"not_here"' in body) for _, st, body in proxy.cancels_rerouted] == [(404, True)], \
        proxy.cancels_rerouted
    assert [a["answer"] for a in answers] == ["not_here"], answers
    row = run.ledger.set_index("request_id").loc[c["request_id"]]
    assert row["terminal_state"] == "completed" and row["tokens_after_cancel"] > 100, row.to_dict()
    if assert_lost(c, row, run, proxy) != "race":
        assert c["evidence"]["app_answer"] == "not_here", c["evidence"]


@pytest.mark.slow
def test_a_cancel_sent_to_a_replica_that_passes_it_on_is_released(engine, replicas, explicit, tmp_path):
    # streams go to replica a; the cancel call to replica b, which passes it on to a (the id names it)
    a, b = replicas
    proxy = ProxyBehaviour(a.url, free_port(), cancel_upstream=b.url).start()
    try:
        c, answers, run = explicit_run(engine, explicit, proxy.url, tmp_path)
    finally:
        proxy.stop()
    (path, status, body) = proxy.cancels_rerouted[0]
    assert len(proxy.cancels_rerouted) == 1 and status == 200 and json.loads(body)["forwarded_to"] == "a", body
    assert path.startswith("/cancel/a-"), path  # the id replica a issued
    assert [a["answer"] for a in answers] == ["abort_sent"], answers
    assert c["verdict"] == "released", dump(doc_of(c), proxy, run)
    assert c["timepoint_sources"]["engine_abort"]["source"] == "relay", c


def assert_lost(c: dict, row, run, proxy) -> str:
    """A cancel the app lost is leaked on the engine's word: "leaked" then. Otherwise one of three awkward cases,
    each accepted only where the recording shows it (not read from the verdict):
    - "race": the target ran to its end inside the grace (CI once; here with the target cut to 130 tokens,
      2.3 s after its stop): a race the completion won, inconclusive, as its ledger row (`row`) shows;
    - "hole": three engines share two cores here, and the replica's /metrics (the app's own process) was seen
      answering no scrape from the stop to past the grace (CI, twice): without the engine's word the truth is
      inconclusive, naming the missing samples, as the recorded scrapes show;
    - "ahead": the engine had ended the neighbour before the stop and its end reached its client only at the
      grace's end (neighbour_read_late): which request the engine still held, the count cannot say."""
    if (c["verdict"], c["evidence"]["rule"]) == ("leaked", "app_lost_cancel"):
        return "leaked"
    # the target ran to its end inside the grace (the pace jumped past what it was sized for): no abort was
    # due yet, so the completion won the race; read from the client's ledger, not from the verdict
    after_s = (row["closed_mono_ns"] - row["cancel_mono_ns"]) / 1e9
    if after_s < GRACE_S:
        assert (c["verdict"], c["evidence"]["rule"]) == ("inconclusive", "completion_won_race"), \
            f"the target ended {after_s:.1f} s after its stop; target sized {SIZED}\n" + dump(doc_of(c), proxy, run)
        print(f"the target ended {after_s:.1f} s after its stop, inside the grace, {row['tokens_after_cancel']} "
              f"tokens at {row['tokens_after_cancel'] / after_s:.0f}/s; sized {SIZED}: {c['evidence']['why']}")
        return "race"
    if neighbour_read_late(c, run):
        assert (c["verdict"], c["evidence"]["rule"]) == ("inconclusive", "app_lost_unconfirmed") \
            and c["evidence"]["count_before"] < c["evidence"]["ledger_before"], dump(doc_of(c), proxy, run)
        print(f"the engine ended the neighbour before the stop, its client read the end late: {c['evidence']['why']}")
        return "ahead"
    hole = scrape_hole_s(run, c)
    assert (c["verdict"], c["evidence"]["rule"]) == ("inconclusive", "app_lost_unconfirmed") \
        and c["evidence"].get("count_reading") is None and hole >= GRACE_S - 1.0, \
        f"hole in the app's scrapes {hole:.1f} s; target sized {SIZED}\n" + dump(doc_of(c), proxy, run)
    print(f"the app's /metrics answered nothing for {hole:.1f} s across the grace: {c['evidence']['why']}")
    return "hole"


def ahead_at_stop(c: dict, run) -> bool:
    """The recording shows the engine ahead of the client at the stop: the app's last sample in the second
    before it counted fewer requests than the ledger had open there."""
    stop = c["timepoints"]["user_stop"]
    s = run.samples[run.samples["target"] == c["evidence"]["metrics_target"]]
    s = s[s["metric"].isin(["requests_running", "requests_waiting"]) & (s["t_s"] >= stop - 1.0) & (s["t_s"] < stop)]
    if s.empty:
        return False
    last = s[s["scrape_id"] == s["scrape_id"].max()]
    t_b, t0, led = float(last["t_s"].iloc[0]), run.info["started_mono_ns"], run.ledger
    sent, closed = (led["sent_mono_ns"] - t0) / 1e9, (led["closed_mono_ns"] - t0) / 1e9
    return float(last["value"].sum()) < int(((sent <= t_b) & ~(closed <= t_b)).sum())


def neighbour_read_late(c: dict, run) -> bool:
    """The engine ahead of the client at the stop (CI once: the neighbour's end made in the engine just before a
    stop that came late, 8 s in), and the neighbour's end reaching its client within the grace's last second
    or after: no stretch of the grace is left where the target was the run's only open request."""
    t0, led = run.info["started_mono_ns"], run.ledger
    nb = (led.loc[led["role"] == "neighbour", "closed_mono_ns"] - t0) / 1e9
    late = nb.isna().any() or float(nb.max()) > c["timepoints"]["user_stop"] + c["evidence"]["grace_s"] - 1.0
    return late and ahead_at_stop(c, run)


def doc_of(c: dict) -> dict:
    return {"cancels": [c]}
