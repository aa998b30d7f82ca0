"""Verdict logic on small hand-built runs (analysis is pure: frames in, verdicts out)."""

from __future__ import annotations

import json
import math
from dataclasses import fields

import numpy as np
import pandas as pd

from analysis.evidence import REPORTED_WITH, Evidence
from analysis.verdicts import judge_run
from runstore.reader import Run

T0 = 1_000_000_000_000
HZ = 20


def build_run(count, kv, gen, *, stop_s=2.0, abort_s=2.002, probe_first_s=None, extra_ledger=(), missing=None):
    """A 6 s run at 20 Hz: `count(t)`, `kv(t)`, `gen(t)` give running(+0 waiting), KV usage and tokens;
    no scrape answered in the stretch `missing` (from, to) in s."""
    times = np.arange(0, 6, 1 / HZ)
    rows = []
    for i, t in enumerate(times):
        if missing is not None and missing[0] <= t < missing[1]:
            continue
        for metric, value in (("requests_running", count(t)), ("requests_waiting", 0.0),
                              ("kv_cache_usage_ratio", kv(t)), ("generation_tokens_total", gen(t))):
            rows.append({"source": "vllm", "target": "t0", "metric": metric, "labels": "{}", "value": value,
                         "wall_ns": 0, "mono_ns": T0 + int(t * 1e9), "duration_ns": 1, "scrape_id": i, "t_s": t})
    samples = pd.DataFrame(rows)
    ns = lambda s: T0 + int(s * 1e9)  # noqa: E731
    ledger = [
        {"request_id": "nb", "scenario": "s", "role": "neighbour", "n": 1, "sent_mono_ns": ns(0.1),
         "first_token_mono_ns": ns(0.3), "closed_mono_ns": ns(5.5), "cancel_mono_ns": None,
         "terminal_state": "completed"},
        {"request_id": "tg", "scenario": "s", "role": "target", "n": 1, "sent_mono_ns": ns(0.5),
         "first_token_mono_ns": ns(0.8), "closed_mono_ns": ns(abort_s), "cancel_mono_ns": ns(stop_s),
         "terminal_state": "cancelled"},
        *extra_ledger,
    ]
    if probe_first_s is not None:
        ledger.append({"request_id": "pr", "scenario": "s", "role": "probe", "n": 1, "sent_mono_ns": ns(abort_s + 0.01),
                       "first_token_mono_ns": ns(probe_first_s), "closed_mono_ns": ns(probe_first_s + 0.1),
                       "cancel_mono_ns": None, "terminal_state": "completed"})
    cid = {"cancel_id": "c1"}
    events = pd.DataFrame([
        {"request_id": "tg", "kind": "user_stop", "mono_ns": ns(stop_s),
         "data": json.dumps({**cid, "scenario": "s", "phase": "decode", "metrics_target": "t0"})},
        {"request_id": "tg", "kind": "app_received", "mono_ns": ns(stop_s + 0.001), "data": json.dumps(cid)},
        {"request_id": "tg", "kind": "engine_abort", "mono_ns": ns(abort_s), "data": json.dumps(cid)},
    ])
    events["wall_ns"] = 0
    events["t_s"] = (events["mono_ns"] - T0) / 1e9
    info = {"started_mono_ns": T0, "targets": [{"label": "t0", "url": "http://x"}], "status": "completed",
            "settings": {}}
    return Run(id=1, info=info, samples=samples, scrapes=pd.DataFrame(), gaps=pd.DataFrame(), events=events,
               ledger=pd.DataFrame(ledger))


def steady_gen(t):
    return 100 + 20 * t


def test_released_when_count_and_kv_drop_right_after_the_abort():
    run = build_run(lambda t: 2.0 if t < 2.05 else 1.0, lambda t: 0.4 if t < 2.05 else 0.1, steady_gen,
                    probe_first_s=2.3)
    (v,) = judge_run(run)
    assert v.verdict == "released"
    assert 2.05 <= v.timepoints["left_scheduler"] <= 2.1
    assert v.timepoints["reusable"] == 2.3
    assert v.evidence.kv_before == 0.4 and v.evidence.kv_after == 0.1


