"""The engine's own log as a source: vLLM's per-request lines, followed while the run records.

With `--enable-log-requests` vLLM logs `Added request <id>.` when a request enters the engine (n>1:
one line per child, `<k>_<id>`) and `Aborted request(s) <id>,<id>.` when AsyncLLM.abort runs
(client disconnects included). It builds `<id>` from the client's X-Request-Id header:
`cmpl-<X-Request-Id>-<prompt>-<8 hex>`, `chatcmpl-<X-Request-Id>-<8 hex>` (the 8 hex from 0.14 on).

Each such line becomes an event (`engine_added`, `engine_aborted`) stamped with the ENGINE's clock
as the line says it, the engine's request id, and the client id read back from it; the samples are
running counts of both. Which ids the client's ledger knows is for analysis to say, not for here.
The embedded engine logs with millisecond timestamps (engines/vllm_server.py: LOGGING_CONFIG); vLLM's
default format has whole seconds and no year, which each event's `resolution_s` records.
"""

from __future__ import annotations

import os
import re
import time
from datetime import datetime, tzinfo
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cancelwatch.collectors.sources.base import Source, SourceError
from cancelwatch.runstore.records import EventRecord, Sample

SOURCE_NAME = "engine_log"
MAX_READ_BYTES = 4 << 20  # per read: a log that grew by more is caught up over several ticks

_LINE = re.compile(r"\b(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) (?P<date>(?:\d{4}-)?\d{2}-\d{2}) "
                   r"(?P<time>\d{2}:\d{2}:\d{2})(?:[.,](?P<ms>\d{3}))? \[[^\]]*\] (?P<msg>.*)$")
_ADDED = re.compile(r"^Added request (?P<ids>\S+?)\.?$")
# `Aborted request(s) <id>,<id>.`; vLLM before 0.10.1 wrote `Aborted request <id>.`
_ABORTED = re.compile(r"^Aborted request(?:\(s\))? (?P<ids>\S+?)\.?$")
# a terminal's colours: vLLM colours its level names when it logs to one (and a `script` or a tee keeps them)
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_ENGINE_ID = re.compile(r"^(?:\d+_)?(?:(?P<chat>chatcmpl)|cmpl)-(?P<rest>.+)$")
_HEX8 = re.compile(r"-[0-9a-f]{8}$")
_PROMPT = re.compile(r"-\d+$")


def client_id(engine_request_id: str) -> str | None:
    """The X-Request-Id an engine request id was built from; None for ids not built that way."""
    m = _ENGINE_ID.match(engine_request_id)
    if m is None:
        return None
    rest = _HEX8.sub("", m.group("rest"))
    if not m.group("chat"):
        rest = _PROMPT.sub("", rest)  # completions add the prompt's index
    return rest or None


def log_zone(name: str | None) -> tzinfo | None:
    """The zone of --engine-log-tz (an IANA name: UTC, Europe/Berlin, Asia/Kolkata); None: the
    recorder's local time. ValueError with the fix for a name the zone database does not know."""
    if name is None:
        return None
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise ValueError(f"--engine-log-tz {name[:60]!r} is not a time zone: give an IANA name such as UTC, "
                         "Europe/Berlin or America/New_York") from None


def parse_line(line: str, year: int, tz: tzinfo | None = None,
               near: datetime | None = None) -> tuple[str, list[str], int, float] | None:
    """(kind, engine request ids, wall-clock ns, resolution in s) of a per-request log line, else None.
    A date logged without a year (vLLM's default `%m-%d`) gets the one of `year - 1`, `year`, `year + 1`
    that puts it nearest `near` (default: now), so a run across New Year keeps its order; `tz`: the zone
    the engine logs in (None: the recorder's local time)."""
    m = _LINE.search(_ANSI.sub("", line) if "\x1b" in line else line)
    if m is None:
        return None
    msg = m.group("msg").rstrip()
    for kind, pattern in (("engine_added", _ADDED), ("engine_aborted", _ABORTED)):
        hit = pattern.match(msg)
        if hit is not None:
            break
    else:
        return None
    try:
        if len(m.group("date")) > 5:
            at = datetime.strptime(f"{m.group('date')} {m.group('time')}", "%Y-%m-%d %H:%M:%S")
        else:
            at = _nearest_year(f"{m.group('date')} {m.group('time')}", year, near or datetime.now())
    except ValueError:
        return None
    if tz is not None:  # else the engine's local time is the recorder's
        at = at.replace(tzinfo=tz)
    try:
        stamp_s = int(at.timestamp())
    except (ValueError, OverflowError, OSError):  # a date the platform cannot place (year 1): not a line of ours
        return None
    ms = m.group("ms")
    wall_ns = stamp_s * 1_000_000_000 + (int(ms) * 1_000_000 if ms else 0)
    ids = [i for i in hit.group("ids").split(",") if i]
    return kind, ids, wall_ns, 0.001 if ms else 1.0


