"""`cancelwatch sample|summary|runs|export|load`: sampling without cancels, and what a store holds."""

from __future__ import annotations

import asyncio
import math
import threading
from pathlib import Path
from typing import Optional

import typer
from rich.live import Live
from rich.table import Table

from cancelwatch.console import (
    DEFAULT_STORE,
    ENGINE_LOG_HELP,
    ENGINE_LOG_TZ_HELP,
    engine_log_zone,
    err,
    fail,
    home_dir,
    model_listing_error,
    out,
    print_store_error,
)
from cancelwatch.collectors.recording.session import (
    EXIT_FAILED,
    PreflightError,
    RecordSettings,
    parse_targets,
    record,
)
from cancelwatch.collectors.sources.credentials import strip_userinfo
from cancelwatch.collectors.sources.vllm import SCRAPE_JOB
from cancelwatch.collectors.sources.vllm import SOURCE_NAME as VLLM_SOURCE
from cancelwatch.runstore.errors import StoreError


def _progress(run_id: int, sampler, started: float) -> Table:
    import time

    grid = Table.grid(padding=(0, 2))
    cells = [f"run {run_id}", f"{time.monotonic() - started:5.1f} s"]
    for st in sampler.stats.values():
        latest = {s.metric: s.value for s in sampler.latest.get((st.source, st.target), [])}
        if st.source == VLLM_SOURCE:
            extra = (f"running {latest.get('requests_running', float('nan')):.0f} "
                     f"waiting {latest.get('requests_waiting', float('nan')):.0f} "
                     f"kv {latest.get('kv_cache_usage_ratio', float('nan')):.2f}")
        elif st.source == "process":
            extra = f"rss {latest.get('engine_rss_bytes', float('nan')) / 2**20:.0f} MiB"
        else:
            extra = ""
        bad = st.scrape_errors + st.parse_errors
        cells.append(f"{st.source}/{st.target}: {st.scrapes_ok} ok {bad} failed {extra}")
    grid.add_row(*cells)
    return grid


def sample(
    target: Optional[list[str]] = typer.Option(None, help="vLLM server URL, or LABEL=URL; repeat for replicas."),
    prometheus: Optional[str] = typer.Option(None, help="A Prometheus whose active targets of --job are the "
                                             "replicas to sample (each labelled by its instance)."),
    job: Optional[str] = typer.Option(None, help=f"With --prometheus: the scrape job of the replicas (default {SCRAPE_JOB})."),
    hz: float = typer.Option(20.0, help="Samples per second per source."),
    duration: float = typer.Option(30.0, help="Seconds to sample; 0 runs until Ctrl-C."),
    nvml: str = typer.Option("auto", help="auto: only where a driver answers; on: required; off."),
    store: Path = typer.Option(DEFAULT_STORE, help="Run store (SQLite)."),
    name: Optional[str] = typer.Option(None, help="Run name."),
    pid: Optional[list[int]] = typer.Option(None, help="Engine pid(s) for process memory; default: the embedded engine's."),
    lost_after: float = typer.Option(10.0, help="Seconds a target may fail before the run ends as target_lost."),
    engine_log: Optional[Path] = typer.Option(None, help=ENGINE_LOG_HELP),
    engine_log_tz: Optional[str] = typer.Option(None, help=ENGINE_LOG_TZ_HELP),
):
    """Sample the scheduler and memory only; prints the run id. Ctrl-C ends the run as interrupted."""
    import time

    from cancelwatch.collectors.families import discovered_family, family_for_target, refused_command
    from cancelwatch.collectors.recording.session import discover_targets, split_label

    # every target's family samples (today: vLLM's); one that does not is refused before anything is read
    families = [family_for_target(split_label(v)[1]) for v in target or []]
    refused = next((r for r in (refused_command(f, "sample") for f in families) if r), None)
    if refused or (job is not None and prometheus is None):
        raise fail(refused or "--job works only with --prometheus: add --prometheus, or leave --job out")
    job = job or SCRAPE_JOB
    engine_log_zone(engine_log_tz)  # before anything is read, as record and canary check it
    family = families[0] if families else discovered_family()
    try:
        if not target and not prometheus:
            raise PreflightError("no --target given: pass the vLLM server's URL, or --prometheus URL --job NAME "
                                 "to sample the replicas Prometheus scrapes")
        found = discover_targets(prometheus, job) if prometheus else []
        settings = RecordSettings(targets=parse_targets([*(target or []), *found]), store=store, hz=hz, duration_s=duration or None,
                                  nvml=nvml, name=name, pids=list(pid or []), lost_after_s=lost_after, home=home_dir(),
                                  engine_log=engine_log, engine_log_tz=engine_log_tz)
        sources, facts = family.sources(settings)
        if prometheus:
            facts["discovery"] = {"prometheus": strip_userinfo(prometheus), "job": job, "found": found}
    except PreflightError as exc:
        raise fail(str(exc)) from None
    started = time.monotonic()
    live = Live(console=err, refresh_per_second=4, transient=True) if err.is_terminal else None

    def on_tick(run_id, sampler):
        if live is not None:
            live.update(_progress(run_id, sampler, started))

    try:
        if live is not None:
            live.start()
        result = record(settings, sources, facts, stop=threading.Event(), on_tick=on_tick)
    except StoreError as exc:
        raise fail(str(exc)) from None
    finally:
        if live is not None:
            live.stop()
    _print_summary(store, result.run_id)
    print_store_error(result.stats)
    out.print(f"run {result.run_id} {result.status}: {result.stats['samples_written']} samples written "
              f"of {result.stats['samples_taken']} taken -> {store}")
    raise typer.Exit(result.exit_code)


