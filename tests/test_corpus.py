"""The corpus check (tests/corpus/): every run recorded from real servers is judged, and the verdicts are what
the manifest blessed; none of the cancels whose truth the set-up makes certain is judged the other way.
A difference prints one table by rule (before, after, how many, which runs); `python -m tests.corpus.check
--bless` keeps the new verdicts once that table has been read."""

from __future__ import annotations

import dataclasses
import time

import pytest

from cancelwatch.analysis.facts import VERDICT_METRICS
from cancelwatch.analysis.verdicts.core import COUNT_READING_RULES
from tests.corpus.check import Judged, compare, counts, judge_corpus, table
from tests.corpus.manifest import CONSTRUCTION, REVIEWED, TRUTHS, load_manifest

MIN_CANCELS, MIN_CONSTRUCTION = 300, 100


@pytest.fixture(scope="module")
def manifest() -> dict:
    return load_manifest()


@pytest.fixture(scope="module")
def judged(manifest, tmp_path_factory) -> tuple[list[Judged], float]:
    t = time.perf_counter()
    out = judge_corpus(tmp_path_factory.mktemp("corpus"), manifest)
    return out, time.perf_counter() - t


def test_every_corpus_run_is_judged_as_the_manifest_says(manifest, judged):
    verdicts, seconds = judged
    outcome = compare(verdicts, manifest)
    print(f"corpus: {outcome.judged} cancels judged in {seconds:.1f} s")
    assert outcome.ok, "\n" + table(outcome) + "\n(python -m tests.corpus.check --bless keeps them, once read)"
    assert seconds < 60, f"the corpus check took {seconds:.0f} s: at most a minute"


def test_the_series_the_verdicts_read_are_all_they_need(manifest, judged, tmp_path_factory):
    """A window judged on its own (the live judge's, a long run's) reads only VERDICT_METRICS: every corpus cancel
    judged on those series alone gets what it gets with every series the run recorded."""
    narrow = judge_corpus(tmp_path_factory.mktemp("narrow"), manifest, metrics=VERDICT_METRICS)
    assert len(narrow) == len(judged[0]) > 0
    assert [dataclasses.astuple(j) for j in narrow] == [dataclasses.astuple(j) for j in judged[0]]


def test_every_verdict_that_rests_on_the_count_carries_its_reading(judged):
    verdicts, _ = judged
    rules = {j.rule for j in verdicts} & COUNT_READING_RULES
    assert {"released", "still_counted_generating"} <= rules, rules  # a release and a leak read on the count
    missing = [(j.corpus_run, j.request_id, j.rule) for j in verdicts if j.rule in COUNT_READING_RULES and not j.count_read]
    assert not missing, missing


def test_the_corpus_holds_enough_cancels_and_enough_known_by_construction(manifest):
    c = counts(manifest)
    assert c[CONSTRUCTION] + c[REVIEWED] >= MIN_CANCELS, c
    assert c[CONSTRUCTION] >= MIN_CONSTRUCTION, c
    # every reviewed verdict says in one line what it rests on; every entry names how its run was recorded
    for name, entry in manifest["runs"].items():
        assert entry["recorded"]["commit"] and entry["recorded"]["commands"], name
        for run in entry["expected"].values():
            for rid, e in run.items():
                assert e["basis"] in (CONSTRUCTION, REVIEWED) and e["why"].strip(), (name, rid, e)


def test_a_cancel_known_by_construction_judged_the_other_way_fails_the_check(manifest, judged):
    """The check can fail: a rule that calls every leak a release (or every release a leak) is caught on the
    cancels whose truth the set-up makes certain, and is shown by rule."""
    verdicts, _ = judged
    known = {(n, r, rid): t["truth"] for n, e in manifest["runs"].items() for r, run in e["runs"].items()
             for rid, t in run.get("truth", {}).items()}
    flip = {"released": "leaked", "leaked": "released"}
    broken = [dataclasses.replace(j, verdict=flip.get(j.verdict, j.verdict), rule="broken") for j in verdicts]
    outcome = compare(broken, manifest)
    contradicted = [j for j in broken if j.verdict in TRUTHS.get(known.get((j.corpus_run, j.run_id, j.request_id),
                                                                          "no_cancel"), ())
                    and (j.corpus_run, j.run_id, j.request_id) in known]
    assert contradicted and len(outcome.wrong) == len(contradicted)
    assert not outcome.ok and "broken" in table(outcome)


