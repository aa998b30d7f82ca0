"""The slow-engine knob: CANCELWATCH_ENGINE_CPUS puts the embedded engine under a CPU quota (a cgroup).

bench/slow_engine.py measures what it does to the engine's speed; here: the quota is set and holds every
process of the engine, it goes with the engine, and a bad value is one line that names the fix.
"""

from __future__ import annotations

import os
from pathlib import Path

import psutil
import pytest

from cancelwatch.collectors.engines import cpu_limit
from cancelwatch.collectors.engines.lifecycle import engine_pids, free_port, read_state
from tests.conftest import cli


@pytest.mark.parametrize("text", ["abc", "0", "0.01", "-1", "nan", "inf", "999", ""])
def test_a_bad_share_is_refused_naming_the_fix(text):
    with pytest.raises(cpu_limit.CpuLimitError) as exc:
        cpu_limit.parse_cores(text, available=2)
    msg = str(exc.value)
    assert "\n" not in msg and "e.g. 0.4" in msg and "between 0.05 and 2" in msg


def test_a_share_in_cores():
    assert cpu_limit.parse_cores("0.3", available=2) == 0.3
    assert cpu_limit.parse_cores(" 2 ", available=2) == 2.0


def fake_tree(root: Path, version: str) -> Path:
    """A cgroup tree laid out as the kernel shows it (v1: cpu/ with cfs files; v2: cpu enabled at the root):
    v2 does not run on this machine, v1 does (the engine test below uses the real one)."""
    if version == "v1":
        (root / "cpu").mkdir(parents=True)
        (root / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    else:
        root.mkdir(parents=True)
        (root / "cgroup.subtree_control").write_text("cpuset cpu io memory pids\n")
    return root


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_the_quota_is_written_the_way_each_cgroup_version_takes_it(tmp_path, version):
    root = fake_tree(tmp_path / "cg", version)
    path = cpu_limit.create("cancelwatch-engine-1", 0.3, root=root)
    if version == "v1":
        assert path == root / "cpu" / "cancelwatch-engine-1"
        assert (path / "cpu.cfs_quota_us").read_text() == "30000" and (path / "cpu.cfs_period_us").read_text() == "100000"
    else:
        assert path == root / "cancelwatch-engine-1" and (path / "cpu.max").read_text() == "30000 100000"
    assert cpu_limit.quota_cores(path) == pytest.approx(0.3)


def test_no_cpu_controller_is_one_line_naming_the_fix(tmp_path):
    (tmp_path / "cg").mkdir()
    (tmp_path / "cg" / "cgroup.subtree_control").write_text("memory pids\n")  # v2 without cpu delegated
    with pytest.raises(cpu_limit.CpuLimitError) as exc:
        cpu_limit.create("x", 0.3, root=tmp_path / "cg")
    assert "\n" not in str(exc.value) and "unset CANCELWATCH_ENGINE_CPUS" in str(exc.value)


@pytest.mark.slow
@pytest.mark.engine
def test_engine_up_with_the_knob_runs_every_engine_process_under_the_quota(tmp_path, monkeypatch):
    home, port = tmp_path / "home", free_port()
    monkeypatch.setenv("CANCELWATCH_ENGINE_CPUS", "banana")
    bad = cli("engine", "up", "--port", str(port), home=home)
    assert bad.returncode == 2 and "\n" not in bad.stderr.strip(), bad.stderr
    assert "CANCELWATCH_ENGINE_CPUS='banana'" in bad.stderr and read_state(home, port) is None
    # the point is that every engine process is under the quota, not how slow it makes the engine: 0.9 of a
    # core starts it about as fast as none (0.3 took 183 s of CI's suite to start, for the same assertions)
    monkeypatch.setenv("CANCELWATCH_ENGINE_CPUS", "0.9")
    up = cli("engine", "up", "--port", str(port), home=home, timeout=900)
    state = read_state(home, port)
    try:
        assert up.returncode == 0 and state is not None, up.stdout + up.stderr
        assert "limited to 0.9 CPU" in up.stdout and state.shape["cpu_cores"] == 0.9
        group = Path(state.cgroup)
        assert cpu_limit.quota_cores(group) == pytest.approx(0.9)
        # the API server and every process it started (engine core, workers) count against the quota
        pids = set(engine_pids(state))
        assert len(pids) >= 2 and pids <= set(cpu_limit.members(group)), (pids, cpu_limit.members(group))
        assert os.getpid() not in cpu_limit.members(group)  # the recorder is not slowed
    finally:
        down = cli("engine", "down", "--port", str(port), home=home)
    assert down.returncode == 0 and f"stopped {port}" in down.stdout
    assert not group.exists(), "engine down left the engine's cgroup behind"
    assert not [p for p in pids if psutil.pid_exists(p)]
