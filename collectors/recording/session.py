"""Record a run: preflight the sources, create the run, sample until done, finish it with its stats.

The CLI and the tests both call `record`; nothing here prints.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlparse

from cancelwatch.collectors.recording.sampler import Sampler
from cancelwatch.collectors.sources.base import Source
from cancelwatch.collectors.sources.credentials import CredentialError, split_userinfo, strip_userinfo
from cancelwatch.collectors.sources.engine_log import EngineLogSource
from cancelwatch.collectors.sources.nvml import NvmlSource
from cancelwatch.collectors.sources.process_memory import ProcessMemorySource
from cancelwatch.collectors.sources.tap import Hop, TapError, TapSource, check_chain
from cancelwatch.collectors.sources.vllm import VllmMetricsSource, cache_config, model_names
from cancelwatch.runstore.errors import StoreError
from cancelwatch.runstore.records import DriveSettings
from cancelwatch.runstore.writer import StoreWriter, create_run, finish_run, open_store

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_TARGET_LOST = 3
EXIT_INTERRUPTED = 130


class PreflightError(Exception):
    """Bad input found before anything was recorded; one line, names the fix."""


@dataclass
class Target:
    """One sampled server. `url` is what the run stores (no user:password). The URL as given,
    credentials and all, is kept outside the dataclass's fields, so that asdict() (what the run
    stores) and repr() never see it: only the source that reads the server gets it (`source_url`)."""

    label: str
    url: str
    family: str | None = None  # the engine family, set by whoever builds the target's sources

    def with_credentials(self, given: str | None) -> Target:
        self._given = given
        return self

    @property
    def source_url(self) -> str:
        return getattr(self, "_given", None) or self.url


@dataclass
class RecordSettings:
    """Everything one recording needs, built once at the CLI edge."""

    targets: list[Target]
    store: Path = Path("runs/cancelwatch.db")
    hz: float = 20.0
    duration_s: float | None = 30.0
    nvml: str = "auto"  # auto | on | off
    name: str | None = None
    pids: list[int] = field(default_factory=list)
    lost_after_s: float = 10.0
    home: Path = Path(".cancelwatch")
    max_hz: float = 200.0
    drive: DriveSettings | None = None  # set when the run drives scripted cancels (record)
    engine_log: Path | None = None  # the log of an engine not started by cancelwatch (--engine-log)
    engine_log_tz: str | None = None  # the zone the engine log is stamped in (--engine-log-tz), else local time
    burst_hz: float | None = None  # the scheduler source's rate around each stop (--burst-hz), else hz
    burst_window_s: float = 2.0  # how long after a stop the burst lasts (--burst-window)
    hops: list[Hop] = field(default_factory=list)  # the taps in the path, in order from the client (--hop)
    # `cancelwatch watch`: where it listened, what it fed, and whether it added X-Request-Id to requests
    # without one (the only change it makes to the bytes); None for any other run
    watch: dict | None = None

    def as_stored(self) -> dict:
        """The run's `settings` column; the drive settings keep the key `extra` that stores already hold."""
        out = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(self).items()
               if k not in ("targets", "drive")}
        out["extra"] = asdict(self.drive) if self.drive is not None else {}
        return out


@dataclass
class RunResult:
    run_id: int
    status: str
    stats: dict
    exit_code: int


def split_label(value: str) -> tuple[str, str]:
    """`LABEL=URL` -> (LABEL, URL); `URL` -> ("", URL). The label ends at the first "=" before the
    scheme's "://" (a URL's query or password may hold more)."""
    label, _, url = value.partition("=") if "=" in value.split("://", 1)[0] else ("", "", value)
    return label, url


def parse_targets(values: list[str]) -> list[Target]:
    """`URL` or `LABEL=URL`; unlabelled targets are t0, t1, ..."""
    out: list[Target] = []
    for i, value in enumerate(values):
        label, url = split_label(value)
        url = url.rstrip("/")
        parsed = urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise PreflightError(f"--target {strip_userinfo(value)!r} is not an http(s) URL: use e.g. "
                                 "--target http://127.0.0.1:8000")
        try:
            clean, basic = split_userinfo(url)
        except CredentialError as exc:
            raise PreflightError(f"--target {label or 't' + str(i)}: {exc}") from None
        out.append(Target(label or f"t{i}", clean).with_credentials(url if basic else None))
    labels = [t.label for t in out]
    if len(set(labels)) != len(labels):
        raise PreflightError(f"--target labels must be unique, got {labels}: write them as LABEL=URL")
    return out


