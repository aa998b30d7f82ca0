"""`cancelwatch record`: scripted cancels against a server while sampling it; prints the per-cancel report."""

from __future__ import annotations

import asyncio
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import typer

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
from cancelwatch.live_judge import judging, recording_judge
from cancelwatch.report_commands import FORMAT_HELP, checked_format, judged_run, print_as, report_exit
from cancelwatch.collectors.engines import lifecycle
from cancelwatch.collectors.engines import vllm_server as engine_mod
from cancelwatch.collectors.recording.session import (
    EXIT_FAILED,
    PreflightError,
    RecordSettings,
    check_burst,
    hop_sources,
    parse_targets,
    record,
    scheduler_reader,
)
from cancelwatch.collectors.sources.triton import FAMILY as TRITON_FAMILY
from cancelwatch.collectors.sources.vllm import FAMILY as VLLM_FAMILY
from cancelwatch.collectors.sources.vllm import SCRAPE_JOB
from cancelwatch.runstore.errors import StoreError
from cancelwatch.runstore.records import DriveSettings


def record_cmd(
    target: str = typer.Option(..., help="OpenAI-compatible server the scenarios talk to (engine, gateway or proxy), "
                               "or Triton's gRPC address as grpc://HOST:PORT."),
    metrics_url: Optional[str] = typer.Option(None, help="vLLM whose /metrics is sampled; default: --target. "
                                              "Triton: its metrics port (default HOST:8002)."),
    scenario: str = typer.Option("default", help="Suite, built-in scenario name, or a TOML file (Triton: triton, "
                                 "or triton_* names)."),
    hz: float = typer.Option(20.0),
    burst_hz: Optional[float] = typer.Option(None, help="Sample the scheduler at this rate (a whole multiple of "
                                             "--hz) from just before each stop to the end of --burst-window; "
                                             "--hz stays the baseline."),
    burst_window: Optional[str] = typer.Option(None, help="With --burst-hz: how long each burst lasts from the stop, "
                                               "e.g. 2s or 1.5 (default 2s)."),
    nvml: str = typer.Option("auto"),
    store: Path = typer.Option(DEFAULT_STORE),
    name: Optional[str] = typer.Option(None),
    pid: Optional[list[int]] = typer.Option(None),
    lost_after: float = typer.Option(10.0),
    engine_log: Optional[Path] = typer.Option(None, help=ENGINE_LOG_HELP),
    engine_log_tz: Optional[str] = typer.Option(None, help=ENGINE_LOG_TZ_HELP),
    grace: float = typer.Option(2.0, help="Seconds the scheduler has to reconcile after an abort."),
    relay_url: Optional[str] = typer.Option(None, help="Relay app for in-process scenarios (inproc); default: start one."),
    http_url: Optional[str] = typer.Option(None, help="Triton only: its HTTP endpoint (default HOST:8000)."),
    prometheus: Optional[str] = typer.Option(None, help="A Prometheus whose active targets of --job are the replicas "
                                             "to sample (instead of --metrics-url); the cancels go to --target."),
    job: Optional[str] = typer.Option(None, help=f"With --prometheus: the scrape job of the replicas (default {SCRAPE_JOB})."),
    api_key_env: Optional[str] = typer.Option(None, help="Environment variable holding the API key of an engine "
                                              "started with --api-key (default: VLLM_API_KEY, then OPENAI_API_KEY). "
                                              "Sent to --target only; never stored."),
    hop: Optional[list[str]] = typer.Option(None, help="A tap in front of one component of the path, as "
                                            "NAME=LISTEN,UPSTREAM_URL (NAME: the component it feeds); repeat in "
                                            "order from the client, and point the previous component (or "
                                            "--target) at LISTEN. Or [[hop]] tables in the scenario file."),
    format_: str = typer.Option("table", "--format", help=FORMAT_HELP),
):
    """Run scripted cancels while sampling; one run holds samples, ledger and events. Prints the report."""
    import httpx

    from cancelwatch.collectors.families import family_for_target, refused_option
    from cancelwatch.collectors.sources.credentials import (
        CredentialError,
        api_key,
        auth_headers,
        split_userinfo,
        strip_userinfo,
    )

    fmt = checked_format(format_)  # before anything is sent
    given_target = target
    try:
        target, basic = split_userinfo(target)  # user:password@ is sent, never stored
    except CredentialError as exc:
        raise fail(f"--target: {exc}") from None
    family = family_for_target(target)
    refused = refused_option(family, {"--burst-hz": burst_hz, "--burst-window": burst_window, "--api-key-env": api_key_env,
                                      "--relay-url": relay_url, "--prometheus": prometheus, "--job": job,
                                      "--http-url": http_url, "user:password@ in --target": basic,
                                      "--engine-log-tz": engine_log_tz, "--hop": hop or None})
    refused = refused or needs_option({"--burst-window": ("--burst-hz", burst_hz), "--job": ("--prometheus", prometheus)},
                                      {"--burst-window": burst_window, "--job": job})
    if refused:  # before anything is sent to the target
        raise fail(refused)
    window_s = seconds(burst_window or "2s", "--burst-window")
    engine_log_zone(engine_log_tz)
    job = job or SCRAPE_JOB
    try:  # before anything is sent to the target
        check_burst(RecordSettings(targets=[], hz=hz, burst_hz=burst_hz, burst_window_s=window_s))
    except PreflightError as exc:
        raise fail(str(exc)) from None
    try:
        key, key_var = api_key(api_key_env)
    except CredentialError as exc:
        raise fail(str(exc)) from None
    auth = auth_headers(key, basic)
    from cancelwatch.collectors.cancels.scenarios import ScenarioError

    try:
        scenarios = family.scenarios(scenario)
    except (ScenarioError, ValueError) as exc:
        raise fail(str(exc)) from None
    hops = taps_of(hop or [], scenario)
    if family.name != VLLM_FAMILY:
        return RECORDERS[family.name](family, scenarios, target, metrics_url, http_url, hz, nvml, store, name, pid,
                                      lost_after, engine_log, grace, fmt)

    from cancelwatch.collectors.cancels.load import served_model
    from cancelwatch.collectors.recording.session import discover_targets
    from cancelwatch.collectors.sources.process_memory import ProcessMemorySource
    from cancelwatch.collectors.sources.vllm import VllmMetricsSource

    found: list[str] = []
    taps: list = []
    try:
        # listening before anything is sent: --target may be the first tap's address
        taps = hop_sources(hops)
        found = discover_targets(prometheus, job) if prometheus else []
        # the target as given: its user:password reach its /metrics too (Target keeps them out of the run)
        targets = parse_targets(found or [metrics_url or given_target])
        parse_targets([target])
        model = served_model(target, auth=auth)
    except PreflightError as exc:
        close_all(taps)
        raise fail(str(exc)) from None
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        close_all(taps)
        raise fail(model_listing_error(target, exc, key_var)) from None
    relay_state: dict = {}
    try:
        settings = RecordSettings(targets=targets, store=store, hz=hz, duration_s=None, nvml=nvml, name=name,
                                  pids=list(pid or []), lost_after_s=lost_after, home=home_dir(),
                                  engine_log=engine_log, engine_log_tz=engine_log_tz, burst_hz=burst_hz,
                                  burst_window_s=window_s, hops=hops,
                                  drive=DriveSettings(driven_target=target, scenarios=[s.name for s in scenarios],
                                                      grace_s=grace, model=model,
                                                      relay_url=strip_userinfo(relay_url) if relay_url else None))
        sources, facts = family.sources(settings)
        sources += taps  # the sampler owns them from here: it closes them when the run ends
        taps = []
        if prometheus:
            facts["discovery"] = {"prometheus": strip_userinfo(prometheus), "job": job, "found": found}
        # where the credentials came from, never what they are
        facts["auth"] = {"api_key_env": key_var} if key else ({"url_credentials": True} if basic else None)

        def driver_factory(writer, sampler):
            judge = recording_judge(store, grace, writer, sampler)
            put = judge.putting(writer.put)  # the judge sees each stop and scenario as it is put

            async def start_relay():
                # the in-process scenarios need an app that owns an AsyncLLM: cancelwatch's relay app,
                # started only now (an idle second engine would cost CPU through the whole run)
                url = relay_url
                if url is None:
                    state = await asyncio.to_thread(engine_mod.start, home_dir(), lifecycle.free_port(), relay=True)
                    relay_state["state"] = state
                    url = state.url
                    proc = ProcessMemorySource([state.pid], target="relay")
                    sampler.add_source(proc)
                    relay_state["sources"] = [proc]
                src = VllmMetricsSource(url, "relay", critical=False)
                sampler.add_source(src)
                relay_state.setdefault("sources", []).append(src)
                # the relay app serves vLLM's AsyncLLM in its own process: a vLLM target, in the app's role
                all_targets = [*(asdict(t) for t in targets),
                               {"label": "relay", "url": strip_userinfo(url), "family": VLLM_FAMILY,
                                "role": "relay app"}]
                writer.set_run_json("targets", all_targets)
                relay_driver = family.driver(url, await asyncio.to_thread(served_model, url), put,
                                             scheduler_reader(sampler, "relay", family.scheduler_source),
                                             grace_s=grace, metrics_target="relay")
                relay_driver.stop_soon = lambda: sampler.burst(window_s, family.burst_sources, target="relay")
                counted = counted_clients(sampler, "relay")
                relay_state["sources"].append(counted)
                relay_driver.delivered = counted.add
                return relay_driver

            async def stop_relay():
                for src in relay_state.get("sources", []):
                    await asyncio.to_thread(sampler.remove_source, src)
                    writer.forget((src.name, src.target))  # the live judge no longer waits for its reads
                if "state" in relay_state:
                    await asyncio.to_thread(lifecycle.stop, home_dir(), relay_state["state"].port)

            # the replica the cancels go to judges them (a discovered one by its URL), else the first
            judged = next((t.label for t in targets if t.url == target.rstrip("/")), targets[0].label)
            driver = family.driver(target, model, put, scheduler_reader(sampler, judged, family.scheduler_source),
                                   grace_s=grace, metrics_target=judged, relay_factory=start_relay,
                                   relay_cleanup=stop_relay, auth=auth)
            driver.stop_soon = lambda: sampler.burst(window_s, family.burst_sources, target=judged)
            # counted where every chunk is surely the judged engine's: the cancels go straight to it. Through a
            # gateway or proxy, the clients may get tokens from replicas the run does not sample
            if any(t.url == target.rstrip("/") for t in targets):
                driver.delivered = counted_clients(sampler, judged).add
            return judging(driver.run(scenarios), judge)

        result = record(settings, sources, facts, driver_factory=driver_factory)
    except PreflightError as exc:
        raise fail(str(exc)) from None
    except lifecycle.EngineError as exc:
        raise fail(f"could not start the relay app for in-process scenarios: {exc}", EXIT_FAILED) from None
    except StoreError as exc:
        raise fail(str(exc)) from None
    finally:
        close_all(taps)  # a run that never started
        if "state" in relay_state:  # also after Ctrl-C or a lost target
            lifecycle.stop(home_dir(), relay_state["state"].port)
    report_recorded(store, result, grace, fmt)


