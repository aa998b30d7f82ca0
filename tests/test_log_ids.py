"""A gateway that mints its own X-Request-Id (analysis/verdicts/log_ids.py): the engine's log then names
every request by an id the ledger does not know. Each line is matched to the one request whose window
(from its send to its first token) it alone falls in, and the cancels are judged as if the ids had been
passed on; lines that could be either of two requests, or that no window holds, stay unknown (other
traffic: inconclusive). The run is the shipped sample (a real default-suite recording on the embedded
vLLM), its engine lines renamed as such a gateway would have them."""

from __future__ import annotations

import hashlib
import json
from types import SimpleNamespace

import pandas as pd
import pytest

from cancelwatch.analysis.verdicts import judge_run, report_document
from cancelwatch.analysis.verdicts.log_ids import AddedLine, LogIds
from tests.test_log_clock import LOG_KINDS, sample


def minted(rid: str) -> str:
    return "gw-" + hashlib.sha1(rid.encode()).hexdigest()[:12]


def renamed(shift_s: float = 0.0):
    """The sample with every engine line naming the gateway's id instead of the client's."""
    run = sample(shift_s)
    lines = run.events["kind"].isin(LOG_KINDS)
    for i in run.events.index[lines]:
        rid = run.events.at[i, "request_id"]
        data = json.loads(run.events.at[i, "data"])
        data["engine_request_id"] = data["engine_request_id"].replace(rid, minted(rid))
        run.events.at[i, "data"] = json.dumps(data)
        run.events.at[i, "request_id"] = minted(rid)
    return run


def test_renamed_lines_are_matched_by_time_and_every_cancel_judged_as_before():
    # every cancel but the burst's two targets, sent together: their lines could be either's
    base = {v.request_id: (v.verdict, v.evidence.rule) for v in judge_run(sample())}
    judged = {v.request_id: v for v in judge_run(renamed())}
    burst = {rid for rid in judged if rid.startswith("cw-burst-target-")}
    assert len(burst) == 2 and len(judged) == 6
    assert {r: (v.verdict, v.evidence.rule) for r, v in judged.items() if r not in burst} == \
        {r: v for r, v in base.items() if r not in burst}
    assert all(judged[r].evidence.log_named_as == minted(r) for r in judged if r not in burst)
    # untold, and said so: never a verdict on a line that may be the other target's
    assert all(judged[r].verdict == "inconclusive" and judged[r].evidence.log_named_as is None for r in burst)
    assert {judged[r].evidence.rule for r in burst} == {"renamed_untold"}
    assert "Pass X-Request-Id through" in judged[min(burst)].evidence.why
    notes = report_document(renamed())["engine_log_notes"]
    assert any("replaces X-Request-Id" in n for n in notes), notes


def test_renamed_lines_the_run_cannot_place_stay_other_traffic():
    # a container logging in UTC beside a recorder 8 h west, and every id renamed: no line names a ledger
    # id to place the clock by, so no window holds any line; never matched to the wrong request
    judged = judge_run(renamed(28800.0))
    assert judged and all(v.verdict == "inconclusive" and v.evidence.log_named_as is None for v in judged)
    assert {v.evidence.rule for v in judged} <= {"other_traffic_logged", "never_added"}


def _ids(lines, bounds):
    run = SimpleNamespace(ledger=pd.DataFrame({"request_id": list(bounds)}))
    return LogIds(run, [AddedLine("t0", cid, f"cmpl-{cid}-0-deadbeef", at, 0.001) for cid, at in lines], bounds)


def test_two_requests_sent_together_are_not_told_apart():
    # a burst: both lines fall in both windows; either assignment fits, so neither is made
    ids = _ids([("gw-1", 1.010), ("gw-2", 1.012)], {"a": (1.000, 1.300), "b": (1.001, 1.310)})
    assert ids.matched == {}


def test_a_request_with_one_line_left_takes_it_once_the_others_are_placed():
    # the neighbour's window holds only its line; the target's holds both (its send 1 ms before the
    # neighbour's first token): the neighbour's line is the neighbour's, the other the target's
    ids = _ids([("gw-n", 0.250), ("gw-t", 0.320)], {"n": (0.200, 0.300), "t": (0.299, 0.450)})
    assert ids.matched == {("t0", "gw-n"): "n", ("t0", "gw-t"): "t"}


def test_a_line_no_window_holds_leaves_the_whole_log_unmatched():
    # other traffic beside the renamed requests, or a clock off: nothing is matched, never a guess
    ids = _ids([("gw-x", 0.9), ("gw-n", 0.250)], {"n": (0.200, 0.300)})
    assert ids.matched == {}
    # a line far outside the run's span (another run's) is not the run's business
    assert _ids([("gw-x", 50.0), ("gw-n", 0.250)], {"n": (0.200, 0.300)}).matched == {("t0", "gw-n"): "n"}


@pytest.mark.parametrize("shift_s", [-0.5, -0.05, 0.05, 0.5])
def test_renamed_lines_on_a_clock_a_little_off_are_not_matched(shift_s):
    # no line names a ledger id to place the clock by: lines shifted into their neighbours' windows would
    # be the wrong requests' lines; some land in no window, and the log matches nothing
    judged = judge_run(renamed(shift_s))
    assert all(v.evidence.log_named_as is None and v.verdict == "inconclusive" for v in judged), \
        [(v.request_id, v.verdict, v.evidence.log_named_as) for v in judged]


def test_without_a_gateway_a_foreign_line_is_never_a_requests_line():
    # the log names the ledger's ids (nothing renames them): an unknown line inside the window of a request
    # that never reached the engine is other traffic, not that request's
    run = sample()
    queued = run.ledger["request_id"].str.startswith("cw-queued-target-")
    rid = run.ledger.loc[queued, "request_id"].iloc[0]
    lines = run.events["kind"].isin(LOG_KINDS) & (run.events["request_id"] == rid)
    run.events.loc[lines, "request_id"] = "stranger"
    run.events.loc[lines, "data"] = run.events.loc[lines, "data"].str.replace(rid, "stranger")
    (v,) = [v for v in judge_run(run) if v.request_id == rid]
    assert v.evidence.log_named_as is None and v.verdict == "inconclusive", v
