"""When the engine was done with a request its client still read (analysis/verdicts/engine_done.py): a
fall of the scheduler's count that no abort line explains, and that lasts, ends the request the engine
would have finished first, when that is one the client completed; never a cancelled one, never on a fall
an abort explains or one that does not last."""

import numpy as np
import pandas as pd

from cancelwatch.analysis.rows import frame_rows
from cancelwatch.analysis.verdicts import LOST_CANCEL_RULES
from cancelwatch.analysis.verdicts.engine_done import engine_done_at, tokens_per_s

T0 = 1_000_000_000_000
HZ = 20


def ns(t_s: float) -> int:
    return T0 + int(t_s * 1e9)


def row(rid, sent, closed, *, tokens, cancelled_at=None, state="completed", n=1):
    return {"request_id": rid, "n": n, "sent_mono_ns": ns(sent), "closed_mono_ns": ns(closed),
            "terminal_state": state, "cancel_mono_ns": None if cancelled_at is None else ns(cancelled_at),
            "chunks": tokens if state == "completed" else 20, "max_tokens": tokens}


def sched(until_s: float, running) -> dict[str, np.ndarray]:
    """Samples at HZ; `running(t)` sequences in the engine, each making 100 tokens/s."""
    t = np.arange(0, until_s, 1 / HZ)
    run_ = np.array([running(float(x)) for x in t], dtype=float)
    gen = np.concatenate([[0.0], np.cumsum(run_[:-1] * 100 / HZ)])
    return {"t_s": t, "count": run_, "waiting": np.zeros(len(t)), "kv": np.zeros(len(t)), "gen_tokens": gen}


def done(ledger_rows, s, aborts=(), gone_at=None):
    return engine_done_at(frame_rows(pd.DataFrame(ledger_rows)), T0, s, 1 / HZ, gone_at or {}, {}, np.array(aborts, float), 0.05)


# the neighbour: in the engine from 0.2 s to 3.0 s (280 tokens), its client reading until 9 s; the target
# (lost cancel, 500 tokens) in from 5 s to 10 s, its client gone at its stop at 5.2 s
NEIGHBOUR = row("n", 0.2, 9.0, tokens=280)
TARGET = row("t", 5.0, 5.2, tokens=500, state="cancelled", cancelled_at=5.2)


def engine(t):
    return (0.2 <= t < 3.0) + (5.0 <= t < 10.0)


def test_the_rate_is_tokens_per_running_sequence():
    s = sched(6, engine)
    assert abs(tokens_per_s(s["t_s"], s["count"], s["gen_tokens"]) - 100) < 1


def test_a_neighbour_the_engine_finished_before_its_client_closed_ends_at_the_fall():
    # the target stays in the ledger (no abort line: at most to its scenario's end)
    out = done([NEIGHBOUR, TARGET], sched(12, engine), gone_at={"t": 11.0})
    assert set(out) == {"n"} and 3.0 <= out["n"] <= 3.0 + 1.5 / HZ, out


def test_a_fall_an_abort_line_explains_moves_nothing():
    assert done([NEIGHBOUR, TARGET], sched(12, engine), aborts=[3.02], gone_at={"t": 11.0}) == {}


def test_a_fall_that_does_not_last_moves_nothing():
    # the neighbour's client closes 0.3 s after the engine finished it: a lag, not a lagging client
    assert done([row("n", 0.2, 3.3, tokens=280), TARGET], sched(12, engine), gone_at={"t": 11.0}) == {}


def test_a_fall_a_cancelled_request_may_have_made_moves_nothing():
    # a short target with no abort line (lost, 50 tokens) would have finished before the neighbour: which
    # one left at the fall cannot be told
    target = row("t", 0.3, 0.4, tokens=50, state="cancelled", cancelled_at=0.4)
    s = sched(12, lambda t: (0.2 <= t < 3.0) + (0.3 <= t < 0.8))
    assert done([NEIGHBOUR, target], s, gone_at={"t": 11.0}).get("n") is None
    # with the target long, the neighbour is the first the engine would finish: it is moved
    long_target = row("t", 0.3, 0.4, tokens=900, state="cancelled", cancelled_at=0.4)
    s = sched(12, lambda t: (0.2 <= t < 3.0) + (0.3 <= t < 9.3))
    assert set(done([NEIGHBOUR, long_target], s, gone_at={"t": 11.0})) == {"n"}


def test_a_fall_at_the_end_of_the_run_is_not_shown_to_last():
    assert done([NEIGHBOUR], sched(3.5, lambda t: 0.2 <= t < 3.0)) == {}


# ------------------------------------------------------------------ whole runs judged (analysis/verdicts/vllm.py)
# A run in memory: `running(t)` and `waiting(t)` are the engine's truth, each running sequence makes RATE
# tokens/s; the engine log names every request entering at its send, and the aborts given. The cases where
# the ledger's reading must stand were found by an adversarial read of the first version: each turned an
# honest verdict into a confident leaked.

