"""Re-record the verdicts' corpus from real servers (`make corpus`; outside `make test`).

    python -m tests.corpus.record                 # every run of RUNS
    python -m tests.corpus.record --only direct_log,proxy_log

Each run is recorded by the real command line (`cancelwatch record`, `watch`, `matrix`) against the embedded
vLLM (CPU build) or Triton, started here on loopback and stopped after, through the test proxies of
tests/proxies.py where the run names one. The store is compacted and gzipped into tests/corpus/runs/, and
its manifest entry (tests/corpus/manifest.json) says how it was recorded (command lines, engine flags, the
path and its configuration, the client, the commit of the code) and, per cancel, the truth the set-up makes
certain (`truth`, basis `construction`). The verdicts expected of the rules are written by
`python -m tests.corpus.check --bless`, once its table of what moved has been read.

Every request loop here is bounded in count and time; every server is stopped on the way out.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gzip
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.corpus.manifest import CORPUS, RUNS_DIR, load_manifest, save_manifest, unpack  # noqa: E402
from tests.corpus.truth import truths  # noqa: E402

GRACE_S = 2.0
# the default suite but the in-process relay (inproc starts a second AsyncLLM: a run of its own, below)
SUITE = "queued,prefill,decode,race,disconnect,nonstream_timeout,chat,n2,burst,resubmit"
RECORDER_TZ = "Asia/Kolkata"  # UTC+5:30, never the recorder's by chance
RECORD_TIMEOUT_S = 900
AIPERF = "AIPerf 0.13.0 (.venv-aiperf)"


@dataclass
class Spec:
    """One corpus run: which engine, which path, which client."""

    name: str
    what: str  # one line: the situation
    kind: str = "record"  # record | watch | matrix | triton
    engine: str = "log"  # log (--enable-log-requests, ms stamps) | default (vLLM's defaults) | utc (vLLM's format, UTC)
    path: str = "direct"  # direct | leaky | slow_reader_leak | mint_ids | foreign
    read_log: bool = True  # the recorder follows the engine's log (--engine-log)
    scenario: str = SUITE
    client: str = "cancelwatch record's driver (httpx)"
    repeats: int = 1
    # tests/proxies.py ProxyBehaviour's keyword arguments, where `path` is "proxy" (or a function of the pace)
    proxy: dict | Callable[[float], dict] | None = None
    toml: Callable[[float], str] | None = None  # the scenario file, from the engine's decode pace (tokens/s)
    grace: float = GRACE_S
    metrics_via_proxy: bool = False  # /metrics read through the proxy (its outages are the run's)
    engine_log_tz: str | None = None  # record --engine-log-tz
    gateways: tuple[str, ...] = ()  # the matrix's --gateway names (collectors/engines/gateways.py)


MATRIX_GATEWAYS = ("nginx", "nginx-ignore-abort", "haproxy", "haproxy-abortonclose")
MORE_GATEWAYS = ("caddy", "apache", "envoy", "traefik", "litellm", "vllm-router")


RUNS: list[Spec] = [
    Spec("direct_log", "the default suite straight to the engine, request log on and read",
         scenario="default", repeats=2),
    Spec("direct_default", "the default suite straight to vLLM on its defaults: no --enable-log-requests, no "
         "--engine-log", engine="default", read_log=False, repeats=2),
    Spec("proxy_log", "the default suite through a proxy that never passes a disconnect on, request log on",
         path="leaky", repeats=2),
    Spec("proxy_default", "the default suite through the leaking proxy to vLLM on its defaults", engine="default",
         path="leaky", read_log=False, repeats=2),
    Spec("direct_default_counted", "the default suite straight to vLLM on its defaults, its clients' chunks counted "
         "(client_chunks_total): the tokens the engine made for nobody", engine="default", read_log=False, repeats=2),
    Spec("proxy_default_counted", "the default suite through the leaking proxy to vLLM on its defaults, its clients' "
         "chunks counted", engine="default", path="leaky", read_log=False, repeats=2),
    Spec("utc_vllm_format", "the default suite against an engine logging in vLLM's own format (whole seconds, no "
         f"year) in UTC, the recorder in {RECORDER_TZ} (6 s grace: its stamps are whole seconds)", engine="utc",
         grace=6.0),
    Spec("foreign_streams", "the default suite direct while unrelated streams arrive at random (seeded), straight "
         "to the engine", path="foreign"),
    Spec("slow_reader_lost", "decode cancels through a proxy that loses the first target's cancel while the "
         "neighbours read slowly (each event handed on 1 s late)", path="proxy",
         proxy=dict(leak_only="target", late_s=1.0, late_only="neighbour"),
         scenario="decode,disconnect,chat", repeats=2),
    Spec("minted_ids", "the default suite through a gateway that mints its own X-Request-Id and passes "
         "disconnects on", path="mint_ids"),
    Spec("watch_sdk_direct_log", "`cancelwatch watch` straight to the engine, the openai SDK's streams broken "
         "off, timed out and read to their end, request log on", kind="watch", client="openai SDK"),
    Spec("watch_sdk_direct_default", "the same watch to vLLM on its defaults", kind="watch", engine="default",
         read_log=False, client="openai SDK"),
    Spec("watch_sdk_proxy_log", "the watch in front of the leaking proxy, openai SDK clients, request log on",
         kind="watch", path="leaky", client="openai SDK"),
    Spec("watch_sdk_proxy_default", "the watch in front of the leaking proxy to vLLM on its defaults",
         kind="watch", engine="default", path="leaky", read_log=False, client="openai SDK"),
    Spec("aiperf_direct_log", "the watch straight to the engine under AIPerf 0.13.0 (concurrency 4, half its 40 "
         "requests cancelled after 1 s), request log on", kind="watch", client=AIPERF),
    Spec("aiperf_direct_default", "the same, vLLM on its defaults", kind="watch", engine="default", read_log=False,
         client=AIPERF),
    Spec("aiperf_proxy_log", "AIPerf through the watch in front of the leaking proxy, request log on", kind="watch",
         path="leaky", client=AIPERF),
    Spec("aiperf_proxy_default", "AIPerf through the watch in front of the leaking proxy, vLLM on its defaults",
         kind="watch", engine="default", path="leaky", read_log=False, client=AIPERF),
    Spec("matrix", "the gateway matrix (disconnect, chat, nonstream_timeout) direct and through nginx and "
         "HAProxy in each configuration, a tap in front of each", kind="matrix", gateways=MATRIX_GATEWAYS),
    Spec("matrix_more", "the gateway matrix through the gateways beyond nginx and HAProxy (Caddy, Apache, Envoy, "
         "Traefik, the LiteLLM proxy, vllm-router; make gateways-all installs them), a tap in front of each",
         kind="matrix", gateways=MORE_GATEWAYS),
    Spec("triton_suite", "the Triton suite on the embedded tritonserver", kind="triton", engine="triton",
         scenario="triton", client="tritonclient (gRPC, HTTP)"),
]


# ---------------------------------------------------------------------------------------------- one rule each
# Situations built to show one rule, on the engine with its request log: the proxy of tests/proxies.py makes
# one cancel misbehave on purpose, and the manifest's facts say what it did. Lengths come from the engine's
# measured pace (tokens/s), so that the situation holds on a slower engine too.
LONG = 1200  # far more tokens than the engine makes while a loaded API server hands the client its first 20


def toml(*tables: dict) -> str:
    return "\n".join("[[scenario]]\n" + "\n".join(f"{k} = {json.dumps(v)}" for k, v in t.items()) for t in tables) + "\n"


def minted_lost(rid: str) -> bool:
    """the target of the minted_lost scenario"""
    return "-minted_lost-target-" in rid


def _decode(name: str, max_tokens: int, **more) -> dict:
    return {"name": name, "trigger": "after_tokens", "trigger_value": 20, "prompt_tokens": 600,
            "max_tokens": max_tokens, **more}


RUNS += [
    Spec("case_late_finish", "the engine finished the target before its client's stop: the proxy hands the "
         "target's chunks over 4 s late", path="proxy", proxy=dict(late_s=4.0, late_only="target"),
         toml=lambda p: toml(_decode("late_finish", 20 + min(20, max(5, round(p))), neighbour_max_tokens=60))),
    Spec("case_lost_inside_grace", "two lost cancels (the proxy never passes a disconnect on) whose requests end "
         "3 and 6.5 s of decoding after the stop, under a 6 s grace", path="proxy", proxy=dict(leak=True),
         grace=6.0, toml=lambda p: toml(*(_decode(f"leak_{n}", n) for n in (20 + round(3 * p), 20 + round(6.5 * p))))),
    Spec("case_slow_reader_lost", "a lost cancel beside a neighbour whose client reads slowly: the engine is "
         "done with the neighbour before the stop, its client reads on past the grace", path="proxy",
         proxy=lambda p: dict(leak_only="target", late_s=4.0 + 1.5, late_only="neighbour"),
         toml=lambda p: toml(_decode("lagging", 20 + round(5 * p), neighbour_max_tokens=20 + round(4 * p)))),
    Spec("case_minted_ids", "a gateway that sends every request upstream under an id of its own, and loses one "
         "scenario's cancel", path="proxy", proxy=dict(mint_ids=True, leak_only=minted_lost),
         toml=lambda p: toml(_decode("minted_clean", LONG), _decode("minted_lost", 20 + round(20 * p)))),
    Spec("case_waiting_prefill", "a target stopped while it waits behind three fillers and the neighbour: it "
         "held no KV", toml=lambda p: toml({"name": "waiting_prefill", "trigger": "before_first_token",
                                            "trigger_value": 1000, "fillers": 3,
                                            "filler_max_tokens": max(400, 20 + round(5 * p)),
                                            "neighbour_max_tokens": max(400, 20 + round(5 * p)) + 100,
                                            "prompt_tokens": 300, "max_tokens": 200})),
    Spec("case_shared_prefix", "a target whose prompt begins with the neighbour's: the prefix cache gives it the "
         "neighbour's blocks, which stay held when it goes",
         toml=lambda p: toml({"name": "shared", "trigger": "after_tokens", "trigger_value": 20, "prompt_tokens": 400,
                              "max_tokens": LONG, "share_prefix": True, "neighbour_max_tokens": 1000})),
    Spec("case_foreign_clean", "one request the ledger does not know enters the engine 0.1 s after the proxy sees "
         "the client go; the disconnect is passed on", path="proxy", proxy=dict(foreign_after_stop_s=0.1),
         toml=lambda p: toml(_decode("foreign_window", LONG))),
    Spec("case_foreign_lost", "the same, the disconnect never passed on", path="proxy",
         proxy=dict(foreign_after_stop_s=0.1, leak=True), toml=lambda p: toml(_decode("foreign_window", LONG))),
    Spec("case_burst_one_leaks", "two of three concurrent targets cancelled at once; the proxy loses one of the "
         "two cancels (6 s grace)", path="proxy", proxy=dict(leak_only="target"), grace=6.0,
         toml=lambda p: toml(_decode("burst_one_leaks", LONG, trigger_value=15, concurrency=3, cancel_count=2))),
    Spec("case_metrics_down", "/metrics (read through the proxy) down from the target's 15th token to 3.5 s after "
         "its client went", path="proxy", proxy=dict(metrics_down=(15, 3.5)), metrics_via_proxy=True,
         toml=lambda p: toml(_decode("metrics_gap", LONG))),
    Spec("case_races_lost", "the race scenario three times through the leaking proxy: its request runs its last "
         "2 tokens out", path="proxy", proxy=dict(leak=True),
         toml=lambda p: toml({"name": "race", "trigger": "near_completion_tokens", "trigger_value": 2,
                              "prompt_tokens": 200, "max_tokens": 40, "repeats": 3})),
    Spec("case_resubmit", "a gateway that passes the disconnect on, then sends the same request upstream again "
         "and reads it to its end", path="proxy", proxy=dict(resubmit_after_gone=True),
         toml=lambda p: toml(_decode("resubmit_gw", min(LONG, max(200, 20 + round(8 * p)))))),
    Spec("utc_log_tz_given", "the engine logging in vLLM's own format in UTC, the recorder told so "
         "(--engine-log-tz UTC)", engine="utc", scenario="decode,disconnect", engine_log_tz="UTC", grace=6.0),
]


def commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return sha + ("+uncommitted" if dirty else "")


def cli(args: list[str], *, home: Path, env: dict | None = None, timeout: float = RECORD_TIMEOUT_S,
        log: list | None = None) -> subprocess.CompletedProcess:
    """The real command line in a session of its own (as tests/conftest.py's cli)."""
    full = {**os.environ, "PYTHONUNBUFFERED": "1", "CANCELWATCH_HOME": str(home), **(env or {})}
    if log is not None:
        log.append(" ".join(["cancelwatch", *args]))
    return subprocess.run([sys.executable, "-m", "cancelwatch", *args], capture_output=True, text=True,
                          timeout=timeout, env=full, cwd=ROOT, start_new_session=True)


# ---------------------------------------------------------------------------------------------- engines
@contextmanager
def vllm_engine(kind: str, work: Path):
    from cancelwatch.collectors.engines import lifecycle
    from cancelwatch.collectors.engines import vllm_server

    home = work / f"engine-{kind}"
    env_tz = os.environ.get("TZ")
    if kind == "utc":
        os.environ["TZ"] = "UTC"
    try:
        state = vllm_server.start(home, port=lifecycle.free_port(), timeout_s=600,
                                  vllm_log_format=(kind == "utc"), log_requests=(kind != "default"))
    finally:
        if kind == "utc":
            os.environ.pop("TZ") if env_tz is None else os.environ.__setitem__("TZ", env_tz)
    try:
        yield home, state
    finally:
        lifecycle.stop(home, state.port)


@contextmanager
def path_to(spec: Spec, engine_url: str, kwargs: dict | None):
    """The proxy the run's path names in front of the engine (none for direct), and what it did."""
    from cancelwatch.collectors.engines.lifecycle import free_port
    from tests.proxies import ProxyBehaviour

    behaviour = kwargs if spec.path == "proxy" else {"leaky": dict(leak=True), "mint_ids": dict(mint_ids=True)}.get(spec.path)
    if behaviour is None:
        yield None
        return
    proxy = ProxyBehaviour(engine_url, free_port(), **behaviour).start()
    try:
        yield proxy
    finally:
        proxy.stop()


class ForeignStreams:
    """Unrelated streams straight to the engine at random (seeded) moments: at most `count`, each bounded."""

    def __init__(self, url: str, model: str, count: int = 16, seed: int = 7):
        self.url, self.model, self.count, self.rng = url, model, count, random.Random(seed)
        self.sent: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import httpx

        for i in range(self.count):
            if self._stop.wait(self.rng.uniform(2.0, 9.0)):
                return
            rid = f"foreign-{i:02d}"
            body = {"model": self.model, "prompt": " ".join(f"w{j}" for j in range(self.rng.randint(50, 400))),
                    "max_tokens": self.rng.randint(20, 200), "stream": True, "ignore_eos": True}
            try:
                with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=60,
                                  headers={"X-Request-Id": rid}) as resp:
                    for _ in resp.iter_lines():
                        pass
                self.sent.append(rid)
            except httpx.HTTPError:
                pass

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=90)


