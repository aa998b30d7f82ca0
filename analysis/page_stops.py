"""A page's own word on its user's Stop: the report a page sends when its Stop button is pressed (its front-end
task id, the request it stopped, the click's time on its own clock), read by a tap on its way to the app
(runstore/event_kinds.py: page_stop). The first timepoint then rests on the click, not on the socket close the
taps saw it cause. A page's word is evidence, never trusted over the server's: a report that cannot be placed on
the run's clock, names no cancel or a request id more than one request had, or comes twice is kept, with a note,
and the stop stays the client side's (the tap's close). It times the click, and nothing else: the verdict, its
grace and the ghosts' ages stay on the client side's close (Evidence.client_left_s).

The click is placed by the page's own interval from the click to sending the report (both on its clock), back
from the instant the tap read the report (the run's clock): a page's clock may be anywhere, its intervals are
its own. Its clock against the run's, at the report, only says whether to believe it at all.

An app's word on its receipt is read the same way (runstore/event_kinds.py: app_receipt): an app that sees its
client leave before the answer's end reports it upstream, toward the engine, and a tap behind it reads it. The
second timepoint then rests on the app's own word, not on its connection closing at the tap in front of it."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import pandas as pd

from cancelwatch.runstore.reader import Run

PAGE_STOP = "page_stop"  # the event kind a tap writes for a page's report
APP_RECEIPT = "app_receipt"  # and for an app's report of its client leaving
# each report's kind -> the field of the instant it reports, and that instant in words
SAID = {PAGE_STOP: ("clicked_wall_ms", "click"), APP_RECEIPT: ("received_wall_ms", "receipt")}
# a page sends its report as the click's handler runs: one sent longer after its click than this is not the
# click's (a page stalled, a report replayed)
REPORT_WITHIN_S = 5.0
# a page's clock against the run's at the report (its wall time sent, against the tap's wall time read): past
# this, a clock that far off is not believed to time anything
PAGE_CLOCK_S = 2.0
# the click is placed late by the report's delivery (the page's interval runs from the click to the report's
# sending, not to the tap reading it): under load that is tens of ms and more. A click placed after the close it
# caused is at the close at the latest; one placed later than this after it is not this stop's
CLICK_AFTER_CLOSE_S = 1.0
# and the close follows the click at once (fetch's abort closes the connection): a click placed longer before
# it than this did not cause it
CLICK_BEFORE_CLOSE_S = 5.0


@dataclass
class PageStop:
    """One report: the request it names, the page's task id, the tap that read it, where the click lies on the
    run's clock (None: it cannot be placed), the instant the tap read the report, and why it is not used (None:
    usable, as far as the report alone tells)."""

    request_id: str | None
    task_id: str | None
    hop: str | None
    t_report: float
    t_click: float | None
    note: str | None = None


def _number(v) -> float | None:
    """A finite number of a report, or None (a bool, a string, an int too large for a float, NaN)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    try:
        f = float(v)
    except OverflowError:
        return None
    return f if math.isfinite(f) else None


def _read(rid, t_s: float, wall_ns, d: dict, kind: str = PAGE_STOP) -> PageStop:
    """One report as the tap read it, placed on the run's clock or noted (`t_click`: the instant it reports, a
    page's click or an app's receipt)."""
    key, what = SAID[kind]
    task = d.get("task_id")
    stop = PageStop(None if rid is None or pd.isna(rid) else str(rid), None if task is None else str(task)[:200],
                    d.get("hop"), float(t_s), None)
    said, sent = _number(d.get(key)), _number(d.get("sent_wall_ms"))
    if d.get("why"):
        stop.note = f"its report could not be read ({d['why']})"
    elif said is None or sent is None:
        stop.note = f"its report has no {what} time ({key} and sent_wall_ms, ms since 1970)"
    elif not 0 <= sent - said <= REPORT_WITHIN_S * 1000:
        stop.note = f"it reported its {what} {(sent - said) / 1000:+.1f} s after it: not the {what}'s report"
    elif abs(float(wall_ns) / 1e6 - sent) > PAGE_CLOCK_S * 1000:
        stop.note = (f"its clock is {(sent - float(wall_ns) / 1e6) / 1000:+.1f} s from the run's: a clock that far "
                     "off times nothing")
    else:
        stop.t_click = stop.t_report - (sent - said) / 1000
    return stop


def app_receipts(run: Run, hops: list[str] | None = None) -> list[PageStop]:
    """Every app's report of its client leaving, as page_stops reads a page's (`t_click`: the receipt)."""
    return page_stops(run, hops, APP_RECEIPT)


def page_stops(run: Run, hops: list[str] | None = None, kind: str = PAGE_STOP) -> list[PageStop]:
    """Every page report of the run in the order the taps read them, each placed on the run's clock or noted.
    Every tap on the way reads the same report: per request named, the reports of the tap nearest the page that
    read one (`hops`: the run's taps in order from the client). Of a request's reports the first usable one
    stands; the others are noted. `kind`: an app's reports instead (app_receipts)."""
    rows = run.events_of(kind)
    if rows.empty:
        return []
    read = [_read(rid, t, w, json.loads(d) if isinstance(d, str) else (d or {}), kind)
            for rid, t, w, d in zip(rows["request_id"], rows["t_s"], rows["wall_ns"], rows["data"])]
    order = {h: i for i, h in enumerate(hops or [])}
    nearest: dict[str | None, int] = {}
    for r in read:
        nearest[r.request_id] = min(nearest.get(r.request_id, len(order)), order.get(r.hop, len(order)))
    out = [r for r in read if order.get(r.hop, len(order)) == nearest[r.request_id]]
    stopped = set(run.events_of("user_stop")["request_id"].dropna())
    # a request id the ledger holds more than once (the watch renames a reuse `id~xxxxxx`): which one a page
    # stopped, its id cannot say
    reused = {str(rid).split("~")[0] for rid in run.ledger.get("request_id", pd.Series(dtype=object)).dropna()
              if "~" in str(rid)} if not run.ledger.empty else set()
    for r in out:
        if r.note is None and r.request_id not in stopped:
            r.note = "it names no cancel of the run (an unknown task or request id)"
        elif r.note is None and r.request_id in reused:
            r.note = "more than one request had its request id: which one it stopped is not known"
    standing: set[str | None] = set()
    for r in out:
        if r.note is None and r.request_id in standing:
            r.note = f"the {'page' if kind == PAGE_STOP else 'app'} reported this stop again: the first report stands"
        elif r.note is None:
            standing.add(r.request_id)
    return out


