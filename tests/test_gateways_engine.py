"""Cancels through real gateways, traced hop by hop: Debian's nginx and HAProxy between the client and the
embedded engine, a tap (`record --hop`) in front of each, the engine's own log for the verdict. And the taps
never change what they measure: the default suite through a tap is released as it is direct, and the
leaking test proxy behind taps is still leaked, with the trace naming it as where the cancel stopped."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from cancelwatch.collectors.engines import gateways as gw_mod
from cancelwatch.runstore.reader import load_run
from tests.conftest import cli, free_port
from tests.leaky_proxy import LeakyProxy
from tests.test_cancels_engine import assert_recorded

pytestmark = [pytest.mark.timeout(1800),
              pytest.mark.skipif(not (gw_mod.GATEWAYS["nginx"].binary() and gw_mod.GATEWAYS["haproxy"].binary()),
                                 reason="nginx and haproxy are installed by `make test` (make gateways)")]


def record_through(engine, home: Path, tmp_path: Path, scenarios: str, gateway: str | None = None,
                   proxy=None, *extra: str):
    """`record` with a tap in front of the gateway (or of `proxy`, a LeakyProxy class started here in front of
    the engine's tap, named `leaky`) and one in front of the engine; returns (record's result, the report,
    the run)."""
    tap_engine, tap_front = free_port(), free_port()
    hops, running, started = [], None, None
    if gateway is not None:
        gw_port = free_port()
        running = gw_mod.start(gw_mod.GATEWAYS[gateway], tmp_path / gateway, gw_port, tap_engine)
        hops.append(f"{gateway}=127.0.0.1:{tap_front},http://127.0.0.1:{gw_port}")
    elif proxy is not None:
        started = proxy(f"http://127.0.0.1:{tap_engine}", free_port()).start()
        hops.append(f"leaky=127.0.0.1:{tap_front},{started.url}")
    else:
        tap_front = tap_engine
    hops.append(f"vllm=127.0.0.1:{tap_engine},{engine.url}")
    store = tmp_path / "cw.db"
    try:
        res = cli("record", "--target", f"http://127.0.0.1:{tap_front}", "--metrics-url", engine.url,
                  "--scenario", scenarios, "--store", str(store), *[a for h in hops for a in ("--hop", h)], *extra,
                  home=home, timeout=1500)
    finally:
        if running is not None:
            gw_mod.stop(running)
        if started is not None:
            started.stop()
    assert res.returncode in (0, 1), res.stdout[-3000:] + res.stderr[-3000:]
    doc = json.loads(cli("report", "latest", "--json", "--store", str(store)).stdout)
    return res, doc, load_run(store, "latest"), started


def by_scenario(doc) -> dict:
    return {c["scenario"]: c for c in doc["cancels"]}


def hops_of(c) -> dict:
    return {h["hop"]: h for h in c["hops"]}


def tap_times(run, kind: str, request_id: str) -> dict:
    """{hop: run time} of the taps' `kind` events (tap_request, tap_response_end) for one request."""
    ev = run.events[(run.events["kind"] == kind) & (run.events["request_id"] == request_id)]
    return {json.loads(d)["hop"]: t for d, t in zip(ev["data"], ev["t_s"])}


