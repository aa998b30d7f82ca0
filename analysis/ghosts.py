"""Ghosts: requests the engine still holds whose client is gone (analysis, pure).

A watched cancel judged leaked was still in the engine at its grace's end. From then on the engine's own
count tells how many it holds beyond the requests the watch has in flight (its surplus), but not which:
the ghosts are the leaked cancels the surplus can still hold, at most as many as the surplus. Where the
surplus falls to zero, every leaked request has left the engine; where it falls below their number, the
oldest are taken to have gone first (the bound is the count, the ages are the oldest still possible).

Ghosts is that reading; the watch keeps it live a grace behind the clock (WatchGhosts), and
analysis/verdicts/ghost_list.py replays it over a stored run (the dashboard's, the report's ghosts). Here too:
their vocabulary and how a reader is shown them."""

from __future__ import annotations

import math
from bisect import bisect_right
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

import pandas as pd

from cancelwatch.analysis.bounds import GHOST_HOLD_S



HOLD_S = GHOST_HOLD_S


class EngineReading(NamedTuple):
    """One target's engine count against the ledger, as a family reads it (Family.in_engine)."""

    t_s: np.ndarray  # the scheduler's samples, s since the run started
    count: np.ndarray  # requests the engine counted (running + waiting)
    in_flight: np.ndarray  # the ledger's requests in the engine then, the stopped ones with no abort left out
    # request id -> from when the engine counted it at the latest (its first Added line, and a step's time)
    counted_from: dict[str, float]


@dataclass
class Ghosts:
    """The leaked cancels the engine may still hold: request id -> when its client left (s, the run's clock)."""

    left_at: dict[str, float] = field(default_factory=dict)
    # request id -> from when the engine's count holds it beyond the requests in flight (its client's close, or
    # when the engine counted it if later): each sample of the hold is weighed against the ghosts joined by then
    joined_at: dict[str, float] = field(default_factory=dict)
    # request id -> until when its verdict saw it in the engine: it is never taken to have left before then
    seen_until: dict[str, float] = field(default_factory=dict)
    hold_s: float = HOLD_S
    # (instant, surplus) of the samples read, back to the first at or before hold_s ago
    history: deque = field(default_factory=deque)
    # (joined, ended) of ghosts the evidence ended (`ended`): held by the count until then, in the hold's samples
    ended_spans: list = field(default_factory=list)

    def leaked(self, request_id: str, left_at_s: float, seen_at_s: float | None = None,
               seen_until_s: float | None = None) -> None:
        """A ghost: its client left at `left_at_s`; the count holds it from `seen_at_s` (default: then); it was
        in the engine until `seen_until_s` at least (default: from when the count holds it)."""
        self.left_at[request_id] = left_at_s
        self.joined_at[request_id] = left_at_s if seen_at_s is None else seen_at_s
        self.seen_until[request_id] = self.joined_at[request_id] if seen_until_s is None else seen_until_s

    def ended(self, request_id: str, t_s: float) -> None:
        """The evidence ended this ghost at `t_s` (it still counts in the samples before)."""
        self.left_at.pop(request_id, None)
        self.seen_until.pop(request_id, None)
        joined = self.joined_at.pop(request_id, None)
        if joined is not None:
            self.ended_spans.append((joined, t_s))

    def update(self, engine_count: float, in_flight: float, t_s: float) -> list[tuple[str, float]]:
        """Given the engine's count (running + waiting) and the requests in flight at `t_s`, keep as many leaked
        cancels as the surplus held at most over the last hold_s can hold, newest first; return (id, by when it
        had left) of those taken to have left."""
        self.history.append((t_s, _surplus(engine_count, in_flight)))
        while len(self.history) > 1 and self.history[1][0] <= t_s - self.hold_s:
            self.history.popleft()
        since = self.history[0][0]
        if not self.left_at or since > t_s - self.hold_s:
            return []
        # the count beyond in-flight at each sample of the hold against the ghosts that had joined by then: one
        # joining inside it is no shortfall before it (under steady load behind a leaking proxy a lost request
        # joined every second or so, and the oldest read as gone while still held)
        joined = sorted(self.joined_at.get(rid, -math.inf) for rid in self.left_at)
        self.ended_spans = [(j, e) for j, e in self.ended_spans if e > since]
        short = min(bisect_right(joined, t) + sum(1 for j, e in self.ended_spans if j <= t < e) - s
                    for t, s in self.history)
        if short <= 0:
            return []
        gone = sorted(self.left_at, key=self.left_at.get)[:short]  # oldest first
        for rid in gone:
            del self.left_at[rid]
            self.joined_at.pop(rid, None)
        return [(rid, max(since, self.seen_until.pop(rid, since))) for rid in gone]

    def short_by(self, engine_count: float, in_flight: float) -> int:
        """How many ghosts the latest count cannot hold, before the hold has passed (the end of what was read)."""
        return max(0, len(self.left_at) - _surplus(engine_count, in_flight))

    def count(self) -> int:
        return len(self.left_at)

    def oldest_age_s(self, now_s: float) -> float:
        return max((now_s - t for t in self.left_at.values()), default=0.0)


