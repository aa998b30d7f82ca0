"""The embedded Triton: the real `tritonserver` (2.51, CPU) bundled in the pinned nvidia-pytriton wheel,
serving cancelwatch's own python-backend models on 127.0.0.1.

PyTriton's bound functions cannot see cancellation, so the bundled binary is run directly on a model
repository written here from triton_models/: `generator` (decoupled, polls is_cancelled every step),
`generator_deaf` (the same, never polling) and `slow` (unary, dynamic batching, one instance: requests
queue in the core). The wheel lives in its own venv (.venv-triton, `make triton-venv`), apart from the
tool's requirements; the state file, start, stop and `engine down/status` are every family's (lifecycle.py).
"""

from __future__ import annotations

import os
import shutil
import sysconfig
import time
from pathlib import Path

from cancelwatch.collectors.engines import lifecycle
from cancelwatch.collectors.engines.lifecycle import EngineError, EngineState, PortBusy

PROJECT_ROOT = Path(__file__).resolve().parents[2]
TRITON_VENV = PROJECT_ROOT / ".venv-triton"
MODELS_DIR = Path(__file__).resolve().with_name("triton_models")
MODEL_NAMES = ("generator", "generator_deaf", "generator_hoard", "slow")
STEP_MS = 50  # the generators' default step: 20 tokens a second
KIND = "triton"  # what its state files say (lifecycle.EngineState.kind)
HEALTH_PATH = "/v2/health/ready"  # KServe v2 readiness (strict by default: every model loaded)

_GENERATOR_CONFIG = """name: "{name}"
backend: "python"
max_batch_size: 0
model_transaction_policy {{ decoupled: true }}
input [
  {{ name: "N" data_type: TYPE_INT32 dims: [ 1 ] }},
  {{ name: "STEP_MS" data_type: TYPE_INT32 dims: [ 1 ] optional: true }}
]
output [ {{ name: "TOKEN" data_type: TYPE_INT32 dims: [ 1 ] }} ]
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
parameters {{ key: "poll_cancel" value: {{ string_value: "{poll}" }} }}
parameters {{ key: "step_ms" value: {{ string_value: "{step_ms}" }} }}
parameters {{ key: "keep_on_cancel" value: {{ string_value: "{keep}" }} }}
"""

_SLOW_CONFIG = """name: "slow"
backend: "python"
max_batch_size: 1
dynamic_batching { }
input [ { name: "MS" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "DONE" data_type: TYPE_INT32 dims: [ 1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""


def owns(state: EngineState) -> bool:
    """Whether a state file is one of this launcher's tritonservers."""
    return state.kind == KIND


def site_packages(venv: Path = TRITON_VENV) -> Path | None:
    found = sorted(venv.glob("lib/python3*/site-packages"))
    return found[0] if found else None


def bundled_server(venv: Path = TRITON_VENV) -> Path:
    """The wheel's tritonserver; the error names the make target that installs it."""
    sp = site_packages(venv)
    binary = sp / "pytriton" / "tritonserver" / "bin" / "tritonserver" if sp else None
    if binary is None or not binary.exists():
        raise EngineError(f"no tritonserver under {venv}: install it with `make triton-venv` "
                          "(the nvidia-pytriton wheel bundles Triton 2.51)")
    return binary


def write_repository(home: Path, step_ms: int = STEP_MS, models: tuple[str, ...] = MODEL_NAMES) -> Path:
    """The model repository: one folder per model, version 1, from triton_models/ (rewritten each start)."""
    repo = home / "triton-models"
    shutil.rmtree(repo, ignore_errors=True)
    repo.mkdir(parents=True)
    for name, source, config in (
        ("generator", "generator.py", _GENERATOR_CONFIG.format(name="generator", poll="true", step_ms=step_ms,
                                                               keep="false")),
        ("generator_deaf", "generator.py", _GENERATOR_CONFIG.format(name="generator_deaf", poll="false",
                                                                    step_ms=step_ms, keep="false")),
        ("generator_hoard", "generator.py", _GENERATOR_CONFIG.format(name="generator_hoard", poll="true",
                                                                     step_ms=step_ms, keep="true")),
        ("slow", "slow.py", _SLOW_CONFIG),
    ):
        if name not in models:
            continue
        (repo / name / "1").mkdir(parents=True)
        shutil.copy(MODELS_DIR / source, repo / name / "1" / "model.py")
        (repo / name / "config.pbtxt").write_text(config)
    return repo


