"""The `cancelwatch` command line. Settings are read here, at the edge, and passed down."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.live import Live
from rich.table import Table

from collectors import engine as engine_mod
from collectors.recorder import (
    EXIT_FAILED,
    EXIT_USAGE,
    PreflightError,
    RecordSettings,
    build_sources,
    parse_targets,
    record,
)
from runstore.reader import StoreError

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, no_args_is_help=True,
                  help="cancelwatch: does a cancelled LLM request really leave the engine?")
engine_app = typer.Typer(no_args_is_help=True, help="The embedded vLLM engine (real vLLM, CPU build).")
app.add_typer(engine_app, name="engine")

out = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 150)
err = Console(stderr=True, soft_wrap=True)
DEFAULT_STORE = Path("runs/cancelwatch.db")


def home_dir() -> Path:
    return Path(os.environ.get("CANCELWATCH_HOME", ".cancelwatch"))


def fail(message: str, code: int = EXIT_USAGE) -> typer.Exit:
    err.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    return typer.Exit(code)


# ---------------------------------------------------------------- engine
@engine_app.command("up")
def engine_up(
    port: int = typer.Option(8000, help="Port on 127.0.0.1."),
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
    shape = engine_mod.EngineShape(max_num_seqs=max_num_seqs, num_gpu_blocks=num_gpu_blocks or None, block_size=block_size)
    if gpu:
        shape.dtype, shape.gpu_memory_utilization, shape.max_num_batched_tokens = "auto", 0.9, None
    try:
        state = engine_mod.start(home_dir(), port=port, model=model, shape=shape, engine_python=engine_python,
                                 gpu=gpu, extra_args=extra, timeout_s=timeout, relay=relay)
    except engine_mod.PortBusy as exc:
        raise fail(str(exc), EXIT_USAGE) from None
    except engine_mod.EngineError as exc:
        raise fail(str(exc), EXIT_FAILED) from None
    out.print(f"engine up: {state.url} pid {state.pid} model {state.served_model_name} log {state.log_path}")


@engine_app.command("down")
def engine_down(port: Optional[int] = typer.Option(None, help="Port of the engine; default: all.")):
    """Stop the engine(s) and every process under them."""
    home = home_dir()
    ports = [port] if port is not None else [s.port for s in engine_mod.all_states(home)]
    stopped = [p for p in ports if engine_mod.stop(home, p)]
    out.print(f"engine down: stopped {', '.join(map(str, stopped))}" if stopped else "engine down: nothing was running")


@engine_app.command("status")
def engine_status():
    """Say which embedded engines run, with pid, URL, health and log."""
    states = engine_mod.all_states(home_dir())
    if not states:
        out.print("no embedded engine is running (start one with: cancelwatch engine up)")
        raise typer.Exit(1)
    any_alive = False
    for s in states:
        alive = engine_mod.is_alive(s)
        any_alive |= alive
        health = "healthy" if alive and _healthy(s.url) else ("starting/unhealthy" if alive else "dead")
        out.print(f"{s.url} pid {s.pid} {health} model {s.served_model_name} log {s.log_path}")
    raise typer.Exit(0 if any_alive else 1)


def _healthy(url: str) -> bool:
    import httpx

    try:
        return httpx.get(url + "/health", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


# ---------------------------------------------------------------- sampling
def _progress(run_id: int, sampler, started: float) -> Table:
    import time

    grid = Table.grid(padding=(0, 2))
    cells = [f"run {run_id}", f"{time.monotonic() - started:5.1f} s"]
    for st in sampler.stats.values():
        latest = {s.metric: s.value for s in sampler.latest.get((st.source, st.target), [])}
        if st.source == "vllm":
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


@app.command()
def sample(
    target: list[str] = typer.Option(..., help="vLLM server URL, or LABEL=URL; repeat for replicas."),
    hz: float = typer.Option(20.0, help="Samples per second per source."),
    duration: float = typer.Option(30.0, help="Seconds to sample; 0 runs until Ctrl-C."),
    nvml: str = typer.Option("auto", help="auto: only where a driver answers; on: required; off."),
    store: Path = typer.Option(DEFAULT_STORE, help="Run store (SQLite)."),
    name: Optional[str] = typer.Option(None, help="Run name."),
    pid: Optional[list[int]] = typer.Option(None, help="Engine pid(s) for process memory; default: the embedded engine's."),
    lost_after: float = typer.Option(10.0, help="Seconds a target may fail before the run ends as target_lost."),
):
    """Sample the scheduler and memory only; prints the run id. Ctrl-C ends the run as interrupted."""
    import time

    try:
        settings = RecordSettings(targets=parse_targets(target), store=store, hz=hz, duration_s=duration or None,
                                  nvml=nvml, name=name, pids=list(pid or []), lost_after_s=lost_after, home=home_dir())
        sources, facts = build_sources(settings)
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
    _print_store_error(result.stats)
    out.print(f"run {result.run_id} {result.status}: {result.stats['samples_written']} samples written "
              f"of {result.stats['samples_taken']} taken -> {store}")
    raise typer.Exit(result.exit_code)


def _print_store_error(stats: dict) -> None:
    if stats.get("store_error"):
        err.print(f"[bold red]error:[/] {stats['store_error']}", highlight=False)


def _print_summary(store: Path, run_id: int) -> None:
    from analysis.summary import key_figures, sampling_stats
    from runstore.reader import load_run

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


@app.command()
def summary(run: str = typer.Argument("latest"), store: Path = typer.Option(DEFAULT_STORE)):
    """Sampling stats and key figures of a run."""
    from runstore.reader import resolve_run_id

    try:
        _print_summary(store, resolve_run_id(store, run))
    except StoreError as exc:
        raise fail(str(exc)) from None


@app.command()
def runs(store: Path = typer.Option(DEFAULT_STORE)):
    """List the runs in a store."""
    from runstore.reader import list_runs

    try:
        df = list_runs(store)
    except StoreError as exc:
        raise fail(str(exc)) from None
    table = Table()
    for col in ("id", "name", "status", "started (UTC)", "duration s", "targets"):
        table.add_column(col)
    for r in df.itertuples(index=False):
        dur = "" if r.duration_s != r.duration_s else f"{r.duration_s:.1f}"
        table.add_row(str(r.id), r.name or "", r.status, r.started.strftime("%Y-%m-%d %H:%M:%S"), dur, r.targets)
    out.print(table)


@app.command()
def export(run: str = typer.Argument(...), parquet: Path = typer.Option(..., help="Directory to write into."),
           store: Path = typer.Option(DEFAULT_STORE)):
    """Write a run's tables as Parquet files."""
    from runstore.reader import load_run

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