@pytest.mark.slow
def test_nginx_ignoring_client_aborts_keeps_a_timed_out_request_and_passes_a_stream_disconnect_on(
        engine, engine_home, tmp_path):
    _, doc, run, _ = record_through(engine, engine_home, tmp_path, "nonstream_timeout,disconnect", "nginx-ignore-abort")
    cancels = by_scenario(doc)
    timeout, stream = cancels["nonstream_timeout"], cancels["disconnect"]
    nginx, vllm = hops_of(timeout)["nginx-ignore-abort"], hops_of(timeout)["vllm"]
    # the client's timeout closed its side of the tap in front of nginx; nginx kept the engine's connection
    # open, and the engine ran the request for nobody: the cancel stopped at nginx
    assert nginx["matched"] == "id" and nginx["reached_s"] is not None, json.dumps(timeout, indent=1)
    end_at = tap_times(run, "tap_response_end", timeout["request_id"])
    if nginx["passed_s"] is None:
        # kept to the request's natural end: the engine's answer came, complete (and nginx wrote it to a
        # client long gone)
        assert vllm["reached_s"] is None, json.dumps(timeout, indent=1)
        assert set(end_at) == {"vllm", "nginx-ignore-abort"}, end_at
        assert nginx["upstream_end_s"] == pytest.approx(end_at["vllm"], abs=0.01)
        assert end_at["vllm"] - nginx["reached_s"] > timeout["evidence"]["grace_s"], (end_at, nginx)
    else:
        # or until nginx's own clock ended it: an engine too slow to answer 1500 tokens within nginx's
        # proxy_read_timeout (60 s, as shipped: no byte of a non-streamed answer comes before its end) is
        # closed by nginx then, 60 s after the request went, whatever the client did. Late is still kept
        sent_at = tap_times(run, "tap_request", timeout["request_id"])
        assert nginx["passed_s"] - sent_at["vllm"] == pytest.approx(60.0, abs=5.0), (sent_at, nginx)
        assert vllm["reached_s"] == nginx["passed_s"] and "vllm" not in end_at, json.dumps(timeout, indent=1)
        assert timeout["evidence"]["rule"] == "abort_after_grace", timeout["evidence"]
    assert timeout["evidence"]["stopped_at"] == "nginx-ignore-abort", timeout["evidence"]
    assert "the cancel stopped at `nginx-ignore-abort`" in timeout["evidence"]["path"]
    assert timeout["verdict"] == "leaked", json.dumps(timeout, indent=1)
    # the stream: nginx's write to a client that went failed, and it closed upstream: traced to the engine
    s_nginx, s_vllm = hops_of(stream)["nginx-ignore-abort"], hops_of(stream)["vllm"]
    assert s_nginx["reached_s"] is not None and s_nginx["passed_s"] is not None, json.dumps(stream, indent=1)
    assert s_vllm["reached_s"] == s_nginx["passed_s"] and s_vllm["passed_by"] == "engine log", stream["hops"]
    assert stream["verdict"] == "released" and stream["evidence"].get("stopped_at") is None, json.dumps(stream, indent=1)
    # app_received: the tap in front of the gateway, said to be a socket close
    assert stream["timepoint_sources"]["app_received"]["source"] == "tap"
    assert stream["timepoints"]["app_received"] == s_nginx["reached_s"]


# HAProxy's run is in `make test-slow`: the two hops are the same code, and nginx is the gateway of the page
@pytest.mark.parametrize("gateway", ["nginx", pytest.param("haproxy", marks=pytest.mark.slow)])
def test_each_cancel_is_traced_through_two_hops(engine, engine_home, tmp_path, gateway):
    """A non-streaming timeout, a stream disconnect and a chat stream, through a gateway as shipped: each
    found at both taps by its id, its way written down hop by hop, judged on the engine's log."""
    _, doc, run, _ = record_through(engine, engine_home, tmp_path, "nonstream_timeout,disconnect,chat", gateway)
    assert {c["scenario"] for c in doc["cancels"]} == {"nonstream_timeout", "disconnect", "chat"}
    sent = set(run.events.loc[run.events["kind"] == "tap_request", "request_id"].dropna())
    unsent = [c for c in doc["cancels"] if c["request_id"] not in sent]
    # the machine can hold the whole recorder up past a timeout's deadline before its request leaves it (CI:
    # every sampler woke 1.2 s late, and the timeout, then 1 s, now 2.5 s, fired first): no tap saw the
    # request, and the truth is that the engine never had it, never a release or a leak. At most one such
    assert len(unsent) <= 1, json.dumps(unsent, indent=1)
    for c in unsent:
        assert (c["verdict"], c["evidence"]["rule"]) == ("inconclusive", "never_added"), json.dumps(c, indent=1)
        assert all(h["reached_s"] is None for h in c["hops"]), json.dumps(c, indent=1)
    for c in doc["cancels"]:
        if c in unsent:
            continue
        front, back = hops_of(c)[gateway], hops_of(c)["vllm"]
        assert front["matched"] == "id" and back["matched"] == "id", json.dumps(c, indent=1)
        assert front["reached_s"] is not None, json.dumps(c, indent=1)  # the client's close reached the gateway
        if front["passed_s"] is not None:  # passed on: the engine's tap saw it when the gateway did
            assert back["reached_s"] == front["passed_s"], json.dumps(c, indent=1)
        held_s = None if front["passed_s"] is None else front["passed_s"] - front["reached_s"]
        if held_s is not None and held_s <= c["evidence"]["grace_s"]:  # passed on in time: the engine's log
            assert c["verdict"] == "released", json.dumps(c, indent=1)
        else:
            # kept: the trace names the gateway, and the engine's evidence says leaked. Kept to the end of the
            # request, or until the gateway's own clock ended it: HAProxy's shipped `timeout server 50000` reset
            # the engine's connection 47.5 s after the client left (CI, an engine too slow to finish 1500 tokens
            # in 50 s), and the engine ran the request for nobody until then: late is leaked, never released
            assert c["evidence"]["stopped_at"] == gateway and c["verdict"] == "leaked", json.dumps(c, indent=1)
            if held_s is not None:
                assert c["evidence"]["rule"] == "abort_after_grace", json.dumps(c, indent=1)
        print(f"{gateway} {c['scenario']}: {c['verdict']}, {c['evidence']['path']}")


