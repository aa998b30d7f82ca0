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
from datetime import datetime

from collectors.sources.base import Source, SourceError
from runstore.records import EventRecord, Sample

SOURCE_NAME = "engine_log"
MAX_READ_BYTES = 4 << 20  # per read: a log that grew by more is caught up over several ticks

_LINE = re.compile(r"\b(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) (?P<date>(?:\d{4}-)?\d{2}-\d{2}) "
                   r"(?P<time>\d{2}:\d{2}:\d{2})(?:[.,](?P<ms>\d{3}))? \[[^\]]*\] (?P<msg>.*)$")
_ADDED = re.compile(r"^Added request (?P<ids>\S+?)\.?$")
_ABORTED = re.compile(r"^Aborted request\(s\) (?P<ids>\S+?)\.?$")
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


def parse_line(line: str, year: int) -> tuple[str, list[str], int, float] | None:
    """(kind, engine request ids, wall-clock ns, resolution in s) of a per-request log line, else None.
    `year` completes a date logged without one (vLLM's default `%m-%d`)."""
    m = _LINE.search(line)
    if m is None:
        return None
    msg = m.group("msg").rstrip()
    for kind, pattern in (("engine_added", _ADDED), ("engine_aborted", _ABORTED)):
        hit = pattern.match(msg)
        if hit is not None:
            break
    else:
        return None
    date = m.group("date") if len(m.group("date")) > 5 else f"{year}-{m.group('date')}"
    try:
        at = datetime.strptime(f"{date} {m.group('time')}", "%Y-%m-%d %H:%M:%S")  # the engine's local time
    except ValueError:
        return None
    ms = m.group("ms")
    wall_ns = int(at.timestamp()) * 1_000_000_000 + (int(ms) * 1_000_000 if ms else 0)
    ids = [i for i in hit.group("ids").split(",") if i]
    return kind, ids, wall_ns, 0.001 if ms else 1.0


class EngineLogSource(Source):
    """Follows one engine log file from where it ended when the source was made.

    Lines are read whole (a line still being written waits for the next tick); a log that was
    truncated or replaced (rotation, an engine restarted into the same file) is read again from
    its start. Events are handed over by `take_events()`; the recording session stores them.
    """

    name = SOURCE_NAME

    def __init__(self, path: str, target: str = "engine", from_start: bool = False):
        self.path = str(path)
        self.target = target
        self._offset = 0
        self._inode: int | None = None
        self._partial = b""
        self._events: list[EventRecord] = []
        self.added = 0
        self.aborted = 0
        # engine wall clock -> this process's monotonic clock (same machine, same wall clock); taken
        # again at every read, so that a wall-clock step (NTP on a fresh machine) moves no line
        # by more than the time between its write and its read
        self._wall_minus_mono = time.time_ns() - time.monotonic_ns()
        self._year = datetime.now().year
        if not from_start:
            try:
                st = os.stat(self.path)
                self._offset, self._inode = st.st_size, st.st_ino
            except OSError:
                pass

    def check(self) -> str | None:
        try:
            with open(self.path, "rb"):
                return None
        except OSError as exc:
            return (f"cannot read the engine log {self.path} ({exc.strerror}): give the log of the engine "
                    "with --engine-log PATH (vLLM started with --enable-log-requests)")

    def sample(self, wall_ns: int, mono_ns: int) -> list[Sample]:
        try:
            with open(self.path, "rb") as f:
                st = os.fstat(f.fileno())
                if self._inode not in (None, st.st_ino) or st.st_size < self._offset:
                    self._offset, self._partial = 0, b""  # a new file, or the old one cut short
                self._inode = st.st_ino
                f.seek(self._offset)
                chunk = f.read(MAX_READ_BYTES)
        except OSError as exc:
            raise SourceError(f"engine log {self.path}: {exc.strerror or exc}") from exc
        self._offset += len(chunk)
        self._wall_minus_mono = time.time_ns() - time.monotonic_ns()
        *lines, self._partial = (self._partial + chunk).split(b"\n")
        for raw in lines:
            self._take(raw.decode("utf-8", errors="replace"))
        return [Sample(self.name, "engine_log_requests_added_total", float(self.added), (), wall_ns, mono_ns),
                Sample(self.name, "engine_log_requests_aborted_total", float(self.aborted), (), wall_ns, mono_ns)]

    def _take(self, line: str) -> None:
        if "request" not in line:  # most lines are not per-request ones: skip the regex
            return
        parsed = parse_line(line, self._year)
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
        pass
