"""The protocol every source sits behind. Looping, timing, retries and back-off live in the sampler.

Every attribute the sampler reads is declared here with its default; a source subclasses `Source`
to take the defaults and overrides what differs.
"""

from __future__ import annotations

from typing import Protocol

from cancelwatch.runstore.records import Sample


class SourceError(Exception):
    """The source could not be read this time (network, process gone, driver error)."""


class ParseError(SourceError):
    """The source answered, but with something that is not what it should be."""


class Source(Protocol):
    name: str  # kind of source: vllm, process, nvml
    target: str  # label of what it reads, e.g. a replica name or a GPU host
    # reads of one source that may overlap: a server answering late must not shift later ticks
    max_in_flight: int = 1
    # True: failing past the sampler's `lost_after_s` ends the run as target_lost
    critical: bool = False

    def check(self) -> str | None:
        """None when the source can be read now; else one line that says how to fix it."""

    def sample(self, wall_ns: int, mono_ns: int) -> list[Sample]:
        """Read once. Raise SourceError (or ParseError) on failure; never return made-up zeros."""

    def close(self) -> None:
        """Let go of connections and handles; the sampler calls it once, when the source stops."""
