"""The sampler: every source on its own ticker and tick grid, so a slow one never delays the others.

Each tick's read starts on the grid even when the previous read of the same source is still in
flight (up to the source's `max_in_flight`): a busy server answering late widens that scrape's
duration, which is stored with it, instead of shifting every later sample; its scrape is still handed
on before theirs (a store is never ahead of a read still in flight). Timing, retries,
back-off and gap bookkeeping live here once; sources only read.
"""

from __future__ import annotations

import os
import sys
from array import array
from collections import deque
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from cancelwatch.collectors.sources.base import ParseError, Source, SourceError
from cancelwatch.runstore.records import GapRecord, Sample, ScrapeRecord

BACKOFF_START_S = 0.1
BACKOFF_MAX_S = 2.0
TICK_NICE = -10


def make_thread_realtime() -> bool:
    """Best effort: SCHED_FIFO (lowest real-time priority) for the calling thread, else a lower nice.

    Only tickers ask for it: they sleep between ticks and only hand a read to a worker, so they
    cannot starve anything, while a woken ticker no longer queues behind a saturated engine.
    """
    try:
        os.sched_setscheduler(threading.get_native_id(), os.SCHED_FIFO, os.sched_param(1))
        return True
    except (OSError, AttributeError):
        return raise_thread_priority()


def raise_thread_priority(nice: int = TICK_NICE) -> bool:
    """Best effort: give the calling thread a lower nice value (Linux: per thread id).

    A saturated engine keeps every core busy; at equal priority a ticker's wake-up can then wait
    10-30 ms for a core, which is the whole timing budget. Without CAP_SYS_NICE this is a no-op.
    """
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
        return True
    except (OSError, AttributeError):
        return False


