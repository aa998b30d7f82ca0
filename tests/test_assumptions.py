"""What a verdict rests on that its evidence does not show (issue 37 point 2): each verdict names the assumptions
it rests on (evidence.assumes, codes of analysis.verdicts.ASSUMPTIONS), and the report says where the run's own
evidence contradicts one. Hand-built runs (tests/test_verdicts.py's build_run); the corpus's no-log runs carry the
same (tests/test_corpus.py)."""

from __future__ import annotations

from cancelwatch.analysis.verdicts import ASSUMPTIONS, judge_run, report_document
from cancelwatch.analysis.verdicts.core import run_assumptions
from tests.test_verdicts import ADDED, build_run, steady_gen


def released(engine_log):
    # the engine's own ends counted (none here): without the log, what tells a release from a request run out
    return build_run(lambda t: 2.0 if t < 2.05 else 1.0, lambda t: 0.4 if t < 2.05 else 0.1, steady_gen,
                     probe_first_s=2.3, engine_log=engine_log, finished=lambda t: 0.0)


def test_a_release_read_on_the_count_without_a_log_that_names_requests_assumes_no_traffic_beside_the_run():
    (named,) = judge_run(released([*ADDED, ("engine_aborted", "tg", 2.012)]))
    (unnamed,) = judge_run(released(None))
    assert named.verdict == unnamed.verdict == "released"
    assert named.evidence.assumes is None  # the log names every request: another's would show
    assert unnamed.evidence.assumes == ["no_traffic_beside_the_run"]
    assert set(ASSUMPTIONS) >= set(unnamed.evidence.assumes)
    assert unnamed.as_json()["evidence"]["assumes"] == ["no_traffic_beside_the_run"]


def test_a_leak_read_on_the_count_without_a_log_names_it_too():
    (v,) = judge_run(build_run(lambda t: 2.0, lambda t: 0.4, steady_gen))  # never falls: no release, steps on
    assert v.verdict == "leaked", v.evidence.why
    assert "no_traffic_beside_the_run" in v.evidence.assumes


def test_the_report_says_where_the_runs_own_evidence_contradicts_an_assumption():
    (quiet,) = judge_run(released(None))
    (a,) = run_assumptions([quiet])
    assert a["assumption"] == "no_traffic_beside_the_run" and a["verdicts"] == 1 and a["contradicted"] is None
    # another cancel of the run saw the engine count more than the run sent: the assumption does not hold there
    (busy,) = judge_run(build_run(lambda t: 3.0, lambda t: 0.4, steady_gen))
    assert busy.evidence.rule == "other_traffic_counted", busy.evidence.why
    (a,) = run_assumptions([quiet, busy])
    assert a["request_ids"] == [quiet.request_id]
    assert a["contradicted"] and busy.request_id in a["contradicted"]


def test_the_report_of_a_run_lists_the_assumptions_its_verdicts_rest_on():
    from cancelwatch.runstore.reader import load_run
    from tests.test_dashboard import SAMPLE

    run = load_run(SAMPLE)
    verdicts = judge_run(run)
    doc = report_document(run, verdicts=verdicts)
    assert [a["assumption"] for a in doc["assumptions"]] == [
        code for code in ASSUMPTIONS if any(code in (v.evidence.assumes or []) for v in verdicts)]


def test_the_engine_ending_more_requests_than_the_run_sent_contradicts_no_traffic_beside_the_run():
    """Without the request log, the engine's own ends (vllm:request_success_total by finish reason) say what the count
    cannot: it ended 6 requests by themselves where the run sent 3 (the neighbour, the target, the probe) and the
    engine held 2 at its first sample, so others' requests reached it. Where the ends stay within the run's, nothing
    is said."""
    from cancelwatch.analysis.verdicts.families import FAMILIES
    from cancelwatch.analysis.verdicts.vllm_frames import ends_beyond_the_run

    def run(ends):
        return build_run(lambda t: 2.0 if t < 2.05 else 1.0, lambda t: 0.4 if t < 2.05 else 0.1, steady_gen,
                         probe_first_s=2.3, engine_log=None, finished=ends)

    busy = run(lambda t: 0.0 if t < 3.0 else 6.0)
    (v,) = judge_run(busy)
    assert "no_traffic_beside_the_run" in v.evidence.assumes
    said = ends_beyond_the_run(busy)
    assert said and "6 request(s)" in said and "the 5 " in said
    assert FAMILIES["vllm"].traffic_beyond is ends_beyond_the_run  # what report_document tells run_assumptions
    (a,) = run_assumptions([v], said)
    assert a["assumption"] == "no_traffic_beside_the_run" and a["contradicted"] == said
    quiet = run(lambda t: 0.0 if t < 3.0 else 5.0)  # as many as the run could account for
    assert ends_beyond_the_run(quiet) is None


def test_traffic_beyond_is_said_only_where_the_ledger_counts_every_engine_request_of_one_engine():
    """A watch's row may stand for several engine requests (a batch of prompts, a beam search, a tool's calls);
    another replica's users are not the judged engine's traffic; an overview's bucket shows its lowest value first,
    and a restart inside it reads as the counter's whole life. On those runs, nothing is said."""
    from cancelwatch.analysis.verdicts.vllm_frames import ends_beyond_the_run
    from cancelwatch.runstore.records import WATCHED_SCENARIO

    def run():
        return build_run(lambda t: 2.0, lambda t: 0.4, steady_gen, engine_log=None,
                         finished=lambda t: 0.0 if t < 3.0 else 9.0)

    assert ends_beyond_the_run(run())  # 9 ends, where the run sent 2 and the engine held 2
    watched = run()
    watched.ledger["scenario"] = WATCHED_SCENARIO
    two = run()
    two.info["targets"] = [{"label": "t0", "url": "http://127.0.0.1:8000"}, {"label": "t1", "url": "http://127.0.0.1:8001"}]
    overview = run()
    overview.info["overview"] = {"bucket_s": 10}
    assert [ends_beyond_the_run(r) for r in (watched, two, overview)] == [None, None, None]