# ---------------------------------------------------------------------------------------------- clients
def sdk_clients(url: str, model: str, *, cancels: int = 10, full: int = 4, seed: int = 11) -> dict[str, str]:
    """The openai SDK through the watch, one request after another: streams broken off after a few tokens and
    closed (an app's Stop), non-streaming calls that time out, chat streams broken off, and short ones read to
    their end. Returns request id -> what the client did (`cancel` or `full`)."""
    import openai

    rng = random.Random(seed)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    done: dict[str, str] = {}
    plan = ["stream"] * (cancels - 4) + ["timeout"] * 2 + ["chat"] * 2 + ["full"] * full
    rng.shuffle(plan)
    for i, what in enumerate(plan):
        rid = f"sdk-{what}-{i:02d}"
        headers = {"X-Request-Id": rid}
        if what == "stream":
            break_off(client.completions.create(model=model, prompt=f"The sea {i}", max_tokens=1200, stream=True,
                                                extra_body={"ignore_eos": True}, extra_headers=headers),
                      rng.randint(3, 40))
        elif what == "chat":
            break_off(client.chat.completions.create(model=model, messages=[{"role": "user", "content": f"Hi {i}"}],
                                                     max_tokens=1200, stream=True, extra_body={"ignore_eos": True},
                                                     extra_headers=headers),
                      rng.randint(3, 40))
        elif what == "timeout":
            try:
                client.with_options(timeout=1.5).completions.create(
                    model=model, prompt=f"The hill {i}", max_tokens=1200, extra_body={"ignore_eos": True},
                    extra_headers=headers)
            except openai.APITimeoutError:
                pass
        else:
            stream = client.completions.create(model=model, prompt=f"The end {i}", max_tokens=12, stream=True,
                                               extra_headers=headers)
            for _ in stream:
                pass
        done[rid] = "full" if what == "full" else "cancel"
        time.sleep(rng.uniform(0.3, 1.5))
    return done


