"""A page's word on its Stop (analysis/page_stops.py) on hand-built runs: a report that holds times the first
timepoint; one that cannot be placed on the run's clock, names no cancel, or comes twice is kept with a note and
never used; nothing the page says changes a verdict. The real page, in Chromium, is test_page_stop_browser.py."""

from __future__ import annotations

import json

import pandas as pd

from cancelwatch.analysis.page_stops import CLICK_AFTER_CLOSE_S, PAGE_CLOCK_S, page_stops
from cancelwatch.analysis.verdicts import judge_run, report_document
from tests.test_hops import HOPS, both_hops, closed, run_with, through
from tests.test_verdicts import T0

WALL0 = 1_790_000_000_000_000_000  # run_with's started_wall_ns: a page's clock agreeing with the run's reads this at 0


def report(rid: str | None, at: float, clicked_before_s: float = 0.02, clock_off_s: float = 0.0, hop: str = "nginx",
           raw: dict | None = None) -> dict:
    """A page's report read by the tap `hop` at `at` (run s): its click `clicked_before_s` before it sent it, its
    clock `clock_off_s` from the run's."""
    sent_ms = (WALL0 / 1e6) + 1000 * (at + clock_off_s)
    data = raw if raw is not None else {"task_id": f"task-{rid}", "clicked_wall_ms": sent_ms - 1000 * clicked_before_s,
                                        "sent_wall_ms": sent_ms, "why": None}
    return {"request_id": rid, "kind": "page_stop", "mono_ns": T0 + int(at * 1e9), "wall_ns": WALL0 + int(at * 1e9),
            "t_s": at, "data": json.dumps({"hop": hop, "conn": 9, "seq": 0, **data})}


def judged(*reports: dict):
    run = run_with([*both_hops(), closed("nginx", 2, "tg", 2.0), closed("vllm", 2, "tg", 2.001), *reports])
    return run, judge_run(run)[0]


def test_a_report_that_holds_times_the_stop_by_the_click_and_changes_no_verdict():
    _, plain = judged()
    run, v = judged(report("tg", 1.99, clicked_before_s=0.03), report("tg", 1.991, hop="vllm"))
    assert v.timepoints["user_stop"] == 1.96 or abs(v.timepoints["user_stop"] - 1.96) < 1e-6
    assert v.sources["user_stop"]["source"] == "page" and "task task-tg" in v.sources["user_stop"]["reason"]
    assert "40 ms before its connection closed" in v.sources["user_stop"]["reason"]
    assert (v.verdict, v.rule) == (plain.verdict, plain.rule) and plain.sources["user_stop"]["source"] == "client"
    # what the grace counts from stays the client side's close
    assert v.evidence.client_left_s == 2.0 and v.client_left_s() == plain.client_left_s() == 2.0
    # the vllm tap read the same report on its way: the one nearest the page is the run's
    doc = report_document(run, verdicts=[v])
    assert [(r["hop"], r["used"], r["note"]) for r in doc["page_reports"]] == [("nginx", True, None)]


def test_bad_reports_are_kept_with_a_note_and_never_used():
    cases = {
        "clock": (report("tg", 1.99, clock_off_s=PAGE_CLOCK_S + 28), "its clock is +30.0 s from the run's"),
        "late": (report("tg", 1.99, clicked_before_s=9.0), "it reported its click +9.0 s after it"),
        "after close": (report("tg", 3.5, clicked_before_s=0.01), "its click lies -1.49 s before the close"),
        "no time": (report("tg", 1.99, raw={"task_id": "t"}), "its report has no click time"),
        "not json": (report(None, 1.99, raw={"why": "not a JSON object"}), "could not be read (not a JSON object)"),
        "unknown": (report("someone-else", 1.99), "it names no cancel of the run"),
        "huge": (report("tg", 1.99, raw={"task_id": "t", "clicked_wall_ms": 10**400, "sent_wall_ms": 10**400}),
                 "its report has no click time"),
        "before sent": (report("tg", 1.99, clicked_before_s=1.6), "before the request was sent"),
        "past the grace": (report("tg", 4.5, clicked_before_s=4.0), "after the close, past the grace"),
    }
    for name, (bad, note) in cases.items():
        run, v = judged(bad)
        assert v.timepoints["user_stop"] == 2.0, name
        reason = v.sources["user_stop"]["reason"]
        assert v.sources["user_stop"]["source"] == "client", name
        rows = report_document(run, verdicts=[v])["page_reports"]
        assert len(rows) == 1 and not rows[0]["used"] and note in rows[0]["note"], (name, rows)
        if bad["request_id"] == "tg":  # the cancel's own report: the verdict's source says why it stands
            assert note in reason, (name, reason)
        else:
            assert reason == "the page sent no report of this stop: the client side's close", (name, reason)