class RecentValues:
    """The latest values (up to `cap`) as 8-byte integers, for timing statistics. A Python list of ints
    costs ~36 bytes an entry and grows with the run: three of them a source came to ~8 MB of the
    recorder's growth over a 12-minute soak (bench/soak.py), and would keep growing for a day-long
    `sample`. When full, the older half goes (amortised O(1))."""

    def __init__(self, cap: int = 72_000):  # an hour at 20 Hz
        self.cap = cap
        self._a = array("q")

    def append(self, value: int) -> None:
        self._a.append(value)
        if len(self._a) > self.cap:
            del self._a[: len(self._a) - self.cap // 2]

    def __len__(self) -> int:
        return len(self._a)

    def __iter__(self):
        return iter(self._a)

    def __getitem__(self, i):
        return self._a[i]


@dataclass
class SourceStats:
    """Counters of one source over a run. `taken` counts samples handed to the writer."""

    source: str
    target: str
    scrapes_ok: int = 0
    scrape_errors: int = 0
    parse_errors: int = 0
    missed_ticks: int = 0
    taken: int = 0
    first_ok_mono_ns: int | None = None
    last_ok_mono_ns: int | None = None
    intervals_ns: RecentValues = field(default_factory=lambda: RecentValues())  # between scrape starts
    lateness_ns: RecentValues = field(default_factory=lambda: RecentValues())  # start minus its scheduled tick
    durations_ns: RecentValues = field(default_factory=lambda: RecentValues())
    lost: bool = False
    last_error: str = ""

    def as_dict(self) -> dict:
        span = (self.last_ok_mono_ns or 0) - (self.first_ok_mono_ns or 0)
        return {
            "source": self.source,
            "target": self.target,
            "scrapes_ok": self.scrapes_ok,
            "scrape_errors": self.scrape_errors,
            "parse_errors": self.parse_errors,
            "missed_ticks": self.missed_ticks,
            "samples_taken": self.taken,
            "effective_hz": (self.scrapes_ok - 1) / (span / 1e9) if self.scrapes_ok > 1 and span > 0 else None,
            "lost": self.lost,
            "last_error": self.last_error,
        }


class _Gap:
    def __init__(self, kind: str, wall_ns: int, mono_ns: int, detail: str = ""):
        self.kind, self.wall_ns, self.mono_ns, self.detail = kind, wall_ns, mono_ns, detail
        self.ticks = 0


class _SourceState:
    """Mutable per-source bookkeeping shared by its ticker and its reader threads (under `lock`)."""

    def __init__(self, src: Source, stats: SourceStats):
        self.src = src
        self.stats = stats
        self.lock = threading.Lock()
        self.in_flight = 0
        # the reads started and not yet handed on, oldest first, and the records of those done: a read's
        # scrape is handed to the sink only after every read started before it (see _in_order)
        self.order: deque[int] = deque()
        self.held: dict[int, ScrapeRecord] = {}
        self.fail_gap: _Gap | None = None
        self.missed_gap: _Gap | None = None
        self.backoff_s = 0.0
        self.backoff_until_ns = 0


class Sampler:
    """Samples `sources` at `hz` until `stop()`; hands scrapes and gaps to `sink(record)`.

    A critical source (`Source.critical`) failing without pause for `lost_after_s` is marked lost and `lost` is set, so
    the recorder can end the run; it is still retried with back-off until then.
    """

    def __init__(
        self,
        sources: list[Source],
        sink,
        hz: float = 20.0,
        lost_after_s: float = 10.0,
        on_samples=None,
        boost_priority: bool = True,
        burst_hz: float | None = None,
    ):
        if hz <= 0:
            raise ValueError("hz must be > 0")
        self.sources = sources
        self.sink = sink
        self.period_ns = int(1e9 / hz)
        # burst sampling: ticks run on a grid `burst_factor` times finer; outside a burst only every
        # burst_factor-th tick is read, so the baseline keeps its rate and phase and a burst only adds
        # the ticks in between (the stored `tick` is on the fine grid)
        self.burst_factor = 1
        if burst_hz:
            factor = burst_hz / hz
            if factor < 1 or abs(factor - round(factor)) > 1e-9:
                raise ValueError(f"burst_hz {burst_hz:g} must be a whole multiple of hz {hz:g}")
            self.burst_factor = int(round(factor))
        self.tick_ns = self.period_ns // self.burst_factor
        self._burst_until: dict[int, int] = {}  # id(source) -> monotonic ns the burst ends
        self._wake: dict[int, threading.Event] = {}  # id(source) -> wakes its ticker (burst, stop)
        self.lost_after_ns = int(lost_after_s * 1e9)
        self.on_samples = on_samples
        self.boost_priority = boost_priority
        self.stats = {id(s): SourceStats(s.name, s.target) for s in sources}
        self.latest: dict[tuple[str, str], list[Sample]] = {}
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._threads: dict[int, threading.Thread] = {}  # by id(source)
        self._source_stops: dict[int, threading.Event] = {}
        self.t0_mono_ns: int = 0

    def start(self, t0_mono_ns: int | None = None) -> None:
        # A ticker waiting for the GIL behind a parse or a store write waits up to the switch interval
        # (5 ms by default): that alone would eat the 10 ms p99 timing budget. 1 ms bounds it.
        sys.setswitchinterval(min(sys.getswitchinterval(), 0.001))
        self.t0_mono_ns = t0_mono_ns or time.monotonic_ns()
        for src in self.sources:
            self._start_source(src)

    def _start_source(self, src: Source) -> None:
        self._source_stops[id(src)] = threading.Event()
        self._wake[id(src)] = threading.Event()
        t = threading.Thread(target=self._tick_source, args=(src,), name=f"tick-{src.name}-{src.target}", daemon=True)
        t.start()
        self._threads[id(src)] = t

    def add_source(self, src: Source) -> None:
        """Start sampling one more source on the run's tick grid (e.g. an app server started mid-run)."""
        self.sources.append(src)
        self.stats[id(src)] = SourceStats(src.name, src.target)
        self._start_source(src)

    def remove_source(self, src: Source, timeout_s: float = 5.0) -> None:
        """Stop sampling one source before the run ends (its server is about to go away on purpose)."""
        self._source_stops[id(src)].set()
        self._wake[id(src)].set()
        self._threads[id(src)].join(timeout_s)

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        for ev in list(self._wake.values()):
            ev.set()
        for t in self._threads.values():
            t.join(timeout_s)

    def burst(self, window_s: float, names: set[str] | frozenset[str], target: str | None = None) -> int:
        """Read the scheduler sources (`names`: a family's burst_sources, of `target` or all targets) at the
        burst rate from now for `window_s`; a burst already under way is extended. Returns how many
        sources it lifted (0 without --burst-hz)."""
        if self.burst_factor == 1:
            return 0
        until = time.monotonic_ns() + int(window_s * 1e9)
        lifted = 0
        for src in list(self.sources):
            if src.name in names and (target is None or src.target == target) and id(src) in self._wake:
                self._burst_until[id(src)] = max(self._burst_until.get(id(src), 0), until)
                self._wake[id(src)].set()
                lifted += 1
        return lifted

    def _bursting(self, src: Source, at_ns: int) -> bool:
        return self._burst_until.get(id(src), 0) > at_ns

    def _wait_until(self, mono_ns: int, own_stop: threading.Event | None = None,
                    wake: threading.Event | None = None) -> bool:
        """Sleep until the monotonic instant (or until `wake` is set); False when stopped meanwhile."""
        delay = (mono_ns - time.monotonic_ns()) / 1e9
        if delay > 0:
            (wake or self._stop).wait(delay)
        return not (self._stop.is_set() or (own_stop is not None and own_stop.is_set()))

    def _emit_gap(self, src: Source, gap: _Gap | None, end_mono_ns: int) -> None:
        if gap is not None:
            self.sink(GapRecord(src.name, src.target, gap.kind, gap.wall_ns, gap.mono_ns, end_mono_ns, gap.ticks, gap.detail))

    def _skip(self, state: _SourceState, count: int, wall_ns: int, mono_ns: int, why: str) -> None:
        """Ticks that were not read: inside a failure they widen its gap, otherwise they are missed."""
        with state.lock:
            if state.fail_gap is not None:
                state.fail_gap.ticks += count
                return
            if state.missed_gap is None:
                state.missed_gap = _Gap("missed", wall_ns, mono_ns, why)
            state.missed_gap.ticks += count
            state.stats.missed_ticks += count

    def _tick_source(self, src: Source) -> None:
        if self.boost_priority:
            make_thread_realtime()
        state = _SourceState(src, self.stats[id(src)])
        st = state.stats
        workers = max(1, int(src.max_in_flight))
        pool = ThreadPoolExecutor(workers, thread_name_prefix=f"read-{src.name}-{src.target}",
                                  initializer=raise_thread_priority if self.boost_priority else None)
        period, k = self.tick_ns, self.burst_factor  # the fine grid; every k-th tick is the baseline's
        # a source added during the run starts on the current grid point: the ticks before it
        # existed were never due, and must not show as a missed gap
        elapsed = time.monotonic_ns() - self.t0_mono_ns
        tick = (elapsed // (period * k)) * k if elapsed > period * k else 0
        last_start = None
        own_stop = self._source_stops[id(src)]
        wake = self._wake[id(src)]
        while True:
            scheduled = self.t0_mono_ns + tick * period
            if k > 1 and tick % k and not self._bursting(src, scheduled):
                # a fine tick outside a burst: sleep to the next baseline tick, unless a burst starts first
                wake.clear()
                base = (tick // k + 1) * k
                if self._bursting(src, scheduled):  # a burst began since the check above
                    continue
                if not self._wait_until(self.t0_mono_ns + base * period, own_stop, wake):
                    break
                now = time.monotonic_ns()
                tick = base if now >= self.t0_mono_ns + base * period else max(tick + 1, -(-(now - self.t0_mono_ns) // period))
                continue
            if not self._wait_until(scheduled, own_stop):
                break
            wall_ns, mono_ns = time.time_ns(), time.monotonic_ns()
            if mono_ns < state.backoff_until_ns:
                self._skip(state, 1, wall_ns, mono_ns, "backing off")
            elif state.in_flight >= workers:
                self._skip(state, 1, wall_ns, mono_ns, f"{workers} reads still in flight")
            else:
                with state.lock:
                    state.in_flight += 1
                    state.order.append(mono_ns)
                    if state.missed_gap is not None:
                        self._emit_gap(src, state.missed_gap, mono_ns)
                        state.missed_gap = None
                st.lateness_ns.append(mono_ns - scheduled)
                if last_start is not None:
                    st.intervals_ns.append(mono_ns - last_start)
                last_start = mono_ns
                pool.submit(self._read, state, tick, wall_ns, mono_ns)
            # a ticker that woke up late (a starved CPU) jumps to the current grid point
            now = time.monotonic_ns()
            next_tick = max(tick + 1, (now - self.t0_mono_ns) // period)
            if next_tick > tick + 1:
                bursting = self._bursting(src, now)
                missed = next_tick - tick - 1 if bursting else (next_tick - 1) // k - tick // k
                if missed:
                    self._skip(state, missed, wall_ns, mono_ns, "sampler woke up late")
            tick = next_tick
        pool.shutdown(wait=True)
        end = time.monotonic_ns()
        self._emit_gap(src, state.fail_gap, end)
        self._emit_gap(src, state.missed_gap, end)
        src.close()

    def _read(self, state: _SourceState, tick: int, wall_ns: int, mono_ns: int) -> None:
        src, st = state.src, state.stats
        try:
            samples, error = src.sample(wall_ns, mono_ns), None
        except SourceError as exc:
            samples, error = [], exc
        except Exception as exc:  # noqa: BLE001 - a broken source must not kill the recorder
            samples, error = [], SourceError(f"{type(exc).__name__}: {exc}")
        end = time.monotonic_ns()
        duration = end - mono_ns
        with state.lock:
            state.in_flight -= 1
            st.durations_ns.append(duration)
            if error is None:
                if state.fail_gap is not None:
                    self._emit_gap(src, state.fail_gap, mono_ns)
                    state.fail_gap = None
                state.backoff_s = 0.0
                st.scrapes_ok += 1
                st.taken += len(samples)
                st.first_ok_mono_ns = min(st.first_ok_mono_ns or mono_ns, mono_ns)
                st.last_ok_mono_ns = max(st.last_ok_mono_ns or mono_ns, mono_ns)
                self.latest[(src.name, src.target)] = samples
                self._in_order(state, ScrapeRecord(src.name, src.target, tick, wall_ns, mono_ns, duration, True, samples))
            else:
                self._record_failure(state, error, tick, wall_ns, mono_ns, duration, end)
        # a failed read too: a source may have taken events before it failed (an engine log drained, then
        # found gone), and they must reach the store beside that read, not wait for a success that may never come
        if self.on_samples is not None:
            self.on_samples(src, samples)

    def _in_order(self, state: _SourceState, record: ScrapeRecord) -> None:
        """Hand a read's scrape on once every read of its source started before it is handed on (under the
        source's lock). A source reads up to max_in_flight at once, and a slow read ends after later ones:
        handed on as they end, the store would hold a later read while an earlier one is still to come, and
        a live reader trusting the store up to its last read (StoreWriter.committed_through_ns) would judge
        a window that a late scrape then fills."""
        state.held[record.mono_ns] = record
        while state.order and state.order[0] in state.held:
            self.sink(state.held.pop(state.order.popleft()))

    def _record_failure(self, state: _SourceState, error: SourceError, tick: int, wall_ns: int, mono_ns: int,
                        duration: int, end: int) -> None:
        src, st = state.src, state.stats
        kind = "parse_error" if isinstance(error, ParseError) else "error"
        if kind == "parse_error":
            st.parse_errors += 1
        else:
            st.scrape_errors += 1
            # a server that is down gets fewer, spaced tries; a garbled answer is retried next tick
            state.backoff_s = min(BACKOFF_MAX_S, max(BACKOFF_START_S, state.backoff_s * 2))
            state.backoff_until_ns = end + int(state.backoff_s * 1e9)
        st.last_error = str(error)
        self._in_order(state, ScrapeRecord(src.name, src.target, tick, wall_ns, mono_ns, duration, False, []))
        if state.fail_gap is not None and state.fail_gap.kind != kind:
            self._emit_gap(src, state.fail_gap, mono_ns)
            state.fail_gap = None
        if state.fail_gap is None:
            state.fail_gap = _Gap(kind, wall_ns, mono_ns, str(error))
        state.fail_gap.ticks += 1
        if src.critical and not st.lost and end - state.fail_gap.mono_ns >= self.lost_after_ns:
            st.lost = True
            self.sink(GapRecord(src.name, src.target, "lost", state.fail_gap.wall_ns, state.fail_gap.mono_ns, end, 0, str(error)))
            self.lost.set()
