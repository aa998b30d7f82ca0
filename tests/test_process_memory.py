"""Process memory of a real process tree (a parent with a child that holds 64 MiB)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from cancelwatch.collectors.sources.base import SourceError
from cancelwatch.collectors.sources.process_memory import ProcessMemorySource

CHILD = "import time; b = bytearray(64 * 2**20); time.sleep(30)"
PARENT = f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', {CHILD!r}]); time.sleep(30)"


def test_rss_covers_the_whole_tree_and_a_gone_tree_is_an_error():
    parent = subprocess.Popen([sys.executable, "-c", PARENT])
    try:
        src = ProcessMemorySource([parent.pid], tree_refresh_s=0.0)
        assert src.check() is None
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            got = {s.metric: s.value for s in src.sample(1, 2)}
            if got["engine_processes"] == 2 and got["engine_rss_bytes"] > 64 * 2**20:
                break
            time.sleep(0.2)
        assert got["engine_processes"] == 2
        assert got["engine_rss_bytes"] > 64 * 2**20  # the child's buffer is counted
    finally:
        import psutil

        for p in psutil.Process(parent.pid).children(recursive=True):
            p.kill()
        parent.kill()
        parent.wait()
    time.sleep(0.3)
    with pytest.raises(SourceError, match="gone"):
        src.sample(3, 4)
    assert "--pid" in ProcessMemorySource([parent.pid]).check()
