"""A real browser's Stop: Debian's Chromium, driven by Playwright, opens the chat page the apps serve
(collectors/engines/chat.html) through `cancelwatch watch` in front of nginx, a tap in front of the app and one in
front of the engine; streams an answer with fetch and presses Stop (AbortController). The page reports its task id and
the click's time; the report then times the first timepoint, the app's own word on seeing its client leave the
second, and a request queued behind the stopped one (the engine is made full) the fifth: each of the five has its
source."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import httpx

import pytest

from cancelwatch.analysis.cancel_table import cancel_table
from cancelwatch.analysis.verdicts import judge_run
from cancelwatch.collectors.engines import gateways as gw_mod
from cancelwatch.runstore.reader import load_run
from tests.conftest import cli, cli_popen, free_port
from tests.test_dashboard_browser import CHROMIUM, FLAGS
from tests.test_watch_engine import wait_listening

pytestmark = [pytest.mark.browser, pytest.mark.timeout(600),
              pytest.mark.skipif(not gw_mod.GATEWAYS["nginx"].binary(), reason="nginx is installed by `make test`")]

GRACE_S = 2.0
# the engine's max_num_seqs (collectors/engines/vllm_server.py: the embedded shape): with FILLERS streams and the
# page's running, one more request waits
FILLERS = 3
FILLER_TOKENS = 800  # long enough to run past the stop and the queued request's admission (~100 tokens/s each)


def stream(front: int, rid: str, max_tokens: int, model: str, got: dict, first: threading.Event) -> None:
    """A watched stream through the whole chain, read to its end (bounded in time): `got[rid]` is True once its
    `data: [DONE]` came; its first chunk sets `first`."""
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", f"http://127.0.0.1:{front}/v1/completions", json=body, timeout=120,
                      headers={"X-Request-Id": rid}) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                first.set()
                got[rid] = line == "data: [DONE]"


def press_stop(page, url: str, reports: bool = True, before_stop=None) -> str:
    """Open the page at `url`, send, wait for a few chunks of the answer, call `before_stop`, press Stop (and,
    where the page reports, for its report's answer); the task id it streamed."""
    page.goto(url)
    page.click("#send")
    page.wait_for_function("() => Number(document.body.dataset.chunks || 0) >= 3", timeout=120_000)
    if before_stop is not None:
        before_stop()
    page.click("#stop")
    page.wait_for_function(f"() => document.querySelector('#status').textContent.startsWith("
                           f"'stopped{' (' if reports else ''}')", timeout=30_000)
    return page.evaluate("() => document.body.dataset.task")


def test_a_stop_pressed_in_chromium_is_traced_from_the_click_to_the_engines_release(engine, engine_home, tmp_path):
    if not Path(CHROMIUM).exists():
        pytest.fail("no /usr/bin/chromium: `make test` installs Debian's chromium (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    front, nginx_port, tap_app, app_port, tap_engine = (free_port() for _ in range(5))
    store = tmp_path / "watch.db"
    running, watch = [], None
    try:
        running.append(gw_mod.start(gw_mod.GATEWAYS["app-fastapi"], tmp_path / "app", app_port, tap_engine))
        running.append(gw_mod.start(gw_mod.GATEWAYS["nginx"], tmp_path / "nginx", nginx_port, tap_app))
        watch = cli_popen("watch", "--listen", f"127.0.0.1:{front}", "--upstream", f"http://127.0.0.1:{nginx_port}",
                          "--upstream-name", "nginx", "--metrics-url", engine.url,
                          "--hop", f"app=127.0.0.1:{tap_app},http://127.0.0.1:{app_port}",
                          "--hop", f"vllm=127.0.0.1:{tap_engine},{engine.url}",
                          "--store", str(store), "--grace", str(GRACE_S), home=engine_home)
        wait_listening(front, watch)
        model = httpx.get(f"{engine.url}/v1/models", timeout=10).json()["data"][0]["id"]
        got: dict[str, bool] = {}
        threads = []

        def start(rid: str, max_tokens: int) -> threading.Event:
            first = threading.Event()
            threads.append(threading.Thread(target=stream, args=(front, rid, max_tokens, model, got, first),
                                            daemon=True))
            threads[-1].start()
            return first

        def queue_one() -> None:  # the engine is full: this one waits until the page's request leaves
            start("queued-1", 16)
            time.sleep(1.0)
            assert "queued-1" not in got, "the queued request got in before the Stop: the engine was not full"
        for k in range(FILLERS):
            assert start(f"filler-{k}", FILLER_TOKENS).wait(60), "a filler stream got no first chunk"
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
            try:
                page = browser.new_page()
                reported = press_stop(page, f"http://127.0.0.1:{front}/?max_tokens=1500", before_stop=queue_one)
                assert "reported: HTTP 204" in page.text_content("#status")
                page.wait_for_timeout(3000)
                # a page that never reports: the first timepoint stays the client side's close, said so
                silent = press_stop(page, f"http://127.0.0.1:{front}/?max_tokens=1500&report=off", reports=False)
                page.wait_for_timeout(1000 * (GRACE_S + 4))
            finally:
                browser.close()
        deadline = time.monotonic() + 120
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in threads), "a watched stream did not end within 120 s"
        watch.send_signal(signal.SIGTERM)
        out, err = watch.communicate(timeout=120)
        assert watch.returncode == 0, out[-3000:] + err[-3000:]
    finally:
        if watch is not None and watch.poll() is None:
            watch.kill()
            watch.communicate()
        for r in running:
            gw_mod.stop(r)
    doc = json.loads(cli("report", "latest", "--json", "--store", str(store)).stdout)
    cancels = {c["request_id"]: c for c in doc["cancels"]}
    # the page's own fetches (the page, /v1/models) and its report are no requests of the engine's
    assert set(cancels) == {reported, silent}, json.dumps(doc["cancels"], indent=1)[:4000]
    c = cancels[reported]
    src = {k: (v or {}).get("source") for k, v in c["timepoint_sources"].items()}
    # the app's own word on seeing its client leave; a watch sends no probe: the request queued behind it
    assert src == {"user_stop": "page", "app_received": "app", "engine_abort": "engine_log",
                   "left_scheduler": "samples", "reusable": "queued"}, json.dumps(c, indent=1)
    assert "the app's own word" in c["timepoint_sources"]["app_received"]["reason"]
    assert "request queued-1 waited behind it" in c["timepoint_sources"]["reusable"]["reason"]
    tp = c["timepoints"]
    assert all(tp[k] is not None for k in src), tp
    # the grace counts from the client side's close, which the evidence keeps
    assert 0 <= c["evidence"]["client_left_s"] - tp["user_stop"] < 5, c["evidence"]
    # in order: the click, the app seeing its client leave (placed late by its report's delivery, never early),
    # the engine's abort and the scheduler letting it go; the queued request let in after the abort
    assert tp["user_stop"] <= tp["app_received"] <= tp["left_scheduler"], tp
    assert tp["engine_abort"] <= tp["left_scheduler"] and tp["engine_abort"] < tp["reusable"] <= \
        tp["left_scheduler"] + GRACE_S, tp
    assert c["verdict"] == "released", json.dumps(c, indent=1)
    # the fillers and the queued request were read to their end: no cancels
    assert got == {"queued-1": True, **{f"filler-{k}": True for k in range(FILLERS)}}, got
    assert f"task {reported}" in c["timepoint_sources"]["user_stop"]["reason"]
    assert [h["hop"] for h in c["hops"]] == ["nginx", "app", "vllm"], c["hops"]
    assert c["evidence"].get("stopped_at") is None and "passed every hop" in c["evidence"]["path"], c["evidence"]
    s = cancels[silent]
    assert s["timepoint_sources"]["user_stop"] == {
        "source": "client", "reason": "the page sent no report of this stop: the client side's close"}, s
    # the dashboard's cancel table says where each point came from
    table = cancel_table(load_run(store, "latest"), judge_run(load_run(store, "latest")))
    row = table[table["request_id"] == reported].iloc[0]
    assert "user stop: page (its Stop click)" in row["evidence"] and "app received: app" in row["evidence"], row
    text = cli("report", "latest", "--store", str(store)).stdout
    assert f"user stop: 1 of 2 cancel(s) timed by their page's Stop click ({reported[-8:]})" in text, text