def break_off(stream, after: int) -> None:
    """Read `after` chunks of an SDK stream, then close it: an app's Stop."""
    for k, _ in enumerate(stream):
        if k >= after:
            break
    stream.close()


def aiperf_clients(url: str, model: str, tokenizer: str, out: Path, seed: int = 5) -> dict[str, str]:
    """AIPerf's bounded run (tests/test_watch_aiperf.py's command) through the watch: request id -> `cancel`
    for the requests AIPerf cancelled (its code 499), `full` for those it read to their end."""
    from tests.test_watch_aiperf import run_aiperf

    _, records = run_aiperf(url, model, tokenizer, out, seed)
    out_ = {}
    for r in records:
        rid = (r.get("metadata") or {}).get("x_request_id")
        if rid:
            out_[rid] = "cancel" if (r.get("error") or {}).get("code") == 499 else ("full" if not r.get("error") else "error")
    return out_


def engine_idle(url: str, limit_s: float = 240.0) -> None:
    """Until the engine holds no request (tests/test_watch_engine.py's reading), at most `limit_s`."""
    from tests.test_watch_engine import engine_busy

    deadline = time.monotonic() + limit_s
    while engine_busy(url) and time.monotonic() < deadline:
        time.sleep(0.5)


# ---------------------------------------------------------------------------------------------- one run
@dataclass
class Recorded:
    store: Path
    commands: list[str] = field(default_factory=list)
    engine: dict = field(default_factory=dict)
    proxy: dict = field(default_factory=dict)
    clients: dict = field(default_factory=dict)  # request id -> what the client did (watch runs)
    foreign: list[str] = field(default_factory=list)
    scenario_toml: str | None = None


