"""analysis/ghosts.py: the leaked cancels the engine's count can still hold, never more than its surplus."""

import numpy as np
import pytest

from cancelwatch.analysis.ghosts import LEFT, Ghosts


def test_ghosts_are_bounded_by_the_engines_surplus_and_cleared_when_it_is_gone():
    g = Ghosts(hold_s=1.0)
    g.leaked("a", 10.0)
    g.leaked("b", 12.0)
    g.leaked("c", 13.0)
    assert g.update(engine_count=4, in_flight=1, t_s=19.0) == [] and g.count() == 3  # 3 beyond the watch's one
    assert g.oldest_age_s(20.0) == 10.0
    # the engine let one go: which is not known, the oldest is taken to have gone first, once the count has
    # held one fewer for hold_s; by the first sample that showed it
    assert g.update(engine_count=3, in_flight=1, t_s=19.5) == [] and g.count() == 3
    assert g.update(engine_count=3, in_flight=1, t_s=20.5) == [("a", 19.5)] and g.count() == 2
    assert g.oldest_age_s(20.0) == 8.0
    # a surplus from traffic the watch did not see never makes a ghost of its own
    assert g.update(engine_count=9, in_flight=1, t_s=21.0) == [] and g.count() == 2
    # nothing beyond what the watch has in flight: every leaked request has left
    assert g.update(engine_count=1, in_flight=1, t_s=21.5) == []
    assert sorted(g.update(engine_count=1, in_flight=1, t_s=22.5)) == [("b", 21.5), ("c", 21.5)] and g.count() == 0
    assert g.oldest_age_s(20.0) == 0.0


def test_a_dip_shorter_than_the_hold_drops_no_ghost():
    # a request in the watch's flight that the engine counts only a step later, or a finished one whose
    # client is still reading: the surplus dips for a moment, and the ghost is still there
    g = Ghosts(hold_s=1.0)
    g.leaked("a", 10.0)
    readings = [(2, 1), (1, 1), (1, 1), (2, 2), (3, 2)]  # (engine count, in flight) each 0.25 s
    assert [g.update(c, f, 11.0 + i * 0.25) for i, (c, f) in enumerate(readings)] == [[]] * 5
    assert g.count() == 1


def steady_leaking(every_s=0.8, runs_on_s=6.0, verdict_after_s=2.5, until_s=40.0):
    """Behind a proxy that passes no cancel on, with the engine's abort for every other one: a client gives up
    every `every_s` to `until_s`; a lost request runs on `runs_on_s` in the engine (to its length), an aborted one
    0.3 s; two more are in the watch's flight throughout. Each verdict comes `verdict_after_s` after its stop
    (a 2 s grace, a store half a second behind). -> (stop, end, leaked) of each cancel."""
    stops = [i * every_s for i in range(int(until_s / every_s) + 1)]
    return [(t, t + (runs_on_s if i % 2 == 0 else 0.3), i % 2 == 0) for i, t in enumerate(stops)]


def verdict(kind: str, rule: str, stop: float, left: float | None, kept_ms: float | None = None):
    """What cancelwatch.live_judge reads of a verdict for the watch's ghosts."""
    from types import SimpleNamespace

    return SimpleNamespace(verdict=kind, rule=rule, timepoints={"user_stop": stop, "left_scheduler": left},
                           evidence=SimpleNamespace(kept_running_ms=kept_ms))


