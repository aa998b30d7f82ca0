"""`cancelwatch engine up|down|status`: the embedded vLLM (real vLLM, CPU build) or the embedded Triton
(the real tritonserver of the nvidia-pytriton wheel) on 127.0.0.1."""

from __future__ import annotations

from typing import Optional

import typer

from cancelwatch.console import ENGINE_CPUS_ENV, engine_cpu_cores, err, fail, home_dir, out
from cancelwatch.collectors.engines import lifecycle, triton_server
from cancelwatch.collectors.engines import vllm_server as engine_mod
from cancelwatch.collectors.recording.session import EXIT_FAILED, EXIT_USAGE

engine_app = typer.Typer(no_args_is_help=True, help="The embedded engines: vLLM (CPU build) or Triton.")

@engine_app.command("up")
def engine_up(
    engine: str = typer.Option(engine_mod.KIND, help="vllm, or triton (HTTP on --port, gRPC and metrics on the two "
                               "after)."),
    port: Optional[int] = typer.Option(None, help="Port on 127.0.0.1; default 8000 (vllm), 8100 (triton)."),
    model: Optional[str] = typer.Option(None, help="Model directory; default: build the tiny Llama."),
    max_num_seqs: int = typer.Option(4, help="Scheduler batch size (--max-num-seqs)."),
    num_gpu_blocks: int = typer.Option(64, help="KV pool blocks (--num-gpu-blocks-override); 0 lets vLLM size it."),
    block_size: int = typer.Option(128, help="Tokens per KV block."),
    gpu: bool = typer.Option(False, help="Run `vllm serve` of a GPU vLLM install (engine python = this one)."),
    engine_python: Optional[str] = typer.Option(None, help="Python that has vllm; default .venv-engine."),
    relay: bool = typer.Option(False, help="Serve through cancelwatch's relay app (in-process AsyncLLM, POST /cancel)."),
    timeout: float = typer.Option(600.0, help="Seconds to wait for /health."),
    extra: Optional[list[str]] = typer.Argument(None, help="Extra vLLM flags, after --."),
):
    """Start the engine on 127.0.0.1 and wait until /health answers."""
    if engine == triton_server.KIND:
        if engine_cpu_cores():  # the models pace themselves (50 ms steps): a quota would slow nothing they judge
            err.print(f"note: {ENGINE_CPUS_ENV} slows the embedded vLLM only; Triton runs unlimited", highlight=False)
        return _triton_up(port or 8100, timeout)
    if engine != engine_mod.KIND:
        raise fail(f"--engine {engine!r}: use {engine_mod.KIND} or {triton_server.KIND}", EXIT_USAGE)
    port = port or 8000
    shape = engine_mod.EngineShape(max_num_seqs=max_num_seqs, num_gpu_blocks=num_gpu_blocks or None, block_size=block_size)
    if gpu:
        shape.dtype, shape.gpu_memory_utilization, shape.max_num_batched_tokens = "auto", 0.9, None
    try:
        state = engine_mod.start(home_dir(), port=port, model=model, shape=shape, engine_python=engine_python,
                                 gpu=gpu, extra_args=extra, timeout_s=timeout, relay=relay,
                                 cpu_cores=engine_cpu_cores())
    except lifecycle.PortBusy as exc:
        raise fail(str(exc), EXIT_USAGE) from None
    except lifecycle.EngineError as exc:
        raise fail(str(exc), EXIT_FAILED) from None
    limited = f" limited to {state.shape['cpu_cores']:g} CPU" if state.shape.get("cpu_cores") else ""
    out.print(f"engine up: {state.url} pid {state.pid} model {state.served_model_name}{limited} log {state.log_path}")


def _triton_up(port: int, timeout: float) -> None:
    try:
        state = triton_server.start(home_dir(), port=port, timeout_s=min(timeout, 300.0))
    except lifecycle.PortBusy as exc:
        raise fail(str(exc), EXIT_USAGE) from None
    except lifecycle.EngineError as exc:
        raise fail(str(exc), EXIT_FAILED) from None
    out.print(f"engine up: triton {state.url} grpc {state.urls['grpc']} metrics {state.urls['metrics']} "
              f"pid {state.pid} models {', '.join(state.shape['models'])} log {state.log_path}")


@engine_app.command("down")
def engine_down(port: Optional[int] = typer.Option(None, help="Port of the engine; default: all.")):
    """Stop the engine(s) and every process under them."""
    home = home_dir()
    ports = [port] if port is not None else [s.port for s in lifecycle.all_states(home)]
    stopped = [p for p in ports if lifecycle.stop(home, p)]
    out.print(f"engine down: stopped {', '.join(map(str, stopped))}" if stopped else "engine down: nothing was running")


@engine_app.command("status")
def engine_status():
    """Say which embedded engines run, with pid, URL, health and log."""
    from cancelwatch.collectors.families import family_of_state

    states = lifecycle.all_states(home_dir())
    if not states:
        out.print("no embedded engine is running (start one with: cancelwatch engine up)")
        raise typer.Exit(1)
    any_alive = False
    for s in states:
        alive = lifecycle.is_alive(s)
        any_alive |= alive
        health = "healthy" if alive and _healthy(s) else ("starting/unhealthy" if alive else "dead")
        extra = f" grpc {s.urls['grpc']} metrics {s.urls['metrics']}" if s.urls.get("grpc") else ""
        family = family_of_state(s)
        out.print(f"{family.name if family else s.kind} {s.url}{extra} pid {s.pid} {health} model {s.served_model_name} log {s.log_path}")
    raise typer.Exit(0 if any_alive else 1)


def _healthy(state: lifecycle.EngineState) -> bool:
    import httpx

    from cancelwatch.collectors.families import family_of_state

    # each launcher names its family's health check; a kind no launcher here owns is not judged healthy
    family = family_of_state(state)
    if family is None:
        return False
    path = family.launcher.HEALTH_PATH
    try:
        return httpx.get(state.url + path, timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False

