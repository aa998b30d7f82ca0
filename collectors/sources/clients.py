"""What reached the run's own clients: a counter of the content chunks the driver's streams received, sampled on
the run's clock beside the engine's generation counter.

A chunk with text carries at least one token the engine made and counted (vllm:generation_tokens_total), so the
engine's counter, less the chunks its clients got, bounds the tokens it made for nobody: a client that left
(analysis/verdicts/vllm_case.py, VllmCase.made_for_nobody_at_most). One source per engine the driver talks to,
labelled by that engine's target.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from cancelwatch.collectors.sources.base import Source
from cancelwatch.runstore.records import Sample

SOURCE_NAME = "clients"
METRIC = "client_chunks_total"


class ClientsSource(Source):
    """Counts, never fails: the driver adds each content chunk as it reads it, stamped; a read hands out the total as
    it stood at the read's instant (the sampler stamps a read at its tick and runs it a moment later: a total taken
    then would hold chunks from after the stamp)."""

    name = SOURCE_NAME

    def __init__(self, target: str):
        self.target = target
        self._chunks = 0
        self._since: deque[tuple[int, int]] = deque()  # (monotonic ns, total) at each add not yet read past
        self._read = 0  # the total as of the last read's instant
        self._lock = threading.Lock()  # the driver's event loop adds, the sampler's thread reads

    def add(self, chunks: int = 1) -> None:
        with self._lock:
            self._chunks += chunks
            self._since.append((time.monotonic_ns(), self._chunks))

    def check(self) -> str | None:
        return None

    def sample(self, wall_ns: int, mono_ns: int) -> list[Sample]:
        with self._lock:
            while self._since and self._since[0][0] <= mono_ns:  # reads come in their stamps' order
                self._read = self._since.popleft()[1]
            total = self._read
        return [Sample(self.name, METRIC, float(total), (), wall_ns, mono_ns)]

    def close(self) -> None:
        pass