def counted_clients(sampler, target: str):
    """A count of what reaches the clients of the engine labelled `target`, sampled from now on
    (collectors/sources/clients.py): what the tokens made for nobody are read against."""
    from cancelwatch.collectors.sources.clients import ClientsSource

    src = ClientsSource(target)
    sampler.add_source(src)
    return src


def taps_of(given: list[str], scenario: str) -> list:
    """The hops of --hop, else of the scenario file's [[hop]] tables; one line and exit 2 for a bad one or both."""
    from cancelwatch.collectors.cancels.scenarios import ScenarioError, load_hops
    from cancelwatch.collectors.sources.tap import TapError, parse_hop

    try:
        in_file = load_hops(scenario)
        if given and in_file:
            raise TapError("the taps are given both with --hop and as [[hop]] tables of the scenario file: keep one")
        return [parse_hop(v) for v in given or in_file]
    except (TapError, ScenarioError) as exc:
        raise fail(str(exc)) from None


def close_all(sources: list) -> None:
    for src in sources:
        src.close()



def record_triton(family, scenarios: list, target: str, metrics_url: str | None, http_url: str | None, hz: float,
                  nvml: str, store: Path, name: str | None, pid: list[int] | None, lost_after: float,
                  engine_log: Path | None, grace: float, fmt: str = "table") -> None:
    """`record` against Triton: the Triton scenarios over gRPC (and HTTP for the timeout case)."""
    from cancelwatch.collectors.recording.triton_session import endpoints

    try:
        ep = endpoints(target, metrics_url, http_url, home_dir())
        targets = parse_targets([ep.metrics])
        models = sorted({s.model for s in scenarios} | {"generator"} | ({"slow"} if any(
            s.model == "slow" or s.fillers for s in scenarios) else set()))
        settings = RecordSettings(targets=targets, store=store, hz=hz, duration_s=None, nvml=nvml, name=name,
                                  pids=list(pid or []), lost_after_s=lost_after, home=home_dir(),
                                  engine_log=engine_log,
                                  drive=DriveSettings(driven_target=target, scenarios=[s.name for s in scenarios],
                                                      grace_s=grace, model=",".join(models)))
        sources, facts = family.sources(settings, ep, models)

        def driver_factory(writer, sampler):
            judge = recording_judge(store, grace, writer, sampler)
            reader = scheduler_reader(sampler, targets[0].label, family.scheduler_source)
            return judging(family.driver(ep.grpc, ep.http, judge.putting(writer.put), reader, grace_s=grace,
                                         metrics_target=targets[0].label).run(scenarios), judge)

        result = record(settings, sources, facts, driver_factory=driver_factory)
    except PreflightError as exc:
        raise fail(str(exc)) from None
    except StoreError as exc:
        raise fail(str(exc)) from None
    report_recorded(store, result, grace, fmt)


