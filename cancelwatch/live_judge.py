"""Judging a run's cancels while it is recorded, each on its own window as its grace ends (analysis/watching.py):
`cancelwatch watch` (real clients' cancels) and `cancelwatch record` (scripted ones). The verdicts are kept in
the run as they are given, so that a day's run is never read whole to be judged, and what was judged before a
crash stays judged.

Here, above collectors and analysis, as the canary is: collectors write the run, analysis judges it."""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import asdict
from pathlib import Path

from cancelwatch.console import err, out

MAX_TRIES = 5  # judging a cancel whose window the store does not hold yet, at most
# a source this far behind the clock is not waited for: its cancels are judged by the clock, with its gaps
LATE_S = 10.0
EVERY_S = 0.5  # how often `record` looks for cancels whose windows the store holds
DRAIN_S = 3.0  # at `record`'s end, the longest it waits for the store to hold its last scenario's end
# how often the engine logs' clock is looked for while no request bounds it (a log that names no request, vLLM
# without --enable-log-requests): each look reads the run's events and ledger
OFFSETS_RETRY_S = 30.0


class LiveJudge:
    """The cancels waiting for their grace to end, judged in batches off the event loop's thread.

    `ledger`: the watch's (its live_rows: the requests in flight, which the store holds no row of yet); None for
    `record`, whose rows are written at each scenario's end: a cancel is judged once every scenario that began
    before its window's end has ended and the store holds its end (`saw` follows the scenarios). `said`: the
    command's name, which begins each line printed."""

    def __init__(self, store: Path, grace_s: float, ledger=None, metrics=None, said: str = "watch"):
        self.store, self.grace_s = store, grace_s
        self.run_id, self.t0_ns = 0, 0  # the run's, once recording has created it (start)
        self.ledger, self.metrics, self.said = ledger, metrics, said
        self.pending: dict[str, float] = {}  # request id -> its stop, s since the run started
        # request id -> when its cancel was decided (s since the run started): a half-close is decided when the
        # connection ends, long after the stop, and its events reach the store a commit later
        self.decided: dict[str, float] = {}
        self.tries: dict[str, int] = {}
        # request id -> how much longer its window is: its request was not in the engine's log yet (ENTRY_WAIT_S)
        self.extra: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self.left_seen: dict[str, float] = {}  # request id -> when its verdict saw it leave the engine
        # where the engine logs' lines are against the run's clock (log_clock.log_offsets), once a request bounds
        # them: a container logging in UTC beside a recorder in another zone puts its lines hours off a window
        self.log_offsets: tuple | None = None
        self.log_offsets_tried = -math.inf  # when they were last looked for and not found (now_s)
        self.failures = 0
        self.keep = None
        # `record`'s scenarios: when the one under way began (None: none is), when the last one ended
        self.scenario_since: float | None = None
        self.scenario_ended = -math.inf
        self.stopped: set[str] = set()  # `record`'s cancels seen: a stop put twice is one cancel
        # request id -> its scenario's end (`record`): its window reaches it, for what the scenario still shows of
        # the cancel past the grace (the probe admitted, the KV drop, a leaked request running out)
        self.until: dict[str, float] = {}
        self.committed_through_ns = lambda: None
        from cancelwatch.analysis.ghosts import WatchGhosts
        from cancelwatch.runstore.reader import WindowReader

        self.ghosts = WatchGhosts(grace_s)  # the leaked ones the engine may still hold (the watch counts them)
        self.windows = WindowReader(store)  # the windows, one batch after another, on one connection (close)

    def start(self, run_id: int, t0_ns: int, committed_through_ns=lambda: None, keep=None) -> None:
        self.run_id, self.t0_ns = run_id, t0_ns
        self.committed_through_ns = committed_through_ns  # the writer's: how far the store holds every source
        self.keep = keep  # the writer's put_verdicts: the verdicts are kept in the run, for a page showing a day

    def add(self, request_id: str, t_stop_s: float) -> None:
        self.pending[request_id] = t_stop_s
        self.decided[request_id] = self.now_s()

    def saw(self, rec) -> None:
        """A record `record`'s driver put: its stops are the cancels, its scenarios bound what a window may read."""
        kind = getattr(rec, "kind", None)
        if kind is None or rec.mono_ns is None:
            return
        t = (rec.mono_ns - self.t0_ns) / 1e9
        if kind == "user_stop" and rec.request_id and rec.request_id not in self.stopped:
            self.stopped.add(rec.request_id)
            self.add(rec.request_id, t)
        elif kind == "scenario_start":
            self.scenario_since = t
        elif kind == "scenario_end":
            self.scenario_since, self.scenario_ended = None, t
            self.until.update({rid: t for rid in self.pending if rid not in self.until})

    def putting(self, put):
        """`put` (the writer's), seeing each record on its way: what `record`'s drivers are given to emit with."""
        def put_and_see(rec) -> None:
            put(rec)
            self.saw(rec)
        return put_and_see

    def close(self) -> None:
        """The judge's store connection closed, when its run ends."""
        self.windows.close()

    def now_s(self) -> float:
        return (time.monotonic_ns() - self.t0_ns) / 1e9

    def held_s(self, through_ns: int | None) -> float:
        """The store's mark (committed_through_ns) in s since the run started; -inf when it holds nothing yet."""
        return -math.inf if through_ns is None else (through_ns - self.t0_ns) / 1e9

    def rows_held(self, end_s: float, held: float) -> bool:
        """Whether the store holds the ledger rows of every request a window ending at `end_s` may see: `record`
        writes a scenario's rows at its end, so every scenario begun by then must have ended, and the store
        hold that end. The watch's rows not yet stored are its ledger's live ones (always true)."""
        return ((self.scenario_since is None or self.scenario_since > end_s)
                and (self.scenario_ended == -math.inf or held >= self.scenario_ended))

    async def due(self, everything: bool = False) -> None:
        from cancelwatch.analysis.watching import due, window_of

        now = self.now_s()
        # a window is judged once the store holds every source's reads past its end, not once the clock is
        # past it: on a starved host (seen: the watch's threads stalled 3 s under AIPerf and the engine on two
        # cores) the engine log's lines come seconds late, and a window read by the clock lacked its Added and
        # abort lines. And once the stops of every cancel in the window are in the store too: a cancel is put
        # when it is decided (a half-close at its connection's end, long after its stop), and a window without
        # another cancel's stop would count that request as the engine's surplus. A store further behind
        # than LATE_S is not waited for: judged by the clock, with the gaps in the window
        held = self.held_s(self.committed_through_ns())

        def stops_held(rid: str, t: float) -> bool:
            end = window_of(t, self.grace_s, self.extra.get(rid, 0.0))[1]
            return (all(held >= self.decided[r] for r, s in self.pending.items() if s <= end)
                    and self.rows_held(end, held))

        def ready_now(rid: str, t: float) -> bool:
            extra = self.extra.get(rid, 0.0)
            end = window_of(t, self.grace_s, extra)[1]
            # either way `record`'s rows must be in the store: they are put seconds before their scenario's end,
            # and a store a few seconds behind would give a window without them (other traffic, not a release)
            return ((due(t, self.grace_s, min(now, held), extra) and stops_held(rid, t))
                    or (due(t, self.grace_s, now - LATE_S, extra) and now >= self.decided[rid] + LATE_S
                        and self.rows_held(end, held)))

        ready = {rid: t for rid, t in self.pending.items() if everything or ready_now(rid, t)}
        if ready:
            await self._judge(ready, last_try=everything)

    async def run(self, until) -> None:
        """`record`'s: judge what is due every EVERY_S until `until()` (the scenarios are done); the cancels
        still waiting then are the recorder's tail's (cancelwatch.report_commands.judged_run)."""
        while not until():
            await self.due()
            await asyncio.sleep(EVERY_S)

    async def drain(self, bound_s: float = DRAIN_S) -> None:
        """`record`'s, when its scenarios are done: the cancels whose windows close before the last scenario's end,
        judged once the store holds that end (bounded). Those left reach past the run's end: the tail's."""
        from cancelwatch.analysis.watching import window_of

        until = time.monotonic() + bound_s
        while time.monotonic() < until and any(window_of(t, self.grace_s, self.extra.get(rid, 0.0))[1]
                                               <= self.scenario_ended for rid, t in self.pending.items()):
            await self.due()
            await asyncio.sleep(0.2)

    async def _judge(self, ready: dict[str, float], last_try: bool) -> None:
        import pandas as pd

        from cancelwatch.analysis.facts import VERDICT_METRICS
        from cancelwatch.analysis.watching import ENTRY_WAIT_S, LOOKBACK_S, NOT_YET_ENTERED, window_of

        # when the watch's ledger let each go from its flight (a half-close is put at its connection's end)
        decided = {rid: self.decided.get(rid, t) for rid, t in ready.items()}
        lo = window_of(min(ready.values()), self.grace_s)[0]
        hi = max(max(window_of(t, self.grace_s, self.extra.get(rid, 0.0))[1], self.until.get(rid, -math.inf))
                 for rid, t in ready.items())
        # the store's mark before the rows: a row handed out before it is in the store when the store is read
        through = self.committed_through_ns()
        open_rows = pd.DataFrame([asdict(r) for r in self.ledger.live_rows(through)] if self.ledger else [])
        held = self.held_s(through)

        def judge():
            from cancelwatch.analysis.watching import judge_cancels

            if self.log_offsets is None and self.now_s() >= self.log_offsets_tried + OFFSETS_RETRY_S:
                # the requests in flight bound the clock too: a watch's first cancel has no stored row beside it
                self.log_offsets = log_offsets_of(self.store, self.run_id, open_rows)
                self.log_offsets_tried = self.now_s()
            window = self.windows(self.run_id, lo, hi, extra_ledger=open_rows, lookback_s=LOOKBACK_S,
                                  held_through_s=held, metrics=VERDICT_METRICS, log_offsets_s=self.log_offsets or ())
            return judge_cancels(window, set(ready), self.grace_s, self.left_seen)

        try:
            verdicts = await asyncio.to_thread(judge)
        except Exception as exc:  # noqa: BLE001 - one batch that cannot be judged (a store that failed, a fault in
            # the analysis): said, and left to `cancelwatch report`; the run it is recorded beside goes on
            self.failures += 1
            why = (str(exc).splitlines() or [""])[0][:200] or type(exc).__name__
            err.print(f"{self.said}: {len(ready)} cancel(s) could not be judged ({why}); "
                      "`cancelwatch report` judges them from the run")
            verdicts = []
        # a request the engine's log does not name yet may still reach the engine after its stop: judged again
        # once on a window ENTRY_WAIT_S longer, where its Added line, if it comes, tells (entered_after_stop)
        later = {v.request_id for v in verdicts if v.rule in NOT_YET_ENTERED and not last_try
                 and not self.extra.get(v.request_id)}
        for rid in later:
            self.extra[rid] = ENTRY_WAIT_S
        verdicts = [v for v in verdicts if v.request_id not in later]
        got = {v.request_id for v in verdicts} | later
        for rid in set(ready) - later:
            # a cancel the window did not hold yet (the store a commit behind) is tried again, a few times
            self.tries[rid] = self.tries.get(rid, 0) + 1
            if rid in got or last_try or self.tries[rid] >= MAX_TRIES:
                self.pending.pop(rid, None)
                self.until.pop(rid, None)
                self.decided.pop(rid, None)
                self.extra.pop(rid, None)
                self.tries.pop(rid, None)  # kept for no judged cancel: a watch runs for days
                if rid not in got:
                    self.failures += 1
                    err.print(f"{self.said}: cancel {rid} could not be judged live; `cancelwatch report` judges "
                              "it from the run")
        from cancelwatch.analysis.watching import left_seen

        # when each left the engine, for the windows judged after it (their samples start just before their
        # stops); kept for as long as a window looks back
        self.left_seen.update(left_seen(verdicts))
        self.left_seen = {r: t for r, t in self.left_seen.items() if t >= self.now_s() - LOOKBACK_S - LATE_S}
        for v in verdicts:
            self.counts[v.verdict] = self.counts.get(v.verdict, 0) + 1
            if self.ledger is not None:  # the watch's
                stop, out_s = ready[v.request_id], max(ready[v.request_id], decided[v.request_id])
                self.ghosts.judged(v.request_id, stop, *_in_engine(v, stop, out_s, self.now_s()))
            why = f": {v.evidence.why}" if v.evidence.why else ""
            paid = v.evidence.tokens_after_client_left
            if paid is not None:
                how = "" if v.evidence.tokens_after_client_left_is == "attributed" else "at most "
                why += f" ({how}{paid:.0f} tokens made after its client left)"
            out.print(f"{self.said}: cancel {v.request_id} {v.verdict} ({v.rule}){why}", highlight=False)
        if self.metrics is not None:
            self.metrics.observe(verdicts)
        if self.keep is not None and verdicts:
            from cancelwatch.analysis.verdicts.stored import judged_by, stored

            try:
                self.keep(judged_by(), [(v.request_id, stored(v)) for v in verdicts])
            except (TypeError, ValueError) as exc:  # not kept: said; the verdicts stand, the run goes on
                err.print(f"{self.said}: {len(verdicts)} verdict(s) not kept in the run ({exc}); `cancelwatch "
                          "report` judges them from the run")