@app.command()
def load(
    target: str = typer.Option("http://127.0.0.1:8000", help="OpenAI-compatible server URL."),
    streams: int = typer.Option(6, min=1, max=64),
    prompt_tokens: int = typer.Option(1450, min=1),
    max_tokens: int = typer.Option(50, min=1),
    delay: float = typer.Option(0.0, help="Seconds to wait before sending."),
    timeout: float = typer.Option(120.0),
):
    """Send a bounded burst of concurrent streaming completions (for demos and tests)."""
    import time

    import httpx

    from collectors.load import run_streams, served_model

    time.sleep(delay)
    try:
        model = served_model(target)
    except (httpx.HTTPError, KeyError, IndexError) as exc:
        raise fail(f"cannot list models at {target}/v1/models ({exc}): is the engine up?") from None
    results = asyncio.run(run_streams(target, model, streams, prompt_tokens, max_tokens, timeout))
    for r in results:
        status = r.error or "ok"
        out.print(f"stream {r.index}: {r.chunks} chunks, first after {r.first_chunk_s or float('nan'):.2f} s, "
                  f"done after {r.total_s:.2f} s {status}")
    if any(r.error for r in results):
        raise typer.Exit(EXIT_FAILED)


def _report_exit(doc: dict) -> int:
    verdicts = [c["verdict"] for c in doc["cancels"]]
    return 0 if doc["neighbours_ok"] and verdicts and all(v == "released" for v in verdicts) else EXIT_FAILED


def _print_report(doc: dict) -> None:
    colours = {"released": "green", "leaked": "red", "stale_gauge": "yellow", "inconclusive": "magenta"}
    table = Table(title=f"run {doc['run_id']} ({doc['status']}): cancels")
    for col in ("scenario", "request", "phase", "verdict", "stop->app ms", "app->abort ms", "abort->left ms",
                "left->reusable ms", "why"):
        table.add_column(col)
    for c in doc["cancels"]:
        lat = list(c["latencies_ms"].values())
        fmt = ["" if x is None else f"{x:.0f}" for x in lat]
        why = c["evidence"].get("why") or c["evidence"].get("race") or ""
        table.add_row(c["scenario"], c["request_id"][-8:], c["phase_at_cancel"],
                      f"[{colours.get(c['verdict'], 'white')}]{c['verdict']}[/]", *fmt, why)
    out.print(table)
    out.print(f"neighbours ok: {doc['neighbours_ok']}")


