"""`cancelwatch canary`: a small scenario set against a live endpoint every so often, each round a run
(the last --keep kept), and the verdicts as Prometheus metrics a fleet can alert on."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path
from typing import Optional

import typer

from cancelwatch.console import DEFAULT_STORE, ENGINE_LOG_TZ_HELP, engine_log_zone, err, fail, home_dir, out

BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0)
MAX_ROUND_S = 600.0  # one round's scenarios, bounded


class CanaryMetrics:
    """The canary's own registry, served on --listen."""

    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        self.cancels = Counter("cancelwatch_cancels", "Cancels judged, by scenario and verdict",
                               ["scenario", "verdict"], registry=self.registry)
        self.release = Histogram("cancelwatch_cancel_release_seconds", "User stop to left scheduler, released cancels",
                                 buckets=BUCKETS, registry=self.registry)
        self.ttft = Histogram("cancelwatch_probe_ttft_seconds", "The probe's time to first token after a cancel",
                              buckets=BUCKETS, registry=self.registry)
        self.last_round = Gauge("cancelwatch_last_round_timestamp_seconds", "When the last round ended (Unix time)",
                                registry=self.registry)
        self.errors = Counter("cancelwatch_round_errors", "Rounds that failed (target down, a store error)",
                              registry=self.registry)
        self.rounds = Counter("cancelwatch_rounds", "Rounds run, failed ones included", registry=self.registry)

    def observe(self, verdicts, run) -> None:
        for v in verdicts:
            self.cancels.labels(scenario=v.scenario, verdict=v.verdict).inc()
            lat = v.latency_ms("user_stop", "left_scheduler")
            if v.verdict == "released" and lat is not None:
                self.release.observe(lat / 1000.0)
        ledger = run.ledger
        if not ledger.empty:
            probes = ledger[(ledger["role"] == "probe") & ledger["first_token_mono_ns"].notna()]
            for sent, first in zip(probes["sent_mono_ns"], probes["first_token_mono_ns"]):
                self.ttft.observe((first - sent) / 1e9)


def one_round(family, target: str, scenarios, store: Path, hz: float, grace: float, name: str,
              metrics_url: str | None = None, engine_log: Path | None = None, auth: dict | None = None,
              engine_log_tz: str | None = None):
    """Record the scenarios once against `target`, of `family` (collectors/families.py); (run id, verdicts,
    exit status of the recording)."""
    from cancelwatch.analysis.verdicts import judge_run
    from cancelwatch.collectors.cancels.load import served_model
    from cancelwatch.collectors.recording.session import RecordSettings, parse_targets, record, scheduler_reader
    from cancelwatch.runstore.reader import load_run
    from cancelwatch.runstore.records import DriveSettings

    targets = parse_targets([metrics_url or target])
    model = served_model(target, auth=auth)
    settings = RecordSettings(targets=targets, store=store, hz=hz, duration_s=None, nvml="auto", name=name,
                              home=home_dir(), engine_log=engine_log, engine_log_tz=engine_log_tz,
                              drive=DriveSettings(driven_target=target,
                                                                   scenarios=[s.name for s in scenarios],
                                                                   grace_s=grace, model=model))
    sources, facts = family.sources(settings)
    result = record(settings, sources, facts, driver_factory=lambda writer, sampler: family.driver(
        target, model, writer.put, scheduler_reader(sampler, targets[0].label, family.scheduler_source),
        grace_s=grace, metrics_target=targets[0].label, auth=auth).run(scenarios))
    run = load_run(store, result.run_id)
    return result.run_id, judge_run(run, grace), run, result.status


