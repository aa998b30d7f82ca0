"""What every command shares: where output goes, how a usage error ends, the default store and home."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import typer
from rich.console import Console

from cancelwatch.collectors.recording.session import EXIT_USAGE

out = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 150)
err = Console(stderr=True, soft_wrap=True)
DEFAULT_STORE = Path("runs/cancelwatch.db")
ENGINE_LOG_HELP = ("The log of an engine you run yourself (vLLM with --enable-log-requests), followed for its "
                   "per-request lines; the embedded engine's is read on its own.")
ENGINE_LOG_TZ_HELP = ("The time zone the engine log's stamps are in (an IANA name, e.g. UTC for an engine in a "
                      "container), when it is not this machine's; without it the run finds the log's offset itself.")


def engine_log_zone(name: str | None) -> str | None:
    """--engine-log-tz checked before anything is recorded (one line naming the fix), passed on as given."""
    from cancelwatch.collectors.sources.engine_log import log_zone

    try:
        log_zone(name)
    except ValueError as exc:
        raise fail(str(exc)) from None
    return name


def home_dir() -> Path:
    """Engine state, logs and the tiny model: $CANCELWATCH_HOME, else ./.cancelwatch."""
    return Path(os.environ.get("CANCELWATCH_HOME", ".cancelwatch"))


# a CPU-time quota for the embedded vLLM, in cores (e.g. 0.4): a slow engine on demand, for tests and demos
ENGINE_CPUS_ENV = "CANCELWATCH_ENGINE_CPUS"


def engine_cpu_cores() -> float | None:
    """$CANCELWATCH_ENGINE_CPUS in cores, else None (the engine runs at the machine's speed)."""
    from cancelwatch.collectors.engines.cpu_limit import CpuLimitError, parse_cores

    text = os.environ.get(ENGINE_CPUS_ENV, "").strip()
    try:
        return parse_cores(text) if text else None
    except CpuLimitError as exc:
        raise fail(f"{ENGINE_CPUS_ENV}={exc}") from None


def fail(message: str, code: int = EXIT_USAGE) -> typer.Exit:
    """One red line on stderr naming the fix; raise what it returns. The message is text, never markup: a path, an
    option's value or `pip install 'cancelwatch[triton]'` keeps its brackets."""
    from rich.markup import escape

    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    return typer.Exit(code)


def model_listing_error(target: str, exc: Exception, key_var: str | None) -> str:
    """The one line for a target whose /v1/models could not be listed: a key it wants or refused, or no engine."""
    import httpx

    if isinstance(exc, httpx.HTTPStatusError):
        code = exc.response.status_code
        if code in (401, 403):
            said = f"the key in {key_var} was refused" if key_var else "it wants an API key"
            return (f"{target}/v1/models answered HTTP {code}: {said}; export VLLM_API_KEY "
                    "(or name the variable that holds the key with --api-key-env VAR)")
        return (f"cannot list models at {target}/v1/models (HTTP {code}): start the engine "
                "(cancelwatch engine up) or fix --target")
    return (f"cannot list models at {target}/v1/models ({type(exc).__name__}): start the engine "
            "(cancelwatch engine up) or fix --target")


def print_store_error(stats: dict) -> None:
    if stats.get("store_error"):
        from rich.markup import escape

        err.print(f"[bold red]error:[/] {escape(str(stats['store_error']))}", highlight=False)

