"""The one sample record every source produces."""

from __future__ import annotations

from dataclasses import dataclass

Labels = tuple[tuple[str, str], ...]


def freeze_labels(labels: dict[str, str] | None) -> Labels:
    return tuple(sorted((labels or {}).items()))


@dataclass(frozen=True)
class Sample:
    """One value of one series at one instant.

    `wall_ns` is time.time_ns() and `mono_ns` time.monotonic_ns(), both taken when the scrape
    that produced the value started; every sample of one scrape shares them.
    """

    source: str
    metric: str
    value: float
    labels: Labels
    wall_ns: int
    mono_ns: int

    def label(self, key: str, default: str | None = None) -> str | None:
        return dict(self.labels).get(key, default)