def watch_readings(cancels, until_s):
    """The watch's ghosts over `cancels` (steady_leaking's), as LiveJudge and watch_commands keep them: each
    verdict 2.5 s after its stop, a reading two a second. -> [(t, ghosts counted, {those counted})]."""
    from cancelwatch.analysis.ghosts import WatchGhosts
    from cancelwatch.live_judge import _in_engine

    g, judged, seen = WatchGhosts(grace_s=2.0), set(), []
    for k in range(int(until_s / 0.5)):
        now = k * 0.5
        for i, (stop, end, leaked) in enumerate(cancels):
            if i not in judged and stop + 2.5 <= now:
                judged.add(i)
                # a lost one that ran out within its grace was seen leaving by its verdict
                left = None if leaked and end > stop + 2.0 else end
                v = verdict("leaked" if leaked else "released", "no_abort_still_there" if leaked else "released",
                            stop, left)
                g.judged(f"c{i}", stop, *_in_engine(v, stop, stop, now))
        in_engine = sum(1 for stop, end, _ in cancels if stop <= now < end)
        g.reading(now, 2 + in_engine, 2)  # two more requests in the watch's flight throughout
        pending = [stop for i, (stop, _, _) in enumerate(cancels) if stop <= now and i not in judged]
        for rid, by in g.read(min(pending, default=now)):
            assert by >= cancels[int(rid[1:])][0] + 2.0, (rid, by)  # never before its grace's end
        seen.append((now, g.count(), set(g.ghosts.left_at) | {rid for _, rid in g.joins}))
    return seen


@pytest.mark.parametrize("one_short", [False, True])
def test_under_steady_leaking_a_ghost_that_left_is_counted_for_its_grace_and_the_hold_at_most(one_short):
    # live, a cancel is known leaked only at its verdict, a grace after its close: until then it sits in the
    # count's surplus. Read at once, it hid an older ghost's end, and under steady leaking there always was one:
    # with the others running long, the one that ran out at 13 s stayed counted until the leaking stopped (62 s)
    cancels = steady_leaking(runs_on_s=120.0, until_s=60.0)
    if one_short:
        stop, _, _ = cancels[10]
        cancels[10] = (stop, stop + 5.0, True)
    seen = watch_readings(cancels, until_s=200.0)
    for now, counted, who in seen:
        judged = [(stop, end) for stop, end, leaked in cancels if leaked and end > stop + 2.0 and stop + 2.5 <= now]
        held = sum(1 for _, end in judged if now < end)
        # which left the count does not say (the oldest is taken first): how many it counts is never fewer than the
        # engine holds, and over by those that left within their grace, the store's lag and the hold at the most
        recent = sum(1 for _, end in judged if now - (2.0 + 3.0) < end <= now)
        assert held <= counted == len(who) <= held + recent, (now, counted, held, recent)
    assert max(c for _, c, _ in seen) >= 30, seen  # they were counted
    assert seen[-1][1] == 0, seen


def watched(cancels: dict, engine: dict, until_s: float = 40.0) -> list[tuple[float, int, int]]:
    """The watch's ghosts over hand-made traffic, as LiveJudge and watch_commands keep them, a reading each 0.5 s.
    `cancels`: id -> (sent, stop, out of the watch's flight, judged at, verdict); `engine`: id -> (in, out) of the
    engine's count. -> [(t, ghosts counted, leaked ones judged by then that the engine holds)]."""
    from cancelwatch.analysis.ghosts import WatchGhosts
    from cancelwatch.live_judge import _in_engine

    g, done, seen = WatchGhosts(grace_s=2.0), set(), []
    for k in range(int(until_s / 0.5) + 1):
        now = k * 0.5
        for rid, (sent, stop, out, at, v) in cancels.items():
            if rid not in done and at <= now:
                done.add(rid)
                g.judged(rid, stop, *_in_engine(v, stop, out, now))
        count = sum(1 for t_in, t_out in engine.values() if t_in <= now < t_out)
        flying = sum(1 for sent, _, out, _, _ in cancels.values() if sent <= now < out)
        g.reading(now, count, flying)
        g.read(min((stop for rid, (_, stop, out, _, _) in cancels.items() if out <= now and rid not in done),
                   default=now))
        held = sum(1 for rid, (_, _, _, at, v) in cancels.items() if v.verdict == "leaked" and at <= now
                   and v.timepoints["left_scheduler"] is None and engine[rid][0] <= now < engine[rid][1])
        seen.append((now, g.count(), held))
    return seen