def test_a_report_sent_twice_keeps_the_first():
    run, v = judged(report("tg", 1.99, clicked_before_s=0.03), report("tg", 2.5, clicked_before_s=0.2))
    assert abs(v.timepoints["user_stop"] - 1.96) < 1e-6 and v.sources["user_stop"]["source"] == "page"
    rows = report_document(run, verdicts=[v])["page_reports"]
    assert [r["used"] for r in rows] == [True, False] and "reported this stop again" in rows[1]["note"], rows


def test_a_click_placed_after_the_close_by_its_reports_delivery_is_at_the_close_at_the_latest():
    # the page's interval runs to the report's sending; its delivery places the click late. The click caused the
    # close: it was there at the latest. Placed later than CLICK_AFTER_CLOSE_S after it, it is not this stop's
    _, v = judged(report("tg", 2.0 + CLICK_AFTER_CLOSE_S / 2, clicked_before_s=0.0))
    assert v.sources["user_stop"]["source"] == "page" and v.timepoints["user_stop"] == 2.0, v.sources
    assert "at its connection's close at the latest" in v.sources["user_stop"]["reason"]
    assert v.client_left_s() == 2.0
    _, v = judged(report("tg", 2.0 + 1.5 * CLICK_AFTER_CLOSE_S, clicked_before_s=0.0))
    assert v.sources["user_stop"]["source"] == "client" and v.timepoints["user_stop"] == 2.0


def test_a_run_without_reports_is_as_before():
    run, v = judged()
    assert page_stops(run) == [] and report_document(run, verdicts=[v])["page_reports"] == []
    assert v.sources["user_stop"] == {"source": "client", "reason": None}


def test_a_request_id_more_than_one_request_had_is_not_timed_by_a_report():
    run, _ = judged()
    run.ledger = pd.concat([run.ledger, run.ledger[run.ledger["request_id"] == "tg"].assign(request_id="tg~a1b2c3")],
                           ignore_index=True)
    run.events = pd.concat([run.events, pd.DataFrame([report("tg", 1.99)])], ignore_index=True).sort_values("mono_ns")
    v = next(v for v in judge_run(run) if v.request_id == "tg")
    assert v.sources["user_stop"]["source"] == "client", v.sources["user_stop"]
    assert "more than one request had its request id" in v.sources["user_stop"]["reason"]


def test_a_later_good_report_stands_where_the_first_cannot_be_used_and_each_tap_nearest_the_page_counts():
    # the first report has no time; the second is good: it stands. Read by the farther tap only: still read
    _, v = judged(report("tg", 1.98, raw={"task_id": "t"}), report("tg", 1.99, clicked_before_s=0.03, hop="vllm"))
    assert v.sources["user_stop"]["source"] == "client", v.sources  # the nearest tap's reports only, per request
    _, v = judged(report("tg", 1.98, raw={"task_id": "t"}), report("tg", 1.99, clicked_before_s=0.03))
    assert v.sources["user_stop"]["source"] == "page" and abs(v.timepoints["user_stop"] - 1.96) < 1e-6
    _, v = judged(report("tg", 1.99, clicked_before_s=0.03, hop="vllm"))
    assert v.sources["user_stop"]["source"] == "page", v.sources