@app.command("record")
def record_cmd(
    target: str = typer.Option(..., help="OpenAI-compatible server the scenarios talk to (engine, gateway or proxy)."),
    metrics_url: Optional[str] = typer.Option(None, help="vLLM whose /metrics is sampled; default: --target."),
    scenario: str = typer.Option("default", help="Suite, built-in scenario name, or a TOML file."),
    hz: float = typer.Option(20.0),
    nvml: str = typer.Option("auto"),
    store: Path = typer.Option(DEFAULT_STORE),
    name: Optional[str] = typer.Option(None),
    pid: Optional[list[int]] = typer.Option(None),
    lost_after: float = typer.Option(10.0),
    grace: float = typer.Option(2.0, help="Seconds the scheduler has to reconcile after an abort."),
    relay_url: Optional[str] = typer.Option(None, help="Relay app for in-process scenarios (inproc); default: start one."),
):
    """Run scripted cancels while sampling; one run holds samples, ledger and events. Prints the report."""
    import httpx

    from analysis.verdicts import report_document
    from collectors.driver import Driver
    from collectors.load import served_model
    from collectors.process_memory import ProcessMemorySource
    from collectors.vllm_metrics import VllmMetricsSource
    from collectors.recorder import scheduler_reader
    from collectors.scenarios import ScenarioError, resolve
    from runstore.reader import load_run

    try:
        scenarios = resolve(scenario)
    except ScenarioError as exc:
        raise fail(str(exc)) from None
    try:
        targets = parse_targets([metrics_url or target])
        parse_targets([target])
        model = served_model(target)
    except PreflightError as exc:
        raise fail(str(exc)) from None
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        raise fail(f"cannot list models at {target}/v1/models ({type(exc).__name__}): start the engine "
                   "(cancelwatch engine up) or fix --target") from None
    relay_state: dict = {}
    try:
        settings = RecordSettings(targets=targets, store=store, hz=hz, duration_s=None, nvml=nvml, name=name,
                                  pids=list(pid or []), lost_after_s=lost_after, home=home_dir(),
                                  extra={"driven_target": target, "scenarios": [s.name for s in scenarios],
                                         "grace_s": grace, "model": model, "relay_url": relay_url})
        sources, facts = build_sources(settings)

        def driver_factory(writer, sampler):
            async def start_relay():
                # the in-process scenarios need an app that owns an AsyncLLM: cancelwatch's relay app,
                # started only now (an idle second engine would cost CPU through the whole run)
                url = relay_url
                if url is None:
                    state = await asyncio.to_thread(engine_mod.start, home_dir(), engine_mod.free_port(), relay=True)
                    relay_state["state"] = state
                    url = state.url
                    proc = ProcessMemorySource([state.pid], target="relay")
                    sampler.add_source(proc)
                    relay_state["sources"] = [proc]
                src = VllmMetricsSource(url, "relay", critical=False)
                sampler.add_source(src)
                relay_state.setdefault("sources", []).append(src)
                all_targets = [*({"label": t.label, "url": t.url} for t in targets), {"label": "relay", "url": url}]
                writer.set_run_json("targets", all_targets)
                return Driver(url, await asyncio.to_thread(served_model, url), writer.put,
                              scheduler_reader(sampler, "relay"), grace_s=grace, metrics_target="relay")

            async def stop_relay():
                for src in relay_state.get("sources", []):
                    await asyncio.to_thread(sampler.remove_source, src)
                if "state" in relay_state:
                    await asyncio.to_thread(engine_mod.stop, home_dir(), relay_state["state"].port)

            return Driver(target, model, writer.put, scheduler_reader(sampler, targets[0].label), grace_s=grace,
                          metrics_target=targets[0].label, relay_factory=start_relay,
                          relay_cleanup=stop_relay).run(scenarios)

        result = record(settings, sources, facts, driver_factory=driver_factory)
    except PreflightError as exc:
        raise fail(str(exc)) from None
    except engine_mod.EngineError as exc:
        raise fail(f"could not start the relay app for in-process scenarios: {exc}", EXIT_FAILED) from None
    except StoreError as exc:
        raise fail(str(exc)) from None
    finally:
        if "state" in relay_state:  # also after Ctrl-C or a lost target
            engine_mod.stop(home_dir(), relay_state["state"].port)
    doc = report_document(load_run(store, result.run_id), grace)
    _print_report(doc)
    _print_store_error(result.stats)
    out.print(f"run {result.run_id} {result.status} -> {store}")
    raise typer.Exit(result.exit_code if result.exit_code else _report_exit(doc))