INF = 1e9
# the review's cases, each of which once made the watch drop a ghost still in the engine: id -> (sent, stop, out
# of the watch's flight, judged at, verdict) and id -> (in, out) of the engine's count
DROPPED_ONCE = {
    # two lost ones judged 'left among others': left_scheduler is when both had left *by* (A left at 12, B at 13.8);
    # each was surely there only for its kept_running_ms
    "left by": ({"A": (5.0, 10.0, 10.0, 14.0, verdict("leaked", "no_abort_left_among_others", 10.0, 13.8, 1500)),
                 "B": (5.0, 10.5, 10.5, 14.5, verdict("leaked", "no_abort_left_among_others", 10.5, 13.8, 1000))},
                {"A": (5.0, 12.0), "B": (5.0, 13.8)}),
    # a hop sent C on 2 s after its client left: the engine counted it from 12 s, its verdict came at 24 s
    "entered after its stop": ({"C": (9.8, 10.0, 10.0, 24.0, verdict("leaked", "entered_after_stop", 10.0, None))},
                               {"C": (12.0, INF)}),
    # a half-close: B's FIN at 20.5, its connection (in the watch's flight) to 23 s; A's verdict held the readings
    # back past it. Leaked; released at its connection's end
    "half-close, leaked": ({"A": (15.0, 20.0, 20.0, 24.0, verdict("released", "released", 20.0, 20.1)),
                            "B": (19.0, 20.5, 23.0, 24.5, verdict("leaked", "no_abort_still_there", 20.5, None))},
                           {"A": (15.0, 20.1), "B": (19.0, INF)}),
    "half-close, released": ({"A": (15.0, 20.0, 20.0, 24.0, verdict("released", "released", 20.0, 20.1)),
                              "B": (19.0, 20.5, 23.0, 24.5, verdict("released", "released", 20.5, 23.1))},
                             {"A": (15.0, 20.1), "B": (19.0, 23.1)}),
}


@pytest.mark.parametrize("case", list(DROPPED_ONCE))
def test_the_watchs_ghosts_never_take_one_still_in_the_engine_to_have_left(case):
    # G leaked at 1 s and stays in the engine throughout
    cancels, engine = DROPPED_ONCE[case]
    ghost = {"G": (0.0, 1.0, 1.0, 5.0, verdict("leaked", "no_abort_still_there", 1.0, None))}
    seen = watched({**ghost, **cancels}, {"G": (0.0, INF), **engine})
    assert all(counted >= held for _, counted, held in seen), [x for x in seen if x[1] < x[2]]
    assert seen[-1][1] == seen[-1][2] >= 1, seen[-1]


def test_a_stored_runs_ghosts_under_steady_leaking_leave_with_the_count():
    # the same traffic over a stored run (verdicts/ghost_list.py): each lost request ran out 6 s after its stop,
    # and the ghost table says so, though another lost one was always in its grace
    from types import SimpleNamespace

    from cancelwatch.analysis.ghosts import EngineReading
    from cancelwatch.analysis.verdicts.ghost_list import ghost_table as replayed

    cancels = steady_leaking()
    times = np.arange(0.0, 52.0, 0.05)
    count = np.array([2 + sum(1 for stop, end, _ in cancels if stop <= t < end) for t in times], dtype=float)
    # the ledger's requests in the engine: the two in flight, an aborted one until its abort (its end here)
    flying = np.array([2 + sum(1 for stop, end, leaked in cancels if not leaked and stop <= t < end) for t in times],
                      dtype=float)
    reading = EngineReading(times, count, flying, {})
    verdicts = [SimpleNamespace(request_id=f"c{i}", verdict="leaked", rule="no_abort_still_there", scenario="watch",
                                timepoints={"user_stop": stop, "left_scheduler": None},
                                evidence=SimpleNamespace(grace_s=2.0, tokens_after_client_left=None,
                                                         tokens_after_client_left_is=None),
                                client_left_s=lambda stop=stop: stop)
                for i, (stop, _, leaked) in enumerate(cancels) if leaked]
    run = SimpleNamespace(info={"targets": [{"label": "t0", "url": "http://127.0.0.1:1"}]})
    rows = replayed(run, verdicts, lambda run, target: reading).set_index("request_id")
    assert set(rows["in_engine"]) == {LEFT}, rows
    for i, (stop, end, leaked) in enumerate(cancels):
        if leaked:  # gone where the count held one fewer for the hold, by the first sample that showed it
            assert rows.loc[f"c{i}", "left_engine_s"] == pytest.approx(end, abs=0.06), (i, rows.loc[f"c{i}"])