def discover_targets(prometheus_url: str, job: str) -> list[str]:
    """`INSTANCE=URL` of every replica Prometheus scrapes for `job`: sampled directly, at the tool's own
    rate (Prometheus gives history, cancelwatch the resolution). PreflightError when none is found."""
    from cancelwatch.collectors.sources.prometheus_api import PrometheusError, PrometheusHistory

    prom = PrometheusHistory(prometheus_url, timeout_s=10.0)
    problem = prom.check()
    if problem:
        raise PreflightError(problem.replace("check --url", "check --prometheus"))
    try:
        found = prom.active_targets(job)
    except PrometheusError as exc:
        raise PreflightError(str(exc)) from None
    if not found:
        raise PreflightError(f"Prometheus at {prometheus_url} scrapes no target of job {job!r}: check --job "
                             "(the job_name in its scrape config)")
    return [f"{instance}={url}" for instance, url in found]


def check_burst(settings: RecordSettings) -> None:
    """--burst-hz must be a whole multiple of --hz (the baseline keeps its grid) within the rate limit."""
    b = settings.burst_hz
    if b is None:
        return
    factor = b / settings.hz
    if not (settings.hz < b <= settings.max_hz) or abs(factor - round(factor)) > 1e-9:
        raise PreflightError(f"--burst-hz {b:g} must be a whole multiple of --hz {settings.hz:g} and at most "
                             f"{settings.max_hz:.0f}: e.g. --hz 20 --burst-hz 100")
    if not (0 < settings.burst_window_s <= 60):
        raise PreflightError(f"--burst-window {settings.burst_window_s:g} is out of range: use (0, 60] seconds, "
                             "e.g. --burst-window 2s")


def hop_sources(hops: list[Hop]) -> list[TapSource]:
    """The taps of --hop, listening on their addresses, each upstream answering. PreflightError (and nothing
    left listening) for hops that do not form a chain, an address in use or an upstream that does not answer."""
    taps: list[TapSource] = []
    try:
        check_chain(hops)
        for hop in hops:
            tap = TapSource(hop)
            problem = tap.check()
            if problem:
                raise PreflightError(problem)
            taps.append(tap.start())
    except (TapError, PreflightError) as exc:
        for tap in taps:
            tap.close()
        raise PreflightError(str(exc)) from None
    return taps


def memory_sources(settings: RecordSettings, pids: list[int], facts: dict, nvml_module=None) -> list[Source]:
    """The engine's process memory (RSS of `pids` and all under them) and NVML where a driver answers;
    `facts` gets the pids and the NVML state. PreflightError for pids given with --pid that are not
    there, an --nvml value that is not auto/on/off, or --nvml on without a driver."""
    out: list[Source] = []
    if pids:
        proc = ProcessMemorySource(pids, target="engine")
        problem = proc.check()
        if problem and settings.pids:
            raise PreflightError(problem)
        if not problem:
            out.append(proc)
    facts["pids"] = pids
    if settings.nvml not in ("auto", "on", "off"):
        raise PreflightError(f"--nvml {settings.nvml!r}: use auto, on or off")
    if settings.nvml != "off":
        nv = NvmlSource(nvml=nvml_module, pids=pids)
        problem = nv.check()
        if problem is None:
            out.append(nv)
        elif settings.nvml == "on":
            raise PreflightError(problem)
        facts["nvml"] = "on" if problem is None else f"off: {problem}"
    else:
        facts["nvml"] = "off"
    return out