RATE = 100.0


def req(rid, sent, closed, *, max_tokens, chunks=None, state="completed", cancel=None, n=1, role="neighbour"):
    return {"request_id": rid, "scenario": "s", "role": role, "n": n, "prompt_tokens": 100, "max_tokens": max_tokens,
            "sent_mono_ns": ns(sent), "first_token_mono_ns": ns(sent + 0.05),
            "chunks": (max_tokens * n if chunks is None else chunks) if state == "completed" else (chunks or 20),
            "cancel_mono_ns": None if cancel is None else ns(cancel), "closed_mono_ns": ns(closed),
            "terminal_state": state}


def whole_run(ledger, running, *, waiting=lambda t: 0.0, stop=None, aborts=(), until=12.0):
    import json

    from cancelwatch.runstore.reader import Run
    times = np.arange(0, until, 1 / HZ)
    rows, gen = [], 100.0
    for i, t in enumerate(times):
        t = float(t)
        for metric, value in (("requests_running", float(running(t))), ("requests_waiting", float(waiting(t))),
                              ("kv_cache_usage_ratio", 0.1 * (running(t) + waiting(t))),
                              ("generation_tokens_total", gen)):
            rows.append({"source": "vllm", "target": "t0", "metric": metric, "labels": "{}", "value": value,
                         "wall_ns": 0, "mono_ns": ns(t), "duration_ns": 1, "scrape_id": i, "t_s": t})
        gen += float(running(t)) * RATE / HZ
    rid, t_stop, tokens = stop
    events = [{"request_id": rid, "kind": "user_stop", "mono_ns": ns(t_stop),
               "data": json.dumps({"cancel_id": "c0", "scenario": "s", "phase": "decode", "metrics_target": "t0",
                                   "tokens_at_cancel": tokens})},
              {"request_id": rid, "kind": "client_closed", "mono_ns": ns(t_stop + 0.001),
               "data": json.dumps({"cancel_id": "c0", "source": "client"})},
              {"request_id": None, "kind": "scenario_end", "mono_ns": ns(until - 1.0), "data": json.dumps({"scenario": "s"})}]
    lines = [("engine_added", r["request_id"], (r["sent_mono_ns"] - T0) / 1e9) for r in ledger]
    for kind, lid, at in [*lines, *(("engine_aborted", a, t) for a, t in aborts)]:
        events.append({"request_id": lid, "kind": kind, "mono_ns": ns(at),
                       "data": json.dumps({"engine_request_id": f"cmpl-{lid}-0-0123abcd", "clock": "engine_log",
                                           "resolution_s": 0.001, "target": "t0"})})
    events = pd.DataFrame(events).sort_values("mono_ns")
    events["wall_ns"] = 0
    events["t_s"] = (events["mono_ns"] - T0) / 1e9
    info = {"started_mono_ns": T0, "targets": [{"label": "t0", "url": "http://x"}], "status": "completed",
            "settings": {}, "engine": {"engine_log": {"t0": {"path": "/var/log/engine.log"}}}}
    return Run(id=1, info=info, samples=pd.DataFrame(rows), scrapes=pd.DataFrame(), gaps=pd.DataFrame(),
               events=events, ledger=pd.DataFrame(ledger))


def judged(run):
    from cancelwatch.analysis.verdicts import judge_run
    (v,) = judge_run(run)
    return v.verdict, v.rule, v.evidence.lagging_clients


def test_a_lost_cancel_beside_a_lagging_neighbour_is_leaked_and_the_neighbour_named():
    # the neighbour: in the engine 0.2-3.0 s (280 tokens), its client reads until 9 s; the target's cancel
    # at 5.2 s is lost: it runs to 10 s. Without the engine's evidence the neighbour stands in for it
    nb = req("nb", 0.2, 9.0, max_tokens=280)
    tg = req("tg", 5.0, 5.201, max_tokens=500, state="cancelled", cancel=5.2, role="target")
    run = whole_run([nb, tg], lambda t: (0.2 <= t < 3.0) + (5.0 <= t < 10.0), stop=("tg", 5.2, 20))
    verdict, rule, lagging = judged(run)
    assert verdict == "leaked" and rule in LOST_CANCEL_RULES and lagging == ["nb"]