def _print_summary(store: Path, run_id: int) -> None:
    from cancelwatch.analysis.summary import key_figures, sampling_stats
    from cancelwatch.runstore.reader import load_run

    run = load_run(store, run_id)
    table = Table(title=f"run {run_id} ({run.info['status']})")
    for col in ("source", "target", "ok", "failed", "Hz", "p50 ms", "p99 ms", "gaps"):
        table.add_column(col)
    for row in sampling_stats(run).itertuples(index=False):
        table.add_row(row.source, row.target, str(row.scrapes_ok), str(row.scrapes_failed), f"{row.effective_hz:.1f}",
                      f"{row.scrape_p50_ms:.1f}", f"{row.scrape_p99_ms:.1f}", str(row.gaps))
    out.print(table)
    for metric, fig in key_figures(run).items():
        scale = 2**20 if metric.endswith("_bytes") else 1
        unit = " MiB" if scale > 1 else ""
        out.print(f"{metric}: max {fig['max'] / scale:.2f}{unit}  min {fig['min'] / scale:.2f}{unit}  last {fig['last'] / scale:.2f}{unit}")


def summary(run: str = typer.Argument("latest"), store: Path = typer.Option(DEFAULT_STORE)):
    """Sampling stats and key figures of a run."""
    from cancelwatch.runstore.reader import resolve_run_id

    try:
        _print_summary(store, resolve_run_id(store, run))
    except StoreError as exc:
        raise fail(str(exc)) from None


def runs(store: Path = typer.Option(DEFAULT_STORE)):
    """List the runs in a store."""
    from cancelwatch.runstore.reader import list_runs

    try:
        df = list_runs(store)
    except StoreError as exc:
        raise fail(str(exc)) from None
    table = Table()
    for col in ("id", "name", "status", "started (UTC)", "duration s", "targets"):
        table.add_column(col)
    for r in df.itertuples(index=False):
        dur = "" if math.isnan(r.duration_s) else f"{r.duration_s:.1f}"
        table.add_row(str(r.id), r.name or "", r.status, r.started.strftime("%Y-%m-%d %H:%M:%S"), dur, r.targets)
    out.print(table)


def export(run: str = typer.Argument(...), parquet: Path = typer.Option(..., help="Directory to write into."),
           store: Path = typer.Option(DEFAULT_STORE)):
    """Write a run's tables as Parquet files."""
    from cancelwatch.runstore.reader import load_run

    try:
        r = load_run(store, run)
    except StoreError as exc:
        raise fail(str(exc)) from None
    try:
        parquet.mkdir(parents=True, exist_ok=True)
        for table in ("samples", "scrapes", "gaps", "events", "ledger"):
            getattr(r, table).to_parquet(parquet / f"run{r.id}_{table}.parquet", index=False)
    except OSError as exc:
        raise fail(f"cannot write Parquet into {parquet} ({exc}): choose a writable --parquet directory") from None
    out.print(f"run {r.id} -> {parquet}")


def load(
    target: str = typer.Option("http://127.0.0.1:8000", help="OpenAI-compatible server URL."),
    streams: int = typer.Option(6, min=1, max=64),
    prompt_tokens: int = typer.Option(1450, min=1),
    max_tokens: int = typer.Option(50, min=1),
    delay: float = typer.Option(0.0, help="Seconds to wait before sending."),
    timeout: float = typer.Option(120.0),
    api_key_env: Optional[str] = typer.Option(None, help="Environment variable holding the API key of an engine "
                                              "started with --api-key (default: VLLM_API_KEY, then OPENAI_API_KEY)."),
):
    """Send a bounded burst of concurrent streaming completions (for demos and tests)."""
    import time

    import httpx

    from cancelwatch.collectors.cancels.load import run_streams, served_model
    from cancelwatch.collectors.sources.credentials import CredentialError, api_key, auth_headers, split_userinfo

    try:
        target, basic = split_userinfo(target)  # user:password@ is sent as Basic, never printed
    except CredentialError as exc:
        raise fail(f"--target: {exc}") from None
    try:
        key, key_var = api_key(api_key_env)
    except CredentialError as exc:
        raise fail(str(exc)) from None
    auth = auth_headers(key, basic)
    time.sleep(delay)
    try:
        model = served_model(target, auth=auth)
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        raise fail(model_listing_error(target, exc, key_var)) from None
    results = asyncio.run(run_streams(target, model, streams, prompt_tokens, max_tokens, timeout, headers=auth))
    for r in results:
        status = r.error or "ok"
        out.print(f"stream {r.index}: {r.chunks} chunks, first after {r.first_chunk_s or float('nan'):.2f} s, "
                  f"done after {r.total_s:.2f} s {status}")
    if any(r.error for r in results):
        raise typer.Exit(EXIT_FAILED)

