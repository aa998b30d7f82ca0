"""A release shown by the KV blocks of the running requests (analysis/verdicts/vllm.py,
VllmCase.blocks_of_the_running), on a run recorded here: AIPerf 0.13.0 at concurrency 4, half its requests
cancelled, through `cancelwatch watch` straight to the CPU vLLM (tests/test_watch_aiperf.py, make test-aiperf;
the store gzipped). One of its 26 cancels was aborted in the same step as two newcomers entered (one on its way
at the stop): 3 blocks for 3 requests before, 4 for 4 after, KV usage never lower within the grace. It was
`kv_did_not_fall` (inconclusive) until the blocks were read. Another (TWO) stays so: the count was the ledger's
without it only by chance, and taken_in_its_place no longer reads a release there."""

from __future__ import annotations

import gzip
import shutil
from pathlib import Path

import pytest

from analysis.verdicts import judge_run
from runstore.reader import load_run

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "recorded" / "aiperf_direct.db.gz"
ONE = "53319596-6375-49bb-b4fb-c83a13998ca6"  # aborted at 22.894 s of the run, two newcomers in its place


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("kv_blocks") / "watch.db"
    with gzip.open(FIXTURE, "rb") as src, open(path, "wb") as dst:
        shutil.copyfileobj(src, dst)
    return path


def judged(store: Path, change=None) -> dict:
    run = load_run(store, "latest")
    if change is not None:
        change(run)
    return {v.request_id: v for v in judge_run(run)}


def test_the_cancel_aborted_as_two_newcomers_entered_is_released_by_the_blocks_of_the_running(store):
    verdicts = judged(store)
    # all but TWO (below) released
    assert len(verdicts) == 26 and {r for r, v in verdicts.items() if v.verdict != "released"} == {TWO}, \
        {r: v.rule for r, v in verdicts.items() if v.verdict != "released"}
    v = verdicts[ONE]
    ev = v.evidence
    assert ev.kv_drop_waived == "blocks_of_the_running", ev
    # KV usage higher than at the stop (4 blocks of 63 against 3), the count the ledger's 4 without it
    assert round(ev.kv_before * 63) == 3 and round(ev.kv_after * 63) == 4
    assert ev.count_after == ev.ledger_after == 4
    assert 0 < v.timepoints["left_scheduler"] - v.timepoints["engine_abort"] < 0.1
    # the others: none of them rests on the blocks
    assert all(x.evidence.kv_drop_waived != "blocks_of_the_running" for r, x in verdicts.items() if r != ONE)


def no_pool_size(run) -> None:
    run.info["cache"] = {}  # a vLLM that serves no vllm:cache_config_info


def a_prefix_hit_after_the_stop(run) -> None:
    s = run.samples
    rows = (s["metric"] == "prefix_cache_hits_tokens_total") & (s["t_s"] > 22.92)
    s.loc[rows, "value"] = s.loc[rows, "value"] + 128  # a newcomer took a whole block from the cache


def one_block_more(run) -> None:
    s = run.samples
    rows = (s["metric"] == "kv_cache_usage_ratio") & (s["t_s"] > 22.92) & (s["t_s"] < 25.0)
    s.loc[rows, "value"] = s.loc[rows, "value"] + 1 / 63  # a block no running request accounts for


@pytest.mark.parametrize("change", [no_pool_size, a_prefix_hit_after_the_stop, one_block_more])
def test_where_the_blocks_cannot_say_it_stays_inconclusive(store, change):
    v = judged(store, change)[ONE]
    assert (v.verdict, v.rule) == ("inconclusive", "kv_did_not_fall"), (v.verdict, v.rule, v.evidence)


# aborted as a newcomer entered, and another one step after: 4 blocks before (three requests, one at two), 5 after
# for four running, KV usage never lower than at the stop within the grace. At 10.200 s the count (3) is the
# ledger's without it only by chance: the newcomer Added at 10.162 s had no token yet, and the engine may not have
# counted it there (this one in its place). taken_in_its_place read a release there; nothing else shows one (a
# block more may be the newcomer's, or a running request's next)
TWO = "a2ab41b8-f11d-431c-819c-0e7fa4dcc729"


