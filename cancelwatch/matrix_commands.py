"""`cancelwatch matrix`: the same cancels direct and through each gateway installed here, with a tap in front
of the gateway and one in front of the engine; the matrix as Markdown and as one HTML page."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
import subprocess
import sys
from pathlib import Path
from typing import Optional

import typer

from cancelwatch.console import fail, home_dir, out
from cancelwatch.runstore.errors import StoreError

MATRIX_SCENARIOS = "disconnect,chat,nonstream_timeout"  # stream, chat stream, a non-streaming client timeout
ENGINE_HOP = "engine"  # the tap in front of the engine
RELAY_SERVES_NOT = {"chat"}  # the scenarios the relay app has no route for (it serves /v1/completions)


def matrix(
    gateway: Optional[list[str]] = typer.Option(None, help="Gateway configurations to run (repeatable; default: "
                                                "every one installed here). Known: nginx, nginx-ignore-abort, haproxy, "
                                                "haproxy-abortonclose, caddy, apache, envoy, traefik, litellm, "
                                                "vllm-router; apps: app-fastapi, app-base-http-middleware, "
                                                "app-pure-asgi-middleware, app-background-task; vLLM's own server with a --middleware: "
                                                "vllm-middleware-class, vllm-middleware-function; cancelwatch's relay app: "
                                                "cancelwatch-relay."),
    target: Optional[str] = typer.Option(None, help="A vLLM you run (started with --enable-log-requests; give its "
                                         "log with --engine-log); default: the embedded engine, started for the "
                                         "matrix and stopped after."),
    engine_log: Optional[Path] = typer.Option(None, help="The log of --target's engine."),
    out_dir: Path = typer.Option(Path("docs"), "--out", help="Where matrix.md and matrix.html are written."),
    store: Path = typer.Option(Path("runs/matrix.db"), help="The run store the matrix's runs go to."),
    scenario: str = typer.Option(MATRIX_SCENARIOS, help="The scenarios each configuration runs."),
):
    """The gateway matrix: does each gateway pass a client's cancel on to the engine, and how fast?"""
    from cancelwatch.analysis.matrix import DIRECT, Row, matrix_html, matrix_markdown, matrix_row
    from cancelwatch.collectors.engines import gateways as gw_mod
    from cancelwatch.collectors.engines import lifecycle
    from cancelwatch.collectors.engines import vllm_server as engine_mod
    from cancelwatch.runstore.reader import load_run

    chosen = _chosen(gw_mod, gateway)
    engine_state = None
    rows: list[Row] = []
    command = "cancelwatch matrix" + "".join(f" --gateway {g.name}" for g in chosen if gateway)
    try:
        if target is None:
            out.print("starting the embedded engine for the matrix ...")
            try:
                engine_state = engine_mod.start(home_dir(), lifecycle.free_port())
            except lifecycle.EngineError as exc:
                raise fail(f"cannot start the embedded engine: {exc}") from None
            target, engine_desc = engine_state.url, f"the embedded engine ({engine_mod.KIND}, {engine_state.model})"
        else:
            engine_desc = f"the vLLM at {target}"
        target = target.rstrip("/")
        for g in [None, *chosen]:
            name = DIRECT if g is None else g.name
            out.print(f"matrix: {name} ...")
            run_id, running = _record_row(g, gw_mod, target, engine_log, store, scenario, lifecycle.free_port)
            run = load_run(store, run_id)
            hop = None if g is None else g.name
            rows.append(matrix_row(run, name=name, product="-" if g is None else g.product,
                                   version="-" if running is None else running.version,
                                   setting="no gateway" if g is None else g.setting,
                                   config="" if running is None else running.config_text, hop=hop,
                                   scenarios=[s.strip() for s in scenario.split(",") if s.strip()]))
    except StoreError as exc:
        raise fail(str(exc)) from None
    finally:
        if engine_state is not None:
            lifecycle.stop(home_dir(), engine_state.port)
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    out_dir.mkdir(parents=True, exist_ok=True)
    md = matrix_markdown(rows, command=command, engine=engine_desc, when=when)
    (out_dir / "matrix.md").write_text(md)
    (out_dir / "matrix.html").write_text(matrix_html(rows, command=command, engine=engine_desc, when=when))
    out.print(md, markup=False, highlight=False)
    out.print(f"matrix written to {out_dir / 'matrix.md'} and {out_dir / 'matrix.html'}")


