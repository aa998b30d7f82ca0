"""Where a cancel went on its way to the engine, hop by hop: what the taps in the path (`record --hop`)
saw of the cancelled request's connections.

A tap sits in front of one component (its `hop` is the component it feeds). HTTP/1.1 carries a cancel only
as a close: the cancel *reached* a component when the tap in front of it saw its client side close (FIN or
RST) while the request's response was still open, and the component *passed it on* when the next tap saw
the component close its own upstream connection for that request, or, for the component that is the
engine, when the engine logged its abort. A component that kept its upstream open past the grace is where
the cancel stopped. These are socket closes, stamped on the recorder's clock by the tap: evidence that a
connection went, not that anybody read a cancel.

A request is found at each tap by its `X-Request-Id`; a component that drops or rewrites the id leaves the
request to be matched by time (the scenarios send their requests one after another), and the step says
it was matched so. Pure: events in, steps out.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from urllib.parse import urlparse

import pandas as pd

from cancelwatch.runstore.reader import Run

# two requests sent this close together cannot be told apart by their arrival order at a tap
AMBIGUOUS_S = 0.05
# a tap's stamp and the client's may differ by this much (two threads of one process, one clock)
SLACK_S = 0.05
MATCHES = ("id", "time")
LOG_STAMP_S = 0.05  # how far an engine log's abort may read before the tap's close that caused it
LOOPBACK = {"localhost": "127.0.0.1", "::1": "127.0.0.1"}
# what of the engine's shows a request gone (engine_left's `by`), in a sentence's words
SHOWN_BY = {"engine log": "abort line", "relay": "abort through the relay", "engine": "abort",
            "engine's count": "count"}


@dataclass
class HopStep:
    """One component on a cancelled request's path, as the taps saw it. Times: s since the run started.

    matched: how the request was found at the tap in front of it ("id", "time"), None: not found there;
    reached_s/how: its client side closed (fin | rst) while the response was open: the cancel reached it;
    passed_s/how/by: it closed its upstream for the request (seen by the next tap: by "tap NAME"), or the
    engine logged the abort ("engine log"); upstream_end_s: where its upstream exchange ended otherwise
    (the response's end or a later close at the next tap); note: what else a reader needs (in words).
    untapped: no tap between it and the engine (users tap where they can): what it did with the cancel is the
    engine's evidence alone. engine_left_s/by: where the engine's own evidence shows the request gone (its abort
    line, the relay's abort, its count for a released cancel); a step it contradicts is no stop. unobserved: it
    was reached, and nothing shows whether it passed the cancel on."""

    hop: str
    feeds_engine: bool
    matched: str | None = None
    conn: int | None = None
    reached_s: float | None = None
    reached_how: str | None = None
    passed_s: float | None = None
    passed_how: str | None = None
    passed_by: str | None = None
    upstream_end_s: float | None = None
    note: str | None = None
    untapped: bool = False
    engine_left_s: float | None = None
    engine_left_by: str | None = None
    unobserved: bool = False

    @property
    def held_ms(self) -> float | None:
        """How long the component held the cancel: from reaching it to passing it on (ms)."""
        if self.reached_s is None or self.passed_s is None:
            return None
        held = self.passed_s - self.reached_s
        if self.passed_by == "engine log" and -LOG_STAMP_S < held < 0:
            held = 0.0  # the log's line is stamped to the millisecond, and placed on the run's clock from there
        return round(held * 1000, 1)

    def as_json(self, t_stop: float) -> dict:
        def after(t):
            return None if t is None else round((t - t_stop) * 1000, 1)

        return {"hop": self.hop, "feeds_engine": self.feeds_engine, "matched": self.matched, "conn": self.conn,
                "reached_s": self.reached_s, "reached_how": self.reached_how, "reached_ms": after(self.reached_s),
                "passed_s": self.passed_s, "passed_how": self.passed_how, "passed_by": self.passed_by,
                "passed_ms": after(self.passed_s), "held_ms": self.held_ms, "upstream_end_s": self.upstream_end_s,
                "note": self.note, "untapped": self.untapped, "engine_left_s": self.engine_left_s,
                "engine_left_by": self.engine_left_by, "unobserved": self.unobserved}


def run_hops(run: Run) -> list[dict]:
    """The run's taps in order from the client, as stored (`settings.hops`); [] for a run without."""
    return list((run.info.get("settings") or {}).get("hops") or [])


def _addr(host: str | None, port) -> tuple[str, int | None]:
    return LOOPBACK.get(host or "", host or ""), (int(port) if port is not None else None)


def engine_addresses(run: Run) -> set[tuple[str, int | None]]:
    """host:port of the run's sampled targets (the engines): a tap whose upstream is one feeds an engine."""
    out = set()
    for t in run.info.get("targets") or []:
        u = urlparse(t.get("url") or "")
        if u.hostname:
            out.add(_addr(u.hostname, u.port or (443 if u.scheme == "https" else 80)))
    return out


@dataclass
class _Tap:
    """One tap's events, by connection."""

    requests: pd.DataFrame  # t_s, request_id, conn, seq, method
    closes: dict  # conn -> [(t_s, side, how, open_seq)]
    ends: dict  # (conn, seq) -> t_s


# a page's or an app's report to cancelwatch (analysis/page_stops.py) passes a tap as a request to a path under
# this one: it is none, whether the tap read the report or not (a body cut short, a path its table does not hold:
# collectors/sources/tap.py REPORTS)
REPORT_PATHS = "/cancelwatch/"


def _taps(run: Run) -> dict[str, _Tap]:
    ev = run.events_of("tap_request", "tap_closed", "tap_response_end")
    rows = {"tap_request": [], "tap_closed": [], "tap_response_end": []}
    for kind, rid, t, raw in zip(ev["kind"], ev["request_id"], ev["t_s"], ev["data"]) if len(ev) else ():
        d = json.loads(raw) if isinstance(raw, str) else (raw or {})
        rows[kind].append((d.get("hop"), None if pd.isna(rid) else rid, float(t), d))
    out: dict[str, _Tap] = {}
    for hop in {r[0] for rs in rows.values() for r in rs}:
        reqs = pd.DataFrame([(t, rid, d.get("conn"), d.get("seq"), d.get("method"))
                             for h, rid, t, d in rows["tap_request"]
                             if h == hop and REPORT_PATHS not in str(d.get("path") or "")],
                            columns=["t_s", "request_id", "conn", "seq", "method"]).sort_values("t_s")
        closes: dict = {}
        for h, _, t, d in rows["tap_closed"]:
            if h == hop:
                closes.setdefault(d.get("conn"), []).append((t, d.get("side"), d.get("how"), d.get("open_seq")))
        ends = {(d.get("conn"), d.get("seq")): t for h, _, t, d in rows["tap_response_end"] if h == hop}
        out[hop] = _Tap(reqs.reset_index(drop=True), closes, ends)
    return out


def _match(tap: _Tap, ledger: pd.DataFrame, t0: int, before: dict[str, float]) -> dict[str, tuple[int, int, str, float]]:
    """Ledger request id -> (conn, seq, how matched, arrival s) at one tap. By `X-Request-Id` first (the id or
    one that holds it); the requests left (a component that drops or rewrites ids) by order of arrival, each
    after its send and its arrival at the tap before (`before`), and only where its send stands apart."""
    out: dict[str, tuple[int, int, str, float]] = {}
    reqs = tap.requests
    if reqs.empty:
        return out
    known = [r for r in ledger["request_id"] if isinstance(r, str)]
    claimed: set[int] = set()
    for i, rid in enumerate(reqs["request_id"]):
        if not isinstance(rid, str):
            continue
        mine = rid if rid in known else next((k for k in known if k in rid), None)
        if mine is not None and mine not in out:
            out[mine] = (int(reqs["conn"][i]), int(reqs["seq"][i]), "id", float(reqs["t_s"][i]))
            claimed.add(i)
    free = [i for i in range(len(reqs)) if i not in claimed and reqs["method"][i] == "POST"
            and not (isinstance(reqs["request_id"][i], str) and any(k in reqs["request_id"][i] for k in known))]
    left = ledger[~ledger["request_id"].isin(list(out))].dropna(subset=["sent_mono_ns"]).sort_values("sent_mono_ns")
    sent = ((left["sent_mono_ns"].to_numpy(float) - t0) / 1e9).tolist()
    ids = list(left["request_id"])
    for k, (rid, t_sent) in enumerate(zip(ids, sent)):
        near = [s for j, s in enumerate(sent) if j != k and abs(s - t_sent) < AMBIGUOUS_S]
        earliest = max(t_sent, before.get(rid, t_sent)) - SLACK_S
        pick = next((i for i in free if reqs["t_s"][i] >= earliest), None)
        if pick is None:
            continue
        free.remove(pick)  # taken in order even where ambiguous: the next request is not given its arrival
        if not near:
            out[rid] = (int(reqs["conn"][pick]), int(reqs["seq"][pick]), "time", float(reqs["t_s"][pick]))
    return out


def _client_close(tap: _Tap, conn: int, seq: int) -> tuple[float, str] | None:
    """When the client side of `conn` closed while request `seq`'s response was open, and how."""
    for t, side, how, open_seq in tap.closes.get(conn, []):
        if side == "client" and open_seq == seq:
            return t, how
    return None


def _exchange_end(tap: _Tap, conn: int, seq: int) -> float | None:
    """The end of request `seq` on `conn` at a tap: its response's end, else the connection's first close."""
    end = tap.ends.get((conn, seq))
    if end is not None:
        return end
    closes = tap.closes.get(conn, [])
    return min(t for t, *_ in closes) if closes else None


def hop_traces(run: Run, cancels: list) -> dict[str, list[HopStep]]:
    """Per cancelled request (each of `cancels`: request_id, timepoints, sources), its steps through the
    run's taps in order from the client; {} for a run without taps."""
    hops = run_hops(run)
    if not hops or run.ledger.empty:
        return {}
    taps, engines, t0 = _taps(run), engine_addresses(run), run.info["started_mono_ns"]
    matches: list[dict] = []
    before: dict[str, float] = {}
    for h in hops:
        m = _match(taps[h["name"]], run.ledger, t0, before) if h["name"] in taps else {}
        before.update({rid: arrived for rid, (_, _, _, arrived) in m.items()})
        matches.append(m)
    out = {}
    for v in cancels:
        steps = []
        left_s, left_by = engine_left(v)
        for i, h in enumerate(hops):
            step = HopStep(h["name"], _addr(h.get("upstream_host"), h.get("upstream_port")) in engines,
                           engine_left_s=left_s, engine_left_by=left_by)
            found = matches[i].get(v.request_id)
            if found is None:
                step.note = "the tap in front of it saw no request it could tell was this one"
                steps.append(step)
                continue
            step.conn, seq, step.matched, _ = found
            tap = taps[h["name"]]
            reached = _client_close(tap, step.conn, seq)
            if reached is not None:
                step.reached_s, step.reached_how = reached
            elif tap.ends.get((step.conn, seq)) is not None:
                step.note = "its response had passed to its end before its client side closed"
            nxt = matches[i + 1].get(v.request_id) if i + 1 < len(hops) else None
            if nxt is not None:
                nconn, nseq = nxt[0], nxt[1]
                ntap = taps[hops[i + 1]["name"]]
                passed = _client_close(ntap, nconn, nseq)
                if passed is not None:
                    step.passed_s, step.passed_how = passed
                    step.passed_by = f"tap {hops[i + 1]['name']}"
                step.upstream_end_s = _exchange_end(ntap, nconn, nseq)
            elif step.feeds_engine or i == len(hops) - 1:
                step.untapped = not step.feeds_engine
                _by_the_engine(step, getattr(v, "verdict", None))
            steps.append(step)
        out[v.request_id] = steps
    return out


def engine_left(v) -> tuple[float | None, str | None]:
    """Where the engine's own evidence shows the cancelled request gone, and what shows it: its abort line (or the
    relay's abort), else, for a cancel judged released, the sample where its count showed it gone."""
    abort = v.timepoints.get("engine_abort")
    if abort is not None:
        return abort, {"engine_log": "engine log", "relay": "relay"}.get(
            (v.sources.get("engine_abort") or {}).get("source"), "engine")
    if getattr(v, "verdict", None) == "released" and v.timepoints.get("left_scheduler") is not None:
        return v.timepoints["left_scheduler"], "engine's count"
    return None, None


def _by_the_engine(step: HopStep, verdict: str | None) -> None:
    """A component with no tap behind it: the engine itself (the tap in front of it is the last), or the last tapped
    one, with untapped others between it and the engine (`untapped`). What it did with the cancel is the engine's
    evidence: it passed it on where that shows the request gone (an untapped one by then at the latest); it kept it
    (or, untapped, one after it did) where the engine kept the request (leaked); else nothing shows which."""
    if step.reached_s is None:
        return
    where = "no tap between it and the engine" if step.untapped else "the engine's own evidence"
    if step.engine_left_s is not None:
        step.passed_s, step.passed_by = step.engine_left_s, step.engine_left_by
        if step.untapped:
            step.note = (f"{where}: the engine's {SHOWN_BY.get(step.engine_left_by, 'evidence')} shows the cancel "
                         "came through, by then at the latest")
            if step.engine_left_s < step.reached_s - LOG_STAMP_S:
                step.note = "the engine let the request go before the cancel reached this component"
    elif verdict == "leaked":
        step.note = (f"{where}: the engine kept the request"
                     + (": it, or one after it, kept the cancel" if step.untapped else ""))
    else:
        step.unobserved = True
        step.note = f"{where}: it does not say whether the cancel came through"


def stopped_at(steps: list[HopStep], grace_s: float) -> HopStep | None:
    """The first component the cancel reached but did not pass on within the grace: never one the engine's own
    evidence contradicts (the request gone within the grace of reaching it), nor one nothing can tell of."""
    for s in steps:
        if s.reached_s is None or s.unobserved:
            continue
        if s.passed_s is None or s.passed_s - s.reached_s > grace_s:
            if s.engine_left_s is not None and s.engine_left_s - s.reached_s <= grace_s:
                continue  # the next tap saw no close for it, but the engine let the request go in time
            return s
    return None


def app_received(steps: list[HopStep]) -> HopStep | None:
    """The step of the app nearest the client whose tap saw the cancel reach it (not the engine's own)."""
    return next((s for s in steps if not s.feeds_engine and s.reached_s is not None), None)


def hop_story(steps: list[HopStep], grace_s: float) -> str | None:
    """The cancel's way through the hops in one sentence; None without taps."""
    if not steps:
        return None
    stop = stopped_at(steps, grace_s)
    if stop is not None:
        if stop.untapped:  # what kept it, this component or an untapped one after it, no tap saw
            return (f"the cancel stopped at `{stop.hop}` or past it (no tap between it and the engine, which kept the "
                    f"request): its client side closed at {stop.reached_s:.2f} s ({stop.reached_how})")
        after = stop.passed_s if stop.passed_s is not None else stop.upstream_end_s
        more = (f"its upstream stayed open {after - stop.reached_s:.1f} s more" if after is not None
                else "its upstream was not seen to close")
        return (f"the cancel stopped at `{stop.hop}`: its client side closed at {stop.reached_s:.2f} s "
                f"({stop.reached_how}), {more}")
    unseen_past = next((s for s in steps if s.unobserved), None)
    if unseen_past is not None:
        why = ("no tap between it and the engine, and the engine's evidence does not say" if unseen_past.untapped
               else "the engine's evidence does not say whether it left")
        return (f"the cancel reached `{unseen_past.hop}` at {unseen_past.reached_s:.2f} s ({unseen_past.reached_how}) "
                f"and was not observed past it: {why}")
    passed = [s for s in steps if s.reached_s is not None and s.passed_s is not None]
    if passed and len(passed) == len([s for s in steps if s.matched]):
        return "the cancel passed every hop: " + ", ".join(
            f"`{s.hop}` {s.held_ms:g} ms" + (f" (no tap behind it: at most, by the engine's "
                                             f"{SHOWN_BY.get(s.passed_by, 'evidence')})" if s.untapped else "")
            for s in passed)
    through = next((s for s in steps if s.reached_s is not None and s.passed_s is None and s.engine_left_s is not None),
                   None)
    if through is not None:
        return (f"the taps did not see `{through.hop}` pass the cancel on, but the engine's "
                f"{SHOWN_BY.get(through.engine_left_by, 'evidence')} shows the request gone at "
                f"{through.engine_left_s:.2f} s")
    unseen = [s.hop for s in steps if s.reached_s is None]
    if unseen:
        return f"the taps did not see the cancel reach {', '.join(f'`{h}`' for h in unseen)}"
    return None