def standing_reports(reports: list[PageStop]) -> dict[str, PageStop]:
    """Request id -> the report that speaks for its stop: its first usable one, else its first."""
    out: dict[str, PageStop] = {}
    for r in reports:
        if r.request_id is not None and (r.request_id not in out or (out[r.request_id].note and not r.note)):
            out[r.request_id] = r
    return out


def user_stop_source(stop: PageStop | None, t_close: float, t_sent: float | None, grace_s: float,
                     any_reports: bool) -> tuple[float | None, dict | None]:
    """For a cancel whose client side closed at `t_close` (the server side's stop), its request sent at `t_sent`:
    the click's instant and the user_stop's source where the page's word holds; else (None, the source that
    stays, with why) where the run has page reports; else (None, None). A report read past the grace is not used:
    the live judge, whose window ends there, could not have read it."""
    if stop is not None and stop.note is None and stop.t_click is not None:
        before = t_close - stop.t_click
        if not -CLICK_AFTER_CLOSE_S <= before <= CLICK_BEFORE_CLOSE_S:
            stop.note = (f"its click lies {before:+.2f} s before the close it would have caused: its word is kept, "
                         "not used")
        elif t_sent is not None and stop.t_click < t_sent:
            stop.note = f"its click lies {t_sent - stop.t_click:.2f} s before the request was sent"
        elif stop.t_report > t_close + grace_s:
            stop.note = f"it was read {stop.t_report - t_close:.1f} s after the close, past the grace"
        elif before >= 0:
            return stop.t_click, {"source": "page", "reason": f"the page's Stop click (task {stop.task_id}), "
                                                            f"{1000 * before:.0f} ms before its connection closed"}
        else:  # placed after the close by its report's delivery: the click came before the close it caused
            return t_close, {"source": "page", "reason": f"the page's Stop click (task {stop.task_id}), at its "
                                                       f"connection's close at the latest (its report was read "
                                                       f"{1000 * -before:.0f} ms after it)"}
    if stop is not None:
        return None, {"source": "client", "reason": f"the page's report is not used: {stop.note}"}
    if any_reports:
        return None, {"source": "client", "reason": "the page sent no report of this stop: the client side's close"}
    return None, None


def report_rows(reports: list[PageStop], user_stops: dict[str, dict]) -> list[dict]:
    """The run's page reports for its report: each with whether it timed its cancel's stop (`used`) and, where
    not, why. `user_stops`: request id -> the user_stop source its verdict gave (with_page_stops)."""
    out, used_one = [], set()
    for r in reports:
        source = user_stops.get(r.request_id or "") or {}
        used = source.get("source") == "page" and r.note is None and r.request_id not in used_one
        note = None if used else r.note or (source.get("reason") or "").removeprefix(
            "the page's report is not used: ") or "its cancel was not judged"
        if used:
            used_one.add(r.request_id)
        out.append({"request_id": r.request_id, "task_id": r.task_id, "hop": r.hop, "t_report": r.t_report,
                    "t_click": r.t_click, "used": used, "note": note})
    return out


# an app sees its client leave after the client side closed (the first tap saw it first); its receipt is placed
# late by its report's delivery, early only by its wall clock's whole milliseconds
RECEIPT_BEFORE_CLOSE_S = 0.005


def app_received_source(receipt: PageStop | None, t_close: float, grace_s: float,
                        passed_on: float | None = None) -> tuple[float | None, dict | None]:
    """For a cancel whose client side closed at `t_close`: the app's receipt and the app_received source where the
    app's report (app_receipts) holds; else (None, why it is not used); (None, None) where the app sent none. A
    receipt read past the grace is not used: the live judge, whose window ends there, could not have read it.
    `passed_on`: where the cancel was seen past the app (its upstream closing at the tap behind it, the engine's
    abort): the app had it by then, and a receipt placed later by its report's delivery is put there."""
    if receipt is None:
        return None, None
    if receipt.note is None and receipt.t_click is not None:
        after = receipt.t_click - t_close
        if after < -RECEIPT_BEFORE_CLOSE_S:
            receipt.note = f"its receipt lies {-after:.3f} s before the client side closed: its word is kept, not used"
        elif receipt.t_report > t_close + grace_s:
            receipt.note = f"it was read {receipt.t_report - t_close:.1f} s after the close, past the grace"
        elif passed_on is not None and receipt.t_click > passed_on:
            return max(passed_on, t_close), {
                "source": "app", "reason": f"the app's own word: it saw its client leave, at the latest when the "
                                           f"cancel was seen past it (its report was read "
                                           f"{1000 * (receipt.t_report - passed_on):.0f} ms after)"}
        else:
            return max(receipt.t_click, t_close), {
                "source": "app", "reason": f"the app's own word: it saw its client leave {1000 * max(after, 0):.0f} "
                                           "ms after the client side closed"}
    return None, {"source": None, "reason": f"the app's report is not used: {receipt.note}"}