def describe(kwargs: dict) -> str:
    """ProxyBehaviour's keyword arguments in words (a predicate by its docstring or name)."""
    return ", ".join(f"{k}={getattr(v, '__doc__', None) or v.__name__ if callable(v) else v!r}"
                     for k, v in kwargs.items())


_PACE: dict[str, float] = {}


def pace_of(state) -> float:
    """The engine's decode pace, tokens/s a stream beside a neighbour (tests/conftest.py's decode_rate), once."""
    if state.url not in _PACE:
        from tests.conftest import decode_rate

        _PACE[state.url] = decode_rate(state.url, state.served_model_name)
        print(f"corpus: the engine decodes {_PACE[state.url]:.1f} tokens/s a stream", flush=True)
    return _PACE[state.url]


def record_vllm(spec: Spec, work: Path, home: Path, state) -> Recorded:
    from cancelwatch.collectors.cancels.load import served_model

    rec = Recorded(work / f"{spec.name}.db")
    rec.engine = {"command": state.command, "log_requests": spec.engine != "default",
                  "log_format": "vLLM's own (%m-%d %H:%M:%S)" if spec.engine == "utc" else "milliseconds",
                  "tz": "UTC" if spec.engine == "utc" else os.environ.get("TZ", "the machine's"),
                  "engine_log_read": spec.read_log}
    recorder_home = work / f"recorder-{spec.name}"
    env = {"TZ": RECORDER_TZ} if spec.engine == "utc" else {}
    log_args = ["--engine-log", state.log_path] if spec.read_log else []
    if spec.read_log and spec.engine_log_tz:
        log_args += ["--engine-log-tz", spec.engine_log_tz]
    scenario = spec.scenario
    rec.engine["pace_tokens_s"] = round(pace_of(state), 1)
    kwargs = spec.proxy
    if callable(kwargs):
        kwargs = kwargs(pace_of(state))
    if spec.toml is not None:
        pace = pace_of(state)
        scenario = str(work / f"{spec.name}.toml")
        Path(scenario).write_text(spec.toml(pace))
        rec.scenario_toml = Path(scenario).read_text()
    with path_to(spec, state.url, kwargs) as proxy:
        target = proxy.url if proxy else state.url
        metrics = proxy.url if (proxy and spec.metrics_via_proxy) else state.url
        if spec.kind == "watch":
            from cancelwatch.collectors.engines.lifecycle import free_port
            from tests.test_watch_engine import wait_listening

            port = free_port()
            args = ["watch", "--listen", f"127.0.0.1:{port}", "--upstream", target, "--metrics-url", metrics,
                    "--store", str(rec.store), "--grace", str(GRACE_S), "--duration", "600", "--name", spec.name,
                    *log_args]
            rec.commands.append(" ".join(["cancelwatch", *args]))
            proc = subprocess.Popen([sys.executable, "-m", "cancelwatch", *args], cwd=ROOT, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                                    env={**os.environ, "CANCELWATCH_HOME": str(recorder_home), **env})
            try:
                wait_listening(port, proc)
                url = f"http://127.0.0.1:{port}"
                rec.clients = (aiperf_clients(url, served_model(state.url), state.model, work / f"aiperf-{spec.name}")
                               if spec.client == AIPERF else sdk_clients(url, served_model(state.url)))
                engine_idle(state.url)
                time.sleep(GRACE_S + 3)
            finally:
                proc.terminate()
                try:
                    out, err = proc.communicate(timeout=120)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    out, err = proc.communicate()
            if proc.returncode != 0:
                raise RuntimeError(f"{spec.name}: the watch ended {proc.returncode}: {err[-2000:]}")
        else:
            foreign = ForeignStreams(state.url, served_model(state.url)) if spec.path == "foreign" else None
            for i in range(spec.repeats):
                args = ["record", "--target", target, "--metrics-url", metrics, "--scenario", scenario,
                        "--store", str(rec.store), "--grace", f"{spec.grace:g}", "--name", f"{spec.name}-{i + 1}",
                        *log_args]
                if foreign is not None:
                    with foreign:
                        res = cli(args, home=recorder_home, env=env, log=rec.commands)
                    rec.foreign = list(foreign.sent)
                else:
                    res = cli(args, home=recorder_home, env=env, log=rec.commands)
                if res.returncode > 1:
                    raise RuntimeError(f"{spec.name}: record ended {res.returncode}: {res.stderr[-2000:]}")
                engine_idle(state.url)
            if proxy is not None and kwargs and kwargs.get("resubmit_after_gone"):
                deadline = time.monotonic() + 300
                while proxy.resubmit_done_at is None and proxy.resubmit_error is None and time.monotonic() < deadline:
                    time.sleep(0.2)
            if proxy is not None and kwargs and kwargs.get("foreign_after_stop_s") is not None:
                proxy.wait_foreign_done(90)
        if proxy is not None:
            rec.proxy = {"behaviour": spec.path if kwargs is None else describe(kwargs), **proxy.summary(),
                         "minted": dict(proxy.minted), "resubmitted": list(proxy.resubmitted),
                         "resubmit_done_at": proxy.resubmit_done_at, "resubmit_error": proxy.resubmit_error}
    return rec