def test_leaked_when_the_server_keeps_counting_and_generating():
    run = build_run(lambda t: 2.0 if t < 5.0 else 1.0, lambda t: 0.4, steady_gen)
    (v,) = judge_run(run)
    assert v.verdict == "leaked" and v.evidence.engine_stepping is True
    assert v.evidence.excess_max == 1.0
    # KV never fell: the drop was looked for, so its key is there, empty
    doc = v.evidence.as_json()
    assert "kv_drop_s" in doc and doc["kv_drop_s"] is None and "release_ms" not in doc


def test_stale_gauge_when_nothing_steps_after_the_abort():
    run = build_run(lambda t: 2.0, lambda t: 0.4, lambda t: 100 + 20 * min(t, 2.0))
    (v,) = judge_run(run)
    assert v.verdict == "stale_gauge" and v.evidence.engine_stepping is False


def test_foreign_traffic_makes_it_inconclusive():
    run = build_run(lambda t: 3.0 if t < 2.05 else 2.0, lambda t: 0.4 if t < 2.05 else 0.1, steady_gen)
    (v,) = judge_run(run)
    assert v.verdict == "inconclusive" and "foreign" in v.evidence.why
    doc = v.evidence.as_json()
    assert doc["kv_before"] == 0.4 and "kv_drop_s" not in doc and "engine_stepping" not in doc


def test_a_count_that_reconciles_only_briefly_is_not_a_release():
    # the server drops to the ledger's count for one sample, then counts the request again
    run = build_run(lambda t: 1.0 if 2.05 <= t < 2.1 else (2.0 if t < 5 else 1.0), lambda t: 0.4, steady_gen)
    (v,) = judge_run(run)
    assert v.verdict == "leaked"


def test_evidence_keeps_a_reached_field_that_is_none_and_leaves_out_an_unreached_one():
    ev = Evidence(grace_s=2.0, metrics_target="t0", samples_in_window=3)
    assert list(ev.as_json()) == ["grace_s", "metrics_target", "samples_in_window"]
    ev.kv_before = math.nan  # the stage before the stop was reached, with no sample in it
    doc = ev.as_json()
    assert doc["count_before"] is None and doc["ledger_before"] is None and math.isnan(doc["kv_before"])
    assert not {"note", "kv_drop_s", "excess_max", "generation_tokens_delta"} & set(doc)
    ev.engine_stepping = False
    doc = ev.as_json()
    assert doc["kv_drop_s"] is None and doc["excess_max"] is None and doc["generation_tokens_delta"] is None
    assert not {"release_ms", "gauges_refreshed", "why"} & set(doc)
    assert json.dumps(doc).count("NaN") == 1


def test_evidence_groups_name_its_own_fields():
    names = [f.name for f in fields(Evidence)]
    for f in fields(Evidence):
        assert set(f.metadata.get(REPORTED_WITH, ())) <= set(names) - {f.name}, f.name


def test_a_scrape_outage_across_the_grace_is_inconclusive_not_a_stale_gauge():
    # the request was running; from the stop on, /metrics did not answer for 3 s (past the 2 s grace)
    run = build_run(lambda t: 2.0, lambda t: 0.4, steady_gen, missing=(2.0, 5.0))
    (v,) = judge_run(run)
    assert v.verdict == "inconclusive" and "no samples" in v.evidence.why, v
    assert v.timepoints["left_scheduler"] is None


def test_an_engine_restart_inside_the_window_is_inconclusive_not_released():
    # the engine died and came back right after the abort: its gauges and counters start again at 0
    def restarted(value):
        return lambda t: value(t) if t < 2.3 else 0.0

    run = build_run(restarted(lambda t: 2.0), restarted(lambda t: 0.4), restarted(steady_gen), probe_first_s=3.0)
    (v,) = judge_run(run)
    assert v.verdict == "inconclusive" and "restarted" in v.evidence.why, v
    assert "generation_tokens_total went back" in v.evidence.why