# readings the watch keeps for WatchGhosts at the most (at its two a second, ten minutes): a cancel that is never
# judged must not hold them for days
MAX_READINGS = 1200


@dataclass
class WatchGhosts:
    """The watch's ghosts, live: Ghosts read a grace behind the clock. A cancel leaves the watch's flight at its
    client's close but is judged a grace later; read at once, a leaked one not judged yet sat in the count's
    surplus as nothing, and hid another ghost's end: under steady leaking there always was one, and a ghost that
    left stayed counted until a second one left or the leaking stopped. So each reading (the
    engine's count, the watch's requests in flight) waits until every cancel stopped before it has its verdict:
    a leaked one is a ghost from its close, one that left (released, or leaked and seen leaving) is in the
    engine until then; the rest are not known, and the surplus may hold them (the ghosts stay a bound from
    above). A ghost that left is counted for the time its verdict takes and the hold at the most."""

    grace_s: float
    ghosts: Ghosts = field(default_factory=Ghosts)
    readings: deque = field(default_factory=deque)  # (t, engine count, in flight), not read yet
    # (from, request id, close): leaked, a ghost once the readings reach `from` (when the engine's count holds it
    # beyond the watch's flight)
    joins: list = field(default_factory=list)
    # request id -> (from, until): judged, in the engine beyond the watch's flight then, and no ghost
    leaving: dict = field(default_factory=dict)

    def reading(self, t_s: float, engine_count: float, in_flight: float) -> None:
        self.readings.append((t_s, engine_count, in_flight))

    def judged(self, request_id: str, stop_s: float, ghost: bool, from_s: float, until_s: float | None) -> None:
        """A cancel's verdict, as cancelwatch.live_judge reads it: a ghost (leaked, not seen leaving) from `from_s`
        (its age from `stop_s`); or in the engine from `from_s` until `until_s` (surely there until then)."""
        if ghost:
            self.joins.append((from_s, request_id, stop_s))
            self.joins.sort()
        elif until_s is not None and until_s > from_s:
            self.leaving[request_id] = (from_s, until_s)

    def read(self, through_s: float) -> list[tuple[str, float]]:
        """Read the readings before `through_s` (the first stop with no verdict yet); (id, by when) of the ghosts
        taken to have left."""
        gone = []
        while self.readings and (self.readings[0][0] < through_s or len(self.readings) > MAX_READINGS):
            t, count, flying = self.readings.popleft()
            while self.joins and self.joins[0][0] <= t:
                at, rid, stop = self.joins.pop(0)
                self.ghosts.leaked(rid, stop, seen_at_s=at, seen_until_s=max(at, stop + self.grace_s))
            leaving = sum(1 for start, left in self.leaving.values() if start <= t < left)
            gone += self.ghosts.update(count, flying + leaving, t)
            self.leaving = {rid: span for rid, span in self.leaving.items() if span[1] > t}
        return gone

    def count(self) -> int:
        """The ghosts as of the last reading read, with those judged leaked since (there at their grace's end)."""
        return self.ghosts.count() + len(self.joins)

    def oldest_age_s(self, now_s: float) -> float:
        return max(self.ghosts.oldest_age_s(now_s), max((now_s - stop for *_, stop in self.joins), default=0.0))


