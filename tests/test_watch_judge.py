"""When the watch judges a cancel: once the store holds every source's reads past the end of the cancel's
window (StoreWriter.committed_through_ns), not once the clock is past it. Seen under AIPerf on two cores: the
watch's threads stalled seconds, the engine log's lines reached the store late, and windows read by the clock
lacked the Added and abort lines (live verdicts `finished_on_its_own`, `other_traffic_logged`, `never_added`
where the report of the same run said `released`)."""

from __future__ import annotations

import asyncio
import time

import pytest

from cancelwatch.analysis.watching import SETTLE_S, window_of
from cancelwatch.live_judge import LATE_S, MAX_TRIES, LiveJudge
from cancelwatch.runstore.records import EventRecord, ScrapeRecord
from cancelwatch.runstore.writer import StoreWriter, create_run, open_store


def test_the_store_is_held_through_each_sources_read_before_its_last_committed_one(tmp_path):
    con = open_store(tmp_path / "s.db")
    rid = create_run(con, name="w", targets=[], engine={}, settings={}, wall_ns=0, mono_ns=0)
    w = StoreWriter(con, rid, flush_s=0.05)
    try:
        def read(source: str, t_s: float) -> None:
            w.put(ScrapeRecord(source, "t0", 0, 0, int(t_s * 1e9), 1000, True, []))

        read("vllm", 1.0)
        read("engine_log", 1.0)
        deadline = time.monotonic() + 5
        while w.scrapes_written < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert w.committed_through_ns() is None  # one read a source: its events may still be a commit behind
        read("vllm", 2.0)
        read("vllm", 3.0)
        read("engine_log", 1.5)
        w.put(EventRecord("engine_added", 0, int(1.4e9), "r1", {}))  # read with the engine log's 1.5 s read
        read("engine_log", 1.55)
        while w.scrapes_written < 6 and time.monotonic() < deadline:
            time.sleep(0.02)
        # vllm is held through 2.0, the engine log only through 1.5 (its 1.55 read's events may lag): 1.5
        assert w.committed_through_ns() == int(1.5e9)
    finally:
        w.close()
        con.close()


class _Seen(LiveJudge):
    def __init__(self, through_s: float | None):
        super().__init__(store=None, grace_s=2.0, ledger=None, metrics=None)
        self.judged: list[set[str]] = []
        self.start(1, time.monotonic_ns() - int(100e9),
                   lambda: None if through_s is None else self.t0_ns + int(through_s * 1e9))

    async def _judge(self, ready, last_try):
        self.judged.append(set(ready))
        for rid in ready:
            self.pending.pop(rid)


class _Clocked(_Seen):
    """A judge whose clock the test sets: each record is put at its own instant, as a driver puts it."""
    clock = 0.0

    def now_s(self) -> float:
        return self.clock


def test_a_cancel_waits_for_the_store_not_the_clock_and_not_past_a_bound():
    stop = 90.0  # the clock is at 100 s: the window [88, 94] is long past by the clock
    end = window_of(stop, 2.0)[1]
    behind = _Seen(through_s=end - 0.5)  # the engine log half a second short of the window's end
    behind.pending["r"], behind.decided["r"] = stop, stop
    asyncio.run(behind.due())
    assert behind.judged == []
    caught_up = _Seen(through_s=end + 0.1)
    caught_up.pending["r"], caught_up.decided["r"] = stop, stop
    asyncio.run(caught_up.due())
    assert caught_up.judged == [{"r"}]
    # a source that stopped answering long ago is not waited for: judged with its gaps
    stale = _Seen(through_s=10.0)
    stale.pending["r"], stale.decided["r"] = 100.0 - LATE_S - SETTLE_S - 2.0 - 0.5, 80.0
    asyncio.run(stale.due())
    assert stale.judged == [{"r"}]
    nothing = _Seen(through_s=None)
    nothing.pending["r"], nothing.decided["r"] = stop, stop
    asyncio.run(nothing.due())
    assert nothing.judged == []