def record_matrix(spec: Spec, work: Path) -> Recorded:
    rec = Recorded(work / f"{spec.name}.db")
    args = ["matrix", "--store", str(rec.store), "--out", str(work / "matrix-docs"),
            *[a for g in spec.gateways for a in ("--gateway", g)]]
    res = cli(args, home=work / "matrix-home", log=rec.commands, timeout=1800)
    if res.returncode != 0:
        raise RuntimeError(f"matrix ended {res.returncode}: {res.stderr[-2000:]}")
    rec.engine = {"command": "the embedded engine `cancelwatch matrix` starts", "log_requests": True,
                  "engine_log_read": True}
    return rec


def record_triton(spec: Spec, work: Path) -> Recorded:
    from cancelwatch.collectors.engines import lifecycle, triton_server

    rec = Recorded(work / f"{spec.name}.db")
    home = work / "triton-home"
    port = lifecycle.free_port()
    while any(lifecycle.port_in_use(port + k) for k in (1, 2)):
        port = lifecycle.free_port()
    state = triton_server.start(home, port=port)
    try:
        res = cli(["record", "--target", f"grpc://127.0.0.1:{port + 1}", "--scenario", "triton", "--store",
                   str(rec.store), "--name", spec.name], home=home, log=rec.commands)
        if res.returncode > 1:
            raise RuntimeError(f"triton record ended {res.returncode}: {res.stderr[-2000:]}")
        rec.engine = {"command": state.command, "engine_log_read": True}
    finally:
        lifecycle.stop(home, state.port)
    return rec