# ghost_table: every leaked cancel of a run, with its age, on small hand-built runs (tests/test_verdicts.py's)
import json  # noqa: E402

import pytest  # noqa: E402

from cancelwatch.analysis.ghosts import GHOST_UNKNOWN, IN_ENGINE, LEFT, UNKNOWN  # noqa: E402
from cancelwatch.analysis.verdicts import ghosts_of as ghost_table, judge_run  # noqa: E402
from tests.test_verdicts import ADDED, T0, build_run, steady_gen  # noqa: E402


def ns(s: float) -> int:
    return T0 + int(s * 1e9)


def still_there():
    """The target's cancel lost (no abort), the engine holding it beside the neighbour to the run's end."""
    run = build_run(lambda t: 2.0, lambda t: 0.4, steady_gen, engine_log=ADDED)
    (v,) = judge_run(run)
    assert (v.verdict, v.rule) == ("leaked", "no_abort_still_there"), v
    return run, v


def test_a_leaked_request_the_engine_still_holds_is_a_ghost_aged_to_the_last_sample():
    run, v = still_there()
    (row,) = ghost_table(run, [v]).to_dict("records")
    last = float(run.samples["t_s"].max())
    assert (row["request_id"], row["in_engine"], row["left_engine_s"]) == ("tg", IN_ENGINE, None)
    assert row["age_s"] == pytest.approx(last - 2.0) and row["client_left_s"] == pytest.approx(2.0)
    assert row["tokens_after_client_left"] == v.evidence.tokens_after_client_left


def test_one_that_left_within_its_verdicts_stretch_is_aged_to_when_it_left():
    run = build_run(lambda t: 2.0 if t < 3.0 else 1.0, lambda t: 0.4, steady_gen, engine_log=ADDED)
    (v,) = judge_run(run)
    assert v.rule == "no_abort_ran_to_end", v
    (row,) = ghost_table(run, [v]).to_dict("records")
    assert (row["in_engine"], row["left_engine_s"], row["age_s"]) == (LEFT, pytest.approx(3.0), pytest.approx(1.0))


def test_past_its_verdicts_window_it_leaves_where_the_count_no_longer_holds_it():
    # judged live on a window that ended while it was still there: the count after it says when it went
    _, v = still_there()
    run = build_run(lambda t: 2.0 if t < 4.5 else 1.0 if t < 5.5 else 0.0, lambda t: 0.4, steady_gen, engine_log=ADDED)
    (row,) = ghost_table(run, [v]).to_dict("records")
    assert (row["in_engine"], row["left_engine_s"]) == (LEFT, pytest.approx(4.5)), row
    assert row["age_s"] == pytest.approx(2.5)
    # a released cancel is no ghost
    released = build_run(lambda t: 2.0 if t < 2.05 else 1.0, lambda t: 0.4 if t < 2.05 else 0.1, steady_gen,
                         probe_first_s=2.2, engine_log=[*ADDED, ("engine_aborted", "tg", 2.01)])
    assert ghost_table(released, judge_run(released)).empty