def _nearest_year(stamp: str, year: int, near: datetime) -> datetime:
    """`MM-DD HH:MM:SS` in the year around `year` nearest `near` (Feb 29 only where the year has one)."""
    near = near.replace(tzinfo=None)
    candidates = []
    for y in (year - 1, year, year + 1):
        try:
            candidates.append(datetime.strptime(f"{y}-{stamp}", "%Y-%m-%d %H:%M:%S"))
        except ValueError:
            continue
    if not candidates:
        raise ValueError(stamp)
    return min(candidates, key=lambda at: abs((at - near).total_seconds()))


class _Followed:
    """One open log file: its handle, the line still being written, the last bytes read (to tell a file
    cut short and written again past where it was read), and when it last grew."""

    TAIL = 64

    def __init__(self, fh, now: int):
        self.fh, self.partial, self.tail, self.grew_ns = fh, b"", b"", now

    def cut_short(self) -> bool:
        """The bytes last read are no longer where they were: the file was cut short in place (and may
        have grown past that point again), or overwritten."""
        pos = self.fh.tell()
        if os.fstat(self.fh.fileno()).st_size < pos:
            return True
        return bool(self.tail) and os.pread(self.fh.fileno(), len(self.tail), pos - len(self.tail)) != self.tail

    def read(self, limit: int) -> bytes:
        chunk = self.fh.read(limit)
        if chunk:
            self.tail = (self.tail + chunk)[-self.TAIL:]
        return chunk


