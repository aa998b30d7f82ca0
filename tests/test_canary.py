"""The canary against the embedded engine, scraped by a real Prometheus evaluating deploy/'s rules: the
leak alert fires for the canary behind a proxy that never passes the cancel on, and not for the one
talking to the engine directly; SIGTERM ends a canary cleanly between rounds."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import ROOT, free_port
from tests.leaky_proxy import LeakyProxy
from tests.test_prometheus_import import Prometheus

pytestmark = pytest.mark.prometheus


def start_canary(home: Path, store: Path, listen: str, *args: str) -> subprocess.Popen:
    env = {**os.environ, "CANCELWATCH_HOME": str(home), "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "cancelwatch", "canary", "--every", "60s", "--scenario", "decode",
                             "--listen", listen, "--store", str(store), *args], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def first_round(proc: subprocess.Popen, timeout_s: float = 200) -> list[str]:
    """The canary's lines up to its first round's end (a bounded wait)."""
    lines, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line.rstrip())
        if line.startswith("canary round 1"):
            return lines
    proc.kill()
    pytest.fail(f"no first round in {timeout_s} s: {lines}")


def stop(proc: subprocess.Popen) -> tuple[int, str]:
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=30)
    return proc.returncode, rest


def alerts(prom: Prometheus) -> list[dict]:
    return httpx.get(prom.url + "/api/v1/alerts").json()["data"]["alerts"]


def test_the_leak_alert_fires_through_a_leaky_proxy_and_not_direct(engine, engine_home, tmp_path):
    direct_listen, leaky_listen = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    folder = tmp_path / "prom"
    folder.mkdir()
    shutil.copy(ROOT / "deploy" / "cancelwatch-rules.yml", folder / "cancelwatch-rules.yml")
    prom = Prometheus(folder, [direct_listen, leaky_listen], job="cancelwatch-canary",
                      rule_files=["cancelwatch-rules.yml"])
    proxy = LeakyProxy(engine.url, free_port()).start()
    try:
        direct = start_canary(engine_home, tmp_path / "direct.db", direct_listen, "--target", engine.url)
        lines = first_round(direct)
        time.sleep(3)  # a few scrapes of its metrics
        code, rest = stop(direct)
        assert "1 released" in lines[-1], lines
        assert code == 0 and "SIGTERM, stopping" in rest and "1 round(s)" in rest, rest
        leaky = start_canary(engine_home, tmp_path / "leaky.db", leaky_listen, "--target", proxy.url,
                             "--metrics-url", engine.url)
        lines = first_round(leaky)
        assert "1 leaked" in lines[-1], lines
        firing, deadline = [], time.monotonic() + 40
        while time.monotonic() < deadline and not firing:
            firing = [a for a in alerts(prom) if a["labels"]["alertname"] == "CancelwatchCancelLeaked"
                      and a["state"] == "firing"]
            time.sleep(0.5)
        stop(leaky)
        assert firing, alerts(prom)
        assert {a["labels"]["instance"] for a in firing} == {leaky_listen}  # never the direct canary
        released = httpx.get(prom.url + "/api/v1/query", params={
            # the direct canary has stopped: its series went stale, so ask over the last minutes
            "query": f'max_over_time(cancelwatch_cancels_total{{instance="{direct_listen}",verdict="released"}}[5m])'
        }).json()
        assert float(released["data"]["result"][0]["value"][1]) == 1.0
    finally:
        proxy.stop()
        prom.stop()


def test_a_round_against_a_dead_target_is_counted_and_the_canary_keeps_serving(tmp_path):
    listen = f"127.0.0.1:{free_port()}"
    proc = start_canary(tmp_path / "home", tmp_path / "cw.db", listen, "--target", f"http://127.0.0.1:{free_port()}")
    try:
        deadline = time.monotonic() + 60
        errors = None
        while time.monotonic() < deadline:
            try:
                body = httpx.get(f"http://{listen}/metrics", timeout=2).text
            except httpx.HTTPError:
                time.sleep(0.3)
                continue
            values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in body.splitlines()
                      if line.startswith("cancelwatch_round_errors_total")}
            errors = values.get("cancelwatch_round_errors_total")
            if errors:
                break
            time.sleep(0.3)
        assert errors == 1.0
    finally:
        code, rest = stop(proc)
    assert code == 0 and "round 1 failed" in rest
