"""A later cancel's leaving can decide an earlier one: judge_vllm judges a run again, its frames made anew, while its
verdicts see more lost requests leave (JUDGE_PASSES). A review built this run with the engine's request log, every
request at 40 tokens a second: r2 and r3 were both sent at 2.74 s and stopped with no abort (lost), r3 at 4.46 s
though the engine had ended it at 3.96 s, r2 at 4.23 s, and the engine ran r2 to its end at 10.23 s. Judged once in
stop order, r2 read as already finished and r3 as the leak."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd

T0 = 1_000_000_000_000


def ns(s: float | None) -> int | None:
    return None if s is None else T0 + int(round(s * 1e9))


# request -> (sent, left the engine by itself, the client's stop or None, the client's close where it read the end)
REQUESTS = {"r0": (0.06, 0.71, None, 0.72), "r1": (1.67, 5.04, None, 5.24), "r2": (2.74, 10.23, 4.23, None),
            "r3": (2.74, 3.96, 4.46, None), "r4": (0.89, 1.21, 1.36, None), "r5": (2.3, 8.45, None, 8.46)}
RATE, ADDED_AFTER = 40.0, 0.02


def build():
    from cancelwatch.runstore.reader import Run

    spans = [(sent + ADDED_AFTER, left) for sent, left, _, _ in REQUESTS.values()]
    count = lambda t: float(sum(a <= t < b for a, b in spans))  # noqa: E731
    rows = []
    for i, t in enumerate(np.round(np.arange(0, 14.25, 0.05), 6)):
        for metric, labels, value in (
                ("requests_running", "{}", count(t)), ("requests_waiting", "{}", 0.0),
                ("kv_cache_usage_ratio", "{}", 0.1 * count(t)),
                ("generation_tokens_total", "{}", 100 + RATE * sum(max(0.0, min(t, b) - a) for a, b in spans)),
                ("requests_finished_total", '{"finished_reason": "stop"}', float(sum(b <= t for _, b in spans)))):
            rows.append({"source": "vllm", "target": "t0", "metric": metric, "labels": labels, "value": value,
                         "wall_ns": 0, "mono_ns": ns(t), "duration_ns": 1, "scrape_id": i, "t_s": t})
    ledger, events = [], []
    for k, (rid, (sent, left, stop, closed)) in enumerate(REQUESTS.items()):
        ledger.append({"request_id": rid, "scenario": "s", "role": "target" if stop else "neighbour", "n": 1,
                       "sent_mono_ns": ns(sent), "first_token_mono_ns": ns(sent + ADDED_AFTER + 0.1),
                       "closed_mono_ns": ns(stop + 0.001 if stop else closed), "cancel_mono_ns": ns(stop),
                       "terminal_state": "cancelled" if stop else "completed",
                       "max_tokens": int(round(RATE * (left - sent - ADDED_AFTER))), "chunks": 0})
        events.append({"request_id": rid, "kind": "engine_added", "mono_ns": ns(sent + ADDED_AFTER),
                       "data": json.dumps({"engine_request_id": f"cmpl-{rid}-0-0123abcd", "clock": "engine_log",
                                           "resolution_s": 0.001, "target": "t0"})})
        if stop:
            cid = {"cancel_id": f"c{k}"}
            events += [{"request_id": rid, "kind": "user_stop", "mono_ns": ns(stop),
                        "data": json.dumps({**cid, "scenario": "s", "phase": "decode", "metrics_target": "t0",
                                            "tokens_at_cancel": 10})},
                       {"request_id": rid, "kind": "client_closed", "mono_ns": ns(stop + 0.001),
                        "data": json.dumps({**cid, "source": "client"})}]
    events = pd.DataFrame(events).sort_values("mono_ns").assign(wall_ns=0).reset_index(drop=True)
    events["t_s"] = (events["mono_ns"] - T0) / 1e9
    info = {"started_mono_ns": T0, "targets": [{"label": "t0", "url": "http://127.0.0.1:8000"}], "status": "completed",
            "settings": {}, "engine": {"engine_log": {"t0": {"path": "engine.log"}}}}
    return Run(id=1, info=info, samples=pd.DataFrame(rows), scrapes=pd.DataFrame(), gaps=pd.DataFrame(),
               events=events, ledger=pd.DataFrame(ledger))


def test_a_later_lost_cancels_leaving_decides_an_earlier_one():
    """With JUDGE_PASSES at 1 this reads r2 already_finished and r3 leaked."""
    from cancelwatch.analysis.verdicts import judge_run

    got = {v.request_id: (v.verdict, v.rule) for v in judge_run(build())}
    assert got["r2"] == ("leaked", "no_abort_ran_to_end"), got
    assert got["r3"][0] != "leaked", got  # the engine had ended it before its stop