@pytest.mark.slow
def test_the_default_suite_through_a_tap_is_released_as_direct(engine, engine_home, tmp_path):
    res, doc, run, _ = record_through(engine, engine_home, tmp_path, "default")
    assert_recorded(res, doc, run)
    for c in doc["cancels"]:
        (step,) = c["hops"]
        assert step["hop"] == "vllm" and step["feeds_engine"], c["hops"]
        if c["scenario"] == "inproc":  # its requests go to the relay app, beside the path: the tap never saw it
            assert step["matched"] is None and step["note"], step
            continue
        # every other request is the client's own at the tap (its id), its close passed on as it came
        assert step["matched"] == "id", c["hops"]
    closes = run.events[run.events["kind"] == "tap_closed"]
    assert len(closes) >= len(doc["cancels"])


@pytest.mark.slow  # the leaking proxy is leaked in test_watch_engine.py; where taps end, below
def test_the_leaking_proxy_behind_taps_is_still_leaked_and_named(engine, engine_home, tmp_path):
    _, doc, run, proxy = record_through(engine, engine_home, tmp_path, "disconnect", None, LeakyProxy)
    (c,) = doc["cancels"]
    assert proxy.client_gone >= 1
    assert c["verdict"] == "leaked" and c["evidence"]["stopped_at"] == "leaky", json.dumps(c, indent=1)
    leaky, vllm = hops_of(c)["leaky"], hops_of(c)["vllm"]
    # its client went; it read the engine's answer to its end through the tap behind it
    assert leaky["reached_s"] is not None and leaky["passed_s"] is None, c["hops"]
    assert vllm["matched"] == "id" and vllm["reached_s"] is None, c["hops"]
    assert leaky["upstream_end_s"] - leaky["reached_s"] > c["evidence"]["grace_s"], c["hops"]


@pytest.mark.slow
def test_matrix_writes_the_page_for_nginx_and_haproxy_in_one_command(engine, engine_home, tmp_path):
    out = tmp_path / "docs"
    res = cli("matrix", "--target", engine.url, "--engine-log", engine.log_path, "--gateway", "nginx",
              "--gateway", "haproxy", "--scenario", "disconnect,nonstream_timeout", "--out", str(out),
              "--store", str(tmp_path / "matrix.db"), home=engine_home, timeout=1500)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    md, page = (out / "matrix.md").read_text(), (out / "matrix.html").read_text()
    for name in ("direct", "nginx", "haproxy"):
        assert f"| {name} |" in md, md
    assert re.search(r"\| nginx \| 1\.\d+\.\d+ \|", md) and re.search(r"\| haproxy \| 2\.\d+", md), md  # as printed
    assert "proxy_pass http://127.0.0.1:" in md and "backend engine" in md  # the configs the matrix wrote
    assert page.startswith("<!doctype html>") and "<script" not in page and "http" in page
    rows = [line.split(" | ") for line in md.splitlines() if line.startswith("| direct |")]
    assert len(rows) == 2, md
    # direct, every cancel reached the engine; but a machine that holds the recorder up past a timeout's
    # deadline before its request left (CI: 1.2 s on two cores) leaves the engine nothing to cancel, and the
    # page says so: at most the one timeout, said as such, never a "no"
    unsent = [r for r in rows if r[4] != "yes"]
    assert len(unsent) <= 1 and all(r[3] == "nonstream_timeout" and r[4] == "never reached the engine"
                                    and r[7] == "inconclusive (never_added) |" for r in unsent), md