def canary(
    target: str = typer.Option(..., help="The live endpoint (engine, gateway or proxy) the cancels go to."),
    metrics_url: Optional[str] = typer.Option(None, help="The vLLM whose /metrics is sampled; default: --target."),
    engine_log: Optional[Path] = typer.Option(None, help="The engine's log (vLLM with --enable-log-requests)."),
    engine_log_tz: Optional[str] = typer.Option(None, help=ENGINE_LOG_TZ_HELP),
    every: str = typer.Option("10m", help="Time between the starts of two rounds (30s, 10m, 1h)."),
    scenario: str = typer.Option("decode,disconnect", help="Built-in scenarios of each round (no inproc)."),
    listen: str = typer.Option("127.0.0.1:9464", help="Where /metrics is served (HOST:PORT)."),
    store: Path = typer.Option(DEFAULT_STORE),
    keep: int = typer.Option(48, help="Rounds kept in the store; older canary rounds are deleted."),
    rounds: int = typer.Option(0, help="Stop after this many rounds; 0 runs until Ctrl-C or SIGTERM."),
    hz: float = typer.Option(20.0),
    grace: float = typer.Option(2.0),
    api_key_env: Optional[str] = typer.Option(None, help="Environment variable holding the endpoint's API key "
                                              "(default: VLLM_API_KEY, then OPENAI_API_KEY); never stored."),
):
    """Run a scenario set every --every, store each round as a run, serve the verdicts on /metrics."""
    from prometheus_client import start_http_server

    from cancelwatch.collectors.sources.credentials import CredentialError, api_key, auth_headers, split_userinfo

    try:
        given_target = target
        target, basic = split_userinfo(target)  # user:password@ is sent, never stored
        auth = auth_headers(api_key(api_key_env)[0], basic)
    except CredentialError as exc:
        raise fail(str(exc)) from None

    from cancelwatch.collectors.cancels.scenarios import ScenarioError
    from cancelwatch.collectors.families import family_for_target, refused_command
    from cancelwatch.collectors.recording.session import PreflightError, parse_targets
    from cancelwatch.collectors.sources.prometheus_api import parse_duration
    from cancelwatch.runstore.reader import list_runs
    from cancelwatch.runstore.writer import delete_runs, open_store

    engine_log_zone(engine_log_tz)
    family = family_for_target(target)
    if refused := refused_command(family, "canary"):
        raise fail(refused)
    try:
        period = parse_duration(every)
        scenarios = family.scenarios(scenario)
        parse_targets([target, *([metrics_url] if metrics_url else [])])
    except (ValueError, ScenarioError, PreflightError) as exc:
        raise fail(str(exc)) from None
    if any(s.via_relay for s in scenarios):
        raise fail("the canary drives an endpoint over HTTP: leave out inproc (it needs the relay app)")
    if keep < 1 or rounds < 0:
        raise fail("--keep must be at least 1 and --rounds at least 0")
    host, _, port = listen.rpartition(":")
    if not host or not port.isdigit():
        raise fail(f"--listen {listen!r}: give HOST:PORT, e.g. 127.0.0.1:9464")
    metrics = CanaryMetrics()
    for s in scenarios:  # every series from 0: a first leak is an increase Prometheus can see
        for verdict in ("released", "leaked", "stale_gauge", "inconclusive"):
            metrics.cancels.labels(scenario=s.name, verdict=verdict)
    try:
        server, _ = start_http_server(int(port), addr=host, registry=metrics.registry)
    except OSError as exc:
        raise fail(f"cannot serve /metrics on {listen} ({exc.strerror}): pick another --listen") from None
    stop = threading.Event()

    def on_signal(signum, frame):  # ends between rounds; a round in progress finishes first
        stop.set()
        err.print(f"canary: {signal.Signals(signum).name}, stopping after this round")

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    out.print(f"canary: {target} every {every}, scenarios {scenario}; metrics on http://{listen}/metrics")
    done = 0
    mine: list[int] = []
    try:
        while not stop.is_set():
            started = time.monotonic()
            metrics.rounds.inc()
            try:
                rid, verdicts, run, status = one_round(family, target, scenarios, store, hz, grace,
                                                       f"canary round {done + 1}", metrics_url or given_target,
                                                       engine_log, auth, engine_log_tz)
                mine.append(rid)
                metrics.observe(verdicts, run)
                if status != "completed":
                    metrics.errors.inc()
                counts = {}
                for v in verdicts:
                    counts[v.verdict] = counts.get(v.verdict, 0) + 1
                out.print(f"canary round {done + 1}: run {rid} {status}, " +
                          (", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "no cancels"))
            except Exception as exc:  # noqa: BLE001 - a failed round is counted; the canary keeps serving
                metrics.errors.inc()
                err.print(f"canary round {done + 1} failed: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}")
            metrics.last_round.set(time.time())
            done += 1
            if len(mine) > keep:
                old, mine = mine[:-keep], mine[-keep:]
                con = open_store(store)
                try:
                    delete_runs(con, old)
                finally:
                    con.close()
            if rounds and done >= rounds:
                break
            stop.wait(max(0.0, period - (time.monotonic() - started)))
    finally:
        server.shutdown()
    kept = list_runs(store) if store.exists() else None
    out.print(f"canary: {done} round(s); {0 if kept is None else len(kept)} run(s) in {store}")
