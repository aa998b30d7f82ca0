"""What a Triton recording needs beside the common session: where the server's three endpoints are,
its sources (metrics port, its log, its process tree, NVML), and the facts that tie a result to what
was tested (server and client versions, protocol, backend and version of each model)."""

from __future__ import annotations

from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from urllib.parse import urlparse

import httpx

from cancelwatch.collectors.engines import lifecycle, triton_server
from cancelwatch.collectors.recording.session import PreflightError, RecordSettings, memory_sources
from cancelwatch.collectors.sources.base import Source
from cancelwatch.collectors.sources.credentials import strip_userinfo
from cancelwatch.collectors.sources.triton import FAMILY, TritonMetricsSource, server_version
from cancelwatch.collectors.sources.triton_log import TritonLogSource

NO_TRITON_LOG = ("no server log: the target is not cancelwatch's embedded Triton; pass --engine-log PATH "
                 "(tritonserver's log, serving cancelwatch's models)")


@dataclass
class TritonEndpoints:
    grpc: str  # host:port
    http: str  # http://host:port
    metrics: str  # http://host:port
    state: lifecycle.EngineState | None = None  # the embedded server, when it is one


def is_triton_target(target: str) -> bool:
    return target.startswith("grpc://")


def endpoints(target: str, metrics_url: str | None, http_url: str | None, home: Path) -> TritonEndpoints:
    """The server's endpoints from `grpc://host:port`: the embedded Triton's own when the address is
    one it serves, else Triton's default ports on that host unless given."""
    parsed = urlparse(target)
    if not parsed.hostname or parsed.port is None:
        raise PreflightError(f"--target {target!r}: give Triton's gRPC address as grpc://HOST:PORT "
                             "(e.g. grpc://127.0.0.1:8001)")
    grpc = f"{parsed.hostname}:{parsed.port}"
    state = next((s for s in lifecycle.all_states(home)
                  if triton_server.owns(s) and s.urls.get("grpc") == grpc and lifecycle.is_alive(s)), None)
    if state is not None:
        return TritonEndpoints(grpc, http_url or state.url, metrics_url or state.urls["metrics"], state)
    return TritonEndpoints(grpc, http_url or f"http://{parsed.hostname}:8000",
                           metrics_url or f"http://{parsed.hostname}:8002")


def _check_grpc(ep: TritonEndpoints, models: list[str]) -> None:
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(ep.grpc)
    try:
        if not client.is_server_live(client_timeout=3.0):
            raise PreflightError(f"Triton at grpc://{ep.grpc} is not live: start it "
                                 "(cancelwatch engine up --engine triton) or fix --target")
        for m in models:
            if not client.is_model_ready(m, client_timeout=3.0):
                raise PreflightError(f"model {m!r} is not ready on grpc://{ep.grpc}: serve cancelwatch's models "
                                     "(cancelwatch engine up --engine triton), or run only scenarios whose models it has")
    except InferenceServerException as exc:
        raise PreflightError(f"cannot reach Triton's gRPC at grpc://{ep.grpc} ({exc.status() or 'unavailable'}): "
                             "start it (cancelwatch engine up --engine triton) or fix --target") from None
    finally:
        client.close()


def model_facts(http_url: str, models: list[str]) -> dict:
    """Backend (platform) and versions of each model, from the server's own model metadata."""
    out = {}
    for m in models:
        try:
            meta = httpx.get(f"{http_url}/v2/models/{m}", timeout=2.0).json()
            out[m] = {"versions": meta.get("versions"), "platform": meta.get("platform")}
        except (httpx.HTTPError, ValueError):
            out[m] = {"versions": None, "platform": None}
    return out


def build_triton_sources(settings: RecordSettings, ep: TritonEndpoints, models: list[str],
                         nvml_module=None) -> tuple[list[Source], dict]:
    """The run's sources and the server facts to store. Raises PreflightError before any run exists."""
    label = settings.targets[0].label
    settings.targets[0].family = FAMILY
    src = TritonMetricsSource(ep.metrics, label)
    problem = src.check()
    if problem:
        src.close()
        raise PreflightError(problem)
    _check_grpc(ep, models)
    sources: list[Source] = [src]
    try:
        client_version = version("tritonclient")
    except PackageNotFoundError:
        client_version = None
    server = server_version(ep.http)
    facts: dict = {"engine": FAMILY, "targets": {label: {
        "version": f"Triton {server}" if server else None, "kind": FAMILY, "grpc": strip_userinfo(ep.grpc), "http": strip_userinfo(ep.http),
        "metrics": strip_userinfo(ep.metrics), "client": f"tritonclient {client_version}", "protocols": ["grpc", "http"],
        "backend": "python", "models": model_facts(ep.http, models)}}}
    log_path = str(settings.engine_log) if settings.engine_log else (ep.state.log_path if ep.state else None)
    facts["engine_log"] = {label: {"off": NO_TRITON_LOG}}
    if log_path:
        log = TritonLogSource(log_path, target=label)
        problem = log.check()
        if problem and settings.engine_log is not None:
            src.close()
            raise PreflightError(problem)
        if problem:
            facts["engine_log"][label] = {"off": problem}
        else:
            sources.append(log)
            facts["engine_log"][label] = {"path": log_path}
    pids = list(settings.pids) or ([ep.state.pid] if ep.state else [])
    if ep.state is not None:
        facts["targets"][label].update({"embedded": True, "pid": ep.state.pid, "command": ep.state.command,
                                        "shape": ep.state.shape})
    # the server and its python-backend stubs, where the models' buffers live
    sources += memory_sources(settings, pids, facts, nvml_module)
    return sources, facts
