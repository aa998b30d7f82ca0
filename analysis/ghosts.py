"""Ghosts: requests the engine still holds whose client is gone (analysis, pure).

A watched cancel judged leaked was still in the engine at its grace's end. From then on the engine's own
count tells how many it holds beyond the requests the watch has in flight (its surplus), but not which:
the ghosts are the leaked cancels the surplus can still hold, at most as many as the surplus. Where the
surplus falls to zero, every leaked request has left the engine; where it falls below their number, the
oldest are taken to have gone first (the bound is the count, the ages are the oldest still possible)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Ghosts:
    """The leaked cancels the engine may still hold: request id -> when its client left (s, the run's clock)."""

    left_at: dict[str, float] = field(default_factory=dict)

    def leaked(self, request_id: str, left_at_s: float) -> None:
        self.left_at[request_id] = left_at_s

    def update(self, engine_count: float, in_flight: float) -> list[str]:
        """Given the engine's count (running + waiting) and the requests the watch has in flight, keep as
        many leaked cancels as the surplus can hold, newest first; return the ids taken to have left."""
        surplus = max(0, int(round(engine_count - in_flight)))
        if len(self.left_at) <= surplus:
            return []
        by_age = sorted(self.left_at, key=self.left_at.get)  # oldest first
        gone = by_age[: len(by_age) - surplus]
        for rid in gone:
            del self.left_at[rid]
        return gone

    def count(self) -> int:
        return len(self.left_at)

    def oldest_age_s(self, now_s: float) -> float:
        return max((now_s - t for t in self.left_at.values()), default=0.0)
