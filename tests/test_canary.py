"""The canary against the embedded engine, scraped by a real Prometheus evaluating deploy/'s rules: the
leak alert fires for the canary behind a proxy that never passes the cancel on, and not for the one
talking to the engine directly; SIGTERM ends a canary cleanly between rounds."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import ROOT, free_port
from tests.leaky_proxy import LeakyProxy
from tests.test_prometheus_import import Prometheus

pytestmark = pytest.mark.prometheus

# the canaries' --every: longer than any test here runs (pytest's timeout), so that each canary does one round
# and SIGTERM finds it between rounds however slow the engine's rounds are (60 s was once, and a round longer
# than that had the next one begun, for the signal to wait out)
PERIOD_S = 600.0


class Canary:
    """A `cancelwatch canary` process whose output (stderr with it) is read on a thread, each line with the
    instant it came: waits on it have deadlines, and a round's length is measured, not assumed."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self.lines: list[tuple[float, str]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip()))

    def text(self, since: float = 0.0) -> list[str]:
        return [line for t, line in list(self.lines) if t >= since]

    def wait_line(self, prefix: str, timeout_s: float) -> tuple[float, list[str]]:
        """(when the first line starting with `prefix` came, every line up to it); else kill it and fail
        with what it printed."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for i, (t, line) in enumerate(list(self.lines)):
                if line.startswith(prefix):
                    return t, [x for _, x in self.lines[: i + 1]]
            if self.proc.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.05)
        self.proc.kill()
        self.proc.wait(10)
        pytest.fail(f"no line {prefix!r} from the canary within {timeout_s:.0f} s "
                    f"(exit {self.proc.returncode}): {self.text()}")

    def first_round(self, timeout_s: float = 300) -> list[str]:
        """The canary's lines up to its first round's end; measures that round (from the line the canary prints
        as it starts its loop to the round's line) into `round_s`."""
        self.started, _ = self.wait_line("canary: ", timeout_s)
        ended, lines = self.wait_line("canary round 1", timeout_s - (time.monotonic() - self.started))
        self.round_s = ended - self.started
        return lines

    def stop(self) -> tuple[int, str]:
        """SIGTERM, and its exit: a round in progress would finish first, so the wait is twice the round this
        canary measured, and a margin; a canary that outlasts it is killed, and what it printed is said."""
        timeout_s = 30 + 2 * getattr(self, "round_s", 30.0)
        sent = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            pytest.fail(f"the canary did not exit within {timeout_s:.0f} s of SIGTERM (its first round took "
                        f"{getattr(self, 'round_s', float('nan')):.1f} s); after the signal it printed: "
                        f"{self.text(since=sent)}")
        self.stopped_s = time.monotonic() - sent
        self._reader.join(10)
        return self.proc.returncode, "\n".join(self.text(since=sent))


def start_canary(home: Path, store: Path, listen: str, *args: str) -> Canary:
    env = {**os.environ, "CANCELWATCH_HOME": str(home), "PYTHONUNBUFFERED": "1"}
    return Canary(subprocess.Popen([sys.executable, "-m", "cancelwatch", "canary", "--every", f"{PERIOD_S:.0f}s",
                                    "--scenario", "decode", "--listen", listen, "--store", str(store), *args],
                                   env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                   start_new_session=True))  # as conftest.cli: a session's share of the CPU


def prometheus_value(prom: Prometheus, query: str, timeout_s: float = 60) -> float:
    """The value of `query` once Prometheus has one (the target scraped, the series there); else fail with
    the last answer."""
    deadline, answer = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        answer = httpx.get(prom.url + "/api/v1/query", params={"query": query}, timeout=5).json()
        if answer["data"]["result"]:
            return float(answer["data"]["result"][0]["value"][1])
        time.sleep(0.3)
    pytest.fail(f"Prometheus had no value for {query} within {timeout_s:.0f} s; last answer {answer}")


def alerts(prom: Prometheus) -> list[dict]:
    return httpx.get(prom.url + "/api/v1/alerts").json()["data"]["alerts"]


@pytest.mark.slow
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
        lines = direct.first_round()
        # until Prometheus has scraped the round's verdict off the canary's metrics
        prometheus_value(prom, f'cancelwatch_cancels_total{{instance="{direct_listen}",verdict="released"}} == 1')
        code, rest = direct.stop()
        assert "1 released" in lines[-1], lines
        assert code == 0 and "SIGTERM, stopping" in rest and "1 round(s)" in rest, rest
        leaky = start_canary(engine_home, tmp_path / "leaky.db", leaky_listen, "--target", proxy.url,
                             "--metrics-url", engine.url)
        lines = leaky.first_round()
        assert "1 leaked" in lines[-1], lines
        firing, deadline = [], time.monotonic() + 40
        while time.monotonic() < deadline and not firing:
            firing = [a for a in alerts(prom) if a["labels"]["alertname"] == "CancelwatchCancelLeaked"
                      and a["state"] == "firing"]
            time.sleep(0.5)
        leaky.stop()
        assert firing, alerts(prom)
        assert {a["labels"]["instance"] for a in firing} == {leaky_listen}  # never the direct canary
        # the direct canary has stopped: its series went stale, so ask over the time since it started (minutes
        # where the engine is fast, more where the rounds are slow)
        since_s = int(time.monotonic() - direct.started) + 60
        released = httpx.get(prom.url + "/api/v1/query", params={
            "query": f'max_over_time(cancelwatch_cancels_total{{instance="{direct_listen}",verdict="released"}}'
                     f'[{since_s}s])'
        }).json()
        assert released["data"]["result"], (since_s, released)
        assert float(released["data"]["result"][0]["value"][1]) == 1.0
        print(f"rounds: direct {direct.round_s:.1f} s, leaky {leaky.round_s:.1f} s; SIGTERM to exit: direct "
              f"{direct.stopped_s:.1f} s, leaky {leaky.stopped_s:.1f} s")
    finally:
        proxy.stop()
        prom.stop()


def test_a_round_against_a_dead_target_is_counted_and_the_canary_keeps_serving(tmp_path):
    listen = f"127.0.0.1:{free_port()}"
    canary = start_canary(tmp_path / "home", tmp_path / "cw.db", listen, "--target", f"http://127.0.0.1:{free_port()}")
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
        assert errors == 1.0, f"cancelwatch_round_errors_total as last served within 60 s: {errors}"
    finally:
        code, rest = canary.stop()
    assert code == 0 and "round 1 failed" in "\n".join(canary.text()), canary.text()
