"""`cancelwatch import prometheus`: history from a Prometheus that already scrapes the fleet, as a run."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import typer

from cancelwatch.console import DEFAULT_STORE, fail, out

import_app = typer.Typer(no_args_is_help=True, help="Import history from systems that already hold it.")


@import_app.command("prometheus")
def import_prometheus(
    url: str = typer.Option(..., help="The Prometheus server, e.g. http://127.0.0.1:9090."),
    start: str = typer.Option(..., help="now-2h, 2026-11-30T09:00:00Z or epoch seconds."),
    end: str = typer.Option("now", help="As --start."),
    step: str = typer.Option("15s", help="Resolution of the range queries (15s, 1m, ...)."),
    match: str = typer.Option("", help="Label matchers for the vLLM series, e.g. '{job=\"vllm\"}'."),
    gpu_match: str = typer.Option("", help="Label matchers for the DCGM exporter's series."),
    store: Path = typer.Option(DEFAULT_STORE),
    name: Optional[str] = typer.Option(None),
):
    """Range queries over the window -> one run: vLLM series per replica, GPU memory per GPU and host."""
    from rich.progress import Progress

    from cancelwatch.collectors.recording.prometheus_import import ImportSettings, import_prometheus as run_import
    from cancelwatch.collectors.recording.session import PreflightError
    from cancelwatch.collectors.sources.prometheus_api import parse_duration, parse_time
    from cancelwatch.runstore.errors import StoreError

    now = time.time()
    try:
        settings = ImportSettings(url=url, start_s=parse_time(start, now), end_s=parse_time(end, now),
                                  step_s=parse_duration(step), match=match, gpu_match=gpu_match, store=store,
                                  name=name)
    except ValueError as exc:
        raise fail(str(exc)) from None
    try:
        with Progress(transient=True, console=out) as progress:
            task = progress.add_task("querying Prometheus", total=None)
            rid, stats = run_import(settings, on_chunk=lambda done, total: progress.update(task, completed=done,
                                                                                            total=total))
    except PreflightError as exc:
        raise fail(str(exc)) from None
    except StoreError as exc:
        raise fail(str(exc)) from None
    out.print(f"run {rid} imported -> {store}: {len(stats['replicas'])} replica(s) {', '.join(stats['replicas'])}, "
              f"{stats['steps']} steps, {stats['samples_written']} samples, {stats['gaps']} gap(s)"
              + (f", GPU hosts {', '.join(stats['gpu_hosts'])}" if stats["gpu_hosts"] else ""))