def test_the_readme_hop_command_as_written(engine, engine_home, tmp_path):
    """The README's command, its ports moved to free ones: the client to the tap in front of nginx (as shipped),
    nginx to the tap in front of the engine."""
    from tests.readme_commands import RUN

    (cmd,) = [c for c, test in RUN.items() if test.endswith("::test_the_readme_hop_command_as_written")]
    tap1, tap2, nginx_port = free_port(), free_port(), free_port()
    engine_port = engine.url.rsplit(":", 1)[1]
    args = (cmd.replace("9001", str(tap1)).replace("9002", str(tap2)).replace("8080", str(nginx_port))
            .replace("8000", engine_port)).split()[1:]
    store = tmp_path / "cw.db"
    running = gw_mod.start(gw_mod.GATEWAYS["nginx"], tmp_path / "nginx", nginx_port, tap2)
    try:
        res = cli(*args, "--store", str(store), home=engine_home, timeout=600)
    finally:
        gw_mod.stop(running)
    assert res.returncode in (0, 1), res.stdout[-3000:] + res.stderr[-3000:]
    doc = json.loads(cli("report", "latest", "--json", "--store", str(store)).stdout)
    (c,) = doc["cancels"]
    assert [h["hop"] for h in c["hops"]] == ["nginx", "vllm"] and c["hops"][0]["reached_s"] is not None, c
    print(f"the README's command: {c['verdict']}, {c['evidence']['path']}")



def test_where_the_taps_end_the_engines_own_evidence_says_whether_the_cancel_came_through(engine, engine_home,
                                                                                           tmp_path):
    """As users tap where they can: client -> tap -> nginx -> tap -> HAProxy -> vLLM, no tap between HAProxy and the
    engine. A cancel the engine's abort line shows gone within the grace passed HAProxy (by then, at the latest),
    and no trace names a stop the engine's evidence contradicts; one the engine kept stopped at HAProxy or past it."""
    tap_front, tap_hap, nginx_port, hap_port = free_port(), free_port(), free_port(), free_port()
    running = []
    store = tmp_path / "cw.db"
    try:
        running.append(gw_mod.start(gw_mod.GATEWAYS["haproxy"], tmp_path / "haproxy", hap_port, engine.port))
        running.append(gw_mod.start(gw_mod.GATEWAYS["nginx"], tmp_path / "nginx", nginx_port, tap_hap))
        hops = [f"nginx=127.0.0.1:{tap_front},http://127.0.0.1:{nginx_port}",
                f"haproxy=127.0.0.1:{tap_hap},http://127.0.0.1:{hap_port}"]
        res = cli("record", "--target", f"http://127.0.0.1:{tap_front}", "--metrics-url", engine.url, "--scenario",
                  "disconnect,chat", "--store", str(store), *[a for h in hops for a in ("--hop", h)], home=engine_home,
                  timeout=900)
    finally:
        for r in running:
            gw_mod.stop(r)
    assert res.returncode in (0, 1), res.stdout[-3000:] + res.stderr[-3000:]
    doc = json.loads(cli("report", "latest", "--json", "--store", str(store)).stdout)
    assert {c["scenario"] for c in doc["cancels"]} == {"disconnect", "chat"}
    for c in doc["cancels"]:
        nginx, hap = hops_of(c)["nginx"], hops_of(c)["haproxy"]
        assert not hap["feeds_engine"] and hap["untapped"] and nginx["passed_by"] == "tap haproxy", json.dumps(c)
        assert hap["reached_s"] is not None, json.dumps(c, indent=1)
        if c["verdict"] == "released":
            assert c["timepoint_sources"]["engine_abort"]["source"] == "engine_log", json.dumps(c, indent=1)
            assert hap["passed_by"] == "engine log" and c["evidence"].get("stopped_at") is None, json.dumps(c, indent=1)
            assert "(no tap behind it: at most, by the engine's abort line)" in c["evidence"]["path"]
        else:
            assert c["verdict"] == "leaked" and c["evidence"]["stopped_at"] in ("nginx", "haproxy"), json.dumps(c)
        print(f"{c['scenario']}: {c['verdict']}, {c['evidence']['path']}")