def record(
    settings: RecordSettings,
    sources: list[Source],
    engine_facts: dict,
    stop: threading.Event | None = None,
    on_tick=None,
    driver_factory=None,
) -> RunResult:
    """Sample until the duration passes, `stop` is set, a critical target is lost, or Ctrl-C.

    With `driver_factory(writer, sampler) -> coroutine`, the coroutine (the scripted cancels) runs in
    this thread while the sampler samples, and the run ends when it is done.
    Whatever ends the run, everything sampled so far is written and the run gets its status.
    """
    con = open_store(settings.store)  # StoreError names the path
    wall_ns, mono_ns = time.time_ns(), time.monotonic_ns()
    run_id = create_run(
        con,
        name=settings.name,
        targets=[asdict(t) for t in settings.targets],
        engine=engine_facts,
        settings=settings.as_stored(),
        wall_ns=wall_ns,
        mono_ns=mono_ns,
    )
    writer = StoreWriter(con, run_id)
    caches: dict[str, dict] = {}
    caches_lock = threading.Lock()

    def on_samples(src, samples):
        # the first scrape of each vLLM target carries its cache config: keep it as run metadata. Targets
        # are read on worker threads at once: under the lock, the last snapshot queued holds every target
        # (without it, a snapshot of one target could be queued after the one of both, and win)
        # (called after a failed read too, with no samples: the events a source took before failing)
        if samples and isinstance(src, VllmMetricsSource) and src.target not in caches:
            with caches_lock:
                if src.target not in caches:
                    caches[src.target] = {**cache_config(samples), "model_names": model_names(samples)}
                    writer.set_run_json("cache", dict(caches))
        if isinstance(src, EngineLogSource | TapSource):  # the sources that see events, not only values
            for event in src.take_events():
                writer.put(event)

    sampler = Sampler(sources, writer.put, hz=settings.hz, lost_after_s=settings.lost_after_s, on_samples=on_samples,
                      burst_hz=settings.burst_hz)
    stop = stop or threading.Event()
    status = "completed"
    sampler.start(mono_ns)
    deadline = mono_ns + int(settings.duration_s * 1e9) if settings.duration_s else None
    try:
        if driver_factory is not None:
            asyncio.run(_drive(driver_factory(writer, sampler), sampler, writer.failed))
            if sampler.lost.is_set():
                status = "target_lost"
            stop.set()
        while not stop.is_set():
            if sampler.lost.is_set():
                status = "target_lost"
                break
            if writer.failed.is_set():
                break  # the store takes no more: recording on would only lose what is sampled
            if deadline is not None and time.monotonic_ns() >= deadline:
                break
            if on_tick is not None:
                on_tick(run_id, sampler)
            stop.wait(0.1)
        else:
            status = "interrupted" if driver_factory is None else status
    except KeyboardInterrupt:
        status = "interrupted"
    finally:
        sampler.stop()
        error = None
        try:
            writer.close()
        except Exception as exc:  # noqa: BLE001 - recorded in the run's status below
            error = exc
            status = "failed"
        stats = _run_stats(sampler, writer, error)
        try:
            finish_run(con, run_id, status, stats)
        except StoreError as exc:  # a full disk may refuse the status too: the samples stay intact
            stats["store_error"] = stats["store_error"] or str(exc)
        con.close()
    code = {"completed": EXIT_OK, "interrupted": EXIT_INTERRUPTED, "target_lost": EXIT_TARGET_LOST}.get(status, EXIT_FAILED)
    return RunResult(run_id, status, stats, code)


def _run_stats(sampler: Sampler, writer: StoreWriter, error: Exception | None) -> dict:
    """The run's stats column: per source what it read, and what the store took."""
    per_source = [st.as_dict() for st in sampler.stats.values()]
    return {
        "sources": per_source,
        "samples_taken": sum(s["samples_taken"] for s in per_source),
        "samples_written": writer.samples_written,
        "scrapes_written": writer.scrapes_written,
        "store_error": str(error) if error else None,
    }


async def _drive(coro, sampler: Sampler, store_failed: threading.Event | None = None) -> None:
    """Run the driver, but give up when the target is lost or the store takes no more writes."""
    task = asyncio.ensure_future(coro)
    while not task.done():
        if (sampler.lost.is_set() or (store_failed is not None and store_failed.is_set())) and not task.cancelling():
            task.cancel()  # once: a second cancel would cut the driver's own clean-up short
        await asyncio.wait([task], timeout=0.2)
    if not task.cancelled():
        task.result()


def scheduler_reader(sampler: Sampler, target: str, source: str):
    """() -> (running, waiting) from the latest sample of one target (vLLM, or Triton's common names);
    NaN-free, 0 before any sample."""

    def now() -> tuple[float, float]:
        latest = sampler.latest.get((source, target), [])
        running = sum(s.value for s in latest if s.metric == "requests_running")
        waiting = sum(s.value for s in latest if s.metric == "requests_waiting")
        return running, waiting

    return now
