"""`cancelwatch watch`: a tap in front of a gateway or an engine passes real traffic on while the run samples
the engine's scheduler and log; every request real clients make is in the run's ledger, every one they
gave up on is a cancel, judged live by the same rules as a scripted one as its grace ends, each on its
own stretch of the run (analysis/watching.py). The verdicts are printed and served on --metrics-listen.

Here, above collectors and analysis, as the canary is: collectors write the run, analysis judges it."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from pathlib import Path
from typing import Optional

import typer

from cancelwatch.console import DEFAULT_STORE, ENGINE_LOG_HELP, ENGINE_LOG_TZ_HELP, engine_log_zone, err, fail, \
    home_dir, out, print_store_error
from cancelwatch.live_judge import LATE_S, LiveJudge

BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0)
REQUEST_ID_PREFIX = "cw-watch-"
VERDICT_NAMES = ("released", "leaked", "stale_gauge", "inconclusive")


class WatchMetrics:
    """The watch's own registry, served on --metrics-listen."""

    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        self.requests = Counter("cancelwatch_watched_requests", "Requests through the watch's tap that asked the "
                                "engine for work", registry=self.registry)
        self.cancels = Counter("cancelwatch_watched_cancels", "Cancels real clients made, judged, by verdict and rule",
                               ["verdict", "rule"], registry=self.registry)
        self.refused = Counter("cancelwatch_watched_refused", "Connections past --max-connections, answered 503 "
                               "by the watch itself", registry=self.registry)
        self.upstream_failed = Counter("cancelwatch_watched_upstream_failures", "Connections the upstream refused "
                                       "(their clients were reset, as a refusal is)", registry=self.registry)
        self.ghosts = Gauge("cancelwatch_ghost_requests", "Watched cancels judged leaked that the engine may still "
                            "hold: at most its count beyond the requests the watch has in flight",
                            registry=self.registry)
        self.ghost_age = Gauge("cancelwatch_ghost_oldest_seconds", "How long ago the client of the oldest ghost left",
                               registry=self.registry)
        # not the ledger's tokens_after_cancel (what the client was sent after its stop): the engine's own tokens
        self.paid = Counter("cancelwatch_engine_tokens_after_client_left",
                            "Tokens the engine generated for leaked watched cancels after their clients left, off "
                            "its generation counter: attributed (it held nothing else) or at_most (a bound)",
                            ["attribution"], registry=self.registry)
        self.release = Histogram("cancelwatch_watched_release_seconds",
                                 "Released watched cancels: the client leaving to the request leaving the scheduler",
                                 buckets=BUCKETS, registry=self.registry)

    def start_at_zero(self) -> None:
        """Every series a verdict can count, at 0 before the first: a series that first appears at 1 is no increase
        Prometheus can see, and the first leak of a rule would pass the alert and the dashboard by."""
        from cancelwatch.analysis.verdicts import RULES
        from cancelwatch.analysis.verdicts.paid_tokens import AT_MOST, ATTRIBUTED

        for v in VERDICT_NAMES:
            self.cancels.labels(verdict=v, rule="")
        for code, rule in RULES.items():
            self.cancels.labels(verdict=rule.verdict, rule=code)
        for attribution in (ATTRIBUTED, AT_MOST):
            self.paid.labels(attribution=attribution)

    def observe(self, verdicts) -> None:
        for v in verdicts:
            self.cancels.labels(verdict=v.verdict, rule=v.rule or "").inc()
            left = v.timepoints.get("left_scheduler")  # from the client's leaving, not a page's click before it
            if v.verdict == "released" and left is not None:
                self.release.observe(max(left - v.client_left_s(), 0.0))
            paid = v.evidence.tokens_after_client_left
            if paid is not None:
                self.paid.labels(attribution=v.evidence.tokens_after_client_left_is).inc(paid)


