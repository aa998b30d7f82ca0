"""GPU memory through NVML (nvidia-ml-py, module `pynvml`). The only module that touches NVML.

pynvml is imported lazily, and tests pass a fake module with the same calls, so everything else
imports cleanly on a machine without a driver. An unsupported field drops that field, not the sample.
"""

from __future__ import annotations

from types import ModuleType

from cancelwatch.collectors.sources.base import Source, SourceError
from cancelwatch.runstore.records import Sample, freeze_labels

SOURCE_NAME = "nvml"
NO_DRIVER_HINT = (
    "NVML is not available ({why}): install the NVIDIA driver and nvidia-ml-py, or use --nvml off"
)


def load_pynvml() -> ModuleType:
    """Import pynvml; raise SourceError with a hint when the library or the driver is missing."""
    try:
        import pynvml  # nvidia-ml-py
    except (ImportError, OSError) as exc:
        raise SourceError(NO_DRIVER_HINT.format(why=f"import pynvml failed: {exc}")) from exc
    return pynvml


class NvmlSource(Source):
    """Per GPU: total/free/used/reserved bytes; per engine process: used GPU bytes."""

    name = SOURCE_NAME

    def __init__(self, nvml: ModuleType | None = None, pids: list[int] | None = None, target: str = "local"):
        self._nvml = nvml
        self.pids = set(pids or [])
        self.target = target
        self._handles: list = []
        self._uuids: list[str] = []
        self._unsupported: set[tuple[int, str]] = set()

    def _init(self) -> None:
        if self._handles:
            return
        nv = self._nvml = self._nvml or load_pynvml()
        try:
            nv.nvmlInit()
            count = nv.nvmlDeviceGetCount()
            handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
            uuids = []
            for h in handles:
                uuid = nv.nvmlDeviceGetUUID(h)
                uuids.append(uuid.decode() if isinstance(uuid, bytes) else str(uuid))
        except nv.NVMLError as exc:
            raise SourceError(NO_DRIVER_HINT.format(why=f"nvmlInit: {exc}")) from exc
        if not handles:
            raise SourceError(NO_DRIVER_HINT.format(why="the driver reports no GPU"))
        self._handles, self._uuids = handles, uuids

    def check(self) -> str | None:
        try:
            self._init()
        except SourceError as exc:
            return str(exc)
        return None

    def _read(self, index: int, field: str, call):
        """Call one NVML query; a NotSupported field is remembered and skipped from then on."""
        if (index, field) in self._unsupported:
            return None
        nv = self._nvml
        try:
            return call()
        except nv.NVMLError_NotSupported:
            self._unsupported.add((index, field))
            return None

    def sample(self, wall_ns: int, mono_ns: int) -> list[Sample]:
        self._init()
        nv = self._nvml
        out: list[Sample] = []
        try:
            for i, h in enumerate(self._handles):
                gpu = freeze_labels({"gpu": str(i), "uuid": self._uuids[i]})
                mem = self._read(i, "memory_v2", lambda: nv.nvmlDeviceGetMemoryInfo(h, version=nv.nvmlMemory_v2))
                if mem is None:
                    mem = self._read(i, "memory_v1", lambda: nv.nvmlDeviceGetMemoryInfo(h))
                if mem is not None:
                    for field in ("total", "free", "used", "reserved"):
                        value = getattr(mem, field, None)
                        if value is not None:
                            out.append(Sample(self.name, f"gpu_memory_{field}_bytes", float(value), gpu, wall_ns, mono_ns))
                procs = self._read(i, "processes", lambda: nv.nvmlDeviceGetComputeRunningProcesses(h))
                for p in procs or []:
                    used = getattr(p, "usedGpuMemory", None)
                    if used is None or (self.pids and p.pid not in self.pids):
                        continue  # None: the driver cannot say (e.g. no permission); absent, not 0
                    labels = freeze_labels({"gpu": str(i), "uuid": self._uuids[i], "pid": str(p.pid)})
                    out.append(Sample(self.name, "gpu_process_memory_used_bytes", float(used), labels, wall_ns, mono_ns))
        except nv.NVMLError as exc:
            raise SourceError(f"NVML query failed: {exc}") from exc
        if not out:
            raise SourceError("NVML answered no memory field for any GPU")
        return out

    def close(self) -> None:
        if self._handles and self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:  # noqa: BLE001 - shutting down a driver we no longer need
                pass
        self._handles = []