def test_a_neighbour_that_waited_in_the_queue_is_not_blamed_for_the_targets_own_finish():
    # the neighbour waits 0.1-2.0 s behind a filler, runs 2.0-4.0 s; the target ends on its own at 3.25 s,
    # before its (slow client's) stop at 3.5 s: admitted earliest and shortest, the neighbour would be
    # picked for that fall, though it ran later than its admission says
    f = req("f", 0.0, 2.02, max_tokens=200, role="filler")
    tg = req("tg", 0.05, 3.501, max_tokens=320, state="cancelled", cancel=3.5, role="target")
    nb = req("nb", 0.1, 4.02, max_tokens=200)
    run = whole_run([f, tg, nb], lambda t: (0 <= t < 2.0) + (0.05 <= t < 3.25) + (2.0 <= t < 4.0),
                    waiting=lambda t: float(0.1 <= t < 2.0), stop=("tg", 3.5, 20))
    assert judged(run) == ("inconclusive", "already_finished", None)


def test_a_completed_request_is_timed_by_its_max_tokens_not_its_clients_chunks():
    # a slow reader gets deltas merged: 60 chunks for the neighbour's 400 tokens (engine 0.1-4.1 s). The
    # target ended on its own at 2.0 s, before its stop at 2.5 s: by its chunks the neighbour would have
    # been the one to end then
    nb = req("nb", 0.1, 9.0, max_tokens=400, chunks=60)
    tg = req("tg", 0.5, 2.501, max_tokens=150, state="cancelled", cancel=2.5, role="target")
    run = whole_run([nb, tg], lambda t: (0.1 <= t < 4.1) + (0.5 <= t < 2.0), stop=("tg", 2.5, 20))
    assert judged(run)[:2] == ("inconclusive", "already_finished")


def test_one_child_of_an_n2_request_ending_does_not_end_the_request():
    # the neighbour's two children end at 2.6 s and 4.5 s (the second waited for a slot); the target's
    # abort is logged at 2.002 s and it leaves at 2.05 s
    f = req("f", 0.0, 2.02, max_tokens=200, role="filler")
    nb = req("nb", 0.1, 4.52, max_tokens=250, n=2)
    tg = req("tg", 0.5, 2.002, max_tokens=900, state="cancelled", cancel=2.0, role="target")
    run = whole_run([f, nb, tg], lambda t: (0 <= t < 2.0) + (0.1 <= t < 2.6) + (2.0 <= t < 4.5) + (0.5 <= t < 2.05),
                    waiting=lambda t: float(0.1 <= t < 2.0), stop=("tg", 2.0, 150), aborts=[("tg", 2.002)])
    assert judged(run)[:2] == ("released", "released")


def test_of_two_completed_requests_the_wrong_one_is_never_picked_after_a_queue():
    # x's client lags (engine done 3.25 s, closed 4.5 s); y waited behind a filler until 3.0 s and runs to
    # 6.0 s. The target's abort is logged at 3.802 s; it leaves at 3.85 s
    f = req("f", 0.0, 3.02, max_tokens=300, role="filler")
    x = req("x", 0.05, 4.5, max_tokens=320)
    y = req("y", 0.1, 6.02, max_tokens=300, role="filler")
    tg = req("tg", 3.3, 3.802, max_tokens=900, state="cancelled", cancel=3.8, role="target")
    run = whole_run([f, x, y, tg], lambda t: (0 <= t < 3.0) + (0.05 <= t < 3.25) + (3.0 <= t < 6.0) + (3.3 <= t < 3.85),
                    waiting=lambda t: float(0.1 <= t < 3.0), stop=("tg", 3.8, 40), aborts=[("tg", 3.802)])
    assert judged(run)[:2] == ("released", "released")


def test_two_completed_requests_ending_within_a_second_of_each_other_are_not_told_apart():
    # a (200 tokens) and b (260) both lag; the fall at a's end could be b's as well
    a, b = req("a", 0.1, 9.0, max_tokens=200), req("b", 0.2, 9.0, max_tokens=260)
    tg = req("tg", 5.0, 5.201, max_tokens=500, state="cancelled", cancel=5.2, role="target")
    s = sched(12, lambda t: (0.1 <= t < 2.1) + (0.2 <= t < 2.8) + (5.0 <= t < 10.0))
    assert done([a, b, tg], s, gone_at={"tg": 11.0}) == {}


def test_a_fall_of_one_sequence_never_ends_an_n2_request():
    # the two children of a lagging n=2 request end apart (at 2.6 s and 4.5 s): no fall is its two sequences
    nb = row("nb", 0.1, 9.0, tokens=250, n=2)
    s = sched(12, lambda t: (0.1 <= t < 2.6) + (0.1 <= t < 4.5) + (5.0 <= t < 10.0))
    assert done([nb, TARGET], s, gone_at={"t": 11.0}) == {}
    # ending together, they are one fall of two
    s = sched(12, lambda t: 2 * (0.1 <= t < 2.6) + (5.0 <= t < 10.0))
    assert set(done([row("nb", 0.1, 9.0, tokens=250, n=2), TARGET], s, gone_at={"t": 11.0})) == {"nb"}