# ---------------------------------------------------------------------------------------------- the manifest
def keep(spec: Spec, rec: Recorded, manifest: dict) -> None:
    """Compact, gzip and enter the run: how it was recorded, and the truth its set-up makes certain."""
    from cancelwatch.runstore.compact import compact

    RUNS_DIR.mkdir(parents=True, exist_ok=True)
    compacted = rec.store.with_suffix(".compact.db")
    compact(rec.store, compacted)
    dest = RUNS_DIR / f"{spec.name}.db.gz"
    with open(compacted, "rb") as src, gzip.GzipFile(dest, "wb", compresslevel=9, mtime=0) as out:
        shutil.copyfileobj(src, out)
    runs = run_names(compacted)
    old = manifest["runs"].get(spec.name, {})
    commands = [c.replace(str(rec.store.parent), "$WORK") for c in rec.commands]
    engine = json.loads(json.dumps(rec.engine).replace(str(rec.store.parent), "$WORK"))
    manifest["runs"][spec.name] = {
        "file": str(dest.relative_to(CORPUS)),
        "what": spec.what,
        "recorded": {"by": "tests/corpus/record.py", "commit": commit(),
                     "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                     "commands": commands, "engine": engine, "path": spec.path,
                     "gateway": ", ".join(spec.gateways) if spec.kind == "matrix"
                     else ("tests/proxies.py ProxyBehaviour: " + spec.path if spec.path not in ("direct", "foreign")
                           else None),
                     "client": spec.client, "foreign_streams": rec.foreign or None,
                     "scenario_file": rec.scenario_toml,
                     "kind": spec.kind, "engine_log_read": spec.read_log},
        # what the truths rest on besides the store: what each client did, what the proxy did with each request
        "facts": {"clients": rec.clients, "proxy": proxy_facts(rec.proxy)},
        "runs": runs,
        "expected": old.get("expected", {}),
    }
    enter_truths(manifest["runs"][spec.name], compacted)