def test_a_cancel_waits_for_the_stops_of_the_other_cancels_in_its_window():
    """A half-close is decided, and its stop put, when its connection ends, long after the stop: a window that
    lacks it counts that request as the engine's surplus (X reset at 90.5 s, Y half-closed at 90.0 s and
    decided at 94.8 s, X due on the same pass)."""
    j = _Seen(through_s=94.6)  # the clock at 100 s
    j.pending["X"], j.decided["X"] = 90.5, 90.5
    j.pending["Y"], j.decided["Y"] = 90.0, 94.8  # in X's window, put after the store's mark
    asyncio.run(j.due())
    assert j.judged == []
    j.committed_through_ns = lambda: j.t0_ns + int(94.9e9)
    asyncio.run(j.due())
    assert j.judged == [{"X", "Y"}]


def test_the_mark_waits_for_every_expected_source_and_stops_at_a_failed_write(tmp_path):
    con = open_store(tmp_path / "s.db")
    rid = create_run(con, name="w", targets=[], engine={}, settings={}, wall_ns=0, mono_ns=0)
    w = StoreWriter(con, rid, flush_s=0.05)
    try:
        w.expect([("vllm", "t0"), ("nvml", "gpu0")])  # NVML's first read is slow: no read of it yet
        for t in (1.0, 2.0, 3.0):
            w.put(ScrapeRecord("vllm", "t0", 0, 0, int(t * 1e9), 1000, True, []))
        deadline = time.monotonic() + 5
        while w.scrapes_written < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert w.committed_through_ns() is None
        for t in (1.0, 2.0):
            w.put(ScrapeRecord("nvml", "gpu0", 0, 0, int(t * 1e9), 1000, True, []))
        while w.scrapes_written < 5 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert w.committed_through_ns() == int(1e9)
        w.error = RuntimeError("a batch was rolled back")  # its records are lost: no mark past them
        assert w.committed_through_ns() is None
        w.error = None
    finally:
        w.close()
        con.close()


def test_a_cancel_whose_request_the_log_does_not_name_yet_is_judged_again_on_a_longer_window(monkeypatch):
    """CI (stop 29), on a starved host: a request reached the engine over 5 s after the watch saw it sent, after
    its client had gone; judged on its window it was `never_added`, where its Added line, seconds later, makes
    it a leak (entered_after_stop). That verdict is held back, and the cancel judged once more on a window
    ENTRY_WAIT_S longer; what that one says stands, whatever it is."""
    import types

    import cancelwatch.analysis.watching
    import cancelwatch.runstore.reader
    from cancelwatch.analysis.watching import ENTRY_WAIT_S

    windows: list[tuple[float, float]] = []
    rules = iter(["never_added", "entered_after_stop"])

    def load_window(store, run, lo, hi, **kw):
        windows.append((lo, hi))
        return None

    def judge_cancels(window, ids, grace_s, seen_leaving=None):
        rule = next(rules)
        verdict = "inconclusive" if rule == "never_added" else "leaked"
        ev = types.SimpleNamespace(why="", tokens_after_client_left=None, kept_running_ms=None,
                                   engine_log="read")
        return [types.SimpleNamespace(request_id=rid, rule=rule, verdict=verdict, evidence=ev, timepoints={})
                for rid in ids]

    monkeypatch.setattr(cancelwatch.runstore.reader, "load_window", load_window)
    monkeypatch.setattr(cancelwatch.analysis.watching, "judge_cancels", judge_cancels)
    j = LiveJudge(store=None, grace_s=2.0, ledger=types.SimpleNamespace(live_rows=lambda through: []), metrics=None)
    j.log_offsets = ()  # no engine log to place: the windows are the test's
    j.start(1, time.monotonic_ns() - int(100e9), lambda: j.t0_ns + int(1000e9))  # the clock at 100 s
    stop = 90.0
    j.pending["r"], j.decided["r"] = stop, stop
    asyncio.run(j.due())
    assert windows == [window_of(stop, 2.0)] and j.counts == {} and "r" in j.pending  # not said: held back
    asyncio.run(j.due())
    assert len(windows) == 1  # its longer window ends at 104 s, past the clock
    j.t0_ns -= int(ENTRY_WAIT_S * 1e9)
    asyncio.run(j.due())
    assert windows[1] == window_of(stop, 2.0, ENTRY_WAIT_S) and j.counts == {"leaked": 1} and not j.pending
    assert not j.extra and not j.tries  # nothing kept of a judged cancel: a watch runs for days


