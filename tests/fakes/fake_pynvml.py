"""A hand-written stand-in for nvidia-ml-py's `pynvml`, for machines without a GPU.

Only the calls cancelwatch makes, with real units and shapes: byte counts as an H200 reports them
(nvmlMemory_v2: version/total/reserved/free/used), process entries with pid and usedGpuMemory.
One field can be set to raise NVMLError_NotSupported, as a real driver does for some queries.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_DRIVER_NOT_LOADED = 9
nvmlMemory_v2 = 0x02000028  # sizeof(nvmlMemory_v2_t) | 2 << 24, as pynvml defines it


class NVMLError(Exception):
    def __init__(self, value: int):
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return {3: "Not Supported", 9: "Driver Not Loaded", 1: "Uninitialized"}.get(self.value, f"NVML error {self.value}")


class NVMLError_NotSupported(NVMLError):
    def __init__(self):
        super().__init__(NVML_ERROR_NOT_SUPPORTED)


class NVMLError_DriverNotLoaded(NVMLError):
    def __init__(self):
        super().__init__(NVML_ERROR_DRIVER_NOT_LOADED)


@dataclass
class FakeGpu:
    uuid: str = "GPU-4f8c1c2e-7d1a-4b0e-9b3c-2a7f0e5d9c11"
    total: int = 150_754_820_096  # H200: 143,771 MiB as nvidia-smi shows it
    reserved: int = 646_709_248
    used: int = 132_011_491_328  # vLLM at gpu_memory_utilization 0.9, idle
    processes: tuple = ((4242, 131_364_782_080), (5151, None))


class FakeNvml:
    """Module-like object: pass it where the code takes `nvml=`."""

    NVMLError = NVMLError
    NVMLError_NotSupported = NVMLError_NotSupported
    nvmlMemory_v2 = nvmlMemory_v2

    def __init__(self, gpus=None, driver_loaded=True, unsupported=()):
        self.gpus = list(gpus) if gpus is not None else [FakeGpu()]
        self.driver_loaded = driver_loaded
        self.unsupported = set(unsupported)  # names of calls that raise NotSupported
        self.initialised = False
        self.calls: list[str] = []

    def _call(self, name: str):
        self.calls.append(name)
        if not self.initialised and name != "nvmlInit":
            raise NVMLError(NVML_ERROR_UNINITIALIZED)
        if name in self.unsupported:
            raise NVMLError_NotSupported()

    def nvmlInit(self):
        self.calls.append("nvmlInit")
        if not self.driver_loaded:
            raise NVMLError_DriverNotLoaded()
        self.initialised = True

    def nvmlShutdown(self):
        self._call("nvmlShutdown")
        self.initialised = False

    def nvmlDeviceGetCount(self):
        self._call("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int):
        self._call("nvmlDeviceGetHandleByIndex")
        return self.gpus[index]

    def nvmlDeviceGetUUID(self, handle):
        self._call("nvmlDeviceGetUUID")
        return handle.uuid

    def nvmlDeviceGetMemoryInfo(self, handle, version=None):
        if version == nvmlMemory_v2:
            self._call("nvmlDeviceGetMemoryInfo_v2")
            free = handle.total - handle.used - handle.reserved
            return SimpleNamespace(version=version, total=handle.total, reserved=handle.reserved,
                                   free=free, used=handle.used)
        self._call("nvmlDeviceGetMemoryInfo")
        return SimpleNamespace(total=handle.total, free=handle.total - handle.used, used=handle.used)

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        self._call("nvmlDeviceGetComputeRunningProcesses")
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in handle.processes]