class EngineLogSource(Source):
    """Follows one engine log file from where it ended when the source was made.

    Lines are read whole (a line still being written waits for the next tick). Rotation loses no line
    it can keep: a log renamed away (logrotate's default) is read on beside the new file at the path for
    as long as its writer still adds to it (a writer that never reopens, as `vllm serve > log`, goes on
    in it), and to its end ROTATED_S after it stopped growing. A log cut short in place (copytruncate, an
    engine restarted into it) may have lost what was written since the last read, and says so as an
    `engine_log_gap` event over that stretch. Events are handed over by `take_events()`; the recording
    session stores them.
    """

    name = SOURCE_NAME
    ROTATED_S = 5.0
    OLD_DRAIN_READS = 64  # reads of MAX_READ_BYTES to finish a renamed log before it is let go

    def __init__(self, path: str, target: str = "engine", from_start: bool = False, tz: str | None = None):
        self.path = str(path)
        self.target = target
        self.tz = log_zone(tz)  # the zone its lines are stamped in (--engine-log-tz), else the recorder's
        self._now: _Followed | None = None  # the file at the path (kept open: renamed away, it is read on)
        self._old: list[_Followed] = []  # logs renamed away, read while their writers still add to them
        self._read_mono_ns = time.monotonic_ns()  # when the log was last read: a loss is bounded by it
        self._missing_since: int | None = None  # when the path was first found gone (renamed, not yet recreated)
        self._events: list[EventRecord] = []
        self.added = 0
        self.aborted = 0
        # engine wall clock -> this process's monotonic clock (same machine, same wall clock); taken
        # again at every read, so that a wall-clock step (NTP on a fresh machine) moves no line
        # by more than the time between its write and its read
        self._wall_minus_mono = time.time_ns() - time.monotonic_ns()
        self._year = datetime.now().year
        try:  # opened now: a rotation before the first tick is then one like any other
            self._open(time.monotonic_ns(), at_end=not from_start)
        except OSError:
            pass  # check() says why; the first tick tries again

    def check(self) -> str | None:
        try:
            with open(self.path, "rb"):
                return None
        except OSError as exc:
            return (f"cannot read the engine log {self.path} ({exc.strerror}): give the log of the engine "
                    "with --engine-log PATH (vLLM started with --enable-log-requests)")

    def sample(self, wall_ns: int, mono_ns: int) -> list[Sample]:
        now = time.monotonic_ns()
        self._wall_minus_mono = time.time_ns() - now
        try:
            self._follow(now)
        except OSError as exc:
            raise SourceError(f"engine log {self.path}: {exc.strerror or exc}") from exc
        self._read_mono_ns = now
        return [Sample(self.name, "engine_log_requests_added_total", float(self.added), (), wall_ns, mono_ns),
                Sample(self.name, "engine_log_requests_aborted_total", float(self.aborted), (), wall_ns, mono_ns)]

    def _open(self, now: int, at_end: bool = False) -> None:
        fh = open(self.path, "rb")  # noqa: SIM115 - kept open across ticks, closed by close()
        if at_end:
            fh.seek(0, os.SEEK_END)
        self._now = _Followed(fh, now)

    def _follow(self, now: int) -> None:
        for old in list(self._old):  # logs renamed away: what their writers still add
            grew = self._drain(old, 1)
            if not grew and now - old.grew_ns > self.ROTATED_S * 1e9:
                self._drain(old, self.OLD_DRAIN_READS)
                old.fh.close()
                self._old.remove(old)
        try:
            st = os.stat(self.path)
            self._missing_since = None
        except FileNotFoundError:
            # renamed away and not created again yet: the handle still reads the old one, for a while
            self._missing_since = self._missing_since or now
            if self._now is not None:
                self._drain(self._now, 1)
            if self._now is None or now - self._missing_since >= self.ROTATED_S * 1e9:
                raise
            return
        if self._now is not None and os.fstat(self._now.fh.fileno()).st_ino != st.st_ino:
            self._drain(self._now, 1)  # the renamed log, as far as it goes now; read on beside the new one
            self._old.append(self._now)
            self._now = None
        if self._now is None:
            self._open(now)
        elif self._now.cut_short():
            # cut short in place: whatever was written since the last read went with the copy
            self._events.append(EventRecord(
                kind="engine_log_gap", wall_ns=now + self._wall_minus_mono, mono_ns=now, request_id=None,
                data={"target": self.target, "from_mono_ns": self._read_mono_ns,
                      "why": "the log was cut short in place (copytruncate, or an engine restarted into it): "
                             "lines written since the last read may be lost"}))
            self._now.fh.seek(0)
            self._now.partial, self._now.tail = b"", b""
        self._drain(self._now, 1)

    def _drain(self, f: _Followed, reads: int) -> bool:
        """Up to `reads` reads of MAX_READ_BYTES from `f`, each whole line taken; whether it grew."""
        grew = False
        for _ in range(reads):
            chunk = f.read(MAX_READ_BYTES)
            if not chunk:
                break
            grew = True
            f.grew_ns = time.monotonic_ns()
            # NUL bytes: a writer without O_APPEND writing on at its old offset in a file cut short
            *lines, f.partial = (f.partial + chunk.replace(b"\x00", b"")).split(b"\n")
            for raw in lines:
                self._take(raw.decode("utf-8", errors="replace"))
        return grew

    def _take(self, line: str) -> None:
        if "request" not in line:  # most lines are not per-request ones: skip the regex
            return
        parsed = parse_line(line, self._year, self.tz)
        if parsed is None:
            return
        kind, ids, line_wall_ns, resolution_s = parsed
        for engine_id in ids:
            if kind == "engine_added":
                self.added += 1
            else:
                self.aborted += 1
            self._events.append(EventRecord(
                kind=kind, wall_ns=line_wall_ns, mono_ns=line_wall_ns - self._wall_minus_mono,
                request_id=client_id(engine_id),
                data={"engine_request_id": engine_id, "clock": "engine_log", "resolution_s": resolution_s,
                      "target": self.target}))

    def take_events(self) -> list[EventRecord]:
        """The events read since the last call (a list swap: the reader thread appends to a new one)."""
        out, self._events = self._events, []
        return out

    def close(self) -> None:
        for f in [*self._old, *([self._now] if self._now else [])]:
            f.fh.close()
        self._now, self._old = None, []