# the command-line wiring of each family's recording other than vLLM's (above); what it wires (sources, driver,
# scenarios, scheduler source) comes from the family's entry in collectors/families.py
RECORDERS = {TRITON_FAMILY: record_triton}


def needs_option(needs: dict[str, tuple[str, object]], given: dict[str, object]) -> str | None:
    """The one-line refusal of an option given without the one it only works with (option -> (that
    option, its value)); None when each given option has its partner."""
    for option, (partner, value) in needs.items():
        if given.get(option) is not None and value is None:
            return f"{option} works only with {partner}: add {partner}, or leave {option} out"
    return None


def seconds(value: str, option: str) -> float:
    """`2s`, `1.5`, `500ms` -> seconds; a bad value is the usual one-line error."""
    text = value.strip().lower()
    scale = 0.001 if text.endswith("ms") else 1.0
    text = text.removesuffix("ms").removesuffix("s")
    try:
        return float(text) * scale
    except ValueError:
        raise fail(f"{option} {value!r} is not a duration: write e.g. 2s, 1.5 or 500ms") from None


def report_recorded(store: Path, result, grace: float, fmt: str = "table") -> None:
    """After `record`: the run's verdicts as the table (or `fmt`: report_commands.FORMATS), then exit with the
    recording's failure code, else
    the report's (0 accepted, 1 not). A run longer than RECORDED_LONG_S is reported from its overview and the
    verdicts its live judge kept (those it had not judged yet, each on its own window), never read whole."""
    from cancelwatch.analysis.long_runs import RECORDED_LONG_S
    from cancelwatch.analysis.verdicts import report_document

    recorded, verdicts = judged_run(store, result.run_id, grace, keep=True, long_run_s=RECORDED_LONG_S)
    doc = report_document(recorded, verdicts=verdicts)
    print_as(fmt, recorded, doc, verdicts)
    print_store_error(result.stats)
    # the machine formats keep stdout theirs: where the run went is said on stderr
    (out if fmt == "table" else err).print(f"run {result.run_id} {result.status} -> {store}")
    raise typer.Exit(result.exit_code if result.exit_code else report_exit(doc))
