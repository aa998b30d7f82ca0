"""What the corpus runs built to show one rule show beyond their verdict and rule (which tests/test_corpus.py
checks): where each timepoint came from, the id a gateway gave a request, the lagging client named, the log's
clock placed, a run of races not accepted. Each reads the stored run and the facts the manifest keeps of what
its proxy did (tests/corpus/record.py), never a live server: the recordings are `make corpus`'s."""

from __future__ import annotations

import pytest

from cancelwatch.analysis.facts import run_facts
from cancelwatch.analysis.verdicts import LOST_CANCEL_RULES, report_document
from cancelwatch.runstore.reader import load_run
from tests.corpus.manifest import load_manifest, unpack

MANIFEST = load_manifest()
KOLKATA_S = 19800  # UTC+5:30: the recorder's zone against the engine's UTC


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("corpus-cases")
    cache: dict = {}

    def run(name: str, run_id: str = "1"):
        if (name, run_id) not in cache:
            entry = MANIFEST["runs"][name]
            r = load_run(unpack(entry, folder), int(run_id))
            cache[(name, run_id)] = (r, report_document(r), entry)
        return cache[(name, run_id)]

    return run


def engine_lines(run, kind: str) -> dict[str, list[float]]:
    ev = run.events[run.events["kind"] == kind]
    out: dict[str, list[float]] = {}
    for rid, t in zip(ev["request_id"], ev["t_s"]):
        out.setdefault(str(rid), []).append(float(t))
    return out


def test_a_direct_cancel_says_where_each_timepoint_came_from(corpus):
    run, doc, _ = corpus("direct_log")
    aborted = engine_lines(run, "engine_aborted")
    direct = [c for c in doc["cancels"] if c["scenario"] != "inproc" and c["verdict"] == "released"]
    assert len(direct) >= 9, [(c["scenario"], c["verdict"]) for c in doc["cancels"]]
    for c in direct:
        src = c["timepoint_sources"]
        assert src["engine_abort"]["source"] == "engine_log", src
        # the engine's abort line for this very request is the engine_abort timepoint
        assert abs(c["timepoints"]["engine_abort"] - min(aborted[c["request_id"]])) <= 0.002, c["timepoints"]
        # no app between the client and the engine: no app_received, and it says why
        assert src["app_received"]["source"] is None and src["app_received"]["reason"].strip(), src
        assert c["timepoints"]["app_received"] is None
        # the count it was read by, as data: the engine's count at or under the bound it was held to
        r = c["evidence"]["count_reading"]
        assert r["count"] <= r["compared_with"] + 1e-9 and r["others_fewest"] <= r["others_most"], r


def test_through_a_gateway_that_mints_ids_each_cancel_names_the_id_it_was_matched_by(corpus):
    run, doc, entry = corpus("case_minted_ids")
    minted = entry["facts"]["proxy"]["minted"]
    lines = run.events[run.events["kind"].isin(["engine_added", "engine_aborted"])]
    # the engine's log names no ledger id, only the gateway's
    assert len(lines) and not set(lines["request_id"]) & set(run.ledger["request_id"]), lines
    for c in doc["cancels"]:
        assert c["evidence"]["log_named_as"] == minted[c["request_id"]], c
    assert any("replaces X-Request-Id" in note for note in doc["engine_log_notes"]), doc["engine_log_notes"]


def test_a_lost_cancel_beside_a_slow_reader_names_the_reader(corpus):
    run, doc, entry = corpus("case_slow_reader_lost")
    (c,) = doc["cancels"]
    (nid,) = [r for r in run.ledger["request_id"] if "-neighbour-" in r]
    assert entry["facts"]["proxy"]["requests"][c["request_id"]]["leaked"]
    assert c["verdict"] == "leaked" and c["evidence"]["rule"] in LOST_CANCEL_RULES, c
    assert c["evidence"]["lagging_clients"] == [nid], c["evidence"]