def receipt(rid: str | None, at: float, seen_before_s: float = 0.002, clock_off_s: float = 0.0,
            raw: dict | None = None, conn: int = 7) -> list[dict]:
    """An app's report that its client left, sent upstream and read by the tap `vllm` at `at` (run s): the app saw
    it `seen_before_s` before it sent the report, its clock `clock_off_s` from the run's. The report passes the tap
    as a POST of its own, with no X-Request-Id."""
    sent_ms = (WALL0 / 1e6) + 1000 * (at + clock_off_s)
    data = raw if raw is not None else {"received_wall_ms": sent_ms - 1000 * seen_before_s, "sent_wall_ms": sent_ms,
                                        "why": None}
    return [{"request_id": None, "kind": "tap_request", "mono_ns": T0 + int(at * 1e9), "wall_ns": WALL0 + int(at * 1e9),
             "t_s": at - 0.0005, "data": json.dumps({"hop": "vllm", "conn": conn, "seq": 0, "method": "POST",
                                                     "path": "/cancelwatch/received"})},
            {"request_id": rid, "kind": "app_receipt", "mono_ns": T0 + int(at * 1e9), "wall_ns": WALL0 + int(at * 1e9),
             "t_s": at, "data": json.dumps({"hop": "vllm", "conn": conn, "seq": 0, **data})}]


def test_an_apps_own_word_on_its_receipt_times_the_second_point_and_changes_no_verdict():
    _, plain = judged()
    assert plain.sources["app_received"]["source"] == "tap"
    # the tap behind the app (vllm) saw it close its upstream at 2.001: the app saw its client leave before
    run, v = judged(*receipt("tg", 2.0009, seen_before_s=0.0005))
    assert v.sources["app_received"]["source"] == "app", v.sources["app_received"]
    assert abs(v.timepoints["app_received"] - 2.0004) < 1e-6
    assert "the app's own word: it saw its client leave 0 ms after the client side closed" == \
        v.sources["app_received"]["reason"]
    assert (v.verdict, v.rule) == (plain.verdict, plain.rule) and v.timepoints["user_stop"] == 2.0
    # a report delivered late places the receipt late: it is at the cancel's passing on, at the latest
    _, late = judged(*receipt("tg", 2.012, seen_before_s=0.004))
    assert late.sources["app_received"]["source"] == "app" and abs(late.timepoints["app_received"] - 2.001) < 1e-6
    assert "at the latest when the cancel was seen past it (its report was read 11 ms after)" in \
        late.sources["app_received"]["reason"]
    # the report is no request of the run's: no hop matched it, the ledger's requests kept their steps
    assert [(h.hop, h.matched) for h in v.hops] == [(h.hop, h.matched) for h in plain.hops]


def test_an_apps_report_that_cannot_hold_is_noted_and_the_taps_reading_stays():
    cases = {
        "before the close": (receipt("tg", 1.9), "its receipt lies 0.102 s before the client side closed"),
        "past the grace": (receipt("tg", 4.5, seen_before_s=2.4), "after the close, past the grace"),
        "clock": (receipt("tg", 2.01, clock_off_s=PAGE_CLOCK_S + 3), "its clock is +5.0 s from the run's"),
        "no time": (receipt("tg", 2.01, raw={"why": None}), "its report has no receipt time"),
        "late": (receipt("tg", 2.01, seen_before_s=7.0), "it reported its receipt +7.0 s after it"),
        "unknown": (receipt("nobody", 2.01), None),
    }
    for name, (bad, note) in cases.items():
        _, v = judged(*bad)
        src = v.sources["app_received"]
        assert src["source"] == "tap" and v.timepoints["app_received"] == 2.0, (name, src)
        if note is None:  # names no cancel: nothing said of this one
            assert src["reason"] == "the app's connection from its client closed", (name, src)
        else:
            assert note in src["reason"] and src["reason"].startswith("the app's connection"), (name, src)


def test_a_report_passing_a_tap_is_never_taken_for_a_request_matched_by_time():
    # a tap before vLLM that sees no ids (a gateway dropped them) matches requests by time: an app's report, which
    # comes with none, must not stand in for the next request there
    base = [*through("nginx", 1, "nb", 0.1), *through("vllm", 1, None, 0.102), *through("nginx", 2, "tg", 0.5)]
    # read as a report, or only as a request to its path (its body cut short: no report event)
    for report in (receipt(None, 0.5018, conn=5), receipt(None, 0.5018, conn=5)[:1]):
        run = run_with([*base, *report, *through("vllm", 2, None, 0.502),
                        closed("nginx", 2, "tg", 2.0), closed("vllm", 2, None, 2.001)])
        v = judge_run(run)[0]
        vllm = next(h for h in v.hops if h.hop == "vllm")
        assert vllm.conn == 2 and vllm.matched == "time", v.hops
