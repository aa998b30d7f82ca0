"""The embedded engine's own log, read while `record` runs against the real vLLM: every request the
client sent shows up under its id on the engine's millisecond clock, every cancelled one with its
abort line, and a request the client never sent shows up too, under an id the ledger does not know."""

from __future__ import annotations

import json
import time
import uuid

import httpx

from cancelwatch.runstore.reader import load_run
from tests.conftest import cli_popen

SCENARIOS = "decode,n2,chat"


def send_foreign_request(engine_url: str, store, deadline_s: float = 60.0) -> str:
    """Once the run exists, one short completion straight to the engine, with an id of its own."""
    rid = f"foreign-{uuid.uuid4().hex[:8]}"
    deadline, status = time.monotonic() + deadline_s, "no run"
    while time.monotonic() < deadline:
        try:
            status = load_run(store, "latest", metrics=[]).info["status"]
        except Exception:  # noqa: BLE001 - the store or its run row may not exist yet
            pass
        if status == "running":
            break
        time.sleep(0.2)
    assert status == "running", f"no run recording into {store} within {deadline_s:.0f} s: {status}"
    model = httpx.get(engine_url + "/v1/models", timeout=10).json()["data"][0]["id"]
    resp = httpx.post(engine_url + "/v1/completions", timeout=60, headers={"X-Request-Id": rid},
                      json={"model": model, "prompt": "w1 w2 w3", "max_tokens": 4, "ignore_eos": True})
    assert resp.status_code == 200, resp.text
    return rid


def test_the_engine_log_names_every_request_and_every_abort(engine, engine_home, tmp_path):
    store = tmp_path / "cw.db"
    proc = cli_popen("record", "--target", engine.url, "--scenario", SCENARIOS, "--store", str(store),
                     home=engine_home)
    try:
        foreign = send_foreign_request(engine.url, store)
    finally:
        out, err = proc.communicate(timeout=400)
    assert proc.returncode in (0, 1), out + err  # a verdict is not what this test is about
    run = load_run(store, "latest")
    assert run.info["engine"]["engine_log"] == {"t0": {"path": engine.log_path}}
    # the engine's own version, as its GET /version says (the protocol's "engine and version")
    assert run.info["engine"]["targets"]["t0"]["version"].startswith("vLLM 0.")
    ev = run.events
    logged = ev[ev["kind"].isin(["engine_added", "engine_aborted"])]
    data = [json.loads(d) for d in logged["data"]]
    assert {(d["clock"], d["resolution_s"], d["target"]) for d in data} == {("engine_log", 0.001, "t0")}

    ledger = run.ledger.set_index("request_id")
    added = logged[logged["kind"] == "engine_added"]
    # every request the client sent entered the engine under the client's id: n of them for n > 1
    counts = added["request_id"].value_counts()
    assert {rid: int(counts.get(rid, 0)) for rid in ledger.index} == ledger["n"].astype(int).to_dict()
    # and the one it did not send is there too, under an id the ledger does not know
    assert foreign in set(added["request_id"]) and foreign not in ledger.index

    stops = ev[ev["kind"] == "user_stop"].set_index("request_id")
    aborted = logged[logged["kind"] == "engine_aborted"].set_index("request_id")
    cancelled = ledger[(ledger["role"] == "target") & (ledger["terminal_state"] == "cancelled")]
    assert len(cancelled) == len(SCENARIOS.split(","))
    for rid in cancelled.index:
        assert rid in aborted.index, f"no abort line for {rid}"
        t_abort, t_stop = float(aborted.loc[rid, "t_s"]), float(stops.loc[rid, "t_s"])
        # the engine's stamp is its wall clock cut to the millisecond: at most 1 ms before the true instant
        assert t_stop - 0.002 <= t_abort <= t_stop + run.info["settings"]["extra"]["grace_s"], (rid, t_stop, t_abort)
    assert not set(aborted.index) - set(cancelled.index)  # only the cancelled requests were aborted

    samples = run.series("engine_log_requests_added_total")
    assert samples["value"].iloc[-1] == len(added)
    assert run.series("engine_log_requests_aborted_total")["value"].iloc[-1] == len(aborted)