def test_records_cancel_waits_for_every_scenario_begun_in_its_window_to_end_and_be_stored():
    """`record` writes a scenario's ledger rows at its end: a window read before then lacks the rows of the
    requests in it (the next scenario's neighbour, sent as the last one ended, would read as the engine's
    surplus). The stops and scenarios come from the records the driver puts, each as it is put (LiveJudge.saw)."""
    j = _Clocked(through_s=None)

    def put(kind: str, at_s: float, rid: str | None = None) -> None:
        j.clock = at_s + 0.01
        j.saw(EventRecord(kind, 0, j.t0_ns + int(at_s * 1e9), rid, {}))

    put("scenario_start", 80.0)
    put("user_stop", 82.0, "a")
    put("user_stop", 82.0, "a")  # a stop put twice is one cancel
    put("scenario_end", 85.0)
    put("scenario_start", 85.1)  # begins inside a's window, which ends at 88 s
    assert j.pending == {"a": 82.0}
    j.clock = 94.0
    j.committed_through_ns = lambda: j.t0_ns + int(93.9e9)
    asyncio.run(j.due())
    assert j.judged == []  # the second scenario's rows are not written yet
    put("scenario_end", 95.0)
    j.committed_through_ns = lambda: j.t0_ns + int(94.9e9)
    asyncio.run(j.due())
    assert j.judged == []  # its end is not in the store yet
    j.clock = 96.0
    j.committed_through_ns = lambda: j.t0_ns + int(95.5e9)
    asyncio.run(j.due())
    assert j.judged == [{"a"}]
    # a cancel whose window ends before the next scenario begins waits only for its own scenario's end
    put("scenario_start", 96.0)
    put("user_stop", 98.0, "b")
    put("scenario_end", 100.0)
    j.clock = 106.0
    j.committed_through_ns = lambda: j.t0_ns + int(105.9e9)
    asyncio.run(j.due())
    assert j.judged == [{"a"}, {"b"}]


def test_a_source_removed_on_purpose_no_longer_holds_the_mark_back(tmp_path):
    """`record`'s relay app is stopped after its scenarios: its reads end, and the mark must go on without it."""
    con = open_store(tmp_path / "s.db")
    rid = create_run(con, name="w", targets=[], engine={}, settings={}, wall_ns=0, mono_ns=0)
    w = StoreWriter(con, rid, flush_s=0.05)
    try:
        for t in (1.0, 2.0):
            w.put(ScrapeRecord("vllm", "relay", 0, 0, int(t * 1e9), 1000, True, []))
        for t in (1.0, 2.0, 3.0, 4.0):
            w.put(ScrapeRecord("vllm", "t0", 0, 0, int(t * 1e9), 1000, True, []))
        deadline = time.monotonic() + 5
        while w.scrapes_written < 6 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert w.committed_through_ns() == int(1e9)  # the relay's last read but one
        w.forget(("vllm", "relay"))
        w.put(ScrapeRecord("vllm", "relay", 0, 0, int(2.5e9), 1000, True, []))  # a read already on its way
        while w.scrapes_written < 7 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert w.committed_through_ns() == int(3e9)
    finally:
        w.close()
        con.close()


def test_records_cancel_judged_by_the_clock_still_waits_for_the_store_to_hold_its_scenarios_end():
    """The clock's fallback (a store more than LATE_S behind) is no way round `record`'s rows: a scenario that
    ran long past its stop (a leak waited out, a burst's long target) ends, and its rows, put seconds before,
    are not in the store until the store holds that end (read without them: other traffic, not a release)."""
    j = _Clocked(through_s=None)
    j.clock = 80.01
    j.saw(EventRecord("scenario_start", 0, j.t0_ns + int(80e9), None, {}))
    j.clock = 82.01
    j.saw(EventRecord("user_stop", 0, j.t0_ns + int(82e9), "a", {}))  # its window ends at 86 s
    j.clock = 100.01
    j.saw(EventRecord("scenario_end", 0, j.t0_ns + int(100e9), None, {}))
    j.committed_through_ns = lambda: j.t0_ns + int(99.6e9)  # a commit behind the scenario's end
    asyncio.run(j.due())
    assert j.judged == []
    j.committed_through_ns = lambda: j.t0_ns + int(100.1e9)
    asyncio.run(j.due())
    assert j.judged == [{"a"}]


