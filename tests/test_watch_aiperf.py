"""`cancelwatch watch` under AIPerf (0.13.0, a load generator nobody here wrote, in .venv-aiperf): concurrency 4,
half its requests cancelled with its own `--request-cancellation-rate`. AIPerf's report says how many it
cancelled (its error summary, code 499) and which (its per-request records carry the X-Request-Id it sent);
the watch's says what became of each. Put side by side: the same cancels, each with a verdict; direct to the
engine none leaked, behind the proxy that never passes a disconnect on none released.

Under `make test-aiperf` (the venv is 1.2 GB and the two runs some minutes): `make test` keeps the SDK and
curl clients of tests/test_watch_engine.py.

A cancel the engine never took is `never_added`: seen here when the watch's threads were starved (two cores,
the engine and AIPerf busy) past AIPerf's cancellation delay, so that the request and its client's close
reached the engine together and vLLM dropped it unlogged. Such a cancel must show it: its close came
within a few ms of its request passing the watch."""

from __future__ import annotations

import json
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest

from cancelwatch.runstore.reader import load_run
from tests.conftest import cli, free_port
from tests.leaky_proxy import LeakyProxy
from tests.test_watch_engine import judged, live_verdicts, watching

pytestmark = [pytest.mark.engine, pytest.mark.aiperf]

ROOT = Path(__file__).resolve().parents[1]
AIPERF = ROOT / ".venv-aiperf" / "bin" / "aiperf"
GRACE_S = 2.0
REQUESTS = 40
TOGETHER_MS = 50.0  # a close this soon after its request passed the watch reached the engine with it


def run_aiperf(url: str, model: str, tokenizer: str, out: Path, seed: int) -> tuple[dict, list[dict]]:
    """AIPerf's summary and its per-request records for one bounded run (REQUESTS requests)."""
    if not AIPERF.exists():
        pytest.fail("no .venv-aiperf: run `make aiperf-venv` (make test-aiperf does) to install AIPerf 0.13.0")
    cmd = [str(AIPERF), "profile", "--model", model, "--url", url, "--endpoint-type", "completions", "--streaming",
           "--tokenizer", tokenizer, "--concurrency", "4", "--request-count", str(REQUESTS),
           "--request-cancellation-rate", "50", "--request-cancellation-delay", "1.0",
           "--synthetic-input-tokens-mean", "32", "--output-tokens-mean", "200", "--extra-inputs", "ignore_eos:true",
           "--random-seed", str(seed), "--artifact-dir", str(out), "--ui-type", "none", "--no-server-metrics",
           "--no-gpu-telemetry", "--workers-max", "1", "--record-processor-service-count", "1"]
    # no HF_HUB_OFFLINE: with it AIPerf 0.13.0 takes a tokenizer directory for a hub id and fails
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    summary = json.loads((out / "profile_export_aiperf.json").read_text())
    records = [json.loads(line) for line in (out / "profile_export.jsonl").read_text().splitlines() if line.strip()]
    return summary, records


def aiperf_cancelled(summary: dict, records: list[dict]) -> tuple[int, set[str]]:
    """What AIPerf says it cancelled: the count in its error summary (code 499), the ids in its records."""
    count = sum(e["count"] for e in summary.get("error_summary") or [] if e["error_details"].get("code") == 499)
    ids = {r["metadata"]["x_request_id"] for r in records if (r.get("error") or {}).get("code") == 499}
    return count, ids


def watch_aiperf(engine, engine_home, tmp_path, upstream: str, seed: int):
    """AIPerf through a watch in front of `upstream`; (AIPerf's count and ids, live verdicts, the run, report)."""
    with watching(engine, engine_home, tmp_path, upstream, duration_s=900, end_timeout_s=90) as w:
        summary, records = run_aiperf(f"http://127.0.0.1:{w.port}", engine.served_model_name, engine.model,
                                      tmp_path / "aiperf", seed)
        count, ids = aiperf_cancelled(summary, records)
        # until every cancel is judged, or none more comes for a while (AIPerf may count a request as cancelled
        # that the watch saw answered in full: see answered_before_aiperf_let_go); behind the proxy a leak is
        # judged when its request ends
        deadline, seen, since = time.monotonic() + 240, -1.0, time.monotonic()
        while time.monotonic() < deadline:
            assert w.proc.poll() is None, w.proc.communicate()
            now = sum(judged(w.mport).values())
            if now >= count or time.monotonic() - since > 30:
                break
            if now != seen:
                seen, since = now, time.monotonic()
            time.sleep(1.0)
    report = json.loads(cli("report", "latest", "--json", "--store", str(w.store), home=engine_home).stdout)
    return count, ids, live_verdicts(w.stdout), load_run(w.store, "latest"), report


def side_by_side(ids: set[str], live: dict[str, tuple[str, str]]) -> str:
    """AIPerf's word on each cancel beside the watch's: printed, for the reader of the test's output."""
    lines = [f"{'request (X-Request-Id AIPerf sent)':40} {'AIPerf':10} watch"]
    lines += [f"{rid:40} {'499':10} {' '.join(live.get(rid, ('-', '-')))}" for rid in sorted(ids)]
    return "\n".join(lines)