def test_a_target_stopped_while_waiting_was_waiting(corpus):
    run, doc, _ = corpus("case_waiting_prefill")
    (c,) = doc["cancels"]
    sched = run.series("requests_waiting")
    t = c["timepoints"]["user_stop"]
    before = sched[(sched["t_s"] < t) & (sched["t_s"] >= t - 1.0)]
    assert c["phase_at_cancel"] == "prefill" and len(before) and before["value"].iloc[-1] >= 1, c


def test_a_resubmitting_gateways_request_entered_twice(corpus):
    run, doc, entry = corpus("case_resubmit")
    (c,) = doc["cancels"]
    assert entry["facts"]["proxy"]["resubmitted"] == [c["request_id"]]
    added = engine_lines(run, "engine_added")[c["request_id"]]
    assert len(added) == 2 and added[1] > c["timepoints"]["user_stop"], added


def test_a_run_of_races_through_a_proxy_that_loses_cancels_is_not_accepted(corpus):
    from cancelwatch.analysis.protocol import accepted, protocol_markdown

    run, doc, _ = corpus("case_races_lost")
    assert doc["cancels"] and all(c["verdict"] != "released" for c in doc["cancels"]), doc["cancels"]
    assert not accepted(doc)
    assert "**not accepted**" in protocol_markdown(run, doc)


def test_a_utc_log_beside_a_recorder_in_kolkata_is_moved_back_and_told_its_zone_is_not(corpus):
    run, doc, _ = corpus("utc_vllm_format")
    (clock,) = run_facts(run)["engine_log_clock"]
    # read as Kolkata time the lines are 5 h 30 early; whole-second stamps: the offset within a second
    assert clock["agrees"] and abs(clock["offset_s"] - KOLKATA_S) <= 1.1, clock
    assert clock["lo_s"] <= KOLKATA_S <= clock["hi_s"] and clock["resolution_s"] == 1.0, clock
    assert any("stamped" in note for note in doc["engine_log_notes"]), doc["engine_log_notes"]
    for c in doc["cancels"]:
        if c["timepoint_sources"]["engine_abort"]["source"] == "engine_log":
            # placed on the run's clock: after the stop, inside the grace (not 5 h 30 away)
            assert -0.05 <= c["timepoints"]["engine_abort"] - c["timepoints"]["user_stop"] < 6.0, c
    run, doc, _ = corpus("utc_log_tz_given")
    (clock,) = run_facts(run)["engine_log_clock"]
    assert clock["agrees"] and clock["offset_s"] == 0.0 and clock["lo_s"] <= 0.0 <= clock["hi_s"], clock
    assert doc["engine_log_notes"] == []


def test_the_utc_engine_logged_in_vllms_own_format(corpus):
    run, _, _ = corpus("utc_vllm_format")
    added = run.events[run.events["kind"] == "engine_added"]
    assert len(added) and (added["data"].str.contains('"resolution_s": 1.0')).all(), added["data"].head()


def test_a_neighbours_end_in_the_grace_makes_no_room_for_a_kept_request(corpus):
    """Through the proxy that never passes a cancel on, vLLM on its defaults: the neighbour ended 43 ms before
    the grace's last sample, after the engine's last step, and a count of 1 could be it or this request, which
    ran on 13 s for nobody. Read where the gauges first hold the neighbour's end, the count is still 1: leaked,
    not released (its blocks going back were the neighbour's)."""
    run, doc, entry = corpus("proxy_default", "2")
    (c,) = [c for c in doc["cancels"] if c["scenario"] == "resubmit"]
    truth = entry["runs"]["2"]["truth"][c["request_id"]]
    assert truth["truth"] == "leaked", truth
    assert (c["verdict"], c["evidence"]["rule"]) == ("leaked", "still_counted_generating"), c["evidence"]
    reading = c["evidence"]["count_reading"]
    assert reading["count"] == 1 and reading["open"] == [
        {"request_id": next(r for r in run.ledger["request_id"] if "-resubmit-neighbour-" in r),
         "reason": "ended_after_engines_last_step"}], reading
    assert c["evidence"]["excess_at_grace_end"] == 1.0, c["evidence"]