def _check_html_folder(html_out: Path) -> None:
    """Before any work: an --html file whose folder is missing is a usage error."""
    if not html_out.parent.is_dir():
        raise fail(f"--html {html_out}: the folder {html_out.parent} does not exist; create it or write elsewhere")


@app.command()
def report(run: str = typer.Argument("latest"), store: Path = typer.Option(DEFAULT_STORE),
           as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
           grace: Optional[float] = typer.Option(None, help="Grace window in s; default: the run's own."),
           html_out: Optional[Path] = typer.Option(None, "--html", help="Also write a self-contained HTML report "
                                                   "(the dashboard's figures, opens offline) to this file."),
           context_len: int = typer.Option(2048, help="Context length (tokens) for the capacity figures of --html.")):
    """The per-cancel table (verdicts with evidence) of a recorded run."""
    import json

    from analysis.verdicts import judge_run, report_document
    from runstore.reader import load_run

    if html_out is not None:
        _check_html_folder(html_out)
    if context_len <= 0:
        raise fail(f"--context-len {context_len}: give a positive number of tokens, e.g. --context-len 2048")
    try:
        r = load_run(store, run)
    except StoreError as exc:
        raise fail(str(exc)) from None
    verdicts = judge_run(r, grace)  # without --grace, the run's own
    doc = report_document(r, verdicts=verdicts)
    if html_out is not None:
        from analysis.html_report import report_html

        try:
            html_out.write_text(report_html(r, verdicts, context_len=context_len))
        except OSError as exc:
            raise fail(f"cannot write {html_out} ({exc.strerror}): choose a writable path for --html") from None
        print(f"wrote {html_out}", file=sys.stderr)
    if as_json:
        print(json.dumps(doc, indent=1, default=str))
    else:
        _print_report(doc)
    raise typer.Exit(_report_exit(doc))


@app.command()
def notebook(name: str = typer.Argument(..., help="capacity_review or vram_plateau (notebooks/NAME.ipynb)."),
             run: List[str] = typer.Option(["latest"], "--run", help="Run id or 'latest'; repeat for several runs."),
             store: Path = typer.Option(DEFAULT_STORE, help="Run store (SQLite)."),
             param: List[str] = typer.Option([], "-p", "--param", help="Another notebook parameter as KEY=VALUE: "
                                             "-p context_len=4096"),
             html_out: Path = typer.Option(..., "--html", help="Where to write the rendered HTML (no code cells)."),
             ipynb_out: Optional[Path] = typer.Option(None, "--ipynb", help="Also keep the executed notebook.")):
    """Execute a notebook on runs with papermill and render it to HTML (plotly embedded, opens offline)."""
    import papermill as pm

    from notebooks.render import NOTEBOOKS, NotebookError, available, coerce, render

    if name not in available():
        raise fail(f"no notebook {name!r}: choose one of {', '.join(available())}")
    _check_html_folder(html_out)
    known = set(pm.inspect_notebook(str(NOTEBOOKS / f"{name}.ipynb")))
    params: dict = {"store": str(store)}
    if "run_ids" in known:
        params["run_ids"] = ",".join(run)
    elif len(run) > 1:
        raise fail(f"{name} walks through one run: give --run once")
    else:
        params["run"] = run[0]
    for item in param:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise fail(f"-p {item}: write KEY=VALUE, e.g. -p context_len=4096")
        if key not in known:
            raise fail(f"-p {key}: {name} has no such parameter; it takes {', '.join(sorted(known))}")
        params[key] = coerce(value)
    try:
        render(name, params, html_out, ipynb_out)
    except NotebookError as exc:
        err.print(f"[bold red]error:[/] {exc} (the error cell is in {html_out})", highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None
    print(f"wrote {html_out}", file=sys.stderr)


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