def run_names(store: Path) -> dict:
    """The manifest's `runs` of a store: run id -> {"name"}, the truths entered later."""
    from cancelwatch.runstore.reader import list_runs

    runs = list_runs(store)
    return {str(i): {"name": n} for i, n in zip(runs["id"], runs["name"])}


def proxy_facts(summary: dict) -> dict:
    """Per request the proxy saw: when its client went, when the proxy read the engine's answer to its end (its
    own clock, time.monotonic(), the runs' mono clock), and whether it leaked it (never passed the disconnect on)."""
    if not summary:
        return {}
    leaked = set(summary.get("leaked", []))
    return {"behaviour": summary.get("behaviour"), "minted": summary.get("minted", {}),
            "resubmitted": summary.get("resubmitted", []), "resubmit_done_at": summary.get("resubmit_done_at"),
            "resubmit_error": summary.get("resubmit_error"), "passed_on": summary.get("passed_on", []),
            "foreign_ids": summary.get("foreign_ids", []),
            "metrics_down": [summary.get("metrics_down_at"), summary.get("metrics_down_until")],
            "requests": {rid: {"client_gone_at": r.get("client_gone_at"), "upstream_done_at": r.get("upstream_done_at"),
                               "leaked": rid in leaked} for rid, r in summary.get("requests", {}).items()}}


def enter_truths(entry: dict, store: Path) -> None:
    """Each run's truths, from its store and the entry's facts (tests/corpus/truth.py)."""
    from cancelwatch.runstore.reader import load_run

    rec = entry["recorded"]
    for run_id, run in entry["runs"].items():
        run["truth"] = truths(load_run(store, int(run_id)), path=rec["path"], clients=entry["facts"]["clients"],
                              proxy=entry["facts"]["proxy"], engine_log_read=rec["engine_log_read"], kind=rec["kind"],
                              pace=(rec.get("engine") or {}).get("pace_tokens_s"))