def _in_engine(v, stop_s: float, out_s: float, now_s: float) -> tuple[bool, float, float | None]:
    """What the watch's ghosts (analysis.ghosts.WatchGhosts) take from verdict `v` of a cancel its ledger let go
    from its flight at `out_s`: (a ghost?, from, until when surely in the engine). Counting one in the engine
    longer than it was would take a ghost still there to have left; shorter only keeps one too long."""
    from cancelwatch.analysis.verdicts.core import LEFT_BY_RULES

    left, kept = v.timepoints.get("left_scheduler"), v.evidence.kept_running_ms
    if v.rule == "entered_after_stop":
        # a hop sent it on after its client left: the engine counted it only from its entry (kept_running_ms runs
        # from there); with no leaving seen, it is a ghost from its verdict on
        if left is None:
            return True, now_s, None
        return False, max(out_s, left - (kept or 0.0) / 1000), left
    if v.verdict == "leaked" and left is None:
        return True, out_s, None
    if v.rule in LEFT_BY_RULES:  # gone *by* left_scheduler: surely there only for kept_running_ms
        return False, out_s, None if kept is None else stop_s + kept / 1000
    return False, out_s, left


def recording_judge(store: Path, grace_s: float, writer, sampler) -> LiveJudge:
    """`record`'s live judge, started on the run `writer` writes (its verdicts kept with the run)."""
    # what judging reads with (the verdict rules, pandas) is imported before the first scenario: imported at the
    # first judgement, its second of CPU would come in the middle of the next scenario's requests
    import cancelwatch.analysis.verdicts.stored  # noqa: F401 - and the rules' fingerprint its verdicts are kept with
    import cancelwatch.analysis.watching  # noqa: F401
    import cancelwatch.runstore.reader  # noqa: F401

    judge = LiveJudge(store, grace_s, said="record")
    writer.expect((s.name, s.target) for s in sampler.sources)
    judge.start(writer.run_id, sampler.t0_mono_ns, writer.committed_through_ns, writer.put_verdicts)
    return judge


