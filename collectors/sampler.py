"""The sampler: every source on its own thread and its own tick grid, so a slow one never delays the others.

Timing, retries, back-off and gap bookkeeping live here once; sources only read.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from collectors.samples import Sample
from collectors.source import ParseError, Source, SourceError
from collectors.store import GapRecord, ScrapeRecord

BACKOFF_START_S = 0.1
BACKOFF_MAX_S = 2.0


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
    intervals_ns: list[int] = field(default_factory=list)  # between consecutive scrape starts
    lateness_ns: list[int] = field(default_factory=list)  # scrape start minus its scheduled tick
    durations_ns: list[int] = field(default_factory=list)
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


class _OpenGap:
    def __init__(self, kind: str, wall_ns: int, mono_ns: int, detail: str):
        self.kind, self.wall_ns, self.mono_ns, self.detail = kind, wall_ns, mono_ns, detail
        self.ticks = 0


class Sampler:
    """Samples `sources` at `hz` until `stop()`; hands scrapes and gaps to `sink(record)`.

    A source failing without pause for `lost_after_s` is marked lost and `lost` is set, so the
    recorder can end the run; it is still retried with back-off until then.
    """

    def __init__(
        self,
        sources: list[Source],
        sink,
        hz: float = 20.0,
        lost_after_s: float = 10.0,
        critical_sources: tuple[str, ...] = ("vllm",),
        on_samples=None,
    ):
        if hz <= 0:
            raise ValueError("hz must be > 0")
        self.sources = sources
        self.sink = sink
        self.period_ns = int(1e9 / hz)
        self.lost_after_ns = int(lost_after_s * 1e9)
        self.critical_sources = critical_sources
        self.on_samples = on_samples
        self.stats = {id(s): SourceStats(s.name, s.target) for s in sources}
        self.latest: dict[tuple[str, str], list[Sample]] = {}
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.t0_mono_ns: int = 0

    def start(self, t0_mono_ns: int | None = None) -> None:
        self.t0_mono_ns = t0_mono_ns or time.monotonic_ns()
        for src in self.sources:
            t = threading.Thread(target=self._run_source, args=(src,), name=f"sample-{src.name}-{src.target}", daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout_s)

    def _wait_until(self, mono_ns: int) -> bool:
        """Sleep until the monotonic instant; False when stopped meanwhile."""
        delay = (mono_ns - time.monotonic_ns()) / 1e9
        if delay > 0:
            return not self._stop.wait(delay)
        return not self._stop.is_set()

    def _close_gap(self, src: Source, gap: _OpenGap | None, end_mono_ns: int) -> None:
        if gap is not None:
            self.sink(GapRecord(src.name, src.target, gap.kind, gap.wall_ns, gap.mono_ns, end_mono_ns, gap.ticks, gap.detail))

    def _run_source(self, src: Source) -> None:
        st = self.stats[id(src)]
        period = self.period_ns
        tick = 0
        backoff_s = 0.0
        gap: _OpenGap | None = None
        last_start = None
        while self._wait_until(self.t0_mono_ns + tick * period):
            scheduled = self.t0_mono_ns + tick * period
            wall_ns, mono_ns = time.time_ns(), time.monotonic_ns()
            try:
                samples = src.sample(wall_ns, mono_ns)
                error = None
            except SourceError as exc:
                samples, error = [], exc
            except Exception as exc:  # noqa: BLE001 - a broken source must not kill the recorder
                samples, error = [], SourceError(f"{type(exc).__name__}: {exc}")
            end = time.monotonic_ns()
            duration = end - mono_ns
            st.durations_ns.append(duration)
            st.lateness_ns.append(mono_ns - scheduled)
            if last_start is not None:
                st.intervals_ns.append(mono_ns - last_start)
            last_start = mono_ns
            if error is None:
                self._close_gap(src, gap, mono_ns)
                gap = None
                backoff_s = 0.0
                st.scrapes_ok += 1
                st.taken += len(samples)
                st.first_ok_mono_ns = st.first_ok_mono_ns or mono_ns
                st.last_ok_mono_ns = mono_ns
                self.latest[(src.name, src.target)] = samples
                self.sink(ScrapeRecord(src.name, src.target, tick, wall_ns, mono_ns, duration, True, samples))
                if self.on_samples is not None:
                    self.on_samples(src, samples)
            else:
                kind = "parse_error" if isinstance(error, ParseError) else "error"
                if kind == "parse_error":
                    st.parse_errors += 1
                else:
                    st.scrape_errors += 1
                st.last_error = str(error)
                self.sink(ScrapeRecord(src.name, src.target, tick, wall_ns, mono_ns, duration, False, []))
                if gap is not None and gap.kind != kind:
                    self._close_gap(src, gap, mono_ns)
                    gap = None
                if gap is None:
                    gap = _OpenGap(kind, wall_ns, mono_ns, str(error))
                gap.ticks += 1
                if kind == "error":
                    # a server that is down gets fewer, spaced tries; a garbled answer is retried next tick
                    backoff_s = min(BACKOFF_MAX_S, max(BACKOFF_START_S, backoff_s * 2))
                if (
                    src.name in self.critical_sources
                    and not st.lost
                    and mono_ns - gap.mono_ns >= self.lost_after_ns
                ):
                    st.lost = True
                    self.sink(GapRecord(src.name, src.target, "lost", gap.wall_ns, gap.mono_ns, end, 0, str(error)))
                    self.lost.set()
            # next tick: the first grid point after now (+ back-off); skipped grid points are missed ticks
            now = time.monotonic_ns()
            earliest = now + int(backoff_s * 1e9) if error is not None and backoff_s else now
            next_tick = max(tick + 1, -(-(earliest - self.t0_mono_ns) // period))
            skipped = next_tick - tick - 1
            if skipped > 0:
                if gap is not None:
                    gap.ticks += skipped  # ticks skipped while backing off belong to the failure gap
                else:
                    st.missed_ticks += skipped
                    self.sink(GapRecord(src.name, src.target, "missed", wall_ns, mono_ns,
                                        self.t0_mono_ns + next_tick * period, skipped, "scrape overran its tick"))
            tick = next_tick
        self._close_gap(src, gap, time.monotonic_ns())
        src.close()