def test_a_request_on_its_way_to_the_engine_does_not_make_a_ghost_read_as_gone():
    # another request sent at 4.2 s enters the engine only at 5.5 s (a hop held it): counted from its send, the
    # count (2: the neighbour and the ghost) would have held nothing beyond the ledger's two for 1.3 s
    _, v = still_there()
    late = {"request_id": "nx", "scenario": "s2", "role": "target", "n": 1, "sent_mono_ns": ns(4.2),
            "first_token_mono_ns": ns(5.6), "closed_mono_ns": None, "cancel_mono_ns": None, "terminal_state": None}
    run = build_run(lambda t: 2.0 if t < 5.5 else 3.0, lambda t: 0.4, steady_gen, extra_ledger=[late],
                    engine_log=[*ADDED, ("engine_added", "nx", 5.5)])
    (row,) = ghost_table(run, [v]).to_dict("records")
    assert row["in_engine"] == IN_ENGINE, row


def test_where_the_count_cannot_say_it_is_unknown_and_says_why():
    run, v = still_there()
    run.info["targets"] = [{"label": "t0", "url": "http://x"}, {"label": "t1", "url": "http://y"}]
    (row,) = ghost_table(run, [v]).to_dict("records")
    assert (row["in_engine"], row["unknown_why"]) == (UNKNOWN, GHOST_UNKNOWN["targets"])
    run, v = still_there()
    # an engine whose gauges count no requests (or a store that kept none of them)
    run.samples = run.samples[~run.samples["metric"].isin(["requests_running", "requests_waiting"])]
    (row,) = ghost_table(run, [v]).to_dict("records")
    assert (row["in_engine"], row["unknown_why"]) == (UNKNOWN, GHOST_UNKNOWN["no_count"])


def second_lost_cancel() -> tuple[dict, dict]:
    """A second target for build_run, tg2: sent at 0.5 s, stopped at 2.5 s, with no abort (its ledger row, its stop)."""
    second = {"request_id": "tg2", "scenario": "s", "role": "target", "n": 1, "sent_mono_ns": ns(0.5),
              "first_token_mono_ns": ns(0.8), "closed_mono_ns": ns(2.6), "cancel_mono_ns": ns(2.5),
              "terminal_state": "cancelled"}
    stop2 = {"request_id": "tg2", "kind": "user_stop", "mono_ns": ns(2.5),
             "data": json.dumps({"cancel_id": "c2", "scenario": "s", "phase": "decode", "metrics_target": "t0"})}
    return second, stop2


def test_two_ghosts_and_one_leaving_the_oldest_is_taken_first():
    second, stop2 = second_lost_cancel()
    # three in the engine (the neighbour, both leaked) to 4.6 s, then two, then one from the neighbour's end on
    run = build_run(lambda t: 3.0 if t < 4.6 else 2.0 if t < 5.5 else 1.0, lambda t: 0.4, steady_gen,
                    extra_ledger=[second], extra_events=[stop2], engine_log=[*ADDED, ("engine_added", "tg2", 0.5)])
    verdicts = judge_run(run)
    # the count shows one of them gone at 4.6 s, not which: neither verdict says it left (each was there after its
    # grace: leaked), and the ghosts take the oldest to have gone first
    assert {(x.request_id, x.rule, x.timepoints["left_scheduler"]) for x in verdicts} == {
        ("tg", "no_abort_still_there", None), ("tg2", "no_abort_still_there", None)}
    rows = ghost_table(run, verdicts).set_index("request_id")
    assert list(rows.index) == ["tg", "tg2"]  # oldest first
    assert (rows.loc["tg", "in_engine"], rows.loc["tg", "left_engine_s"]) == (LEFT, pytest.approx(4.6))
    assert rows.loc["tg2", "in_engine"] == IN_ENGINE
    # the other left at 5.8 s: the engine idle. Each verdict says it was there to 4.55 s and had left by 5.8 s
    run = build_run(lambda t: 3.0 if t < 4.6 else 2.0 if t < 5.5 else 1.0 if t < 5.8 else 0.0, lambda t: 0.4,
                    steady_gen, extra_ledger=[second], extra_events=[stop2],
                    engine_log=[*ADDED, ("engine_added", "tg2", 0.5)])
    verdicts = {x.request_id: x for x in judge_run(run)}
    for rid, stop in (("tg", 2.0), ("tg2", 2.5)):
        x = verdicts[rid]
        assert (x.verdict, x.rule, x.timepoints["left_scheduler"]) == ("leaked", "no_abort_left_among_others",
                                                                       pytest.approx(5.8)), x
        assert x.evidence.kept_running_ms == pytest.approx((4.55 - stop) * 1000, abs=1)
    rows = ghost_table(run, list(verdicts.values())).set_index("request_id")
    assert rows.loc["tg", "left_engine_s"] == pytest.approx(4.6) and rows.loc["tg2", "left_engine_s"] == pytest.approx(5.8)


