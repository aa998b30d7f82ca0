"""`cancelwatch watch` under faults (issue 21, point 6), with no engine: a server of recorded vLLM /metrics
bodies (tests/fixture_server.py) stands for the engine, both the upstream the watch passes traffic to and
the /metrics it samples. A flood past --max-connections is answered 503 by the watch and counted; the
engine going away is a refusal its clients get as it was, said once and counted, and a hole in the run,
never its end (a `record` would end `target_lost` after 10 s); SIGTERM still ends it completed, with
everything seen before written."""

from __future__ import annotations

import json
import re
import signal
import socket
import time

import httpx

from cancelwatch.runstore.reader import load_run
from tests.conftest import FIXTURES, cli, cli_popen, free_port
from tests.fixture_server import MetricsFixtureServer
from tests.test_watch_engine import wait_listening

LOST_AFTER_S = 10.0  # RecordSettings.lost_after_s: a record run would end target_lost past it


def counter(metrics_port: int, name: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).text
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def until(check, limit_s: float = 10.0) -> bool:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.1)
    return check()


def test_a_flood_past_the_bound_gets_503_and_an_engine_gone_does_not_end_the_watch(tmp_path):
    engine = MetricsFixtureServer(FIXTURES / "vllm" / "0.32" / "idle.txt").start()
    engine_url = engine.url
    port, mport, store = free_port(), free_port(), tmp_path / "watch.db"
    proc = cli_popen("watch", "--listen", f"127.0.0.1:{port}", "--upstream", engine.url, "--metrics-listen",
                     f"127.0.0.1:{mport}", "--store", str(store), "--hz", "10", "--max-connections", "1",
                     "--duration", "300", home=tmp_path / "home")
    held = None
    try:
        wait_listening(port, proc)
        url = f"http://127.0.0.1:{port}/version"
        # through the watch to the "engine", once the connection wait_listening made and closed is over for the
        # watch too: until then it takes the whole bound (seen under -n 2: the first request got the 503)
        first: list[int] = []
        assert until(lambda: first.append(httpx.get(url, timeout=5).status_code) or first[-1] == 200), first
        assert set(first) <= {200, 503}, first
        # one connection held open (a kept-alive client between requests) takes the whole bound, once the
        # first request's connection is over on both sides
        refused = first.count(503)  # 503s the clients got: each one the watch must count
        for _ in range(50):
            held = socket.create_connection(("127.0.0.1", port))
            held.settimeout(5)
            held.sendall(b"GET /version HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = held.recv(4096)
            if answer.startswith(b"HTTP/1.1 200"):
                break
            assert answer.startswith(b"HTTP/1.1 503"), answer
            refused += 1
            held.close()
            time.sleep(0.1)
        assert answer.startswith(b"HTTP/1.1 200"), answer
        flood = [httpx.get(url, timeout=5, headers={"Connection": "close"}) for _ in range(3)]
        assert [r.status_code for r in flood] == [503] * 3, [r.text for r in flood]
        assert "--max-connections" in flood[0].text and flood[0].headers["retry-after"] == "1"
        refused += 3
        assert until(lambda: counter(mport, "cancelwatch_watched_refused_total") == refused), refused
        held.close()
        held = None
        # the engine goes away: a client is refused as it would be (reset), the watch says so and goes on
        engine.stop()
        time.sleep(0.5)  # the held connection's end reaches the tap
        try:
            status = httpx.get(url, timeout=5).status_code
        except (httpx.ReadError, httpx.RemoteProtocolError, httpx.ConnectError) as exc:
            status = type(exc).__name__
        # the reset reaches the client while it sends, or while it waits for the answer
        assert status in ("ConnectError", "ReadError", "RemoteProtocolError"), status
        assert until(lambda: counter(mport, "cancelwatch_watched_upstream_failures_total") >= 1.0)
        # past the time after which a record run ends target_lost, the watch is still watching
        time.sleep(LOST_AFTER_S + 1.0)
        assert proc.poll() is None, proc.communicate()
        assert counter(mport, "cancelwatch_watched_upstream_failures_total") >= 1.0
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if held is not None:
            held.close()
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        engine.stop()
    assert proc.returncode == 0, stdout + stderr
    # said once each, not once per connection
    assert stderr.count("the upstream refused a connection") == 1, stderr
    assert stderr.count("new ones are answered 503") == 1, stderr
    run = load_run(store, "latest")
    assert run.info["status"] == "completed", run.info["status"]
    kinds = run.events["kind"].value_counts().to_dict()
    assert kinds.get("tap_refused") == refused and kinds.get("tap_upstream_failed", 0) >= 1, kinds
    # the engine's absence is a hole in the samples the run marks, not its end
    assert not run.gaps.empty and (run.gaps["source"] == "vllm").any(), run.gaps
    assert run.info["settings"]["watch"]["max_connections"] == 1
    # the report says what the watch saw, not a neighbour it never sent
    doc = json.loads(cli("report", "latest", "--json", "--store", str(store), home=tmp_path / "home").stdout)
    assert doc["neighbours_ok"] is None and doc["watch"]["requests"] == len(run.ledger), doc
    # its GETs passed the tap, but asked the engine for no work: the ledger holds no row of them
    assert kinds.get("tap_request", 0) >= 2 and run.ledger.empty, (kinds, run.ledger)
    text = cli("report", "latest", "--store", str(store), home=tmp_path / "home").stdout
    assert f"watched: {len(run.ledger)} request(s) through http://127.0.0.1:{port} -> {engine_url}" in text, text
    assert "neighbours ok" not in text