# runs recorded from real servers by the tests before the corpus was, kept as they were: `make corpus` does not
# record them again (their recorders are named); their truths are worked out as every run's are
ADOPTED = [
    dict(name="aiperf_watch_direct_kept", file="runs/aiperf_watch_direct_kept.db.gz", kind="watch", path="direct",
         engine_log_read=True, client="AIPerf 0.13.0 (concurrency 4, 40 requests, half cancelled after 1 s)",
         what="AIPerf through the watch straight to the engine, request log on: the run tests/test_kv_blocks.py "
              "reads (a cancel aborted in the same step as two newcomers entered)",
         by="tests/test_watch_aiperf.py (make test-aiperf), kept by 4254fac", commit="4254fac"),
]


def adopt(manifest: dict) -> None:
    with tempfile.TemporaryDirectory(prefix="cancelwatch-corpus-") as tmp:
        for a in ADOPTED:
            entry = manifest["runs"].setdefault(a["name"], {"expected": {}})
            entry.update(file=a["file"], what=a["what"],
                         recorded={"by": a["by"], "commit": a["commit"], "commands": [a["by"]], "path": a["path"],
                                   "kind": a["kind"], "engine_log_read": a["engine_log_read"], "client": a["client"],
                                   "engine": {"log_requests": True, "log_format": "milliseconds"}},
                         facts={"clients": {}, "proxy": {}})
            store = unpack(entry, Path(tmp))
            entry["runs"] = run_names(store)
            enter_truths(entry, store)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="comma-separated run names (default: every run)")
    ap.add_argument("--truths", action="store_true", help="record nothing: work each run's truths out again from "
                    "its store and facts (after a change to tests/corpus/truth.py)")
    args = ap.parse_args(argv)
    if args.truths:
        manifest = load_manifest()
        adopt(manifest)
        with tempfile.TemporaryDirectory(prefix="cancelwatch-corpus-") as tmp:
            for name, entry in manifest["runs"].items():
                if "facts" in entry:
                    enter_truths(entry, unpack(entry, Path(tmp)))
        save_manifest(manifest)
        return 0
    chosen = [s for s in RUNS if not args.only or s.name in args.only.split(",")]
    unknown = set(filter(None, args.only.split(","))) - {s.name for s in RUNS}
    if unknown:
        print(f"record.py: unknown run(s) {', '.join(sorted(unknown))}; known: {', '.join(s.name for s in RUNS)}",
              file=sys.stderr)
        return 2
    manifest = load_manifest()
    work = Path(tempfile.mkdtemp(prefix="cancelwatch-corpus-"))
    failed = []
    try:
        by_engine: dict[str, list[Spec]] = {}
        for s in chosen:
            by_engine.setdefault(s.engine if s.kind in ("record", "watch") else s.kind, []).append(s)
        for engine, specs in by_engine.items():
            if engine in ("matrix", "triton"):
                for s in specs:
                    print(f"corpus: {s.name} ...", flush=True)
                    try:
                        rec = record_matrix(s, work) if engine == "matrix" else record_triton(s, work)
                        manifest = load_manifest()
                        keep(s, rec, manifest)
                        save_manifest(manifest)
                    except Exception as exc:  # noqa: BLE001 - one run's fault is said, the others go on
                        failed.append(f"{s.name}: {exc}")
                        print(f"corpus: {s.name} failed: {exc}", flush=True)
                continue
            with vllm_engine(engine, work) as (home, state):
                for s in specs:
                    print(f"corpus: {s.name} ...", flush=True)
                    t = time.monotonic()
                    try:
                        rec = record_vllm(s, work, home, state)
                        manifest = load_manifest()  # as it is now: another recorder may have written it
                        keep(s, rec, manifest)
                        save_manifest(manifest)
                        print(f"corpus: {s.name} recorded in {time.monotonic() - t:.0f} s", flush=True)
                    except Exception as exc:  # noqa: BLE001
                        failed.append(f"{s.name}: {exc}")
                        print(f"corpus: {s.name} failed: {exc}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for line in failed:
        print(f"record.py: {line}", file=sys.stderr)
    print("corpus: now `python -m tests.corpus.check` shows what the rules say of it; --bless keeps that")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