def test_two_lost_ones_gone_within_the_hold_of_a_fall_are_each_left_among_others():
    # the engine holds only the two lost requests (the neighbour's client closed at 1.5 s): one leaves at 4.6 s, the
    # other at 5.2 s, the engine then idle. The idle engine ends both before the hold of the lower count passed:
    # nothing was assumed, and neither verdict says which left first
    second, stop2 = second_lost_cancel()
    run = build_run(lambda t: (1.0 if t < 1.5 else 0.0) + (2.0 if t < 4.6 else 1.0 if t < 5.2 else 0.0),
                    lambda t: 0.4, steady_gen, extra_ledger=[second], extra_events=[stop2],
                    engine_log=[*ADDED, ("engine_added", "tg2", 0.5)])
    run.ledger.loc[run.ledger["request_id"] == "nb", "closed_mono_ns"] = ns(1.5)
    verdicts = {x.request_id: x for x in judge_run(run)}
    for rid, stop in (("tg", 2.0), ("tg2", 2.5)):
        x = verdicts[rid]
        assert (x.verdict, x.rule, x.timepoints["left_scheduler"]) == ("leaked", "no_abort_left_among_others",
                                                                       pytest.approx(5.2)), x
        assert x.evidence.kept_running_ms == pytest.approx((4.55 - stop) * 1000, abs=1)


def test_the_report_lists_the_ghosts_in_its_json_and_says_them_in_its_text(tmp_path):
    from tests.conftest import cli
    from tests.test_protocol import NO_QUEUED, write_run

    store = tmp_path / "cw.db"
    disconnect = NO_QUEUED[1]  # leaked: in the engine until 9 s of its stretch, or (leak_end) to the run's end
    write_run(store, [disconnect, {**disconnect, "leak_end": 99.0}])
    res = cli("report", "latest", "--json", "--store", str(store), home=tmp_path)
    doc = json.loads(res.stdout)
    ghosts = {g["request_id"]: g for g in doc["ghosts"]}
    leaked = [c["request_id"] for c in doc["cancels"] if c["verdict"] == "leaked"]
    assert sorted(ghosts) == sorted(leaked) and len(leaked) == 2, doc["cancels"]
    gone, held = leaked
    assert (ghosts[gone]["in_engine"], ghosts[gone]["age_s"]) == (LEFT, pytest.approx(4.0, abs=0.06))
    assert ghosts[held]["in_engine"] == IN_ENGINE and ghosts[held]["left_engine_s"] is None
    text = cli("report", "latest", "--store", str(store), home=tmp_path).stdout
    assert (f"ghosts: 1 leaked request(s) still in the engine at the last sample: {held} "
            f"({ghosts[held]['age_s']:.0f} s since its client left)") in " ".join(text.split()), text
    # and the offline HTML report has them, as the dashboard does
    cli("report", "latest", "--store", str(store), "--html", str(tmp_path / "r.html"), home=tmp_path)
    page = (tmp_path / "r.html").read_text()
    assert "<h2>Ghosts: 1 of 2 leaked request(s) still in the engine</h2>" in page
    assert page.index(f"<td>{held}</td>") < page.index(f"<td>{gone}</td>")  # the ghost first