def _chosen(gw_mod, names: list[str] | None) -> list:
    """The gateways asked for (each known and installed: one line and exit 2 otherwise), else every one here."""
    if not names:
        found = gw_mod.installed()
        if not found:
            raise fail("no gateway is installed here: apt-get install nginx haproxy (make test does), or "
                       "`make matrix` for the rest")
        return found
    picked = []
    for name in (n.strip() for given in names for n in given.split(",") if n.strip()):
        g = gw_mod.GATEWAYS.get(name)
        if g is None:
            raise fail(f"--gateway {name!r} is not one the matrix knows: use one of {', '.join(gw_mod.GATEWAYS)}")
        if g.binary() is None:
            raise fail(f"--gateway {name}: {g.product} is not installed here: {g.install}")
        picked.append(g)
    return picked


def _record_row(g, gw_mod, target: str, engine_log: Path | None, store: Path, scenario: str, free_port):
    """One configuration's run: its gateway started (and stopped), `cancelwatch record` through the taps.
    Returns (run id, the running gateway or None)."""
    if g is not None and g.engine:
        return _record_engine_row(g, store, scenario, free_port)
    tap_engine = free_port()
    hops = []
    running = None
    if g is not None:
        tap_gw, gw_port = free_port(), free_port()
        try:
            running = gw_mod.start(g, home_dir() / "matrix" / g.name, gw_port, tap_engine)
        except gw_mod.GatewayError as exc:
            raise fail(str(exc)) from None
        hops.append(f"{g.name}=127.0.0.1:{tap_gw},http://127.0.0.1:{gw_port}")
        client_url = f"http://127.0.0.1:{tap_gw}"
    else:
        client_url = f"http://127.0.0.1:{tap_engine}"
    hops.append(f"{ENGINE_HOP}=127.0.0.1:{tap_engine},{target}")
    args = [sys.executable, "-m", "cancelwatch", "record", "--target", client_url, "--metrics-url", target,
            "--scenario", scenario, "--store", str(store), "--name", f"matrix {g.name if g else 'direct'}"]
    args += [a for h in hops for a in ("--hop", h)]
    if engine_log is not None:
        args += ["--engine-log", str(engine_log)]
    try:
        return _recorded(args, store, g.name if g else "no gateway"), running
    finally:
        if running is not None:
            gw_mod.stop(running)


def _recorded(args: list[str], store: Path, through: str) -> int:
    """`cancelwatch record` as `args` say: the id of the run it wrote; one line and exit 2 where it failed."""
    done = subprocess.run(args, capture_output=True, text=True, env=dict(os.environ))
    if done.returncode not in (0, 1):  # 1: a cancel not released, which is what a matrix is for
        last = (done.stderr.strip() or done.stdout.strip()).splitlines()[-1:] or ["no output"]
        raise fail(f"recording through {through} failed: {last[0][:300]}")
    from cancelwatch.runstore.reader import list_runs

    return int(list_runs(store)["id"].max())


@dataclass
class _EngineRow:
    """What an engine row keeps of what ran, as a started gateway's Running does."""

    version: str
    config_text: str


def _record_engine_row(g, store: Path, scenario: str, free_port):
    """A row that is an engine of its own (vLLM's API server with a --middleware): started on the embedded engine's
    model with the row's files importable, `cancelwatch record` through a tap in front of it, stopped after."""
    from cancelwatch.collectors.engines import lifecycle
    from cancelwatch.collectors.engines import vllm_server as engine_mod

    work = (home_dir() / "matrix" / g.name).resolve()
    work.mkdir(parents=True, exist_ok=True)
    cfg = g.config(work, 0, 0)
    for name, text in cfg.files.items():
        (work / name).write_text(text)
    try:
        state = engine_mod.start(home_dir(), free_port(), extra_args=cfg.argv, pythonpath=work, relay=g.relay)
    except lifecycle.EngineError as exc:
        raise fail(f"{g.name} did not start: {exc}") from None
    tap = free_port()
    if g.relay:  # the relay app serves completions only: its row has no cell of a chat scenario
        scenario = ",".join(s for s in scenario.split(",") if s.strip() not in RELAY_SERVES_NOT) or scenario
    args = [sys.executable, "-m", "cancelwatch", "record", "--target", f"http://127.0.0.1:{tap}", "--metrics-url",
            state.url, "--scenario", scenario, "--store", str(store), "--name", f"matrix {g.name}",
            "--hop", f"{g.name}=127.0.0.1:{tap},{state.url}"]
    try:
        run_id = _recorded(args, store, g.name)
    finally:
        lifecycle.stop(home_dir(), state.port)
    # what ran: the middleware's source and the flags the server was started with (the relay: its command)
    ran = "\n".join(cfg.files.values()) + f"\n# {' '.join(state.command[1:] if g.relay else ['vllm serve ...', *cfg.argv])}\n"
    return run_id, _EngineRow(g.version(g.binary()), ran)