def test_records_window_reaches_its_scenarios_end_and_a_fault_in_judging_it_is_said_not_raised(monkeypatch,
                                                                                             capsys):
    """A scripted cancel's window runs to its scenario's end where that is later than the grace and settle: the
    scenario still shows the cancel there (the probe admitted, the KV drop, a leaked request running out), as the
    whole run does. And whatever judging a batch meets (here a fault in the analysis) is said in one line and
    left to `cancelwatch report`; the recording beside it goes on, to its last judgement (drain) included."""
    import cancelwatch.analysis.watching
    import cancelwatch.runstore.reader
    from cancelwatch.live_judge import judging

    windows: list[tuple[float, float]] = []

    def load_window(store, run, lo, hi, **kw):
        windows.append((lo, hi))
        return None

    def broken(*args, **kwargs):
        raise IndexError()

    monkeypatch.setattr(cancelwatch.runstore.reader, "load_window", load_window)
    monkeypatch.setattr(cancelwatch.analysis.watching, "judge_cancels", broken)
    j = LiveJudge(store=None, grace_s=2.0, said="record")
    j.log_offsets = ()  # no engine log to place: the windows are the test's
    j.start(1, time.monotonic_ns() - int(100e9), time.monotonic_ns)

    async def scenario():
        for kind, at, rid in (("scenario_start", 80.0, None), ("user_stop", 82.0, "a"), ("scenario_end", 99.9, None)):
            j.saw(EventRecord(kind, 0, j.t0_ns + int(at * 1e9), rid, {}))

    asyncio.run(judging(scenario(), j))
    assert windows and all(w == (window_of(82.0, 2.0)[0], pytest.approx(99.9)) for w in windows)
    said = capsys.readouterr().err
    assert "record: 1 cancel(s) could not be judged (IndexError)" in said
    assert len(windows) <= MAX_TRIES  # tried again a few times at most, then left to the report


def test_the_watchs_judge_lets_go_of_the_store_before_its_writer_closes_it(tmp_path):
    """The live judge holds one connection to the store from window to window. The watch closes it as its loop
    ends, before the recorder's writer closes the store: SQLite folds its log into the store only as the last
    connection closes, and a reader still open then left the run in the -wal file beside the store (a copy of the
    .db alone held no run)."""
    from cancelwatch.runstore.records import Sample
    from cancelwatch.watch_commands import _judged_until_done

    path = tmp_path / "s.db"
    con = open_store(path)
    t0 = time.monotonic_ns()
    rid = create_run(con, name="w", targets=[{"label": "t0", "url": "http://127.0.0.1:1"}], engine={}, settings={},
                     wall_ns=time.time_ns(), mono_ns=t0)
    writer = StoreWriter(con, rid)
    judge = LiveJudge(path, 1.0)
    judge.start(rid, t0, writer.committed_through_ns)
    marks = []
    for i in range(300):
        marks.append(time.monotonic_ns())
        writer.put(ScrapeRecord("vllm", "t0", i, time.time_ns(), marks[-1], 1000, True,
                                [Sample("vllm", "requests_running", 1.0, (), time.time_ns(), marks[-1])]))
    deadline = time.monotonic() + 10  # every read committed (the mark stands at the one before the last)
    while (writer.committed_through_ns() or 0) < marks[-2] and time.monotonic() < deadline:
        time.sleep(0.05)

    async def watch_loop():  # a window read in a worker thread, as LiveJudge._judge reads it
        return len((await asyncio.to_thread(judge.windows, rid, 0.0, judge.now_s())).scrapes)

    assert asyncio.run(_judged_until_done(watch_loop(), judge)) == 300
    writer.close()
    con.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.db"]
