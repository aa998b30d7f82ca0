"""Start a recording from the page: the real `cancelwatch record` in the background, one at a time,
bounded in time, and only against loopback targets unless others are allowed by name.

The page never sends a request itself: it starts the command line (which writes the run) and reads
the store as it fills, like any other reader.
"""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

from cancelwatch.runstore.paths import working_root
from cancelwatch.runstore.reader import StoreError, resolve_run_id

ROOT = working_root()
ALLOW_ENV = "CANCELWATCH_ALLOWED_TARGETS"  # comma-separated hosts or host:port pairs beyond loopback
MAX_RECORDING_S = 900.0  # a recording started from the page is stopped after this long
LOCK_NAME = ".page-recording.json"
LOG_NAME = ".page-recording.log"
EARLY_EXIT_S = 8.0  # how long start() waits for the run to appear (or for a one-line refusal)


class RecordingRefused(ValueError):
    """A recording the page will not start; the message is one line and names the fix."""


def allowed_hosts() -> set[str]:
    return {h.strip().lower() for h in os.environ.get(ALLOW_ENV, "").split(",") if h.strip()}


def _loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_target(url: str, what: str = "target") -> str:
    """The URL, trimmed, if the page may send requests there; else RecordingRefused."""
    url = (url or "").strip()
    parts = urlparse(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise RecordingRefused(f"{what} {url!r} is not an http(s) URL: give one like http://127.0.0.1:8000")
    host = parts.hostname
    if _loopback(host):
        return url
    allowed = allowed_hosts()
    if host.lower() in allowed or f"{host.lower()}:{parts.port}" in allowed:
        return url
    raise RecordingRefused(f"{what} {host} is not on this machine: the page only records loopback targets; "
                           f"allow it with {ALLOW_ENV}={host} in the dashboard's environment")


def current(folder: Path) -> dict | None:
    """The page's recording still running in this store folder, else None (a stale lock is cleared)."""
    lock = folder / LOCK_NAME
    try:
        info = json.loads(lock.read_text())
    except (OSError, ValueError):
        return None
    alive = _alive(info.get("pid"))
    if not alive:
        try:  # the page started it: reap it, and keep how it ended
            _, status = os.waitpid(int(info["pid"]), os.WNOHANG)
            if status and "returncode" not in info:
                info["returncode"] = os.waitstatus_to_exitcode(status)
                lock.write_text(json.dumps(info))
        except (ChildProcessError, OSError, ValueError):
            pass
        return None
    return info


def _alive(pid) -> bool:
    """A running (not zombie) `cancelwatch record` under this pid: a reused pid is someone else."""
    try:
        stat = Path(f"/proc/{int(pid)}/stat").read_text()
        cmdline = Path(f"/proc/{int(pid)}/cmdline").read_bytes().split(b"\0")
    except (OSError, TypeError, ValueError):
        return False
    state = stat.rsplit(")", 1)[-1].split()[0]
    return state != "Z" and b"cancelwatch" in cmdline and b"record" in cmdline


def last_error(folder: Path) -> str | None:
    """The last line the page's last recording wrote to stderr, when it failed."""
    try:
        info = json.loads((folder / LOCK_NAME).read_text())
        text = (folder / LOG_NAME).read_text(errors="replace")
    except (OSError, ValueError):
        return None
    rc = info.get("returncode")
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1] if rc not in (None, 0, 1) and lines else None


def _latest_id(store: Path) -> int | None:
    try:
        return resolve_run_id(store, "latest") if store.is_file() else None
    except StoreError:
        return None


def start(folder: Path, store: Path, target: str, metrics_url: str, scenarios: list[str],
          max_s: float = MAX_RECORDING_S) -> dict:
    """Start `cancelwatch record` on `store`; returns the lock's info once the run exists. Raises
    RecordingRefused with the command line's own one-line error when it refuses (a bad target)."""
    target = check_target(target)
    metrics_url = check_target(metrics_url, "metrics URL") if metrics_url.strip() else ""
    if not scenarios:
        raise RecordingRefused("no scenario chosen: pick at least one")
    running = current(folder)
    if running is not None:
        raise RecordingRefused(f"a recording started from the page is still running (pid {running['pid']}): wait for "
                               "it to end")
    cmd = [sys.executable, "-m", "cancelwatch", "record", "--target", target, "--scenario", ",".join(scenarios),
           "--store", str(store), "--name", "from the page"]
    if metrics_url:
        cmd += ["--metrics-url", metrics_url]
    before = _latest_id(store)
    log = open(folder / LOG_NAME, "w")  # noqa: SIM115 - the child writes it after this function returns
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
    log.close()
    info = {"pid": proc.pid, "started": time.time(), "max_s": max_s, "store": str(store), "target": target,
            "scenarios": scenarios}
    (folder / LOCK_NAME).write_text(json.dumps(info))
    deadline = time.monotonic() + EARLY_EXIT_S
    while time.monotonic() < deadline:
        rc = proc.poll()
        if rc is not None:
            info["returncode"] = rc
            (folder / LOCK_NAME).write_text(json.dumps(info))
            if rc not in (0, 1):
                raise RecordingRefused(last_error(folder) or f"cancelwatch record exited {rc}")
            break
        if _latest_id(store) not in (None, before):
            break
        time.sleep(0.2)
    return info


def enforce_limit(folder: Path) -> str | None:
    """Stop the page's recording once it ran past its bound; says so in one line when it did."""
    info = current(folder)
    if info is None or time.time() - info["started"] <= info.get("max_s", MAX_RECORDING_S):
        return None
    try:
        os.killpg(int(info["pid"]), signal.SIGINT)  # the recorder ends its run as interrupted, nothing lost
    except OSError:
        return None
    return f"the recording started from the page ran past {info.get('max_s', MAX_RECORDING_S):.0f} s and was stopped"