def test_without_the_request_log_and_behind_the_leaking_proxy_few_cancels_are_left_open(manifest, judged):
    """Issue 37's acceptance: on the corpus runs recorded without the engine's request log (vLLM's default), and on
    those behind the proxy that passes no disconnect on, at most one cancel in ten is inconclusive, and every
    verdict says what it rests on (its rule's sentence, or the count it read)."""
    verdicts, _ = judged
    groups = {"without the request log": lambda rec: not rec.get("engine_log_read", True),
              "behind the leaking proxy": lambda rec: rec.get("path") in ("leaky", "slow_reader_leak")}
    for name, belongs in groups.items():
        mine = [j for j in verdicts if belongs(manifest["runs"][j.corpus_run]["recorded"])]
        open_ = [j for j in mine if j.verdict == "inconclusive"]
        print(f"{name}: {len(open_)} of {len(mine)} inconclusive")
        assert len(mine) >= 100, (name, len(mine))
        assert len(open_) * 10 <= len(mine), (name, [(j.corpus_run, j.request_id, j.rule) for j in open_])
        assert all(j.rule and j.why.strip() for j in mine), name


def test_the_engine_made_a_token_or_more_for_each_chunk_its_clients_got(manifest, tmp_path_factory):
    """The premise of tokens_for_nobody_at_most (VllmCase.made_for_nobody_at_most), on every corpus run that counted
    its clients' chunks: from each instant with no request of the run open, generation_tokens_total's rise to any
    later sample is at least the chunks the clients got by LAG_S before that sample. A chunk the engine had not
    counted a token for would let a request that ran out read as released."""
    import numpy as np

    from cancelwatch.analysis.bounds import LAG_S
    from cancelwatch.analysis.verdicts.vllm_frames import _RunFrames
    from cancelwatch.runstore.reader import load_run
    from tests.corpus.check import corpus_stores

    checked, runs = 0, []
    for name, store, entry in corpus_stores(tmp_path_factory.mktemp("premise"), manifest):
        for run_id in entry["runs"]:
            run = load_run(store, int(run_id))
            frames = _RunFrames(run)
            for target in frames.targets:
                frame = frames.frame(target)
                if frame.delivered is None:
                    continue
                runs.append(name)
                times, gen = frame.cols["t_s"], frame.cols["gen_tokens"]
                ok = ~np.isnan(gen)
                times, gen = times[ok], gen[ok]
                d_t, d_v = frame.delivered
                for q in frame.quiet_s:
                    a = int(np.searchsorted(times, q, side="right")) - 1
                    if a < 0:
                        continue
                    later = np.arange(a + 1, len(times))
                    lo = int(np.searchsorted(d_t, q, side="left"))
                    hi = np.searchsorted(d_t, times[later] - LAG_S, side="right") - 1
                    got = np.where((lo < len(d_t)) & (hi > lo), d_v[np.maximum(hi, 0)] - d_v[min(lo, len(d_t) - 1)],
                                   0.0)
                    made = gen[later] - gen[a]
                    steady = np.minimum.accumulate(np.diff(gen[a:], prepend=gen[a])[1:] >= 0)  # until a restart
                    short = (made < got) & steady
                    assert not short.any(), (name, run_id, target, float(q), float(times[later][short][0]),
                                             float(made[short][0]), float(got[short][0]))
                    checked += int(steady.sum())
    assert len(runs) >= 2 and checked > 1000, (runs, checked)


def test_the_engines_own_ends_beyond_the_runs_requests_show_traffic_only_where_there_was_some(manifest, tmp_path_factory):
    """Family.traffic_beyond on every recorded vLLM run: the engine ending more requests by themselves than the run
    sent (vllm:request_success_total by finish reason) contradicts no_traffic_beside_the_run. Said on the run with
    strangers' streams beside it; never on a run that had none (a case built with a stranger may or may not end it
    by itself inside the run)."""
    from cancelwatch.analysis.verdicts.families import family_of
    from cancelwatch.analysis.verdicts.vllm_frames import ends_beyond_the_run
    from cancelwatch.runstore.reader import load_run
    from tests.corpus.check import corpus_stores

    said = {}
    for name, store, entry in corpus_stores(tmp_path_factory.mktemp("beyond"), manifest):
        for run_id in entry["runs"]:
            run = load_run(store, int(run_id))
            if family_of(run) == "vllm":
                said[(name, run_id)] = ends_beyond_the_run(run)
    with_strangers = {k for k in said if manifest["runs"][k[0]]["recorded"].get("foreign_streams")}
    assert with_strangers and all(said[k] for k in with_strangers), with_strangers
    quiet = {k: v for k, v in said.items() if k not in with_strangers and not k[0].startswith("case_foreign")}
    assert len(quiet) > 40 and not any(quiet.values()), {k: v for k, v in quiet.items() if v}
