"""What a vLLM recording needs beside the common session: its sources (each target's /metrics, the
engine log, process memory and NVML) and the facts that tie a result to the engine (version, the
embedded engine's shape, model, command line and sizes)."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlparse

from cancelwatch.collectors.engines import lifecycle
from cancelwatch.collectors.engines import vllm_server as engine_mod
from cancelwatch.collectors.recording.session import PreflightError, RecordSettings, check_burst, memory_sources
from cancelwatch.collectors.sources.base import Source
from cancelwatch.collectors.sources.engine_log import EngineLogSource
from cancelwatch.collectors.sources.vllm import FAMILY as VLLM_FAMILY
from cancelwatch.collectors.sources.vllm import VllmMetricsSource, server_version

NO_ENGINE_LOG = ("no engine log: the target is not cancelwatch's embedded engine; pass --engine-log PATH "
                 "(the log of a vLLM started with --enable-log-requests)")


LOGS_REQUESTS = "--enable-log-requests"  # the flag without which vLLM logs no per-request lines
NO_REQUEST_LINES = ("no engine log: the embedded engine was started without --enable-log-requests (vLLM's default, "
                    "or the relay app): its log names no requests")


def embedded_engine_for(url: str, home: Path) -> lifecycle.EngineState | None:
    parsed = urlparse(url)
    if parsed.hostname not in ("127.0.0.1", "localhost") or parsed.port is None:
        return None
    state = lifecycle.read_state(home, parsed.port)
    return state if state is not None and engine_mod.owns(state) and lifecycle.is_alive(state) else None


def build_vllm_sources(settings: RecordSettings, nvml_module=None) -> tuple[list[Source], dict]:
    """The run's sources and the engine facts to store. Raises PreflightError before any run exists."""
    if not settings.targets:
        raise PreflightError("no --target given: pass the vLLM server's URL, e.g. --target http://127.0.0.1:8000")
    if not (0 < settings.hz <= settings.max_hz):
        raise PreflightError(f"--hz {settings.hz} is out of range: use a rate in (0, {settings.max_hz:.0f}]")
    check_burst(settings)
    sources: list[Source] = []
    engine_facts: dict = {"targets": {}}
    pids = list(settings.pids)
    logs: dict[str, str] = {}  # target label -> the engine log followed for it
    quiet: dict[str, str] = {}  # target label -> why its embedded engine's log is not followed
    for t in settings.targets:
        t.family = VLLM_FAMILY  # these sources read vLLM's /metrics: the target is a vLLM server
        src = VllmMetricsSource(t.source_url, t.label)
        problem = src.check()
        if problem:
            for s in sources:
                s.close()
            src.close()
            raise PreflightError(f"target {t.label} unreachable: {problem}")
        sources.append(src)
        version = server_version(src.base_url)
        state = embedded_engine_for(t.url, settings.home)
        if version is not None:
            engine_facts["targets"].setdefault(t.label, {})["version"] = f"vLLM {version}"
        if state is not None:
            engine_facts["targets"].setdefault(t.label, {}).update({
                "embedded": True, "pid": state.pid, "model": state.model, "shape": state.shape,
                "command": state.command,
                "kv_bytes_per_token": engine_mod.kv_bytes_per_token(state.model, state.shape.get("dtype", "")),
                "weights_bytes": engine_mod.weights_bytes(state.model, state.shape.get("dtype", "")),
            })
            if not settings.pids:
                pids.append(state.pid)
            if LOGS_REQUESTS in state.command:
                logs[t.label] = state.log_path
            else:
                quiet[t.label] = NO_REQUEST_LINES
    if settings.engine_log is not None:
        logs = {settings.targets[0].label: str(settings.engine_log)}
    engine_facts["engine_log"] = {t.label: {"off": quiet.get(t.label, NO_ENGINE_LOG)} for t in settings.targets}
    for label, path in logs.items():
        log = EngineLogSource(path, target=label, tz=settings.engine_log_tz)
        problem = log.check()
        if problem and settings.engine_log is not None:
            for s in sources:
                s.close()
            raise PreflightError(problem)
        if problem:
            engine_facts["engine_log"][label] = {"off": problem}
            continue
        sources.append(log)
        engine_facts["engine_log"][label] = {"path": path}
    sources += memory_sources(settings, pids, engine_facts, nvml_module)
    return sources, engine_facts