def test_a_count_the_ledgers_by_chance_on_the_real_engine_waives_no_kv_drop(store):
    v = judged(store)[TWO]
    assert (v.verdict, v.rule) == ("inconclusive", "kv_did_not_fall"), (v.verdict, v.rule, v.evidence)
    assert round(v.evidence.kv_before * 63) == 4


# where the count is the ledger's by chance: the cancelled request still counted in the place of a newcomer the
# engine has not taken yet (the review's cases, on tests/test_verdicts.py's small runs: one block a request)
BLOCK = 1 / 63
NO_HITS = {"prefix_cache_hits_tokens_total": lambda t: 0.0, "preemptions_total": lambda t: 0.0}


def small_run(count, extra_ledger=(), engine_log=None):
    from tests.test_verdicts import build_run, steady_gen

    run = build_run(count, lambda t: count(t) * BLOCK, steady_gen, extra_ledger=list(extra_ledger),
                    engine_log=engine_log, series=NO_HITS, length_s=5.4)
    run.info["cache"] = {"t0": {"num_gpu_blocks": "64", "block_size": "128"}}
    return run


def newcomer(rid: str, sent: float, first: float) -> dict:
    from tests.test_verdicts import T0

    return {"request_id": rid, "scenario": "s2", "role": "target", "n": 1, "sent_mono_ns": T0 + int(sent * 1e9),
            "first_token_mono_ns": T0 + int(first * 1e9), "closed_mono_ns": None, "cancel_mono_ns": None,
            "terminal_state": None}


def test_a_count_the_ledgers_by_chance_with_a_newcomer_not_yet_counted_shows_no_release():
    from tests.test_verdicts import ADDED

    # the cancel never reached the engine (no log): tg runs on, one block, to the run's end. A newcomer sent at
    # 3.93 s is counted from 4.05 s, past the grace: till then the count (2) is the ledger's without tg
    late = small_run(lambda t: 2.0 if t < 4.05 else 3.0, [newcomer("nw", 3.93, 4.13)])
    # a starved API server hands one sent at 2.3 s to the engine at 4.05 s
    stalled = small_run(lambda t: 2.0 if t < 4.05 else 3.0, [newcomer("nw", 2.3, 4.25)])
    # the abort logged but tg kept; one newcomer counted at 2.55 s (usage rose), another Added at 3.93 s
    log = [*ADDED, ("engine_aborted", "tg", 2.005), ("engine_added", "a", 2.5), ("engine_added", "b", 3.93)]
    kept = small_run(lambda t: 2.0 + (t >= 2.55) + (t >= 4.05), [newcomer("a", 2.49, 2.69), newcomer("b", 3.92, 4.12)],
                     engine_log=log)
    for name, run in (("late", late), ("stalled", stalled), ("kept", kept)):
        (v,) = [x for x in judge_run(run) if x.request_id == "tg"]
        assert v.verdict != "released" and v.evidence.kv_drop_waived != "blocks_of_the_running", (name, v.rule)


def test_a_newcomer_taken_by_chance_in_the_place_of_a_kept_request_shows_no_release():
    from tests.test_verdicts import ADDED

    # the abort logged but tg kept (2 blocks: the neighbour's, tg's); a newcomer Added at 2.5 s that a starved
    # engine counts only at 4.05 s, past the grace: till then the count (2) is the ledger's without tg, and KV
    # usage no higher than at the stop. taken_in_its_place read it as released at 2.5 s
    log = [*ADDED, ("engine_aborted", "tg", 2.005), ("engine_added", "a", 2.5)]
    run = small_run(lambda t: 2.0 if t < 4.05 else 3.0, [newcomer("a", 2.49, 4.2)], engine_log=log)
    (v,) = [x for x in judge_run(run) if x.request_id == "tg"]
    assert v.verdict != "released", (v.rule, v.evidence.kv_drop_waived)
