"""A slow engine on demand: a CPU-time quota for the embedded engine's process tree, through a cgroup.

Tests tuned on a fast machine fail on a slow one (a window that assumed the load ended by 9 s, a wait of
30 s). With a quota of, say, 0.4 cores the embedded vLLM is several times slower than on two free cores,
so the suite can be run against an engine as slow as a loaded CI machine's, on purpose. A quota (not a
pinned core: vLLM's tiny model runs as fast on one core as on two) is what slows it.

The kernel enforces it: every process the engine starts stays in its cgroup. cgroup v1 (the `cpu`
controller at /sys/fs/cgroup/cpu) and v2 (the unified tree with `cpu` enabled at its root) both work;
either needs root (or a delegated tree). Where neither can be written the error says so in one line.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PERIOD_US = 100_000  # the kernel's default CFS period: the engine runs `cores` x 100 ms of every 100 ms


class CpuLimitError(Exception):
    """The quota cannot be set here; the message names the fix."""


def parse_cores(text: str, available: int | None = None) -> float:
    """The engine's CPU time in cores ("0.4": 40 % of one core), between 0.05 and the machine's CPUs."""
    available = available or len(os.sched_getaffinity(0))
    try:
        cores = float(text)
    except ValueError:
        cores = float("nan")
    if not 0.05 <= cores <= available:  # NaN fails too
        raise CpuLimitError(f"{text!r} is not a CPU share: give the engine's CPU time in cores, between 0.05 "
                            f"and {available} (e.g. 0.4), or unset it")
    return cores


def _controller(root: Path) -> tuple[Path, str]:
    """(the folder to create cgroups in, 'v1' or 'v2')."""
    if (root / "cpu" / "cpu.cfs_quota_us").exists():
        return root / "cpu", "v1"
    try:
        if "cpu" in (root / "cgroup.subtree_control").read_text().split():
            return root, "v2"
    except OSError:
        pass
    try:
        available = "cpu" in (root / "cgroup.controllers").read_text().split()
    except OSError:
        available = False
    if available:
        raise CpuLimitError(f"cgroup v2's cpu controller is not enabled for {root}'s children: enable it with "
                            f"`echo +cpu > {root}/cgroup.subtree_control` (as root), or unset CANCELWATCH_ENGINE_CPUS")
    raise CpuLimitError(f"no cgroup cpu controller under {root} (neither v1's cpu/ nor v2's): unset "
                        "CANCELWATCH_ENGINE_CPUS, or run where the cgroup tree is mounted")


def create(name: str, cores: float, root: Path = CGROUP_ROOT) -> Path:
    """A cgroup named `name` allowed `cores` of CPU time; its folder. Join it with `join` in the child."""
    base, version = _controller(root)
    path = base / name
    quota = max(1000, round(cores * PERIOD_US))
    try:
        path.mkdir(exist_ok=True)
        if version == "v1":
            (path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (path / "cpu.cfs_quota_us").write_text(str(quota))
        else:
            (path / "cpu.max").write_text(f"{quota} {PERIOD_US}")
    except OSError as exc:
        remove(path)
        if exc.errno == errno.EINVAL:  # v1: a child's quota may not exceed its parent's (a limited container)
            raise CpuLimitError(f"the quota of {cores:g} cores is more than {base} allows: give fewer cores, or "
                                "unset CANCELWATCH_ENGINE_CPUS") from None
        raise CpuLimitError(f"cannot set a CPU quota in {path} ({exc.strerror}): run as root (the cgroup tree "
                            "is root's), or unset CANCELWATCH_ENGINE_CPUS") from None
    return path


def join(path: Path) -> None:
    """Move the calling process (and so everything it starts from now on) into the cgroup."""
    (path / "cgroup.procs").write_text(str(os.getpid()))


def wrapped(path: Path, cmd: list[str]) -> list[str]:
    """`cmd` started inside the cgroup: a shell moves itself in and execs the command (same pid), so the
    engine counts against the quota from its first instruction and no pre-exec hook runs in a threaded
    parent. A shell that cannot move itself says why on the engine's log and exits 1 before the engine runs."""
    return ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', str(path / "cgroup.procs"), *cmd]


def end_members(path: Path, timeout_s: float = 10.0) -> list[int]:
    """SIGKILL every process still in the cgroup (an orphan of the engine whose parent already exited is one)
    and wait until it is empty; the pids still there after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = members(path)
        if not left or time.monotonic() > deadline:
            return left
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.05)


def members(path: Path) -> list[int]:
    try:
        return [int(x) for x in (path / "cgroup.procs").read_text().split()]
    except OSError:
        return []


def quota_cores(path: Path) -> float | None:
    """The quota the cgroup holds, in cores; None when it has none (or is gone)."""
    try:
        if (path / "cpu.cfs_quota_us").exists():
            quota, period = int((path / "cpu.cfs_quota_us").read_text()), int((path / "cpu.cfs_period_us").read_text())
        else:
            q, p = (path / "cpu.max").read_text().split()
            quota, period = (-1 if q == "max" else int(q)), int(p)
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 else None


def remove(path: Path) -> None:
    """Remove the (empty) cgroup; one whose processes still run is left, and removing it later works."""
    try:
        path.rmdir()
    except OSError:
        pass
