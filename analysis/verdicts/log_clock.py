"""The engine log's clock against the run's: how far its lines are moved, found from the run itself.

The engine log source stamps each line with the time the line says, read as the recorder's local time
(or the zone given with --engine-log-tz). An engine in a container that logs in UTC beside a recorder in
another zone, or on a host whose clock is off by seconds, puts every line off by one offset, and a clean
cancel then reads as "the abort reached the engine only 28800 s after the stop".

The run bounds that offset: the `Added request` line of every request the ledger knows was written after
the client sent it and before its first token came back. A line stamped `stamp` (rounded down to the
log's resolution `res`) of a request sent at `send` whose first token came at `first` allows the offsets
[send - stamp - res, first - stamp]; the log's offset lies in all of them at once, widened by
LOG_SLACK_S for the mapping's own jitter. When they meet, the lines are moved by the offset they allow
(none when that includes 0: the log agrees with the run's clock); when they do not, the log's clock
cannot be placed on the run's and no verdict may rest on its lines.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import pandas as pd

from cancelwatch.analysis.rows import event_rows, ledger_rows
from cancelwatch.analysis.verdicts.core import LOG_SLACK_S
from cancelwatch.analysis.verdicts.log_ids import AddedLine, LogIds
from cancelwatch.runstore.reader import Run


@dataclass(frozen=True)
class LogClock:
    """One target's engine log against the run's clock. offset_s: added to each line's instant (0 where
    the log agrees); lo_s, hi_s: the offsets every bounding request allows (the intersection; lo > hi when
    they disagree); requests: how many ledger requests bound it; resolution_s: the coarsest stamp."""

    target: str | None
    offset_s: float = 0.0
    lo_s: float = -math.inf
    hi_s: float = math.inf
    requests: int = 0
    resolution_s: float = 0.001

    @property
    def agrees(self) -> bool:
        return self.lo_s <= self.hi_s

    @property
    def spread_s(self) -> float:
        """How wide the allowed offsets are: how well the run pins the log's clock down."""
        return self.hi_s - self.lo_s

    @property
    def uncertainty_s(self) -> float:
        """How much later than placed a moved line may have been written: the lines sit at the earliest
        end of the allowed offsets (an Added line right at its send), and a gateway that holds requests,
        or whole-second stamps, put the truth anywhere up to the other end. 0 where nothing was moved
        (the log agrees with the run's clock: one host's, as the embedded engine's)."""
        return self.spread_s if self.offset_s and math.isfinite(self.spread_s) else 0.0

    def as_json(self) -> dict:
        finite = lambda x: round(x, 3) if math.isfinite(x) else None  # noqa: E731
        return {"target": self.target, "offset_s": round(self.offset_s, 3), "lo_s": finite(self.lo_s),
                "hi_s": finite(self.hi_s), "spread_s": finite(self.spread_s), "requests": self.requests,
                "resolution_s": self.resolution_s,
                "agrees": self.agrees if self.requests else None}  # None: no request bounds it, nothing to say


def log_clocks(run: Run) -> dict[str | None, LogClock]:
    """Target -> its engine log's clock, for every target whose log named a request (an `Added` line)."""
    return log_evidence(run)[0]


def log_evidence(run: Run) -> tuple[dict[str | None, LogClock], LogIds]:
    """Each target's log clock, and which ledger request each of its lines is of: lines that name a
    ledger id bound the clock; lines renamed by a gateway, matched to requests by when they entered on
    the recorder's clock (log_ids.py), bound it too."""
    ev, ledger = run.events, run.ledger
    if ev.empty or ledger.empty:
        return {}, LogIds(run, [])
    added = event_rows(run, "engine_added")
    if not added:
        return {}, LogIds(run, [])
    t0 = run.info["started_mono_ns"]
    bounds: dict[str, tuple[float, float]] = {}  # ledger id -> (send, first token), s since the start
    # where a line is looked for: a request stopped before its first token (queued) was added, if at all,
    # before its client closed it
    windows: dict[str, tuple[float, float]] = {}
    for row in ledger_rows(run):
        if pd.isna(row.sent_mono_ns):
            continue
        end = row.first_token_mono_ns if not pd.isna(row.first_token_mono_ns) else row.closed_mono_ns
        if not pd.isna(end):
            windows[row.request_id] = ((row.sent_mono_ns - t0) / 1e9, (end - t0) / 1e9)
        if not pd.isna(row.first_token_mono_ns):
            bounds[row.request_id] = windows[row.request_id]
    lines = [AddedLine(data.get("target"), row.request_id, data.get("engine_request_id"), float(row.t_s),
                       float(data.get("resolution_s") or 0.001))
             for row, data in ((r, json.loads(r.data)) for r in added)]
    targets = {line.target for line in lines}

    def clocks(ids: LogIds) -> dict[str | None, LogClock]:
        first: dict[tuple[str | None, str], tuple[float, float]] = {}  # (target, id) -> (first stamp, resolution)
        for line in lines:
            rid = ids.of(line.target, line.client_id, line.engine_id)
            if rid in bounds and ((line.target, rid) not in first or line.stamp < first[(line.target, rid)][0]):
                first[(line.target, rid)] = (line.stamp, line.resolution)
        return {target: _clock(target, [(bounds[rid], stamp, res) for (tgt, rid), (stamp, res) in first.items()
                                        if tgt == target]) for target in targets}

    ids = LogIds(run, lines, windows)
    return clocks(ids), ids


def _clock(target: str | None, lines: list[tuple[tuple[float, float], float, float]]) -> LogClock:
    if not lines:
        return LogClock(target)
    lo = max(send - stamp - res for (send, _), stamp, res in lines)
    hi = min(first - stamp for (_, first), stamp, _ in lines)
    res = max(r for _, _, r in lines)
    lo_w, hi_w = lo - LOG_SLACK_S, hi + LOG_SLACK_S
    if lo_w <= 0.0 <= hi_w or lo_w > hi_w:
        offset = 0.0  # it agrees, or it cannot be placed (nothing is moved; the verdicts say so)
    else:
        # each Added line at the earliest its request allows: its send, for the request sent the latest
        # after its stamp (the line follows its send by milliseconds; its first token comes a prefill later)
        offset = min(lo, hi_w)
    return LogClock(target, offset, lo_w, hi_w, len(lines), res)


def log_offsets(clocks: dict[str | None, LogClock]) -> tuple[tuple[str | None, float, float], ...]:
    """Per engine log the run places off its own clock (moved: a container logging in UTC beside a recorder in
    another zone), (its target, the lowest and the highest offset its lines may be moved by): where a window of the
    run finds its lines of that stretch (runstore.reader.load_window). Empty where every log agrees with the run's
    clock."""
    return tuple((c.target, c.lo_s, c.hi_s) for c in clocks.values()
                 if c.requests and c.agrees and c.offset_s and math.isfinite(c.spread_s))