def _surplus(engine_count: float, in_flight: float) -> int:
    """Requests the engine counts beyond those in flight: how many ghosts it can hold."""
    return max(0, int(round(engine_count - in_flight)))


GHOST_COLUMNS = ["request_id", "scenario", "rule", "client_left_s", "in_engine", "left_engine_s", "age_s",
                 "tokens_after_client_left", "tokens_are", "unknown_why"]
IN_ENGINE = "still there"  # the engine's count held it at the last sample read
LEFT = "left"
UNKNOWN = "unknown"  # nothing after its grace tells where it went (GHOST_UNKNOWN says why)
GHOST_UNKNOWN = {
    "targets": "the run has several targets, and its ledger does not say which engine held each request",
    "last_second": "the engine's count fell in the last second read: it may have left (read the run again later)",
    "no_count": "no count of the engine's requests after its grace (a family whose gauges count none, or a scrape "
                "outage)",
}


GHOST_CAPTION = ("A leaked request runs on in the engine after its client left. 'still there': the engine's count "
                 "held it at the last sample read, and its age runs to that sample; 'left': when the count showed "
                 "it gone. Where the count dropped with several in the engine, the oldest is taken to have gone "
                 "first. Tokens with ≤ are a bound: other requests ran beside it.")


def ghost_headline(table: pd.DataFrame) -> str:
    held = int((table["in_engine"] == IN_ENGINE).sum())
    return f"Ghosts: {held} of {len(table)} leaked request(s) still in the engine"


def ghost_records(table: pd.DataFrame) -> list[dict]:
    """ghost_table as JSON records (the report's `ghosts`): unknown values None, never NaN."""
    return [{k: (None if isinstance(x, float) and math.isnan(x) else x) for k, x in row.items()}
            for row in table.to_dict("records")]


def ghost_view(table: pd.DataFrame) -> pd.DataFrame:
    """ghost_table for a reader: the ghosts first (youngest last), ages in s, tokens a bound where they are."""
    if table.empty:
        return pd.DataFrame(columns=list(GHOST_LABELS.values()))
    order = table.assign(_held=table["in_engine"] != IN_ENGINE).sort_values(["_held", "client_left_s"], kind="stable")

    def tokens(row) -> str:
        n = row["tokens_after_client_left"]
        if n is None or pd.isna(n):
            return "–"
        return f"{n:.0f}" if row["tokens_are"] == "attributed" else f"≤ {n:.0f}"

    view = pd.DataFrame({
        GHOST_LABELS["request_id"]: order["request_id"],
        GHOST_LABELS["scenario"]: order["scenario"],
        GHOST_LABELS["client_left_s"]: order["client_left_s"].round(1),
        GHOST_LABELS["in_engine"]: [w if w != UNKNOWN else f"unknown: {why}" for w, why in
                                    zip(order["in_engine"], order["unknown_why"])],
        GHOST_LABELS["age_s"]: order["age_s"].astype(float).round(1),
        GHOST_LABELS["left_engine_s"]: order["left_engine_s"].astype(float).round(1),
        GHOST_LABELS["tokens"]: [tokens(r) for _, r in order.iterrows()],
        GHOST_LABELS["rule"]: order["rule"],
    })
    return view.reset_index(drop=True)


GHOST_LABELS = {
    "request_id": "request", "scenario": "scenario", "client_left_s": "client left (s)",
    "in_engine": "in the engine", "age_s": "ran for nobody (s)", "left_engine_s": "left the engine (s)",
    "tokens": "tokens after its client left", "rule": "rule",
}