def matrix_of(engine, engine_home: Path, tmp_path: Path, gateways: list[str], scenarios: str) -> tuple[str, dict]:
    """`cancelwatch matrix` of these rows against the shared engine: its Markdown, and per (row, scenario) its
    (version, passed on, verdict)."""
    out = tmp_path / "docs"
    res = cli("matrix", "--target", engine.url, "--engine-log", engine.log_path,
              *[a for g in gateways for a in ("--gateway", g)], "--scenario", scenarios, "--out", str(out),
              "--store", str(tmp_path / "matrix.db"), home=engine_home, timeout=1500)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    md = (out / "matrix.md").read_text()
    cells = {(r[0].strip("| "), r[3]): (r[1], r[4], r[7].rstrip(" |")) for r in
             (line.split(" | ") for line in md.splitlines()) if r[0].strip("| ") in gateways}
    return md, cells


@pytest.mark.slow
def test_the_apps_people_write_are_measured_in_the_matrix(engine, engine_home, tmp_path):
    """Two apps of the matrix's apps part (collectors/engines/apps.py), each started by the matrix on loopback with a
    tap in front: a FastAPI route relaying with httpx passes a stream's disconnect on (Starlette ends the response,
    closing the generator closes the upstream stream) but keeps a non-streaming request its client gave up on (its
    handler awaits the engine's whole answer); an app that reads upstream in a background task keeps both, and the
    trace names it. Each row names its versions."""
    md, cells = matrix_of(engine, engine_home, tmp_path, ["app-fastapi", "app-background-task"],
                          "disconnect,nonstream_timeout")
    rows = {key: (passed, verdict) for key, (_, passed, verdict) in cells.items()}
    assert re.search(r"\| app-fastapi \| FastAPI \d+\.\d+\.\d+, Starlette \d+\.\d+\.\d+", md), md
    assert "class LogLine(BaseHTTPMiddleware)" in md  # the app's source, kept with the row
    assert rows[("app-fastapi", "disconnect")] == ("yes", "released"), md
    assert rows[("app-fastapi", "nonstream_timeout")] == ("no (stopped at app-fastapi)", "leaked"), md
    for scenario in ("disconnect", "nonstream_timeout"):
        assert rows[("app-background-task", scenario)] == ("no (stopped at app-background-task)", "leaked"), md


@pytest.mark.slow
def test_vllms_own_server_with_a_middleware_is_measured_in_the_matrix(engine, engine_home, tmp_path):
    """vLLM's API server started with `--middleware` (collectors/engines/vllm_middleware.py), the two ways vLLM takes
    one: a BaseHTTPMiddleware subclass, and a function Starlette wraps in one. Each row starts an engine of its own
    with the middleware importable, a tap in front of it; the verdict is the engine's evidence, as measured here
    (Starlette 1.10 passes a stream's disconnect through BaseHTTPMiddleware)."""
    md, cells = matrix_of(engine, engine_home, tmp_path, ["vllm-middleware-class", "vllm-middleware-function"],
                          "disconnect")
    for name in ("vllm-middleware-class", "vllm-middleware-function"):
        version, passed, verdict = cells[(name, "disconnect")]
        assert re.fullmatch(r"vLLM \d+\.\d+\.\d+\S*, FastAPI \d+\.\d+\.\d+, Starlette \d+\.\d+\.\d+", version), rows
        assert (passed, verdict) == ("yes", "released"), md
    assert "class LogLine(BaseHTTPMiddleware)" in md and "--middleware cw_middleware.log_line" in md, md
    # each middleware ran in its engine (its lines are in that engine's log), and each engine was stopped after
    logs = "".join(p.read_text(errors="replace") for p in engine_home.rglob("*.log"))
    assert "LogLine: POST /v1/completions -> 200" in logs and "log_line: POST /v1/completions -> 200" in logs
    from cancelwatch.collectors.engines import lifecycle
    assert [s.port for s in lifecycle.all_states(engine_home) if lifecycle.is_alive(s)] == [engine.port]