async def judging(work, judge: LiveJudge) -> None:
    """Run `work` (the scripted cancels) while `judge` judges each cancel whose window the store holds. When the
    work ends, the judgement under way is finished (bounded) and kept, and those whose windows close before the
    last scenario's end are judged (LiveJudge.drain); the cancels still waiting are left to the recorder's tail.
    When it is cancelled (Ctrl-C, a lost target), so is the judge."""
    finished = False
    task = asyncio.create_task(judge.run(lambda: finished))
    try:
        try:
            await work
        except BaseException:
            task.cancel()
            raise
        finished = True
        done, _ = await asyncio.wait({task}, timeout=60.0)
        if not done:
            task.cancel()
        elif task.exception() is not None:  # a judge that failed: said; the tail judges the run's cancels
            err.print(f"{judge.said}: live judging stopped ({task.exception()}); the cancels are judged from the run")
        else:
            await judge.drain()
    finally:
        judge.close()


def log_offsets_of(store: Path, run_id: int, open_rows=None) -> tuple | None:
    """Where the run's engine logs' lines are against its clock (analysis log_clock.log_offsets), from their Added
    lines and the ledger so far (`open_rows`: the rows a watch still holds); None while no request bounds any log's
    clock (looked for again OFFSETS_RETRY_S later: each look reads the run's events and ledger)."""
    from cancelwatch.analysis.verdicts.log_clock import log_clocks, log_offsets
    from cancelwatch.runstore.reader import load_log_anchors

    anchors = load_log_anchors(store, run_id, open_rows)
    logs = (anchors.info.get("engine") or {}).get("engine_log") or {}
    if not any(entry.get("path") for entry in logs.values()):
        return ()  # no engine log is read: nothing to place
    clocks = log_clocks(anchors)
    return log_offsets(clocks) if any(c.requests for c in clocks.values()) else None