def answered_before_aiperf_let_go(run, ids: set[str], live: dict[str, tuple[str, str]]) -> set[str]:
    """AIPerf's cancels the watch made no cancel of: each must be a request the watch saw answered in full
    before its client closed. Seen on two busy cores: AIPerf's worker, behind on its own event loop, fired its
    cancellation timer after the whole answer was in its socket, and counted a 499 for a request the engine
    had completed. The engine had nothing to cancel: no verdict is owed."""
    answered = ids - set(live)
    ledger = run.ledger.set_index("request_id")
    for rid in answered:
        assert ledger.loc[rid, "terminal_state"] == "completed", (rid, ledger.loc[rid].to_dict())
    assert set(live) <= ids, set(live) - ids  # and the watch saw no cancel AIPerf did not make
    return answered


def check_never_added_came_with_their_close(run, live: dict[str, tuple[str, str]]) -> None:
    ledger = run.ledger.set_index("request_id")
    for rid, (_, rule) in live.items():
        if rule == "never_added":
            row = ledger.loc[rid]
            assert (row["cancel_mono_ns"] - row["sent_mono_ns"]) / 1e6 < TOGETHER_MS, (rid, row.to_dict())


def test_aiperf_cancels_direct_to_the_engine_each_get_a_verdict_and_none_leaked(engine, engine_home, tmp_path):
    count, ids, live, run, report = watch_aiperf(engine, engine_home, tmp_path, engine.url, seed=22)
    print(side_by_side(ids, live))
    # AIPerf's count of what it cancelled is its ids', and each is the watch's cancel, request by request (by
    # the ids AIPerf sent), or a request the watch saw answered in full before AIPerf let go
    assert count == len(ids) >= REQUESTS // 4, (count, ids)
    answered = answered_before_aiperf_let_go(run, ids, live)
    assert len(answered) <= len(ids) // 4, side_by_side(ids, live)
    assert set(run.ledger.loc[run.ledger["terminal_state"] == "cancelled", "request_id"]) == set(live)
    # live, each on its own window as its grace ended, the same as the report judged from the whole run
    assert {c["request_id"]: c["verdict"] for c in report["cancels"]} == {r: v for r, (v, _) in live.items()}
    verdicts = Counter(v for v, _ in live.values())
    assert verdicts["leaked"] == 0 and verdicts["stale_gauge"] == 0, side_by_side(ids, live)
    # every request went through the watch: none is other traffic to it
    assert not any(rule.startswith("other_traffic") for _, rule in live.values()), side_by_side(ids, live)
    check_never_added_came_with_their_close(run, live)
    # each inconclusive says why, and under this steady load through the watch at most 1 in 10 is (issue 21
    # point 7). Seen before the engine-step reading (VllmCase.ended_unseen, taken_in_its_place): 7 in 25
    assert all(c["evidence"].get("why") for c in report["cancels"] if c["verdict"] == "inconclusive")
    assert verdicts["inconclusive"] <= len(live) // 10, side_by_side(ids, live)
    print(f"AIPerf: {count} cancelled; watch: {len(live)} cancels, {dict(verdicts)}; answered before AIPerf let go: "
          f"{len(answered)}")


def test_aiperf_cancels_behind_a_proxy_that_never_passes_them_on_are_leaked(engine, engine_home, tmp_path):
    proxy = LeakyProxy(engine.url, free_port()).start()
    try:
        count, ids, live, run, report = watch_aiperf(engine, engine_home, tmp_path, proxy.url, seed=23)
    finally:
        proxy.stop()
    print(side_by_side(ids, live))
    assert count == len(ids) >= REQUESTS // 4, side_by_side(ids, live)
    answered_before_aiperf_let_go(run, ids, live)
    check_never_added_came_with_their_close(run, live)
    # none released: the proxy passes no cancel on, and a verdict must never say otherwise. Leaked where the
    # count can place the request; the rest inconclusive, saying why. Seen here: 3 of 20 leaked while each lost
    # request stayed the ledger's until the engine went idle; with each ended where its verdict saw it leave
    # (live too: the windows are told), 10 to 15 of 20: once several lost requests were in the engine at once
    # and the count could not tell which left, the ledger held them all, and the later cancels read
    # `already_finished`. Taken out oldest first where the count cannot hold them (_gone_by_surplus): 20 of 20
    assert not any(v == "released" for v, _ in live.values()), side_by_side(ids, live)
    assert any(v == "leaked" for v, _ in live.values()), side_by_side(ids, live)
    assert all(c["evidence"].get("why") for c in report["cancels"] if c["verdict"] == "inconclusive")
    assert {c["request_id"]: c["verdict"] for c in report["cancels"]} == {r: v for r, (v, _) in live.items()}
    verdicts = Counter(v for v, _ in live.values())
    # issue 21 point 7 under the traffic it watches, here too: at most 1 cancel in 10 inconclusive
    assert verdicts["inconclusive"] <= len(live) // 10, side_by_side(ids, live)
    print(f"AIPerf: {count} cancelled; watch: {len(live)} cancels, {dict(verdicts)}")