def write_backends(home: Path, venv: Path = TRITON_VENV) -> Path:
    """The python backend with the stub for this venv's Python beside it (what the bundled server loads)."""
    sp = site_packages(venv)
    bundled = sp / "pytriton" / "tritonserver"
    py = sp.parent.name.removeprefix("python")  # lib/python3.11 -> 3.11
    stub = bundled / "python_backend_stubs" / py / "triton_python_backend_stub"
    if not stub.exists():
        raise EngineError(f"the nvidia-pytriton wheel has no python-backend stub for Python {py}: "
                          "build .venv-triton with Python 3.8-3.13 (`make triton-venv`)")
    backends = home / "triton-backends"
    shutil.rmtree(backends, ignore_errors=True)
    shutil.copytree(bundled / "backends" / "python", backends / "python")
    shutil.copy(stub, backends / "python" / "triton_python_backend_stub")
    return backends


def ports(port: int) -> dict[str, int]:
    """HTTP on `port`, gRPC on the next, metrics on the one after: one number names the server."""
    return {"http": port, "grpc": port + 1, "metrics": port + 2}


def build_command(binary: Path, repo: Path, backends: Path, port: int) -> list[str]:
    p = ports(port)
    return [str(binary), "--model-repository", str(repo), "--backend-directory", str(backends),
            "--http-address", "127.0.0.1", "--grpc-address", "127.0.0.1", "--metrics-address", "127.0.0.1",
            "--http-port", str(p["http"]), "--grpc-port", str(p["grpc"]), "--metrics-port", str(p["metrics"]),
            "--allow-gpu-metrics", "false", "--metrics-interval-ms", "100",
            "--log-info", "true"]  # the default format stamps microseconds (ISO8601 only seconds)


def start(home: Path, port: int = 8100, venv: Path = TRITON_VENV, step_ms: int = STEP_MS,
          timeout_s: float = 120.0, models: tuple[str, ...] = MODEL_NAMES) -> EngineState:
    home = Path(home).resolve()
    home.mkdir(parents=True, exist_ok=True)
    lifecycle.refuse_if_running(home, port)
    for name, p in ports(port).items():
        if lifecycle.port_in_use(p):
            raise PortBusy(f"port {p} on 127.0.0.1 ({name}) is busy: pick another with --port "
                           "(Triton takes --port and the two after it)")
    binary = bundled_server(venv)
    sp = site_packages(venv)
    repo, backends = write_repository(home, step_ms, models), write_backends(home, venv)
    cmd = build_command(binary, repo, backends, port)
    env = dict(os.environ)
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    env["LD_LIBRARY_PATH"] = ":".join(x for x in (libdir, str(sp / "nvidia_pytriton.libs"),
                                                  env.get("LD_LIBRARY_PATH", "")) if x)
    env["PYTHONPATH"] = str(sp)  # the stub's numpy
    proc, _ = lifecycle.launch(cmd, home, port, env)
    p = ports(port)
    state = EngineState(
        pid=proc.pid, port=port, url=f"http://127.0.0.1:{p['http']}", log_path=str(lifecycle.log_path(home, port)),
        model=str(repo), served_model_name="generator", command=cmd, started_wall_ns=time.time_ns(),
        shape={"step_ms": step_ms, "models": list(models)}, kind=KIND,
        urls={"grpc": f"127.0.0.1:{p['grpc']}", "metrics": f"http://127.0.0.1:{p['metrics']}"},
    )
    return lifecycle.wait_started(home, state, proc, timeout_s, health_path=HEALTH_PATH, poll_s=0.3)
