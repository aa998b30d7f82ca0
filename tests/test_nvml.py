"""The NVML source against a hand-written fake (no GPU here); real units and shapes. The vLLM target
beside it is a recorded /metrics body served on loopback (tests/fixture_server.py)."""

from __future__ import annotations

import pytest

from cancelwatch.collectors.engines.lifecycle import free_port
from cancelwatch.collectors.recording.session import PreflightError, RecordSettings, Target
from cancelwatch.collectors.recording.vllm_session import build_vllm_sources as build_sources
from cancelwatch.collectors.sources.base import SourceError
from cancelwatch.collectors.sources.nvml import NvmlSource
from tests.conftest import FIXTURES
from tests.fakes.fake_pynvml import FakeGpu, FakeNvml


def by_metric(samples):
    out = {}
    for s in samples:
        out.setdefault(s.metric, []).append(s)
    return out


def test_memory_v2_and_engine_processes():
    nv = FakeNvml()
    src = NvmlSource(nvml=nv, pids=[4242])
    assert src.check() is None
    got = by_metric(src.sample(5, 6))
    gpu = FakeGpu()
    assert got["gpu_memory_total_bytes"][0].value == gpu.total
    assert got["gpu_memory_used_bytes"][0].value == gpu.used
    assert got["gpu_memory_reserved_bytes"][0].value == gpu.reserved
    assert got["gpu_memory_free_bytes"][0].value == gpu.total - gpu.used - gpu.reserved
    assert dict(got["gpu_memory_used_bytes"][0].labels) == {"gpu": "0", "uuid": gpu.uuid}
    procs = got["gpu_process_memory_used_bytes"]
    assert [(s.label("pid"), s.value) for s in procs] == [("4242", 131_364_782_080)]
    assert all(s.wall_ns == 5 and s.mono_ns == 6 and s.source == "nvml" for s in src.sample(5, 6))


def test_process_with_unknown_usage_is_absent_not_zero():
    src = NvmlSource(nvml=FakeNvml(), pids=[])  # no pid filter: every process considered
    procs = by_metric(src.sample(0, 0))["gpu_process_memory_used_bytes"]
    assert [s.label("pid") for s in procs] == ["4242"]  # pid 5151 has usedGpuMemory None


def test_unsupported_field_drops_the_field_not_the_sample():
    nv = FakeNvml(unsupported={"nvmlDeviceGetComputeRunningProcesses"})
    src = NvmlSource(nvml=nv, pids=[4242])
    got = by_metric(src.sample(0, 0))
    assert "gpu_process_memory_used_bytes" not in got
    assert got["gpu_memory_used_bytes"][0].value == FakeGpu().used
    src.sample(0, 0)
    assert nv.calls.count("nvmlDeviceGetComputeRunningProcesses") == 1  # not asked again


def test_v1_fallback_when_v2_is_unsupported():
    nv = FakeNvml(unsupported={"nvmlDeviceGetMemoryInfo_v2"})
    got = by_metric(NvmlSource(nvml=nv).sample(0, 0))
    assert "gpu_memory_reserved_bytes" not in got
    assert got["gpu_memory_total_bytes"][0].value == FakeGpu().total


def test_two_gpus_are_labelled():
    nv = FakeNvml(gpus=[FakeGpu(uuid="GPU-a"), FakeGpu(uuid="GPU-b", used=1 << 30)])
    used = by_metric(NvmlSource(nvml=nv).sample(0, 0))["gpu_memory_used_bytes"]
    assert {(s.label("gpu"), s.label("uuid"), s.value) for s in used} == {
        ("0", "GPU-a", FakeGpu().used), ("1", "GPU-b", float(1 << 30))}


def test_no_driver_gives_a_hint():
    src = NvmlSource(nvml=FakeNvml(driver_loaded=False))
    problem = src.check()
    assert "Driver Not Loaded" in problem and "--nvml off" in problem
    with pytest.raises(SourceError, match="--nvml off"):
        src.sample(0, 0)


def test_nvml_on_without_driver_is_a_preflight_error(metrics_server, tmp_path):
    # no engine needed to reach the NVML decision: the target is a recorded idle /metrics body served
    # on loopback, so the vLLM source's preflight reads a real body over a real socket
    server = metrics_server(FIXTURES / "vllm" / "0.32" / "idle.txt")
    settings = RecordSettings(targets=[Target("t0", server.url)], nvml="on", home=tmp_path)
    with pytest.raises(PreflightError, match="NVML is not available"):
        build_sources(settings, nvml_module=FakeNvml(driver_loaded=False))
    settings.nvml = "auto"
    sources, facts = build_sources(settings, nvml_module=FakeNvml(driver_loaded=False))
    assert [s.name for s in sources] == ["vllm"] and facts["nvml"].startswith("off")
    assert "Driver Not Loaded" in facts["nvml"]
    for s in sources:
        s.close()
    sources, facts = build_sources(settings, nvml_module=FakeNvml())
    assert [s.name for s in sources] == ["vllm", "nvml"] and facts["nvml"] == "on"
    assert [s.target for s in sources if s.name == "vllm"] == ["t0"]
    for s in sources:
        s.close()
    # each preflight read the full body, and asked the server its version (recorded with the run)
    assert server.paths and set(server.paths) == {"/metrics", "/version"}
    assert facts["targets"]["t0"]["version"] == "vLLM 0.32.0"
    # and a target that does not answer stops the preflight before NVML is asked
    settings.targets = [Target("t0", f"http://127.0.0.1:{free_port()}")]
    with pytest.raises(PreflightError, match="t0 unreachable"):
        build_sources(settings, nvml_module=FakeNvml())


def test_real_pynvml_on_this_machine_fails_cleanly():
    """nvidia-ml-py is installed; without a driver its nvmlInit must turn into the hint, not a crash."""
    src = NvmlSource()
    problem = src.check()
    if problem is None:
        pytest.skip("a real NVIDIA driver answers here")
    assert "--nvml off" in problem
