"""Engine process memory: RSS of the engine's whole process tree, the CPU-side analogue of reserved VRAM."""

from __future__ import annotations

import time

import psutil

from cancelwatch.collectors.sources.base import Source, SourceError
from cancelwatch.runstore.records import Sample

SOURCE_NAME = "process"


class ProcessMemorySource(Source):
    """Sums RSS over the given root pids and all their descendants.

    Walking the process tree scans /proc, so it is refreshed at most every `tree_refresh_s`; RSS
    itself is read every sample.
    """

    name = SOURCE_NAME
    max_in_flight = 2  # the periodic /proc walk can outlast one tick

    def __init__(self, pids: list[int], target: str = "engine", tree_refresh_s: float = 5.0):
        self.root_pids = list(pids)
        self.target = target
        self.tree_refresh_s = tree_refresh_s
        self._procs: list[psutil.Process] = []
        self._tree_at = -1e9

    def _refresh_tree(self) -> None:
        procs: list[psutil.Process] = []
        for pid in self.root_pids:
            try:
                root = psutil.Process(pid)
                procs.append(root)
                procs.extend(root.children(recursive=True))
            except psutil.Error:
                continue
        self._procs = procs
        self._tree_at = time.monotonic()

    def check(self) -> str | None:
        alive = [p for p in self.root_pids if psutil.pid_exists(p)]
        if not alive:
            return f"no engine process among pids {self.root_pids}: pass the engine's pid with --pid"
        return None

    def sample(self, wall_ns: int, mono_ns: int) -> list[Sample]:
        if time.monotonic() - self._tree_at > self.tree_refresh_s:
            self._refresh_tree()
        total = 0
        seen = 0
        for proc in self._procs:
            try:
                total += proc.memory_info().rss
                seen += 1
            except psutil.Error:
                self._tree_at = -1e9  # a process left: rebuild the tree next time
        if seen == 0:
            raise SourceError(f"engine processes {self.root_pids} are gone")
        return [
            Sample(self.name, "engine_rss_bytes", float(total), (), wall_ns, mono_ns),
            Sample(self.name, "engine_processes", float(seen), (), wall_ns, mono_ns),
        ]

    def close(self) -> None:
        self._procs = []
