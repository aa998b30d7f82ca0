"""What every command shares: where output goes, how a usage error ends, the default store and home."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import typer
from rich.console import Console

from collectors.recording.session import EXIT_USAGE

out = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 150)
err = Console(stderr=True, soft_wrap=True)
DEFAULT_STORE = Path("runs/cancelwatch.db")
ENGINE_LOG_HELP = ("The log of an engine you run yourself (vLLM with --enable-log-requests), followed for its "
                   "per-request lines; the embedded engine's is read on its own.")


def home_dir() -> Path:
    """Engine state, logs and the tiny model: $CANCELWATCH_HOME, else ./.cancelwatch."""
    return Path(os.environ.get("CANCELWATCH_HOME", ".cancelwatch"))


def fail(message: str, code: int = EXIT_USAGE) -> typer.Exit:
    """One red line on stderr naming the fix; raise what it returns."""
    err.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    return typer.Exit(code)


def print_store_error(stats: dict) -> None:
    if stats.get("store_error"):
        err.print(f"[bold red]error:[/] {stats['store_error']}", highlight=False)