def _listen_address(value: str, option: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise fail(f"{option} {value!r}: give HOST:PORT, e.g. 127.0.0.1:9000")
    return host, int(port)


class _UpstreamWord:
    """What the watch says of its upstream and its bound as the tap's events pass: a refusal is said once when
    the upstream stops answering and once when it answers again (with how many connections it refused),
    not once per connection; every refusal, and every connection past the bound, is counted on /metrics."""

    def __init__(self, metrics: WatchMetrics | None):
        self.metrics = metrics
        self.failing = 0  # connections refused since the upstream last answered
        self.refused = 0

    def saw(self, rec) -> None:
        if rec.kind == "tap_upstream_failed":
            if self.failing == 0:
                err.print(f"watch: the upstream refused a connection ({rec.data.get('why')}); its client was reset, "
                          "as a refusal is. The watch goes on", highlight=False)
            self.failing += 1
            if self.metrics is not None:
                self.metrics.upstream_failed.inc()
        elif rec.kind == "tap_request" and self.failing:
            err.print(f"watch: the upstream answers again, after {self.failing} refused connection(s)",
                      highlight=False)
            self.failing = 0
        elif rec.kind == "tap_refused":
            if self.refused == 0:
                err.print(f"watch: {rec.data.get('open')} connections open, the bound (--max-connections): new ones "
                          "are answered 503 and counted", highlight=False)
            self.refused += 1
            if self.metrics is not None:
                self.metrics.refused.inc()


def _count_ghosts(judge: LiveJudge, ledger, scheduler, metrics: WatchMetrics | None) -> None:
    """The ghosts against the engine's latest count and the watch's requests in flight, read once every cancel
    stopped before has its verdict (analysis.ghosts.WatchGhosts); said as they go."""
    running, waiting = scheduler()
    in_flight = sum(row.n or 1 for row in ledger.open_rows())
    now = judge.now_s()
    judge.ghosts.reading(now, running + waiting, in_flight)
    gone = judge.ghosts.read(min(judge.pending.values(), default=now))
    if gone:
        out.print(f"watch: {len(gone)} leaked request(s) left the engine (by its count; the oldest taken first): "
                  f"{', '.join(rid for rid, _ in gone)}", highlight=False)
    if metrics is not None:
        metrics.ghosts.set(judge.ghosts.count())
        metrics.ghost_age.set(judge.ghosts.oldest_age_s(judge.now_s()))


async def _judged_until_done(loop, judge: LiveJudge):
    """The watch's loop, its judge closed as it ends: before the writer closes the store (a reader still open then
    keeps SQLite from folding its log into the store, and the run would be left in the -wal file beside it)."""
    try:
        return await loop
    finally:
        judge.close()


async def _watch_loop(tap, ledger, writer, judge: LiveJudge, stop: threading.Event, deadline_ns: int | None,
                      metrics: WatchMetrics | None, scheduler) -> None:
    """Pass the tap's events through the ledger into the run; judge each cancel as its grace ends. At the
    end: the tap closed, every open request's row written, the last cancels sampled through their grace."""
    from cancelwatch.runstore.records import EventRecord

    upstream = _UpstreamWord(metrics)

    def feed() -> None:
        before = ledger.requests
        records = ledger.feed(tap.take_events())
        if metrics is not None:  # the ledger's own count: the requests that asked the engine for work (engine_work)
            metrics.requests.inc(ledger.requests - before)
        for rec in records:
            writer.put(rec)
            if not isinstance(rec, EventRecord):
                continue
            if rec.kind == "user_stop":
                judge.add(rec.request_id, (rec.mono_ns - judge.t0_ns) / 1e9)
            upstream.saw(rec)
        ledger.handed_out(records, time.monotonic_ns())  # read after the last put

    last_judged = 0.0
    try:
        while not stop.is_set() and (deadline_ns is None or time.monotonic_ns() < deadline_ns):
            feed()
            if time.monotonic() - last_judged >= 0.5:
                last_judged = time.monotonic()
                await judge.due()
                feed()  # what the tap saw while judging: the reading's requests in flight are as of now
                _count_ghosts(judge, ledger, scheduler, metrics)
            await asyncio.sleep(0.1)
    finally:
        tap.close()  # connections still open are reset: the watch is over
        feed()
        rows = ledger.finish()
        for row in rows:
            writer.put(row)
        ledger.handed_out(rows, time.monotonic_ns())
    # the last cancels: sampled through their grace (bounded), then judged
    from cancelwatch.analysis.watching import SETTLE_S

    until = time.monotonic() + judge.grace_s + SETTLE_S + 1.0 + LATE_S
    while judge.pending and time.monotonic() < until:
        await judge.due()
        await asyncio.sleep(0.2)
    await judge.due(everything=True)


def watch(
    listen: str = typer.Option(..., help="Where clients connect (HOST:PORT): point them, or the gateway, here."),
    upstream: str = typer.Option(..., help="The gateway or engine the traffic goes on to (http://HOST:PORT)."),
    metrics_url: Optional[str] = typer.Option(None, help="The vLLM whose /metrics is sampled; default: --upstream."),
    engine_log: Optional[Path] = typer.Option(None, help=ENGINE_LOG_HELP),
    engine_log_tz: Optional[str] = typer.Option(None, help=ENGINE_LOG_TZ_HELP),
    metrics_listen: Optional[str] = typer.Option(None, help="Serve the watch's verdicts on /metrics here (HOST:PORT)."),
    store: Path = typer.Option(DEFAULT_STORE),
    duration: str = typer.Option("0", help="How long to watch (30s, 10m, 24h); 0 runs until Ctrl-C or SIGTERM."),
    grace: float = typer.Option(2.0, help="Seconds the engine has to let a cancelled request go."),
    hz: float = typer.Option(20.0),
    nvml: str = typer.Option("auto"),
    name: Optional[str] = typer.Option(None),
    max_connections: int = typer.Option(1024, help="Connections open through the watch at once, at most; past "
                                        "it a new one is answered 503 by the watch and counted."),
    no_request_id: bool = typer.Option(False, "--no-request-id", help="Pass every byte unchanged: no X-Request-Id "
                                       "is added to requests that come without one (the engine's log then cannot "
                                       "name them)."),
    upstream_name: str = typer.Option("watch", help="What --upstream is (nginx, litellm, app), as the hop traces "
                                      "name it."),
    hop: Optional[list[str]] = typer.Option(None, help="A tap in front of a component behind --upstream, as "
                                            "NAME=LISTEN,UPSTREAM_URL, in order from the client (repeat): each "
                                            "cancel is traced hop by hop."),
):
    """Watch real traffic: judge every cancel real clients make, live."""
    from cancelwatch.collectors.families import family_for_target, refused_command
    from cancelwatch.collectors.recording.session import (PreflightError, RecordSettings, hop_sources, parse_targets, record,
                                              scheduler_reader)
    from cancelwatch.collectors.recording.vllm_session import build_vllm_sources
    from cancelwatch.collectors.recording.watch_ledger import WatchLedger
    from cancelwatch.collectors.sources.prometheus_api import parse_duration
    from cancelwatch.collectors.sources.tap import TapError, TapSource, check_chain, parse_hop
    from cancelwatch.runstore.errors import StoreError
    from cancelwatch.runstore.records import DriveSettings

    engine_log_zone(engine_log_tz)
    _listen_address(listen, "--listen")
    if metrics_listen:  # before anything listens
        _listen_address(metrics_listen, "--metrics-listen")
    try:
        text = duration.strip()
        seconds = float(text) if text.replace(".", "", 1).isdigit() else parse_duration(text)
    except ValueError as exc:
        raise fail(f"--duration {exc} (or seconds; 0 runs until Ctrl-C or SIGTERM)") from None
    if not grace > 0:
        raise fail(f"--grace {grace:g}: give the engine a positive number of seconds, e.g. --grace 2")
    if max_connections < 1:
        raise fail(f"--max-connections {max_connections}: give a bound of 1 or more, e.g. --max-connections 1024")
    try:
        own = parse_hop(f"{upstream_name}={listen},{upstream}")
    except TapError as exc:
        raise fail(str(exc).replace(f"--hop {upstream_name}: ", "").replace("--hop name", "--upstream-name")
                   .replace("--hop", "--upstream")) from None
    try:
        behind = [parse_hop(h) for h in hop or []]
        check_chain([own, *behind])
    except TapError as exc:
        raise fail(str(exc)) from None
    hop = own
    family = family_for_target(metrics_url or upstream)
    if refused := refused_command(family, "watch"):
        raise fail(refused)
    try:
        targets = parse_targets([metrics_url or upstream])
    except PreflightError as exc:
        raise fail(str(exc).replace("--target", "--metrics-url" if metrics_url else "--upstream")) from None
    ids = None if no_request_id else REQUEST_ID_PREFIX
    settings = RecordSettings(
        targets=targets, store=store, hz=hz, duration_s=None, nvml=nvml, name=name or f"watch {listen}",
        home=home_dir(), engine_log=engine_log, engine_log_tz=engine_log_tz, hops=[own, *behind] if behind else [],
        drive=DriveSettings(driven_target=hop.upstream, scenarios=["watched"], grace_s=grace),
        watch={"listen": hop.listen_url, "upstream": hop.upstream, "max_connections": max_connections,
               "request_ids": f"added where the client sent none ({REQUEST_ID_PREFIX}...)" if ids else "off"})
    try:
        sources, facts = build_vllm_sources(settings)
    except PreflightError as exc:
        raise fail(str(exc)) from None
    for s in sources:
        # an engine that stops answering is a hole in the run, marked as gaps, not its end: clients keep
        # coming, and the watch keeps passing them on (their refusals as they were)
        s.critical = False
    # what judging reads with (the verdict rules, pandas) is imported before the tap listens: imported at the
    # first judgement, its seconds of CPU on a starved host came with the first requests (seen on two cores
    # beside the engine: their first tokens 6 to 10 s late)
    import cancelwatch.analysis.verdicts.stored  # noqa: F401 - and the rules' fingerprint its verdicts are kept with
    import cancelwatch.analysis.watching  # noqa: F401
    import cancelwatch.runstore.reader  # noqa: F401

    try:
        taps = hop_sources(behind)  # listening before the watch's own: its upstream may reach them at once
    except PreflightError as exc:
        for s in sources:
            s.close()
        raise fail(str(exc)) from None
    sources += taps  # the sampler owns them from here: it closes them when the run ends
    tap = TapSource(hop, request_ids=ids, max_connections=max_connections)
    problem = tap.check()
    try:
        if problem:
            raise TapError(problem.replace(f"--hop {hop.name}: its upstream", "--upstream")
                           .replace("start watch first, or fix the hop's UPSTREAM_URL", "start it, or fix --upstream"))
        tap.start()
    except TapError as exc:
        for s in sources:
            s.close()
        raise fail(str(exc).replace(f"--hop {hop.name}: cannot listen", "--listen: cannot listen")) from None
    metrics = WatchMetrics() if metrics_listen else None
    server = None
    if metrics is not None:
        from prometheus_client import start_http_server

        metrics.start_at_zero()
        mhost, mport = _listen_address(metrics_listen, "--metrics-listen")
        try:
            server, _ = start_http_server(mport, addr=mhost, registry=metrics.registry)
        except OSError as exc:
            tap.close()
            for s in sources:
                s.close()
            raise fail(f"cannot serve /metrics on {metrics_listen} ({exc.strerror}): pick another "
                       "--metrics-listen") from None
    stop = threading.Event()

    def on_signal(signum, frame):
        stop.set()
        err.print(f"watch: {signal.Signals(signum).name}, ending the run (open requests are written)")

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    ledger = WatchLedger(targets[0].label)
    judge = LiveJudge(store, grace, ledger, metrics, said="watch")
    out.print(f"watch: {hop.listen_url} -> {hop.upstream}, sampling {targets[0].url}"
              + (f"; metrics on http://{metrics_listen}/metrics" if metrics_listen else ""), highlight=False)

    def driver(writer, sampler):
        writer.expect((s.name, s.target) for s in sampler.sources)
        judge.start(writer.run_id, sampler.t0_mono_ns, writer.committed_through_ns, writer.put_verdicts)
        deadline = time.monotonic_ns() + int(seconds * 1e9) if seconds else None
        scheduler = scheduler_reader(sampler, targets[0].label, family.scheduler_source)
        return _judged_until_done(_watch_loop(tap, ledger, writer, judge, stop, deadline, metrics, scheduler), judge)

    try:
        result = record(settings, sources, facts, driver_factory=driver)
    except StoreError as exc:
        tap.close()
        for t in taps:  # the run never started: the sampler that owns them closed nothing
            t.close()
        raise fail(str(exc)) from None
    finally:
        if server is not None:
            server.shutdown()
    said = ", ".join(f"{n} {k}" for k, n in sorted(judge.counts.items())) or "none judged"
    out.print(f"watch: run {result.run_id} {result.status}: {ledger.requests} request(s), "
              f"{ledger.cancels} cancel(s): {said}", highlight=False)
    print_store_error(result.stats)
    if result.exit_code:
        raise typer.Exit(result.exit_code)
