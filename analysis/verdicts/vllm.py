"""vLLM's evidence rules: reconcile what the client knows (the ledger) with what the scheduler reports.

Timepoints of a cancel, in seconds since the run started, each with the source it rests on:
  user_stop      the client's action (client; in timeout mode, the moment its timeout fired)
  app_received   the relay app saw the cancel for the id it issued (relay); null on paths with no app
  engine_abort   the engine's own `Aborted request` log line for this id (engine_log), or the relay's
                 abort() returning (relay); null without an engine log. Never a client stamp.
  left_scheduler first refreshed sample at or after the abort where the server's running+waiting is no
                 more than the ledger's in-flight requests and, for a request the gauges counted while
                 it held KV, KV usage is below its level at the stop (samples)
  reusable       the probe's first token: the freed capacity was handed out again (client)

Verdicts: released (left_scheduler within the grace window after the abort); leaked (the engine log
shows no abort while the request stayed in the engine after the stop, even when it then ran to its
natural end inside the grace, or the abort came only after the grace, or, without a log, the server
still counts more than the ledger after the grace while the engine keeps stepping); stale_gauge (the
same, but generation_tokens_total is flat: gauges pinned between steps); inconclusive (the engine had
already finished the request or a race at its last tokens, other traffic anywhere in the window, too
few samples, no samples across the grace, an engine restart in the window).
The ledger counts a request in the server from its send (its Added line, where the log names it) to
its client's close; a request the client completed ends earlier where the engine's evidence says the
engine was done with it while its client still read (engine_done.py): a slow reader beside a lost
cancel must not stand in for the request the engine kept.
Never judged by request_success_total{finished_reason="abort"}:
vLLM does not count client disconnects there.

The shared guards (core.GUARDS) come first; EVIDENCE_RULES are this family's rungs after them.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

import numpy as np
import pandas as pd

from analysis.rows import frame_rows
from analysis.evidence import Evidence
from analysis.ghosts import EngineReading, Ghosts
from analysis.series import sample_period, scheduler_frame
from analysis.verdicts.core import (
    HORIZON_S,
    LOG_SLACK_S,
    NO_APP,
    NO_LOG,
    NO_REQUESTS,
    RACE_TOKENS,
    SEEN_LEAVING,
    CancelVerdict,
    Case,
    climb,
    engine_log_state,
    first_probe_s,
    judge,
    ledger_by_scenario,
    left_seen_at,
)
from analysis.verdicts.engine_done import engine_done_at, solo_tokens_per_s
from analysis.verdicts.paid_tokens import tokens_after_left
from analysis.verdicts.requests import Requests, in_between, requests_of, weighted_between
from analysis.verdicts.log_clock import LogClock, log_evidence
from analysis.verdicts.log_ids import LogIds
from runstore.reader import Run
from runstore.records import WATCHED_SCENARIO

VLLM = "vllm"
ENGINE_LOG = "engine_log"  # the source name of the engine log's gaps (collectors/sources/engine_log.py)
NAMES_NO_REQUESTS = "the engine log names no requests"


def ledger_inflight(ledger: pd.DataFrame, t0_ns: int, times: np.ndarray, aborted_at: dict[str, float],
                    added_at: dict[str, float] | None = None, not_entered: frozenset[str] = frozenset(),
                    reqs: Requests | None = None) -> np.ndarray:
    """Sequences the client believes are in the server at each of `times` (instants, s since the run
    started): sent and not yet closed, or not yet aborted (`aborted_at`: request id -> instant). Where
    the engine's log says when a request entered the engine (`added_at`), it counts from then: a request
    still on its way (a proxy, the API server) is not yet the engine's; one the log shows never entered
    (`not_entered`: _EngineLog.not_entered) is never counted. `reqs`: the ledger as arrays, where built."""
    reqs = requests_of(ledger, t0_ns) if reqs is None else reqs
    start = reqs.sent.copy()
    for rid, t in (added_at or {}).items():
        i = reqs.row.get(rid)
        if i is not None:
            start[i] = max(start[i], t)  # NaN stays NaN: a request never sent is never counted
    for rid in not_entered:
        i = reqs.row.get(rid)
        if i is not None:
            start[i] = math.nan
    return weighted_between(times, start, reqs.ends(aborted_at), reqs.seqs)


def vllm_report_fields(run: Run) -> dict:
    """What a vLLM run's report adds: each engine log's clock against the run's (log_clock.py), and what a
    reader must know of the logs before reading the verdicts."""
    clocks, ids = log_evidence(run)
    return {"engine_log_clock": [c.as_json() for c in clocks.values()],
            "engine_log_notes": engine_log_notes(run, clocks, ids)}


def engine_log_notes(run: Run, clocks: dict[str | None, LogClock], ids: LogIds | None = None) -> list[str]:
    """One sentence per read engine log that names no request, has no abort line for any of the run's
    cancels, names the run's requests by ids a gateway minted (`ids`: log_ids.py), or whose clock
    (`clocks`: log_clocks of the run) the run moved or could not place (the report says them, and the
    protocol from it)."""
    logs = (run.info.get("engine") or {}).get("engine_log") or {}
    ev = run.events
    notes = []
    stops = int((ev["kind"] == "user_stop").sum()) if not ev.empty else 0
    lines = ev[ev["kind"].isin(["engine_added", "engine_aborted"])] if not ev.empty else ev
    lines_of = Counter((json.loads(d).get("target"), kind) for kind, d in zip(lines["kind"], lines["data"])) \
        if len(lines) else Counter()
    for target, entry in logs.items():
        if not (isinstance(entry, dict) and entry.get("path")):
            continue
        added, aborted = lines_of[(target, "engine_added")], lines_of[(target, "engine_aborted")]
        if not added:
            notes.append(f"The engine log of {target} names no requests (not one 'Added request' line): start vLLM "
                         "with --enable-log-requests. Without those lines no cancel is judged on it, and none is "
                         "called lost for its silence.")
        elif stops and not aborted:
            notes.append(f"The engine log of {target} has no abort line for any of the run's {stops} cancel(s): "
                         "either none reached the engine, or this vLLM writes its abort line in a form cancelwatch "
                         "does not read (it reads 'Aborted request(s) <ids>.' and, before vLLM 0.10.1, 'Aborted "
                         "request <id>.').")
        renamed = sum(1 for tgt, _ in ids.renamed if tgt == target) if ids is not None else 0
        if renamed:
            notes.append(f"The engine log of {target} names {renamed} of the run's requests by ids the client did "
                         "not send (something on the path replaces X-Request-Id with its own): each was matched "
                         "to its request as the only unknown one that entered the engine between that request's "
                         "send and its first token. Pass X-Request-Id through to the engine to name them.")
        clock = clocks.get(target)
        if clock is None or not clock.requests:
            continue
        bounds = f"{clock.requests} request(s) allow offsets from {clock.lo_s:+.3f} to {clock.hi_s:+.3f} s"
        if not clock.agrees:
            notes.append(f"The engine log clock of {target} disagrees with the run's: no one offset puts every "
                         f"'Added request' line between its request's send and first token ({bounds}); every "
                         "verdict that rests on this log is inconclusive. Give its zone with --engine-log-tz, or "
                         "check the engine host's clock.")
        elif clock.offset_s:
            notes.append(f"The engine log of {target} was stamped {-clock.offset_s:+.3f} s off the run's clock "
                         f"(another zone, or a clock off): its lines are moved by {clock.offset_s:+.3f} s ({bounds}, "
                         f"a spread of {clock.spread_s:.3f} s; stamps to {clock.resolution_s:g} s).")
    return notes


def _events(run: Run, kind: str) -> pd.DataFrame:
    ev = run.events
    return ev[ev["kind"] == kind] if not ev.empty else ev


class _EngineLog:
    """The engine log's per-request events of one run: abort and admission instants by client id, and
    the instants of requests the ledger does not know (foreign traffic)."""

    def __init__(self, run: Run, known: set[str]):
        self.aborted: dict[tuple[str, str], list[float]] = {}
        self.added: dict[tuple[str, str], list[float]] = {}
        self.foreign: dict[str, list[float]] = {}
        # target -> client id -> when the engine was done with a request its client was still reading
        self.ended_early: dict[str | None, dict[str, float]] = {}
        # (target, client id) -> engine request id -> when it entered: a client id the engine saw twice was sent twice
        self.entered: dict[tuple[str, str], dict[str, float]] = {}
        # an abort line's stamp is its time rounded down to this (vLLM's default format: whole seconds)
        self.resolution: dict[tuple[str, str], float] = {}
        # each target's log against the run's clock: its lines are moved by the offset the run allows
        self.clocks, self.ids = log_evidence(run)
        # (target, from, to, why) of each stretch where the log's reader may have lost lines
        self.losses: list[tuple[str | None, float, float, str | None]] = []
        ev = run.events
        if ev.empty:
            return
        t0 = run.info["started_mono_ns"]
        for row in frame_rows(ev[ev["kind"] == "engine_log_gap"]):
            data = json.loads(row.data)
            self.losses.append((data.get("target"), (float(data.get("from_mono_ns") or t0) - t0) / 1e9,
                                float(row.t_s), data.get("why")))
        logged = ev[ev["kind"].isin(["engine_added", "engine_aborted"])]
        for row in frame_rows(logged):
            data = json.loads(row.data)
            target = data.get("target")
            rid = self.ids.of(target, row.request_id, data.get("engine_request_id"))
            at = float(row.t_s) + self.clock(target).offset_s
            if row.kind == "engine_aborted":
                self.aborted.setdefault((target, rid), []).append(at)
                self.resolution[(target, rid)] = float(data.get("resolution_s") or 0.001)
            else:
                self.added.setdefault((target, rid), []).append(at)
                # the engine request an Added line is of (n>1 children, `k_<id>`, are one request)
                parent = str(data.get("engine_request_id") or "").split("_", 1)[-1]
                entered = self.entered.setdefault((target, rid), {})
                entered[parent] = min(entered.get(parent, at), at)
                if rid not in known:
                    self.foreign.setdefault(target, []).append(at)

    def clock(self, target: str | None) -> LogClock:
        return self.clocks.get(target) or LogClock(target)

    def entry_doubt_s(self, target: str | None) -> float:
        """How much later than placed an Added line of `target` may have been written: its stamp's rounding
        (whole seconds in vLLM's default format) and, where the log's clock was moved, its spread."""
        clock = self.clock(target)
        return clock.resolution_s + clock.uncertainty_s

    def abort_after(self, target: str | None, rid: str, t: float) -> float | None:
        slack = max(LOG_SLACK_S, self.resolution_of(target, rid))
        times = [x for x in self.aborted.get((target, rid), []) if x >= t - slack]
        return min(times) if times else None

    def resolution_of(self, target: str | None, rid: str) -> float:
        """How much later than its instant here an abort line of `rid` may have been written: its stamp's
        rounding, and where the log's clock was moved, how far the offset is from pinned down."""
        return self.resolution.get((target, rid), 0.001) + self.clock(target).uncertainty_s

    def was_added(self, target: str | None, rid: str) -> bool:
        return (target, rid) in self.added

    def names_requests(self, target: str | None) -> bool:
        """Whether the log names any request at all (an Added line): vLLM writes none without
        --enable-log-requests, and then no line can be missing for one request."""
        return any(tgt == target for tgt, _ in self.added)

    def not_entered(self, run: Run, ledger: pd.DataFrame, target: str | None) -> frozenset[str]:
        """The ledger's requests that had not entered the engine by the end of what the log was read for (the
        run, or a window's events): sent after the log's first line read, no Added line. Only where the log
        names every request of the target (no id it does not know) and was read without a hole: then a
        request on its way is not the engine's. Counted from its send (CI: a starved API server added one 5 s
        after the watch saw it sent, and a hop may hold one longer), it read as another request leaving."""
        if not self.names_requests(target) or self.foreign.get(target) or engine_log_state(run, target) != "read":
            return frozenset()
        lo, hi = run.events_span or (-math.inf, math.inf)
        if _log_holes(_target_gaps(run, target), self, target, lo, hi):
            return frozenset()
        offset = self.clock(target).offset_s
        # the events were read by their stamps, and a line is placed at its stamp moved by the clock's offset:
        # the log covers the sends from `first` to `last`, less a stamp's rounding and the clock's doubt
        first = lo + max(offset, 0.0) + LOG_SLACK_S + self.entry_doubt_s(target)
        last = hi + min(offset, 0.0)
        t0 = run.info["started_mono_ns"]
        sent = (ledger["sent_mono_ns"].to_numpy(float) - t0) / 1e9
        # a client that sent its id again has a row of its own (`id~xxxxxx`, the watch's) that the log names by
        # the id it sent: the row is not told apart from the other, and stays counted from its send
        return frozenset(rid for rid, t in zip(ledger["request_id"], sent)
                         if first <= t <= last and (target, rid) not in self.added
                         and (target, str(rid).split("~", 1)[0]) not in self.added)

    def foreign_between(self, target: str | None, lo: float, hi: float) -> int:
        return sum(1 for x in self.foreign.get(target, []) if lo <= x <= hi)

    def done_with(self, run: Run, ledger: pd.DataFrame, target: str | None, sched: dict[str, np.ndarray],
                  gone_at: dict[str, float], added: dict[str, float]) -> dict[str, float]:
        """Completed requests the engine was done with before their client closed them (engine_done.py):
        only where this log names every request of the target."""
        if not self.names_requests(target) or self.foreign.get(target):
            return {}
        aborts = [(x, rid) for (tgt, rid), xs in self.aborted.items() if tgt == target for x in xs]
        slack = max([LOG_SLACK_S] + [self.resolution_of(target, rid) for _, rid in aborts])
        self.ended_early[target] = engine_done_at(
            ledger, run.info["started_mono_ns"], sched, sample_period(run, sched["t_s"]), gone_at, added,
            np.array([x for x, _ in aborts], dtype=float), slack)
        return self.ended_early[target]


def _gone_by_idle(gone_at: dict[str, float], stopped: dict[str, tuple[float, str | None]], target: str | None,
                  cols: dict[str, np.ndarray], added: dict[str, float], counted_within_s: float) -> dict[str, float]:
    """gone_at with each stopped request of `target` gone, at the latest, at the first sample after its stop
    where the engine held nothing (running + waiting 0), once the gauges surely counted it: `counted_within_s`
    after its Added line (its stamp's rounding, the log clock's doubt, the engine's next step). A request with
    no abort is otherwise kept in the ledger to its scenario's end, and a watch has none: kept for ever, every
    later cancel was read against a request long gone (CI: a request that entered after its stop, with the
    engine holding it alone, read as never counted beyond the ledger). None for a request the log does not
    have entering: the engine idle while a hop holds it says nothing of it."""
    idle = cols["t_s"][cols["count"] == 0]
    if not len(idle):
        return gone_at
    out = dict(gone_at)
    for rid, t_gone in gone_at.items():
        t_stop, tgt = stopped.get(rid, (None, None))
        if t_stop is None or tgt != target or rid not in added:
            continue
        k = int(np.searchsorted(idle, _lost_from(t_stop, added[rid], counted_within_s), side="left"))
        if k < len(idle):
            out[rid] = min(t_gone, float(idle[k]))
    return out


def _sum_from(times: np.ndarray, starts: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Per instant of `times`: the weights of the starts at or before it."""
    order = np.argsort(starts, kind="stable")
    cum = np.concatenate(([0.0], np.cumsum(weights[order])))
    return cum[np.searchsorted(starts[order], times, side="right")]


def _pool_blocks(run: Run, target: str | None) -> int | None:
    """The engine's KV blocks (vllm:cache_config_info's num_gpu_blocks); None where it did not say."""
    cache = (run.info.get("cache") or {}).get(target or "")
    try:
        blocks = int(float(cache.get("num_gpu_blocks"))) if isinstance(cache, dict) else 0
    except (TypeError, ValueError, OverflowError):
        return None
    return blocks if blocks > 1 else None


def _lost_from(t_stop: float, t_added: float, counted_within_s: float) -> float:
    """From when a stopped request with no abort is one of the lost ones the engine may still hold: its stop, once
    the gauges surely counted it (`counted_within_s` after its Added line: a stamp's rounding, the log clock's
    doubt, the engine's next step)."""
    return max(t_stop, t_added + counted_within_s)


def _gone_by_surplus(gone_at: dict[str, float], lost: dict[str, tuple[float, str | None]],
                     joins: dict[str, float], cols: dict[str, np.ndarray], others: np.ndarray,
                     hold_s: float) -> tuple[dict[str, float], dict[str, float]]:
    """gone_at with the `lost` requests (stopped, no abort: request id -> (stop, target)) taken out where the
    engine's count can no longer hold them beyond the ledger's other requests in it (`others`, per sample): the
    idle rule of _gone_by_idle where the engine is never idle. Each joins the lost at `joins` (_lost_from); where
    the count holds fewer of them than have joined for `hold_s` (analysis.ghosts.Ghosts, as the watch keeps its
    ghosts), the oldest stops are taken to have gone, by the start of that hold. Under steady load behind a
    proxy that passes no cancel on, several lost requests were in the engine at once and no fall of the count
    said which left: each was kept to its scenario's end (a watch has none), and the later cancels read one
    short of the ledger for each, as the engine running ahead (`already_finished`). Returns gone_at so bounded,
    and the requests taken out at a fall that others still in the engine could have made (their end assumed)."""
    order = sorted((t, rid) for rid, t in joins.items())
    out, chosen, ghosts, k = dict(gone_at), {}, Ghosts(hold_s=hold_s), 0
    times, counts = cols["t_s"], cols["count"]
    read = np.nonzero(~np.isnan(counts))[0]
    read_t, i = times[read], 0
    while i < len(times):
        if not ghosts.left_at:
            # none held: the samples before the next join's hold change nothing, and an hour's frame is 72,000
            next_in = order[k][0] if k < len(order) else math.inf
            r = int(np.searchsorted(read_t, next_in - hold_s, side="right")) - 1  # the last read at or before
            if r >= 0 and read[r] > i:
                i = int(read[r])
            elif not math.isfinite(next_in):
                break
        t, count, flying = float(times[i]), counts[i], others[i]
        i += 1
        while k < len(order) and order[k][0] <= t:
            t_in, rid = order[k]
            if out[rid] > t_in:
                ghosts.leaked(rid, lost[rid][0], seen_at_s=t_in)
            k += 1
        if not math.isnan(count):
            for rid, by in ghosts.update(count, flying, t):
                if by < out[rid]:
                    out[rid] = by
                    # another still held had been stopped by then, and may have been the one that left: which of
                    # them left is the oldest-first reading
                    if any(t_stop <= by for t_stop in ghosts.left_at.values()):
                        chosen[rid] = by
        for rid in [r for r in ghosts.left_at if out[r] <= t]:  # the evidence (an idle engine, a verdict) ended it
            ghosts.ended(rid, out[rid])
    return out, chosen


def _trace_events(run: Run) -> dict[tuple[str, str], tuple[float, str]]:
    """(kind, cancel id) -> (first instant, source) of the driver's trace events. Events of runs
    recorded before sources were written carry none: on HTTP paths those were the client's own stamps."""
    trace: dict[tuple[str, str], tuple[float, str]] = {}
    for row in frame_rows(run.events):
        if row.kind not in ("app_received", "engine_abort", "client_closed"):
            continue
        data = json.loads(row.data)
        source = data.get("source") or ("relay" if data.get("mode") == "explicit" else "client")
        if row.kind != "client_closed" and source == "client":
            key = ("client_closed", data.get("cancel_id"))  # a client stamp, never under a server's name
        else:
            key = (row.kind, data.get("cancel_id"))
        trace.setdefault(key, (float(row.t_s), source))
    return trace


def _app_answers(run: Run) -> dict[str, str]:
    """cancel id -> what the app answered the explicit cancel (the app_answered event's `answer`)."""
    datas = (json.loads(d) for d in _events(run, "app_answered")["data"])
    return {d.get("cancel_id"): str(d.get("answer")) for d in datas}


def _gone_at(run: Run, stops: pd.DataFrame, englog: _EngineLog, trace: dict,
             target_of) -> tuple[dict[str, float], frozenset[str]]:
    """Request id -> instant it left the engine as far as the evidence goes: the engine log's abort,
    else the relay's; where the log was read and shows no abort, the request may still be there. And the
    stopped requests with no abort at all (neither the log's nor the relay's)."""
    gone_at: dict[str, float] = {}
    unaborted = set()
    ends = np.sort(_events(run, "scenario_end")["t_s"].to_numpy(dtype=float)) if not run.events.empty else np.array([])
    for row in frame_rows(stops):
        data = json.loads(row.data)
        target, cid = target_of(data), data.get("cancel_id")
        t_log = englog.abort_after(target, row.request_id, float(row.t_s))
        t_relay = trace.get(("engine_abort", cid), (None, None))[0]
        if t_log is not None or t_relay is not None:
            # a stamp rounded down to the second can read before the stop that caused it
            gone_at[row.request_id] = max(float(row.t_s), min(t for t in (t_log, t_relay) if t is not None))
            continue
        unaborted.add(row.request_id)
        if engine_log_state(run, target) == "read" or ("client_closed", cid) in trace:
            # no abort: it may still be there, at most until its scenario ended (the driver waits for
            # the engine to go idle first); past that, the server counting it is the next one's excess. Without
            # the engine's log, its client's close says nothing of the engine either (a hop may keep reading):
            # where it left is the count's to say (_RunFrames.frame: the idle engine, the surplus)
            k = int(np.searchsorted(ends, float(row.t_s)))
            gone_at[row.request_id] = float(ends[k]) if k < len(ends) else math.inf
    return gone_at, frozenset(unaborted)


class _RunFrames:
    """What every cancel of a run is judged against: the engine log, the trace of the hops, the stops and
    where each request left as far as the evidence goes; per target (cached) the scheduler frame with the
    ledger's reading of it."""

    def __init__(self, run: Run, metrics_target: str | None = None, seen_leaving: dict[str, float] | None = None):
        self.run, self.t0 = run, run.info["started_mono_ns"]
        self.targets = [t["label"] for t in run.info.get("targets", [])]
        self.default_target = metrics_target or (self.targets[0] if self.targets else None)
        self.stops = _events(run, "user_stop")
        self.trace = _trace_events(run)
        self.englog = _EngineLog(run, set(run.ledger["request_id"]) if not run.ledger.empty else set())
        self.reqs = requests_of(run.ledger, self.t0)
        self.evidence_gone, self.unaborted = _gone_at(run, self.stops, self.englog, self.trace, self.target_of)
        self.stopped = {s.request_id: (float(s.t_s), self.target_of(json.loads(s.data)))
                        for s in frame_rows(self.stops)}
        self.told(seen_leaving or {})

    def told(self, seen_leaving: dict[str, float]) -> None:
        """Start again from the evidence, with the stopped requests with no abort that verdicts saw leave the
        engine (judge_vllm's earlier pass, a watch's earlier windows) gone then; the frames are made anew."""
        self.gone_at = dict(self.evidence_gone)
        for rid, t in seen_leaving.items():
            if rid in self.unaborted and t < self.gone_at.get(rid, math.inf):
                self.gone_at[rid] = t
        self.frames: dict = {}

    def target_of(self, data: dict) -> str | None:
        target = data.get("metrics_target") or self.default_target
        return self.default_target if target not in self.targets and self.default_target is not None else target

    def added(self, target: str | None) -> dict[str, float]:
        return {rid: min(ts) for (tgt, rid), ts in self.englog.added.items() if tgt == target}

    def entered(self, target: str | None, added: dict[str, float], within: float) -> dict[str, float]:
        """Request id -> from when the engine may hold each stopped request, `within` before the gauges surely
        count it: its Added line where the log names this target's requests; else (vLLM's default, no request
        log) its send, or where its first token reached its client, `within` before that (the gauges counted it
        before they sent that token on)."""
        if self.englog.names_requests(target):
            return added
        rows = self.run.ledger.set_index("request_id")
        out = {}
        for rid, (_, tgt) in self.stopped.items():
            if tgt != target or rid not in rows.index or pd.isna(rows.at[rid, "sent_mono_ns"]):
                continue
            first = rows.at[rid, "first_token_mono_ns"]
            out[rid] = (float(rows.at[rid, "sent_mono_ns"]) - self.t0) / 1e9 if pd.isna(first) \
                else (float(first) - self.t0) / 1e9 - within
        return out

    def seen_leaving(self, target: str | None, rid: str, t: float, n: int) -> None:
        """A stopped request with no abort, that its verdict saw leave the engine at `t`: the ledger no longer
        counts it from then, for the cancels judged after it (in stop order: a leak's end is seen first)."""
        frame = self.frame(target)
        end = frame.ends.get(rid, math.inf)
        if t >= end:
            return
        times = frame.cols["t_s"]
        frame.inflight[(times >= t) & (times < end)] -= n
        frame.ends[rid] = frame.gone[rid] = t
        if rid in frame.reqs.row:
            frame.ends_s[frame.reqs.row[rid]] = t
        frame.assumed_gone.pop(rid, None)

    def frame(self, target: str | None) -> _Frame:
        if target not in self.frames:
            run, ledger, englog = self.run, self.run.ledger, self.englog
            sched = scheduler_frame(run, target)
            times = sched["t_s"].to_numpy()
            added = self.added(target)
            cols = {c: sched[c].to_numpy(dtype=float) for c in ("t_s", "count", "waiting", "kv", "gen_tokens",
                                                                  "prefix_hits", "preemptions", "finished")}
            cols["scrape_s"] = _scrape_spans(run, target, cols["t_s"])
            settled = _settled(cols["gen_tokens"])
            cols["step_s"] = np.where(settled >= 0, cols["t_s"][np.maximum(settled, 0)], -math.inf)
            within = LOG_SLACK_S + englog.entry_doubt_s(target) + ENTER_S
            entered = self.entered(target, added, within)
            gone = _gone_by_idle(self.gone_at, self.stopped, target, cols, entered, within)
            ends = {**gone, **englog.done_with(run, ledger, target, cols, gone, added)} if len(times) else gone
            not_entered = englog.not_entered(run, ledger, target)
            assumed: dict[str, float] = {}
            lost = {rid: self.stopped[rid] for rid in self.unaborted
                    if rid in gone and rid in entered and rid in self.stopped and self.stopped[rid][1] == target}
            if lost and len(times):
                # the ledger's requests with each lost one counted until it joins the lost (_lost_from): what the
                # count holds beyond them, the lost ones can be
                joins = {rid: _lost_from(t_stop, entered[rid], within) for rid, (t_stop, _) in lost.items()}
                others = ledger_inflight(ledger, self.t0, times, {**ends, **joins}, added, not_entered, self.reqs)
                capped, assumed = _gone_by_surplus(gone, lost, joins, cols, others,
                                                   max(SURPLUS_HOLD_S, within + LAG_S))
                if capped != gone:
                    gone = capped
                    ends = {**gone, **englog.done_with(run, ledger, target, cols, gone, added)}
            inflight = ledger_inflight(ledger, self.t0, times, ends, added, not_entered, self.reqs) if len(times) \
                else np.array([])
            solo = solo_tokens_per_s(cols["t_s"], cols["count"] - np.nan_to_num(cols["waiting"]), cols["waiting"],
                                     cols["gen_tokens"]) if len(times) else None
            self.frames[target] = _Frame(cols, inflight, solo, ends, not_entered, gone, assumed, self.reqs,
                                         self.reqs.per_row(englog.added, target, math.nan),
                                         self.reqs.per_row(englog.aborted, target, math.inf), _target_gaps(run, target),
                                         self.reqs.ends(ends))
        return self.frames[target]


def vllm_in_engine(run: Run, target: str | None) -> EngineReading | None:
    """The engine's count of requests against the ledger's requests in it, for ghosts (analysis/ghosts.py):
    each counted from its Added line, a completed one until the engine was done with it (a lagging reader:
    engine_done.py), an aborted one until its abort, and one its client stopped with no abort line until
    its client's close (from there it is a ghost, if its verdict says leaked). None without a count."""
    if run.ledger.empty:
        return None
    frames = _RunFrames(run, target)
    frame = frames.frame(target)
    if not len(frame.cols["t_s"]):
        return None
    ends = {rid: t for rid, t in frame.ends.items() if rid not in frames.unaborted}
    added = frames.added(target)
    inflight = ledger_inflight(run.ledger, frames.t0, frame.cols["t_s"], ends, added, frame.not_entered, frames.reqs)
    late = LOG_SLACK_S + frames.englog.entry_doubt_s(target) + ENTER_S
    return EngineReading(frame.cols["t_s"], frame.cols["count"], inflight, {rid: t + late for rid, t in added.items()})


# passes of judge_vllm at the most: each ends the ledger's no-abort requests where their verdicts saw them leave
JUDGE_PASSES = 3


def judge_vllm(run: Run, grace_s: float, metrics_target: str | None = None) -> list[CancelVerdict]:
    """One verdict per cancel of a vLLM run, judged against the scheduler of `metrics_target` (default:
    the target each stop names, else the run's first)."""
    ledger = run.ledger
    if ledger.empty or _events(run, "user_stop").empty:
        return []
    # a request whose cancel never reached the engine stays the ledger's until its scenario ends (or the engine is
    # idle): where its own verdict saw it leave, every other cancel is judged again with it gone then. Seen under
    # AIPerf behind a proxy that passes no cancel on: three leaked requests ran out 0.6 s after their stops and
    # the ledger held them for the rest of the watch, so every later cancel read as `already_finished`
    seen: dict[str, float] = dict(run.info.get(SEEN_LEAVING) or {})
    frames = _RunFrames(run, metrics_target, seen)
    for i in range(JUDGE_PASSES):
        if i:
            frames.told(seen)
        out = _judge_all(run, grace_s, frames)
        left = {v.request_id: t for v in out if v.request_id in frames.unaborted and (t := left_seen_at(v)) is not None}
        more = {rid: t for rid, t in left.items() if t < seen.get(rid, math.inf)}
        if not more:
            break
        seen.update(more)
    return out


def _judge_all(run: Run, grace_s: float, frames: _RunFrames) -> list[CancelVerdict]:
    t0, ledger = run.info["started_mono_ns"], run.ledger
    stops, trace, englog, target_of, frame_for = (frames.stops, frames.trace, frames.englog, frames.target_of,
                                                  frames.frame)
    answers = _app_answers(run)
    missed = {r.request_id: json.loads(r.data) for r in frame_rows(_events(run, "trigger_missed"))}

    rows = {r["request_id"]: r for r in ledger.to_dict("records")}
    by_scenario = ledger_by_scenario(ledger)
    out = []
    for stop in frame_rows(stops):
        data = json.loads(stop.data)
        rid, scenario, target = stop.request_id, data.get("scenario"), target_of(data)
        case = _case(run, frame_for(target), englog, trace, by_scenario.get(scenario, NO_REQUESTS), data=data,
                     rid=rid, target=target, lrow=rows.get(rid), t_stop=float(stop.t_s), grace_s=grace_s, t0=t0,
                     missed=missed.get(rid), gone_until=frame_for(target).gone.get(rid, math.inf))
        case.app_answer = answers.get(data.get("cancel_id"))
        lagged = sorted(r for r in englog.ended_early.get(target, {}) if rows.get(r, {}).get("scenario") == scenario)
        case.ev.lagging_clients = lagged or None
        case.ev.log_named_as = englog.ids.renamed_as(target, rid)
        verdict = judge(case, EVIDENCE_RULES)
        if verdict.verdict == "leaked":  # what the leak cost: the tokens made for nobody
            paid_for_nobody(case)
        out.append(verdict)
        left = left_seen_at(verdict)
        if left is not None and rid in frames.unaborted:
            frames.seen_leaving(target, rid, left, case.n)
    return out


def paid_for_nobody(c: VllmCase) -> None:
    """A leaked request's tokens after its client left (analysis/verdicts/paid_tokens.py): from the stop, or
    its entry when the engine took it later; to the sample that shows it gone, or its abort when one came
    (late) and no sample did. A request sent again has no cap: the copy could make its whole length again."""
    times = c.sched["t_s"]
    firsts = c.entries if c.has_log else []
    # a copy sent again runs from its own entry; an abort logged while the request ran on ends nothing
    later = [t for t in firsts if t >= c.t_stop] if c.ev.rule == "resubmitted_after_stop" else firsts[:1]
    t_from = max([c.t_stop, *later[:1]])
    t_left = c.tp["left_scheduler"]
    if t_left is None and c.ev.rule == "abort_after_grace":
        t_left = c.t_abort
    c.ev.tokens_after_client_left, c.ev.tokens_after_client_left_is = tokens_after_left(
        times, c.sched["count"], c.sched["gen_tokens"], c.without, n=c.n, t_from=t_from, t_left=t_left,
        remaining=None if c.ev.rule == "resubmitted_after_stop" else c.remaining)


class _Baseline(NamedTuple):
    before: np.ndarray  # per sample of the case's stretch: in the second before the stop
    count_before: float | None  # the server's count at the last of them (Evidence.count_before); None when none
    ledger_before: float | None  # the ledger's sequences in the server there (Evidence.ledger_before)
    kv_before: float  # KV usage at the last of them; NaN when none
    ahead: bool  # the server counted fewer requests than the ledger there: the engine ran ahead
    # this request surely held KV there: the count was the ledger's, or below it only by other requests with no
    # token yet, which the engine may not count yet (this one's had reached its client)
    kv_held: bool


class _Kept(NamedTuple):
    """VllmCase.kept_at_grace_end."""
    excess: np.ndarray  # per sample of the grace: the count beyond the ledger's others and their unseen ends
    at_end: int  # the grace's last refreshed sample, in `excess` (-1: none refreshed)
    i: int | None  # that sample in the stretch (None: no sample in the grace)
    read_at: int | None  # where the excess is read: i, or the first sample past it whose gauges hold those ends
    value: float | None  # the excess there
    stepping: bool  # generation_tokens_total rose across the grace
    generated: float | None  # by how much


class _LedgerRows(NamedTuple):
    """VllmCase.ledger_rows: the ledger's requests with no first token at the stretch's start."""
    ids: np.ndarray
    seqs: np.ndarray  # sequences the server runs for each
    counted: np.ndarray  # rows x samples: where the ledger counts it in the engine (as ledger_inflight does)
    first: np.ndarray  # when its first token reached its client (inf: never)
    added: np.ndarray  # its first Added line (-inf: none)
    sent: np.ndarray  # when its client sent it


LAG_S = 0.25  # an end the engine made reaches its client this much later through a hop, at the most assumed
# a request is counted by the gauges within this long of its Added line (the engine's next step), at the most
# assumed: on a starved host a step took over half a second
ENTER_S = 1.0
# how long the engine's count must hold fewer lost requests than the ledger before the oldest are taken out
# (_gone_by_surplus): the ledger's other requests run ahead of the gauges for up to a request's entry (its Added
# line's doubt and the next step) and a lagging client's close; a review built releases read as leaks from a
# shortfall of just over a second (a whole-second Added stamp; a neighbour's reader a second behind). Longer, the
# last lost requests of an AIPerf run were never taken out: the engine went idle 2.85 s after the shortfall began
SURPLUS_HOLD_S = 2.0


@dataclass(kw_only=True, eq=False)
class VllmCase(Case):
    """A vLLM cancel: its stretch of the scheduler frame against the ledger, and the engine log's word."""

    run: Run
    englog: _EngineLog
    target: str | None
    has_log: bool
    t_log_abort: float | None  # the engine log's abort line (t_abort may be the relay's instead)
    t_ref: float  # the instant the release is looked for from
    t_end: float  # the end of the window: the grace after t_ref (or the stop)
    sched: dict[str, np.ndarray]  # this cancel's stretch of the scheduler: t_s, count, kv, gen_tokens
    inflight: np.ndarray  # the ledger's sequences in the server at each of sched's samples
    lrow: dict | None
    tokens_at_cancel: int | None
    gone_until: float  # at the latest, the request left the engine then (inf: not known)
    hits_at_admission: float | None = None  # prefix-cache hit tokens while it was admitted (None: unknown)
    frame_cols: dict = field(default_factory=dict)  # the target's whole scheduler frame (sched is its stretch)
    solo_rate: float | None = None  # tokens/s of one sequence running alone in the run: no sequence is faster
    # request id -> where the ledger stops counting it, when not its client's close (ledger_inflight)
    ledger_ends: dict[str, float] = field(default_factory=dict)
    assumed_gone: dict[str, float] = field(default_factory=dict)  # _Frame.assumed_gone
    not_entered: frozenset[str] = frozenset()  # the ledger's requests the log shows never entered
    app_answer: str | None = None  # what the app answered an explicit cancel (None: no explicit cancel)
    reqs: Requests | None = None  # the ledger as arrays (_Frame.reqs), and per row the log's word on this target:
    added_s: np.ndarray | None = None  # its first Added line (NaN: none)
    aborted_s: np.ndarray | None = None  # its first abort line (inf: none)
    gaps: "_Gaps | None" = None  # the run's gaps of this target
    frame_ends_s: np.ndarray | None = None  # ledger_ends by row (_Frame.ends_s), as at this cancel's turn

    @cached_property
    def baseline(self) -> _Baseline:
        """The second before the stop, read once (every verdict reports it: `verdict`)."""
        times = self.sched["t_s"]
        before = (times >= self.t_stop - 1.0) & (times < self.t_stop)
        count_before = float(self.sched["count"][before][-1]) if before.any() else None
        ledger_before = float(self.inflight[before][-1]) if before.any() else None
        kv_before = float(self.sched["kv"][before][-1]) if before.any() else math.nan
        ahead, kv_held = False, True
        if count_before is not None and ledger_before is not None:
            b = np.nonzero(before)[0][-1]
            rows = self.ledger_rows
            ahead = count_before < ledger_before - 1e-9
            # below the ledger's by the requests the engine may not count yet alone (with no token yet): none ran
            # ahead, unless this one is one of them
            this = rows.ids == self.rid
            unseen = self.unseen_with_this[b]
            unsure = unseen > 0.5 and count_before >= ledger_before - unseen - 1e-9
            maybe_uncounted = bool((rows.counted[this, b] & (rows.first[this] > self.sched["t_s"][b])).any()) \
                or self.rid in self.not_entered
            # and none of those is in the count in place of this one ended by itself (it ran ahead): the engine
            # ended none by itself unread
            ends = self.own_ends_unread
            kv_held = not ahead or (unsure and not maybe_uncounted and ends is not None and ends[b] < 0.5)
        return _Baseline(before, count_before, ledger_before, kv_before, ahead, kv_held)

    def verdict(self, rule: str, **fields) -> CancelVerdict:
        """Case.verdict, with the second before the stop in the evidence of every verdict, whichever rule gave
        it and whatever it read first."""
        b, ev = self.baseline, self.ev
        ev.count_before, ev.ledger_before, ev.kv_before = b.count_before, b.ledger_before, b.kv_before
        if b.ahead and ev.note is None:  # a rule's own note says more
            ev.note = ("the server counted fewer requests than the client before the stop: a request had already "
                       "finished in the engine while its tokens were still on their way to the client")
        return super().verdict(rule, **fields)

    @property
    def ahead(self) -> bool:
        return self.baseline.ahead

    @cached_property
    def waiting_at_stop(self) -> bool:
        """The request was still waiting at its stop (behind max_num_seqs), whatever its trigger's name: it
        held no KV, and its release gives none back. vLLM admits first come, first served: with W sequences
        waiting at the last sample before the stop, the last W sequences to enter the engine by then (an
        n>1 request is n of them) were the waiting ones."""
        before = np.nonzero(self.baseline.before)[0]
        if not len(before):
            return False
        t_b, w = float(self.sched["t_s"][before[-1]]), float(self.sched["waiting"][before[-1]])
        if math.isnan(w) or w < 0.5:
            return False
        r, logged = self.reqs, ~np.isnan(self.added_s)
        # not sent, or (the log names this target's requests) another target's, is in none
        keep = ~np.isnan(r.sent) & (logged | (not self.englog.names_requests(self.target)))
        t_in = np.where(logged, self.added_s, r.sent)
        t_out = np.where(np.isfinite(self.aborted_s), self.aborted_s, np.nan_to_num(r.closed, nan=math.inf))
        with np.errstate(invalid="ignore"):
            inside = np.nonzero(keep & (t_in <= t_b) & (t_b < t_out))[0]  # in the engine at that sample
        entered = [(float(t_in[i]), r.ids[i], int(r.seqs[i])) for i in inside]
        newest, seqs = set(), 0.0
        for _, rid, n in sorted(entered, reverse=True):
            if seqs >= w - 0.5:
                break
            newest.add(rid)
            seqs += n
        return self.rid in newest

    def judged_beside_traffic(self) -> bool:
        return self.has_log and self.englog.names_requests(self.target)

    @cached_property
    def kv_waived(self) -> str | None:
        """Why no KV drop is asked of a request that held KV at its stop: the scheduler preempted a
        request in the window (this one's blocks may have gone back before its stop), or the prefix
        cache gave it part of its prompt while another request of the ledger ran beside it (the shared
        blocks stay held by that one, and what this one gives back can be less than the others take)."""
        times, pre = self.sched["t_s"], self.sched["preemptions"]
        win = (times >= self.t_stop - 1.0) & (times <= self.t_end) & ~np.isnan(pre)
        if win.sum() >= 2 and pre[win][-1] > pre[win][0]:
            return "preempted"
        before = self.baseline.before
        others = float(self.inflight[before][-1]) - self.n if before.any() else 0.0
        if self.hits_at_admission and self.hits_at_admission > 0 and others >= 1:
            return "prefix_shared"
        return None

    @cached_property
    def foreign_logged(self) -> int | None:
        """Requests the engine's log names that the ledger does not know, entering in the window; None without
        a log."""
        return self.englog.foreign_between(self.target, self.t_stop - 1.0, self.t_end) if self.has_log else None

    def foreign_traffic(self) -> tuple[int | None, int]:
        over = self.sched["count"] > self.inflight + self.ended_unseen + 0.5
        return self.foreign_logged, int((over & self.baseline.before).sum())

    def restart(self) -> str | None:
        return _restart_in(self.gaps, self.sched, self.t_stop - 1.0, self.t_end, self.sched["scrape_s"])

    def log_gap(self) -> str | None:
        if not self.has_log:
            return None
        holes = _log_holes(self.gaps, self.englog, self.target, self.t_stop - 1.0, self.t_end)
        return holes[0] if holes else None

    def log_clock_off(self) -> dict | None:
        clock = self.englog.clock(self.target)
        return None if not self.has_log or clock.agrees else {"lo_s": clock.lo_s, "hi_s": clock.hi_s}

    @cached_property
    def n(self) -> int:
        lrow = self.lrow
        return 1 if lrow is None or pd.isna(lrow.get("n")) else int(lrow["n"])

    @cached_property
    def without(self) -> np.ndarray:
        """Per sample of the stretch: what the server should count without this request. The ledger keeps a
        request with no abort in flight from its stop until gone_until; the other requests stay as they are."""
        times = self.sched["t_s"]
        return self.inflight - self.n * ((times >= self.t_stop) & (times < self.gone_until))

    @cached_property
    def stopped_beside(self) -> np.ndarray:
        """Per sample of the stretch: sequences of other requests whose clients had stopped them, with no abort
        line, that the ledger counts in the engine there (as `inflight` does: from their Added line, until
        gone_until; they may run on for nobody too). Any of them may be the one a drop in the count lost: with
        two leaked requests in the engine, a count one lower shows one of them gone, not which (seen: three
        leaked through a proxy, each read as gone at the first end)."""
        r = self.reqs
        keep = (r.ids != self.rid) & ~self.not_entered_rows & ~np.isnan(r.cancel) & ~np.isnan(r.sent) \
            & ~np.isfinite(self.aborted_s)
        t_in = np.maximum(np.maximum(r.sent, r.cancel), np.nan_to_num(self.added_s, nan=-math.inf))
        return weighted_between(self.sched["t_s"], t_in[keep], self.ends_s[keep], r.seqs[keep])

    @cached_property
    def settled(self) -> np.ndarray:
        """Per sample of the stretch: the sample the gauges there hold every end before (-1: none known, fewer
        than two steps seen). A rise of generation_tokens_total is a step's output; that step was scheduled
        (its gauges made, the aborts before it taken) before it, maybe before the sample ahead of it (seen: a
        step of 2 tokens stretched over 50 ms with two aborts in it, its count still 4). The step after it was
        scheduled after that sample: the gauges hold every end before the sample ahead of the second-latest
        rise."""
        return _settled(self.sched["gen_tokens"])

    @cached_property
    def ended_unseen(self) -> np.ndarray:
        """Per sample of the stretch: sequences of other requests the ledger ended (their abort, their close)
        after the engine's last step before that sample. The gauges are the engine's as of its last step
        (generation_tokens_total rose since the sample before): an end after it is not in them yet, and read
        against a ledger that has it, the count reads one too high (seen under AIPerf on two cores: a step of
        the engine stalled 0.3 s while two other cancels' aborts came, and the stretch's excess was theirs)."""
        _, seqs, ended = self._ended_after_last_step
        return seqs @ ended

    @cached_property
    def _ended_after_last_step(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The other requests the ledger ended: (ids, sequences, per request and sample of the stretch: ended
        after the engine's last step before that sample), for ended_unseen and count_reading."""
        # the last step as of each sample, read on the whole frame: at the stretch's first samples it is before them
        times, last_step = self.sched["t_s"], self.sched["step_s"]
        r, gone = self.reqs, self.ends_s
        keep = (r.ids != self.rid) & ~np.isnan(r.sent) & np.isfinite(gone)
        if len(times):  # the steps only go on: a row ended after the stretch, or before its first step, is in none
            keep &= (gone <= times[-1]) & (gone > last_step[0])
        g = gone[keep][:, None]
        return r.ids[keep], r.seqs[keep], (times >= g) & (last_step < g)

    def taken_in_its_place(self, kv_before: float) -> np.ndarray:
        """Per sample of the stretch: the count holds the ledger's requests surely counted there and no other
        (count_surely: not this one), one of them a newcomer the gauges did not count at the stop, and KV usage
        is no higher than at the stop. Under steady load the step that drops an aborted request admits the next
        in its place: the newcomer's prefill takes the freed blocks, and KV usage cannot fall (seen under AIPerf
        at concurrency 4: two cancels' aborts and two new requests' Added lines in the same 5 ms, the count at 4
        throughout). A newcomer holds blocks once counted: usage no higher with it counted and this one not
        says this one's blocks went back. A newcomer is one that entered (its Added line) from the abort on, or
        one the count at the stop did not hold: there too it held the surely counted requests and no other, and
        that one's first token had not reached its client. Where the count is the ledger's only with a request
        not surely counted in it, it can hold this one, leaked, in that one's place, with KV usage no higher for
        the same reason: no release is read there (seen under AIPerf: a newcomer Added by the abort, counted
        from the step after it, in the freed block, another Added as the abort came not counted yet: the count,
        3, below the ledger's, 4, was exactly the surely counted requests)."""
        times, sched = self.sched["t_s"], self.sched
        ids, _, counted, first, added, _ = self.ledger_rows
        doubt = self.englog.entry_doubt_s(self.target)
        new = (ids != self.rid) & (added >= self.t_ref - LOG_SLACK_S - doubt)
        before = np.nonzero(self.baseline.before)[0]
        if len(before) and self.count_surely_with_this[before[-1]]:
            b = before[-1]
            new |= (ids != self.rid) & counted[:, b] & (first > times[b])
        surely_new = (counted[new] & (times >= first[new, None])).any(axis=0)
        return surely_new & self.count_surely & (sched["kv"] <= kv_before + 1e-12)

    @cached_property
    def ledger_rows(self) -> _LedgerRows:
        """The ledger's requests whose first token had not reached their client at the stretch's start, less those
        it stopped counting by then (they count nowhere in it)."""
        times, r = self.sched["t_s"], self.reqs
        if not len(times):
            keep = np.zeros(len(r.ids), dtype=bool)
        else:
            with np.errstate(invalid="ignore"):  # sent before the stretch's end, no first token by its start
                keep = (r.sent <= times[-1]) & (r.first > times[0]) & (self.ends_s > times[0])
        keep &= ~self.not_entered_rows
        added = np.nan_to_num(self.added_s[keep], nan=-math.inf)
        sent, end = r.sent[keep], self.ends_s[keep]
        counted = in_between(times, np.maximum(sent, added), end)
        return _LedgerRows(r.ids[keep], r.seqs[keep], counted, r.first[keep], added, sent)

    @cached_property
    def ends_s(self) -> np.ndarray:
        """Per row of the ledger: where it stops counting the request (ledger_ends, else its client's close; inf
        while open)."""
        return self.reqs.ends(self.ledger_ends) if self.frame_ends_s is None else self.frame_ends_s

    @cached_property
    def not_entered_rows(self) -> np.ndarray:
        return np.isin(self.reqs.ids, list(self.not_entered)) if self.not_entered else np.zeros(len(self.reqs.ids), bool)

    def _count_surely(self, unseen: np.ndarray, ledger: np.ndarray) -> np.ndarray:
        exact = (np.abs(self.sched["count"] - (ledger - unseen)) < 1e-9) & (self.finished_unseen < 0.5)
        ends = self.own_ends_unread
        if ends is None:
            # a sure one the engine had ended (a slow reader) may leave room in the count for another: with none
            # unseen, the count is the ledger's whole (as before vLLM said why its requests ended); with some,
            # that room is theirs or this one's, and nothing says which
            return exact & (unseen < 0.5)
        # the ends as of the sample, not of the gauges (an end counted before the engine drops its request only
        # makes the count less sure), and none credited that only could have been
        with np.errstate(invalid="ignore"):
            return exact & ((unseen < 0.5) | (ends < 0.5))

    @cached_property
    def count_surely(self) -> np.ndarray:
        """Per sample of the stretch: the count holds the other requests the ledger counts that are surely
        counted by the engine, and no other. The ledger counts a request from its Added line, the gauges only
        from the engine's next step (on a starved host, seconds later); vLLM sets them from a step before it
        sends that step's tokens on, so one whose first token reached its client is surely counted (vLLM 0.32's
        output handler yields before it sets them only in a step of over 128 outputs, or with a stop string's
        abort to send, and for no longer than that: a scrape served in between is not ruled out). One the
        ledger ended after the engine's last step may be counted still (ended_unseen). A count of exactly the
        sure ones, with no request ended by itself that the ledger still counts (finished_unseen), holds none
        else: not this one, nor those the engine may not count yet or may count still."""
        return self._count_surely(self.others_unseen, self.without)

    @cached_property
    def others_entering(self) -> np.ndarray:
        """Per sample of the stretch: sequences of the other requests the ledger counts that the gauges may not
        count yet: no first token at their client, and sent (where the log names it, Added) less than ENTER_S
        before, LAG_S more for a hop. Past that the engine surely counts one, waiting or running: a non-streaming
        request, or one queued behind max_num_seqs, shows no token for long and is counted all the same."""
        ids, seqs, counted, first, added, _ = self.ledger_rows
        since = np.maximum(self.ledger_rows.sent, added)
        times = self.sched["t_s"]
        others = ids != self.rid
        recent = times < since[:, None] + ENTER_S + LAG_S
        return seqs[others] @ (counted[others] & (times < first[others, None]) & recent[others])

    @cached_property
    def others_unseen(self) -> np.ndarray:
        """Per sample of the stretch: sequences of the other requests the ledger counts whose first token had not
        reached their client: the engine may not count them yet (count_surely)."""
        ids, seqs, counted, first, _, _ = self.ledger_rows
        others = ids != self.rid
        return seqs[others] @ (counted[others] & (self.sched["t_s"] < first[others, None]))

    def confirmed_past_ended_unseen(self, count_ok: np.ndarray, bound: np.ndarray) -> np.ndarray:
        """Per sample of the stretch: a count reconciled there (`count_ok`) only by other requests the ledger
        ended after the engine's last step (ended_unseen: the gauges may count them still) is borne out where the
        gauges first hold those ends (the first sample whose gauges hold every end before this one: settled),
        and so on, until a sample reconciled with no such allowance. Until then the count may hold this request
        in their place (seen through a proxy that never passed the cancel on, no request log: a neighbour that
        ended 43 ms before a sample left room in a count of 1 for this request, running on for 13 s, and the
        neighbour's blocks going back read as this one's; at half the sampling rate, the probe's end then left
        the same room at the sample that was to bear it out). True where the count needs no such allowance."""
        # over the bound less that allowance: reconciled, if at all, only by those ends
        allowed = (self.ended_unseen > 0.5) & (self.sched["count"] > bound - self.ended_unseen + 1e-9) & count_ok
        out = np.ones(len(allowed), dtype=bool)
        for i in np.nonzero(allowed)[0]:
            k = self.past_unseen_ends(int(i), allowed)
            out[i] = k is not None and bool(count_ok[k])
        return out

    def past_unseen_ends(self, i: int, allowed: np.ndarray) -> int | None:
        """From sample `i` on, each reading that rests on ends after the engine's last step (`allowed`) followed to
        where the gauges hold those ends: the first sample whose reading does not; None where the stretch ends
        first."""
        while allowed[i]:
            j = self.where_ends_settle(i)
            if j is None or j <= i:
                return None
            i = j
        return i

    def where_ends_settle(self, i: int) -> int | None:
        """The first sample, from `i` on, whose gauges hold every end before sample `i` (settled); None where the
        stretch holds none."""
        settled = self._settled_ever
        j = max(int(np.searchsorted(settled, i, side="left")), i)
        return j if j < len(settled) else None

    @cached_property
    def _settled_ever(self) -> np.ndarray:
        return np.maximum.accumulate(self.settled)  # the gauges never un-hold an end

    def count_reading(self, i: int, compared_with: float | None = None, also_open: list[dict] = ()) -> dict:
        """What the count at sample `i` of the stretch was read against, as data (Evidence.count_reading): the
        engine's count; the fewest and the most of the other requests the engine could hold there, by the ledger
        and what it cannot see; the requests that keep those two apart, each with why (`also_open`: more the
        rule allowed for); and the bound the rule compared the count with, where it compared one."""
        times = self.sched["t_s"]
        t = float(times[i])
        ids, seqs, counted, first, _, _ = self.ledger_rows
        others = ids != self.rid
        no_token = others & counted[:, i] & (t < first)
        open_ = [{"request_id": str(r), "reason": "first_token_not_at_client"} for r in ids[no_token]]
        ended_ids, _, ended = self._ended_after_last_step
        open_ += [{"request_id": str(r), "reason": "ended_after_engines_last_step"} for r in ended_ids[ended[:, i]]]
        unread = int(round(float(self.finished_unseen[i])))
        if unread:
            open_.append({"request_id": None, "reason": "ended_by_itself_unread", "count": unread})
        others_now = float(self.without[i])
        return {"at_s": round(t, 3), "count": float(self.sched["count"][i]),
                "others_fewest": max(0.0, others_now - float(seqs[no_token].sum()) - unread),
                "others_most": others_now + float(self.ended_unseen[i]),
                "compared_with": None if compared_with is None else float(compared_with),
                "open": open_ + list(also_open)}

    @cached_property
    def unseen_with_this(self) -> np.ndarray:
        """Per sample of the stretch: sequences the ledger counts whose first token had not reached their client,
        this request's among them (before its stop)."""
        _, seqs, counted, first, _, _ = self.ledger_rows
        unseen = seqs @ (counted & (self.sched["t_s"] < first[:, None]))
        if self.rid in self.not_entered and self.lrow is not None:
            # the log shows it never entered, yet it is the ledger's until its stop (judge_vllm's case)
            times, t0 = self.sched["t_s"], self.run.info["started_mono_ns"]
            unseen = unseen + self.n * ((times >= (self.lrow["sent_mono_ns"] - t0) / 1e9) & (times < self.t_stop))
        return unseen

    @cached_property
    def count_surely_with_this(self) -> np.ndarray:
        """count_surely with this request among those the engine may not count yet (before its stop)."""
        return self._count_surely(self.unseen_with_this, self.inflight)

    @cached_property
    def finished_unseen(self) -> np.ndarray:
        """Per sample of the stretch: requests the engine had ended by themselves that the ledger still counts,
        at the least. From the stretch's first sample (a second before the stop: a watch's window holds it
        too), every end of the engine's own (vllm:request_success_total: series.own_ends) is one of the
        requests the ledger counts, or one it no longer counts there: one whose end reached its client; one
        it stopped counting in the stretch (a cancel, an error) that could have ended before its abort line
        (the driver's requests, with ignore_eos, only once 1.25 times the fastest one sequence went in the
        window could have made their max_tokens; another only with no abort line: the API server logs none
        for a request that ended before its client left); one it stopped counting before, as many as the
        engine counted beyond the ledger at the stretch's first sample. More ends than those, up to the
        requests the ledger counts: the ledger counts requests the engine had ended. A client reading slowly,
        or a hop buffering, ends a request in the ledger long after the engine ended it: counted by the
        ledger and not by the engine, it stands in, in a count at the ledger's, for this one kept
        (engine_done.py cannot tell: the kept one fills the count; an end longer before the stop is its,
        where the log names every request)."""
        sched = self.sched
        times, fin = sched["t_s"], sched["finished"]
        if not len(times) or np.isnan(fin[0]):
            return np.zeros(len(times))  # the engine does not say why its requests ended
        t_w, r = float(times[0]), self.reqs
        sent, ends, t_abort, seqs = r.sent, self.ends_s, self.aborted_s, r.seqs
        completed = r.completed & np.isfinite(r.closed)
        # the earliest each could have ended by itself: one that may end at any token (not the driver's) before
        # its abort line only as its last output crossed its client's leaving, a race the log cannot show
        from_s = np.where(np.isfinite(t_abort), t_abort, -math.inf)
        # the fastest one sequence went within the window (a watch's window holds it too: the whole run's may
        # be faster, and judge otherwise)
        solo = self.stretch_solo_rate
        rate = None if solo is None else 1.25 * solo
        bounded = r.bounded
        from_s[bounded] = sent[bounded] + r.max_tokens[bounded] / rate if rate else -math.inf
        # each request the ledger no longer counts that may have ended by itself in the stretch, from when
        with np.errstate(invalid="ignore"):
            could = ~np.isnan(sent) & np.where(completed, ends > t_w,
                                               np.isfinite(ends) & (t_abort > t_w) & (from_s < t_abort))
        start = np.maximum(ends, from_s)
        early = could & ~completed & (ends < t_w)
        late = could & ~early
        surplus = np.nan_to_num(sched["count"][0] - self.inflight[0] - self.ended_unseen[0])
        explained = _sum_from(times, start[late], seqs[late]) \
            + np.minimum(max(surplus, 0.0), _sum_from(times, start[early], seqs[early]))
        # the counter as of the gauges: an end the API server made (a stop string) is counted a step or two
        # before the engine drops the request
        rose = np.nan_to_num(fin[np.maximum(self.settled, 0)] - fin[0])
        return np.clip(rose - explained, 0.0, np.maximum(self.inflight, 0.0))

    @cached_property
    def own_ends_unread(self) -> np.ndarray | None:
        """Per sample of the stretch: the engine's own ends (vllm:request_success_total: stop, length, repetition)
        since the stretch's first sample that no completion the ledger saw by then reads: a completed request's
        close reads one end counted in the stretch before it, within LAG_S (an end reaches its client within
        LAG_S, at the most assumed; vLLM counts it before it sends the last token). Unlike finished_unseen, no
        end that only could have been (a cancel's) is read, and no close reads an end it cannot be (one counted
        after it, or long before: a slow reader's close, its end before the stretch, reads none): above zero, a
        request the ledger counts as surely in the engine may have ended there unread (a slow reader). NaN where
        the counter was not read; None where the engine does not say why its requests ended."""
        times, fin = self.sched["t_s"], self.sched["finished"]
        if not len(times) or np.isnan(fin[0]):
            return None
        closed = self.reqs.closed
        with np.errstate(invalid="ignore"):
            # a close past the stretch's last sample reads nothing in it
            completed = self.reqs.completed & (closed > times[0]) & (closed <= times[-1])
        read = np.nonzero(~np.isnan(fin))[0]
        # each end counted in the stretch: after the read sample before the one that shows it, by that one
        rises = [(times[p], times[q]) for p, q in zip(read[:-1], read[1:])
                 for _ in range(int(round(max(fin[q] - fin[p], 0.0))))]
        taken = [False] * len(rises)
        reads = []
        for c in np.sort(closed[completed]):
            for k, (after, by) in enumerate(rises):
                if not taken[k] and after < c and by >= c - LAG_S:
                    taken[k] = True
                    reads.append(c)
                    break
        return fin - fin[0] - _sum_from(times, np.array(reads, dtype=float), np.ones(len(reads)))

    @cached_property
    def blocks_of_the_running(self) -> np.ndarray:
        """Per sample of the stretch: every KV block in use is one the running requests hold, at one each (KV
        usage is blocks in use over num_gpu_blocks - 1, from vllm:cache_config_info), and no running request
        shares a block with another: the prefix cache gave no prompt a hit, and the scheduler preempted none,
        since the first of them entered (blocks are shared through a hit, or a preempted request resumed from
        the cache). A running request holds at least one block of its own (its last: vLLM never takes a
        prompt's last token from the cache), so none is left for one the count no longer holds (read where the
        count holds the surely counted requests and no other: count_surely). Seen under AIPerf at
        concurrency 4: an abort, and in the same step two newcomers (one on its way at the stop): 3 blocks
        for 3 requests at the stop, 4 for 4 after it, usage never lower within the grace."""
        times, sched = self.sched["t_s"], self.sched
        out = np.zeros(len(times), dtype=bool)
        pool = _pool_blocks(self.run, self.target)
        hits = sched["prefix_hits"]
        if pool is None or not len(times):
            return out
        # the earliest entry of a ledger request in the engine from the stop on: no hit may come after it
        r = self.reqs
        live = ~np.isnan(r.sent) & ~(self.ends_s < self.t_stop)
        first_in = float(np.min(np.where(np.isnan(self.added_s), r.sent, self.added_s - LOG_SLACK_S)[live],
                                initial=math.inf))
        all_t, all_hits = self.frame_cols["t_s"], self.frame_cols["prefix_hits"]
        i0 = int(np.searchsorted(all_t, first_in, side="right")) - 1
        if i0 < 0 or np.isnan(all_hits[i0]):
            return out  # hits not read from before the first entry: sharing cannot be ruled out
        base = all_hits[i0]
        running = sched["count"] - np.nan_to_num(sched["waiting"])
        used = np.round(sched["kv"] * (pool - 1))
        pre = sched["preemptions"]
        with np.errstate(invalid="ignore"):
            no_hit = np.logical_and.accumulate(~np.isnan(hits) & (hits <= base))
            # a preempted request resumed from the cache shares blocks without the hits counter moving (vLLM
            # counts its hits apart and does not serve them)
            pre_base = self.frame_cols["preemptions"][i0]
            no_preempt = np.logical_and.accumulate(~np.isnan(pre) & (pre <= pre_base)) if not np.isnan(pre_base) \
                else np.zeros(len(times), dtype=bool)
            return no_hit & no_preempt & self.count_surely & (used <= running) & (times >= first_in)

    @cached_property
    def entering(self) -> np.ndarray:
        """Per sample of the stretch: another request of the ledger is entering the engine, from its Added
        line to its first token, and at most ENTER_S (a non-streamed answer's first byte is its end). The
        ledger counts it from its Added line, the gauges only from the engine's next step (on a starved host,
        several samples later): a count at the ledger's there could hold this one in its place."""
        times, added = self.sched["t_s"], self.added_s
        doubt = self.englog.entry_doubt_s(self.target)
        lo, hi = added - LOG_SLACK_S, np.minimum(self.reqs.first, added + doubt + ENTER_S)
        keep = (self.reqs.ids != self.rid) & ~np.isnan(added)
        if len(times):
            keep &= (lo <= times[-1]) & (hi > times[0])
        return in_between(times, lo[keep], hi[keep]).any(axis=0)

    @cached_property
    def entries(self) -> list[float]:
        """When each engine request under this id first entered the engine, by its log, in time order."""
        return sorted(self.englog.entered.get((self.target, self.rid), {}).values())

    @cached_property
    def remaining(self) -> int | None:
        """Tokens the client had still to receive at the stop (a race when only a few); None: not known."""
        lrow = self.lrow
        if lrow is None or pd.isna(lrow.get("max_tokens")) or self.tokens_at_cancel is None:
            return None
        return int(lrow["max_tokens"]) * self.n - int(self.tokens_at_cancel)

    def own_ends_between(self, t_from: float, t_to: float) -> float | None:
        """Requests the engine ended by themselves from `t_from` to `t_to`, both included (its frame's
        vllm:request_success_total, by finish reason); None where it does not say or the frame holds neither end."""
        times, fin = self.frame_cols["t_s"], self.frame_cols["finished"]
        lo = int(np.searchsorted(times, t_from, side="left")) - 1  # the sample before: an end at t_from counts
        hi = int(np.searchsorted(times, t_to, side="right")) - 1
        if lo < 0 or hi < lo or np.isnan(fin[lo]) or np.isnan(fin[hi]):
            return None
        return float(fin[hi] - fin[lo])

    @cached_property
    def stretch_solo_rate(self) -> float | None:
        """The fastest one sequence went within the window (tokens/s; None where none ran alone there): a watch's
        window holds it too, where the whole run's may be faster and judge otherwise."""
        sched = self.sched
        w = sched["t_s"] <= self.t_end
        return solo_tokens_per_s(sched["t_s"][w], (sched["count"] - np.nan_to_num(sched["waiting"]))[w],
                                 sched["waiting"][w], sched["gen_tokens"][w])

    def may_have_run_out_by(self, t: float) -> str | None:
        """With no abort known (no request log, no relay), whether the request could have ended on its own by `t`
        (what it could have run out, in words), else None. The driver's requests (ignore_eos) cannot before their
        max_tokens at the fastest one sequence went in the window (stretch_solo_rate), a quarter added, from their
        send (a hop that buffers, or a non-streaming answer, holds back tokens the engine had made). Any of them
        can have run out by then, but an end of its own is one of the engine's (vllm:request_success_total, by
        finish reason, counts no abort; vLLM counts it in the step that drops the request, or before): where the
        counter rose from the stop to `t` by no more than the other requests whose end reached their client then,
        none was this one's (seen straight to the engine: a race's cancel two tokens before the end, the count one
        lower at the first sample after the stop and the counter not moved, the abort having won)."""
        if self.t_abort is not None:
            return None
        lrow, rate, t0 = self.lrow, self.stretch_solo_rate, self.run.info["started_mono_ns"]
        tokens_out = None  # what it could have run out by then, by its tokens
        if lrow is not None and lrow.get("scenario") != WATCHED_SCENARIO and not pd.isna(lrow.get("max_tokens")) \
                and not pd.isna(lrow.get("sent_mono_ns")) and rate:
            tokens, fastest = int(lrow["max_tokens"]), 1.25 * rate
            if t < (lrow["sent_mono_ns"] - t0) / 1e9 + tokens / fastest:
                return None
            tokens_out = f"its {tokens} token(s) (at {fastest:.0f} tokens/s from its send)"
        # the counter and the clients' reads both to `t`: read later, other requests' ends outnumber the reads
        # (seen: a burst's releases read as ends of their own); a read counted later than the counter excuses an end
        # of this one's own by a neighbour's end read a moment after (a watched request that ran out in the grace)
        times, fin = self.sched["t_s"], self.sched["finished"]
        before = np.nonzero(self.baseline.before)[0]
        at = int(np.searchsorted(times, t, side="right")) - 1
        if not len(before) or at < 0 or np.isnan(fin[before[-1]]) or np.isnan(fin[at]):
            return tokens_out or "its last tokens (the engine does not say why its requests ended)"
        t_b, ends = float(times[before[-1]]), float(fin[at] - fin[before[-1]])
        r = self.reqs
        with np.errstate(invalid="ignore"):
            read = (r.ids != self.rid) & r.completed & (r.closed > t_b) & (r.closed <= t)
        if ends <= float(r.seqs[read].sum()) + 1e-9:
            return None
        return tokens_out or "its last tokens (the engine ended requests of its own then that no other's end accounts for)"

    @cached_property
    def moved(self) -> np.ndarray:
        return _moved_since(self.sched, self.t_ref if self.t_abort is not None else self.t_stop)

    @cached_property
    def in_grace(self) -> np.ndarray:
        times = self.sched["t_s"]
        return (times >= self.t_ref) & (times <= self.t_ref + self.grace_s)

    @cached_property
    def kept_at_grace_end(self) -> _Kept:
        """How many requests the count holds beyond the ledger's others (`without`) where the grace ends: at its
        last refreshed sample (one taken between the abort and the engine's next step still shows the count from
        before it), less the other requests' ends after the engine's last step (ended_unseen: not in its gauges
        yet); where the count is within the ledger's only by those ends, at the first sample whose gauges hold
        them. What `held` reads a leak by, and what shows a request the engine ran ahead of before the stop still
        there after it."""
        sched, in_grace = self.sched, self.in_grace
        gen = sched["gen_tokens"][in_grace]
        gen = gen[~np.isnan(gen)]
        all_excess = sched["count"] - self.without - self.ended_unseen
        excess = all_excess[in_grace]
        refreshed = np.nonzero(self.moved[in_grace])[0]
        at_end = int(refreshed[-1]) if len(refreshed) else -1
        value, i, k = (float(excess[at_end]) if len(excess) else None), None, None
        if len(excess):
            i = int(np.nonzero(in_grace)[0][at_end])
            allowed = (all_excess <= 0) & (self.ended_unseen > 0.5) & (sched["count"] > self.without + 1e-9)
            k = self.past_unseen_ends(i, allowed)
            if k is not None:
                value = float(all_excess[k])
        return _Kept(excess, at_end, i, i if k is None else k, value, len(gen) >= 2 and gen[-1] > gen[0],
                     float(gen[-1] - gen[0]) if len(gen) >= 2 else None)

    def lost_in_app(self) -> dict | None:
        # the client reads on until the app ends the stream: many tokens after the stop and an end past the
        # grace say the cancel did not take, but tokens a buffering hop held back say nothing of the engine:
        # `confirmed` only on the engine's word (engine_doubt)
        lrow = self.lrow
        if self.app_answer is None or lrow is None or pd.isna(lrow.get("closed_mono_ns")):
            return None
        if self.app_answer.startswith("already_"):
            return None  # the app says the request had ended before the cancel came: the race's rule
        tokens = 0 if pd.isna(lrow.get("tokens_after_cancel")) else int(lrow["tokens_after_cancel"])
        after_s = (float(lrow["closed_mono_ns"]) - self.run.info["started_mono_ns"]) / 1e9 - self.t_stop
        if tokens <= RACE_TOKENS * self.n or after_s <= self.grace_s:
            return None
        doubt, reading = self.engine_doubt()
        return {"answer": self.app_answer, "tokens": tokens, "after_s": after_s, "grace_s": self.grace_s,
                "confirmed": doubt is None, "doubt": doubt or "", "reading": reading}

    def engine_doubt(self) -> tuple[str | None, dict | None]:
        """(None, the count reading at the grace's last sample read) where the engine's samples show it kept this request across the grace after the stop: at
        every sample there the server counted each request the ledger had open, this one included (less
        those whose client read their end within LAG_S after: a hop delivers an end a moment after the
        engine made it; and those sent within LAG_S before: a hop and the API server hand a request on a
        moment after its send), and its token counter rose. Else what stands in the way, in words: another
        target stopped in the scenario (the count cannot say which one the engine kept), other traffic, a
        restart, a hole in the engine's log or a log clock that cannot be placed, the engine ahead of the
        client before the stop, too few samples, a counter that did not rise, a sample short of the ledger
        (with that sample's count reading: Evidence.count_reading, the ledger's requests ending or starting
        around it open).

        Where the engine had run ahead of the client before the stop (it counted fewer than the ledger: a
        request it had finished was still reaching its client; CI: the neighbour's end, just before the stop),
        the count cannot say which request was gone, the target included. Only the samples after every
        other request open then has been read to its end are read, and only those no request ending or
        starting around them could stand in for the target at: the server counting the ledger's whole open
        set there holds the target."""
        ahead = "the engine had run ahead of the client before the stop"
        if self.restart():
            return "the engine restarted in the window", None
        if self.log_gap() or self.log_clock_off():
            return "the engine log cannot be read across the window", None
        logged, counted = self.foreign_traffic()
        if logged or counted >= 2:
            return "requests the run did not send reached the engine in the window", None
        r = self.reqs
        mates = (r.ids != self.rid) & ((r.scenario == self.scenario) if self.scenario is not None else False)
        if (mates & ~np.isnan(r.cancel)).any():
            return "another request of the scenario was cancelled beside it", None
        times = self.sched["t_s"]
        # the ledger's open requests with this one among them, whatever the frame made of its stay (its client's
        # close, the count's surplus): that is what the count must hold
        count, gen, inflight = self.sched["count"], self.sched["gen_tokens"], self.without + self.n
        grace = (times >= self.t_stop) & (times <= self.t_stop + self.grace_s) & ~np.isnan(count) & ~np.isnan(gen)
        if self.ahead:
            grace &= times > self.ahead_read_until()
        others = r.ids != self.rid
        ids = r.ids[others].astype(str)
        closes, sends = r.closed[others], r.sent[others]  # NaN: never closed (never sent), never in a span
        # the server read its gauges somewhere in the scrape's span (CI: an app busy generating answered its
        # /metrics ~1 s after the tick): a request whose client read its end by then may be gone, and one sent
        # by then may be counted though the ledger's tick does not hold it yet; one sent within LAG_S before
        # the tick may not be the engine's yet
        at = np.flatnonzero(grace)
        spans = self.sched["scrape_s"][at]
        ending = _within(closes, times[at], times[at] + spans + LAG_S)
        starting = _within(sends, times[at] - LAG_S, times[at])
        arriving = _within(sends, times[at], times[at] + spans)
        if self.ahead:
            # no slack where any request might stand in for the target
            keep = (ending == 0) & (starting == 0) & (arriving == 0)
            at, spans, ending, starting, arriving = at[keep], spans[keep], ending[keep], starting[keep], arriving[keep]
        if len(at) < 2:
            return (ahead if self.ahead else f"{len(at)} scheduler sample(s) answered in the grace"), None
        if not gen[at][-1] > gen[at][0]:
            return "the engine's token counter did not rise across the grace", None

        def reading(i: int, t: float, sp: float, held_to: float) -> dict:
            # the ledger's requests whose end or start around the sample leaves the count's reading open
            near = [(ids[(closes > t) & (closes <= t + sp + LAG_S)], "end_read_within_lag"),
                    (ids[(sends <= t) & (sends > t - LAG_S)], "sent_within_lag"),
                    (ids[(sends > t) & (sends <= t + sp)], "sent_during_its_scrape")]
            return self.count_reading(i, held_to, [{"request_id": str(r), "reason": why}
                                                   for rs, why in near for r in rs])

        for i, t, sp, k, f, e, s, a in zip(at, times[at], spans, count[at], inflight[at], ending, starting, arriving):
            if k - a < f - e - s - 0.5:
                late = f", {a} sent while its scrape was being answered" if a else ""
                return ((f"{t - self.t_stop:.2f} s after the stop the server counted {k:g} request(s){late} where "
                         f"the ledger had {f:g} open"), reading(i, t, sp, f - e - s + a))
        i = at[-1]
        return None, reading(i, times[i], spans[-1], inflight[i] - ending[-1] - starting[-1] + arriving[-1])

    def ahead_read_until(self) -> float:
        """When the last of the other requests the ledger had open at the sample before the stop was read to
        its end (plus LAG_S), the engine having run ahead of the client there: from then on no request the
        engine finished early is still on its way. inf where one of them never ended."""
        times, r = self.sched["t_s"], self.reqs
        t_b = float(times[self.baseline.before][-1])
        sent, gone = r.sent, r.ends(self.ledger_ends, fallback=r.closed)  # NaN: never closed
        open_then = (r.ids != self.rid) & (sent <= t_b) & ~(gone <= t_b)
        return float(np.max(gone[open_then], initial=t_b)) + LAG_S if not np.isnan(gone[open_then]).any() else math.inf

    def samples_in_grace(self) -> int | None:
        # only where the run recorded a hole in the scheduler's scrapes across the grace (failed or missed
        # ticks): a rate chosen slow (--hz) leaves few samples and no hole, and is not an outage
        hole = _gaps_over(self.gaps, self.t_ref, self.t_ref + self.grace_s)
        if not len(hole) or not (hole["source"] == "vllm").any():
            return None
        return int(self.in_grace.sum())

    def note_race(self) -> None:
        if self.remaining is not None and self.remaining <= RACE_TOKENS:
            self.ev.race = f"the stop came {self.remaining} token(s) before the end: the completion could win"


class _Frame(NamedTuple):
    """One target's scheduler and the ledger against it, shared by every cancel judged on that target."""

    cols: dict[str, np.ndarray]  # the scheduler frame: t_s, count, waiting, kv, gen_tokens, ...
    inflight: np.ndarray  # the ledger's sequences in the engine at each sample (ledger_inflight)
    solo_rate: float | None  # tokens/s of one sequence running alone
    ends: dict[str, float]  # request id -> where the ledger stops counting it
    not_entered: frozenset[str]  # _EngineLog.not_entered
    gone: dict[str, float]  # stopped request id -> gone at the latest (_gone_at, bounded by _gone_by_idle and
    # _gone_by_surplus)
    # lost request id -> where _gone_by_surplus took it out: which of the lost ones a fall of the count took is
    # the oldest only by assumption (left_on_its_own_or_stayed never reads a fall there as another's certain end)
    assumed_gone: dict[str, float]
    reqs: Requests  # the ledger as arrays
    added_s: np.ndarray  # per row of reqs: its first Added line on this target (NaN: none)
    aborted_s: np.ndarray  # per row of reqs: its first abort line on this target (inf: none)
    gaps: _Gaps  # the run's gaps of this target
    ends_s: np.ndarray  # per row of reqs: ends, else its client's close (inf: open); kept with ends


def _case(run: Run, frame: _Frame, englog: _EngineLog, trace: dict, same: dict, *, data: dict, rid: str,
          target: str | None, lrow: dict | None, t_stop: float, grace_s: float, t0: int, missed: dict | None,
          gone_until: float) -> VllmCase:
    cols_all, inflight_all, solo_rate, ledger_ends, not_entered = (frame.cols, frame.inflight, frame.solo_rate,
                                                                   frame.ends, frame.not_entered)
    cid = data.get("cancel_id")
    log_state = engine_log_state(run, target)
    has_log = log_state == "read"
    t_app, app_src = trace.get(("app_received", cid), (None, None))
    t_relay_abort, _ = trace.get(("engine_abort", cid), (None, None))
    t_closed, _ = trace.get(("client_closed", cid), (None, None))
    t_log_abort = englog.abort_after(target, rid, t_stop) if has_log else None
    t_abort = t_log_abort if t_log_abort is not None else t_relay_abort
    # requests sent after the stop: the probe, and whatever may take the freed blocks
    if lrow is None:
        cancel_ns = 0.0
    else:
        cancel_ns = math.inf if pd.isna(lrow["cancel_mono_ns"]) else float(lrow["cancel_mono_ns"])
    t_probe = first_probe_s(same, cancel_ns, t0)
    abort_source = "engine_log" if t_log_abort is not None else "relay"
    sources = {
        "user_stop": ("client", None),
        "app_received": (app_src, None) if t_app is not None else (None, NO_APP),
        "engine_abort": ((abort_source, None) if t_abort is not None
                         else (None, "no abort in the engine log" if has_log else NO_LOG)),
        "left_scheduler": (None, "not seen in the samples"),
        "reusable": ("client", None) if t_probe is not None else (None, "no probe got a first token"),
    }
    terminal = None if lrow is None else lrow["terminal_state"]
    completed = terminal == "completed" and t_abort is None
    # the instant the release is looked for from: the engine's abort, else (no log) the client's own
    # close, else the completion the client read, else the stop itself
    if t_abort is not None:
        t_ref = t_abort
    elif completed and lrow is not None:
        t_ref = (lrow["closed_mono_ns"] - t0) / 1e9
    elif has_log:
        t_ref = t_stop
    else:
        t_ref = t_closed if t_closed is not None else t_stop
    t_ref = max(t_ref, t_stop) if not completed else t_ref
    # each cancel looks at its own stretch of the run: an hour at 20 Hz is 72,000 samples a series
    lo = int(np.searchsorted(cols_all["t_s"], t_stop - 1.0, side="left"))
    t_end = max(t_ref, t_stop) + grace_s
    # past the horizon only where a scrape outage covers the window: the first sample after it is what
    # shows an engine restart (a slow engine takes longer than the horizon to come back)
    horizon = max(max(t_ref, t_stop) + HORIZON_S, _outage_end(frame.gaps, t_stop - 1.0, t_end) + 1.0)
    hi = int(np.searchsorted(cols_all["t_s"], horizon, side="right"))
    sched = {c: a[lo:hi] for c, a in cols_all.items()}
    inflight = inflight_all[lo:hi]
    if rid in not_entered and lrow is not None:
        # its own request, that the log does not name, stays the client's count until its stop: the count
        # before the stop is read against it, and the rules say why the log does not name it (never_added)
        n = 1 if pd.isna(lrow.get("n")) else int(lrow["n"])
        inflight = inflight + n * ((sched["t_s"] >= (lrow["sent_mono_ns"] - t0) / 1e9) & (sched["t_s"] < t_stop))
    hits_at_admission = _admission_hits(cols_all, englog.added.get((target, rid)), lrow, t0, t_stop)
    window = (sched["t_s"] >= t_stop - 1.0) & (sched["t_s"] <= t_end)
    ev = Evidence(grace_s=grace_s, metrics_target=target, samples_in_window=int(window.sum()), engine_log=log_state)
    tp = {"user_stop": t_stop, "app_received": t_app,
          "engine_abort": None if t_abort is None else max(t_abort, t_stop), "left_scheduler": None,
          "reusable": t_probe}
    return VllmCase(rid=rid, scenario=data.get("scenario"), phase=data.get("phase"), terminal=terminal, t_stop=t_stop,
                    grace_s=grace_s, ev=ev, tp=tp, sources=sources, completed=completed, missed=missed,
                    t_abort=t_abort, abort_source=abort_source,
                    abort_resolution_s=englog.resolution_of(target, rid) if t_log_abort is not None else 0.0,
                    run=run, englog=englog, target=target, has_log=has_log, t_log_abort=t_log_abort, t_ref=t_ref,
                    t_end=t_end, sched=sched, inflight=inflight, lrow=lrow,
                    tokens_at_cancel=data.get("tokens_at_cancel"), gone_until=gone_until,
                    hits_at_admission=hits_at_admission, frame_cols=cols_all, solo_rate=solo_rate,
                    ledger_ends=ledger_ends, assumed_gone=frame.assumed_gone, not_entered=not_entered,
                    reqs=frame.reqs, added_s=frame.added_s, aborted_s=frame.aborted_s, gaps=frame.gaps,
                    frame_ends_s=frame.ends_s.copy())


def _admission_hits(cols: dict[str, np.ndarray], added: list[float] | None, lrow: dict | None, t0: int,
                    t_stop: float) -> float | None:
    """Prompt tokens the prefix cache gave while this request was admitted: prefix_cache_hits_total's
    rise from the last sample before it entered (its Added line, else its send) to the first at or after
    its first token (else its stop). The driver sends nothing else meanwhile; None where unknown."""
    if lrow is None or pd.isna(lrow.get("sent_mono_ns")):
        return None
    t_in = min(added) if added else (lrow["sent_mono_ns"] - t0) / 1e9
    first = lrow.get("first_token_mono_ns")
    t_first = t_stop if first is None or pd.isna(first) else (first - t0) / 1e9
    t, hits = cols["t_s"], cols["prefix_hits"]
    i0, i1 = int(np.searchsorted(t, t_in, side="right")) - 1, int(np.searchsorted(t, t_first, side="left"))
    if i0 < 0 or i1 >= len(t) or np.isnan(hits[i0]) or np.isnan(hits[i1]):
        return None
    return float(hits[i1] - hits[i0])


# ------------------------------------------------------------------------------------------ the rules
def without_abort(c: VllmCase) -> CancelVerdict | None:
    """The engine's log was read and names no abort of this request after its stop: either the engine
    no longer held it (it finished first, or never got it), or the cancel never reached the engine."""
    if not c.has_log or c.t_abort is not None:
        return None
    c.note_race()
    return climb(c, (names_no_requests, never_added, aborted_first, entered_after_stop, left_on_its_own_or_stayed))


def names_no_requests(c: VllmCase) -> CancelVerdict | None:
    if c.englog.names_requests(c.target):
        return None
    # no line for any request: its silence says nothing of this one (the cancel is not "lost")
    c.sources["engine_abort"] = (None, NAMES_NO_REQUESTS)
    return c.verdict("log_names_no_requests")


def never_added(c: VllmCase) -> CancelVerdict | None:
    if c.englog.was_added(c.target, c.rid):
        return None
    untold = c.englog.ids.untold(c.target, c.rid)
    return c.verdict("renamed_untold", lines=untold) if untold else c.verdict("never_added")


def aborted_first(c: VllmCase) -> CancelVerdict | None:
    slack = max(LOG_SLACK_S, c.englog.resolution_of(c.target, c.rid))
    early = [x for x in c.englog.aborted.get((c.target, c.rid), []) if x < c.t_stop - slack]
    if early and c.ahead:
        # the engine ended it itself before the client's stop (an error in the stream, another cancel)
        return c.verdict("aborted_before_stop", before_ms=1000 * (c.t_stop - max(early)))
    return None


def entered_after_stop(c: VllmCase) -> CancelVerdict | None:
    """The engine's log has the request entering only after its stop, and no abort: a hop held it (a queue, a
    frozen gateway) and sent it on after the client left. The server counting fewer than the ledger at the
    stop is then a request not yet there, never one already finished; when it left is read from its entry on."""
    firsts = c.entries
    if not firsts or firsts[0] < c.t_stop + max(LOG_SLACK_S, c.englog.resolution_of(c.target, c.rid)):
        return None
    if c.run.ledger["request_id"].astype(str).str.startswith(f"{c.rid}~").any():
        return None  # the client sent this id again (the watch's `id~xxxxxx` row): the line may be the other's
    times, t_in = c.sched["t_s"], firsts[0]
    still_all = c.sched["count"] > c.without + 1e-9
    # a sample with another request entering shows nothing of this one leaving (VllmCase.entering)
    after = np.nonzero((times >= t_in) & ~np.isnan(c.sched["count"]) & (still_all | ~c.entering))[0]
    still = still_all[after]
    counted = np.nonzero(still)[0]
    if not len(counted):
        return None  # the server never counted it beyond the ledger: no sample shows it ran
    # left at the first of three samples in a row without it, once it was counted; it stayed from its entry
    gone = np.nonzero(_three_without(still) & (np.arange(len(still)) > counted[0]))[0]
    if len(gone):
        c.tp["left_scheduler"] = float(times[after[gone[0]]])
        c.ev.kept_running_ms = round((c.tp["left_scheduler"] - t_in) * 1000, 1)
    c.ev.note = "the engine's log has this request entering only after its stop"
    return c.verdict("entered_after_stop", after_s=t_in - c.t_stop)


def left_on_its_own_or_stayed(c: VllmCase) -> CancelVerdict:
    """No abort: when the request left the engine after the stop, by the samples that count it."""
    times, without = c.sched["t_s"], c.without
    still_all = c.sched["count"] > without + 1e-9
    # a count at the ledger's with other stopped requests beside it (VllmCase.stopped_beside) shows one of them
    # gone, not that this one is: gone for sure only where it is lower than the ledger's without any of them
    which = ~still_all & (c.sched["count"] > without - np.minimum(c.stopped_beside, without) + 1e-9)
    # a sample with another request entering shows nothing of this one leaving (VllmCase.entering): read as
    # gone there, a request sent after the stop and not yet counted made one that ran on read as gone
    refreshed_after = np.nonzero((times >= c.t_stop) & c.moved & (still_all | ~c.entering) & ~which)[0]
    if not len(refreshed_after):
        return c.verdict("already_finished" if c.ahead else "no_refresh_after_stop")
    still = still_all[refreshed_after]
    run3 = _three_without(still)
    if c.ahead:
        # the gauges did not count it at the stop (finished, or not yet counted: a long prefill step):
        # only the engine counting it after the stop shows it was still there
        first = np.nonzero(still & (times[refreshed_after] <= c.t_stop + c.grace_s))[0]
        if not len(first):
            return c.verdict("already_finished")
        refreshed_after, still = refreshed_after[first[0]:], still[first[0]:]
        run3 = _three_without(still)
    elif not still[0] and run3[0]:
        return c.verdict("finished_on_its_own")
    gone = refreshed_after[run3]
    if not len(gone):
        return c.verdict("no_abort_still_there", after_s=times[refreshed_after[-1]] - c.t_stop)
    c.tp["left_scheduler"] = float(times[gone[0]])
    seen_still = refreshed_after[still & (refreshed_after < gone[0])]
    t_still = float(times[seen_still[-1]]) if len(seen_still) else c.t_stop
    # where the ledger took a lost request out at a fall of the count (_gone_by_surplus: the oldest), this one
    # or another, which left there is an assumption: it was surely there only up to the first such fall
    falls = {rid: t for rid, t in c.assumed_gone.items() if c.t_stop < t <= times[gone[0]]}
    if falls and not c.ev.race:
        first = min(falls.values())
        sure = refreshed_after[still & (times[refreshed_after] < first)]
        t_sure = float(times[sure[-1]]) if len(sure) else c.t_stop
        beside = c.stopped_beside[(times >= c.t_stop) & (times <= first)]
        others = max(len(set(falls) - {c.rid}), int(beside.max()) if len(beside) else 0, 1)
        c.ev.kept_running_ms = round((t_sure - c.t_stop) * 1000, 1)
        if c.rid in falls:  # the oldest: taken out at that fall
            c.tp["left_scheduler"] = falls[c.rid]
        return c.verdict("no_abort_left_oldest_first", still_s=t_sure - c.t_stop, others=others,
                         by_s=c.tp["left_scheduler"] - c.t_stop)
    unsure = np.nonzero(which & (times > t_still) & (times < times[gone[0]]))[0]
    if len(unsure) and not c.ev.race:
        # the count fell while others whose cancels were lost were in the engine too: this one left between the
        # last sample that still held it and the first that shows it gone for sure; kept_running_ms is the least
        c.ev.kept_running_ms = round((t_still - c.t_stop) * 1000, 1)
        return c.verdict("no_abort_left_among_others", still_s=t_still - c.t_stop,
                         others=int(c.stopped_beside[unsure].max()), by_s=times[gone[0]] - c.t_stop)
    if c.ev.race:
        # a few tokens before the end, a request that ran them out looks the same whether the cancel
        # was lost or only too late: neither can be shown
        return c.verdict("ran_out_its_last_tokens", remaining=c.remaining, after_ms=1000 * (times[gone[0]] - c.t_stop))
    c.ev.kept_running_ms = round((times[gone[0]] - c.t_stop) * 1000, 1)
    return c.verdict("no_abort_ran_to_end", kept_ms=c.ev.kept_running_ms)


def ran_ahead_without_log(c: VllmCase) -> CancelVerdict | None:
    """No abort known, and the engine counted fewer requests than the ledger before the stop: one of them had
    finished in the engine while its tokens were still on their way, maybe this one. Where the count holds more
    than the ledger's others where the grace ends, with the engine stepping (what `held` reads a leak by), this
    one was there after the stop whatever ran ahead before it: the later rules judge it (seen behind a proxy
    that passed no cancel on, no request log: a slow reader's request finished ahead of its client, and every
    leaked request stopped beside it read as already finished)."""
    if not c.ahead or c.t_abort is not None:
        return None
    kept = c.kept_at_grace_end
    if kept.stepping and kept.value is not None and kept.value > 0:
        return None
    c.note_race()
    return c.verdict("already_finished_no_log")


def no_baseline(c: VllmCase) -> CancelVerdict | None:
    # no baseline: what the request held, and so what its release must give back, is unknown
    return None if c.baseline.before.any() else c.verdict("no_baseline")


def released(c: VllmCase) -> CancelVerdict | None:
    """The first refreshed sample from the abort on where the count is reconciled to the end of the grace
    and KV usage fell (for a request that held KV): released when within the grace."""
    sched, ev, t_ref = c.sched, c.ev, c.t_ref
    times, kv_before = sched["t_s"], c.baseline.kv_before
    after = np.nonzero(times >= t_ref)[0]
    # a request the gauges counted at the stop held KV there, and must give it back; one they never
    # counted (the engine was mid-step when it came and went) shows its release by the count alone
    needs_kv_drop = (c.phase in ("prefill", "decode", "in_flight") and not math.isnan(kv_before) and c.baseline.kv_held
                     and not c.waiting_at_stop and not c.kv_waived)
    ev.kv_drop_waived = c.kv_waived
    below = sched["kv"] < kv_before if not math.isnan(kv_before) else np.zeros(len(times), dtype=bool)
    drop = after[below[after]]
    ev.kv_drop_s = float(times[drop[0]]) if len(drop) else None
    # another request's end after the engine's last step is not in its gauges yet (VllmCase.ended_unseen); a
    # request the engine ended that the ledger still counts is not in them either (finished_unseen)
    # with no abort known (no request log, no relay), the count is all there is: the other stopped requests with
    # no abort are the ledger's only as the count's surplus holds them, oldest first (the frame's reading), and
    # which of them a fall took out is not this one's evidence
    lost_beside = c.stopped_beside if c.t_abort is None else 0.0
    bound = c.without - lost_beside + c.ended_unseen - c.finished_unseen
    count_ok_all = sched["count"] <= bound + 1e-9
    grace_end = int(np.searchsorted(times, t_ref + c.grace_s, side="right"))
    # the count must stay reconciled to the end of the grace: a probe sent right after the abort
    # can stand in for a request that never left until the server counts the probe too
    count_ok = count_ok_all.copy()
    if grace_end:
        count_ok[:grace_end] = np.logical_and.accumulate(count_ok_all[:grace_end][::-1])[::-1]
    if c.t_abort is None:
        # and where it leaves: within the requests the engine surely counts there, one sent a moment before not
        # counted yet, and the room it leaves not this one's (seen through a proxy that passed no cancel on, no
        # request log: lost requests queued and new ones not yet counted, a count at the ledger's read as a
        # release)
        count_ok &= sched["count"] <= bound - c.others_entering + 1e-9
    count_ok &= c.confirmed_past_ended_unseen(count_ok_all, bound)
    # a request that held KV must give it back: the probe taking blocks does not excuse a KV usage
    # that never fell, only what shows its blocks went back all the same
    waivers = {"taken_in_its_place": c.taken_in_its_place(kv_before),
               "blocks_of_the_running": c.blocks_of_the_running} if needs_kv_drop else {}
    kv_ok = np.logical_or.reduce([below, *waivers.values()]) if needs_kv_drop else np.ones(len(times), dtype=bool)
    hits = after[(count_ok & kv_ok & c.moved)[after]]
    if not len(hits):
        return None
    left = int(hits[0])
    c.tp["left_scheduler"] = float(times[left])
    if times[left] - t_ref > c.grace_s:
        return None
    if not below[left] and needs_kv_drop:
        ev.kv_drop_waived = next(name for name, shown in waivers.items() if shown[left])
    ev.count_after = float(sched["count"][left])
    ev.ledger_after = float(c.without[left])
    ev.count_reading = c.count_reading(left, bound[left])
    ev.kv_after = float(sched["kv"][left])
    ev.release_ms = round((times[left] - t_ref) * 1000, 1)
    ev.samples_to_release = int(left - after[0]) + 1
    if c.tp["reusable"] is None:
        ev.probe = "not admitted"
    ran_out = c.may_have_run_out_by(float(times[left]))
    if ran_out:
        return c.verdict("gone_may_have_run_out", after_s=float(times[left]) - c.t_stop, tokens=ran_out)
    return c.verdict("released")


def no_samples_in_grace(c: VllmCase) -> CancelVerdict | None:
    # a scrape outage across the grace: neither a leak nor a stale gauge can be told from nothing
    n = int(c.in_grace.sum())
    return c.verdict("no_samples_in_grace", samples=n, grace_s=c.grace_s) if n < 2 else None


def held(c: VllmCase) -> CancelVerdict:
    """Not released, with samples across the grace: the server's excess over the ledger, and whether the
    engine kept stepping, tell a leak from gauges no step refreshed."""
    sched, ev, in_grace = c.sched, c.ev, c.in_grace
    kept = c.kept_at_grace_end
    excess, at_end, i, stepping = kept.excess, kept.at_end, kept.read_at, kept.stepping
    ev.excess_max = float(excess.max()) if len(excess) else None
    ev.excess_at_grace_end = kept.value
    if len(excess):
        ev.count_reading = c.count_reading(kept.i, c.without[kept.i] + c.ended_unseen[kept.i])
    ev.engine_stepping = bool(stepping)
    ev.generation_tokens_delta = kept.generated
    if not len(excess) or ev.excess_at_grace_end <= 0:
        ev.gauges_refreshed = bool(c.moved[in_grace].any())
        if not ev.gauges_refreshed:
            return c.verdict("gauges_not_refreshed")
        # the count at the ledger's only with requests the engine had ended and the ledger still counts
        hidden = c.finished_unseen[in_grace]
        if len(hidden) and (excess + hidden)[at_end] > 0:
            return c.verdict("finished_unseen", unread=int(hidden.max()))
        return c.verdict("kv_did_not_fall")
    if c.t_log_abort is not None:
        # the log names every request (no foreign id in the window) and this one's abort: an excess
        # that stays is the engine keeping a request it was told to drop
        return c.verdict("abort_logged_still_generating" if stepping else "abort_logged_gauges_stale")
    # other stopped requests with no abort that the frame took out of the ledger at a fall of the count, oldest
    # first (_gone_by_surplus), may be the ones still counted in this one's place: a leak read past them rests on
    # that reading, and says so
    # (those the frame let go inside this cancel's stretch: an older one it let go before is no more this one's
    # evidence than the requests its window does not hold)
    t_i, t_0 = float(sched["t_s"][i]), float(sched["t_s"][0])
    assumed = sorted(rid for rid, t in c.assumed_gone.items() if rid != c.rid and t_0 <= t <= t_i)
    if stepping and c.t_abort is None and assumed and ev.excess_at_grace_end <= len(assumed):
        reading = ev.count_reading
        reading["others_most"] += len(assumed)
        reading["open"] += [{"request_id": str(r), "reason": "assumed_left_oldest_first"} for r in assumed]
        # oldest first is how requests of one length end by themselves: only where the engine's own ends
        # (vllm:request_success_total, which counts no abort) number those falls. A fall the counter does not show
        # was an abort, and whose nothing says (the older one lost and kept, this one's cancel through)
        # from a hold before the first of them went: the frame lets one go from the start of the hold that showed
        # it gone, which can come a sample after the fall that took it
        ends = c.own_ends_between(min(c.assumed_gone[r] for r in assumed) - SURPLUS_HOLD_S, t_i)
        if ends is None or ends < len(assumed) - 1e-9:
            return c.verdict("counted_beside_lost", others=len(assumed))
        return c.verdict("still_counted_oldest_first", others=len(assumed))
    return c.verdict("still_counted_generating" if stepping else "gauges_stale")


def resubmitted(c: VllmCase) -> CancelVerdict | None:
    """The engine's log names the request entering again after the stop: something on the path sent it
    once more after its client left (a gateway retrying upstream), and the engine ran it for nobody."""
    if not c.has_log:
        return None
    # a second engine request under the client's id, entering from the stop on (the first is the one
    # cancelled; a copy sent again by a gateway gets an engine id of its own)
    firsts = c.entries
    again = [t for t in firsts[1:] if t >= c.t_stop - max(LOG_SLACK_S, c.englog.resolution_of(c.target, c.rid))]
    if not again:
        return None
    c.ev.note = "a second 'Added request' line for this id after the stop: the request was sent again"
    return c.verdict("resubmitted_after_stop", after_s=min(again) - c.t_stop)


def beside_traffic(c: VllmCase) -> CancelVerdict | None:
    """Requests the ledger does not know entered the engine in the window (its log names them): the
    server's count holds them too, and the rules below would read them as this one. Judged only on what
    that traffic cannot move: the count at or under the ledger's (so this request is not in it), or a
    lost cancel whose request could not have ended by the end of the grace at the engine's fastest."""
    if not c.foreign_logged:
        return None
    if c.t_abort is None:
        return never_added(c) or _lost_beside_traffic(c)
    if c.ahead:
        # the server counted fewer than the ledger before the stop: a request the ledger holds had left
        # (its client lagging), and could stand in for this one in a count at the ledger's
        return c.verdict("other_traffic_logged", requests=c.foreign_logged)
    times, sched = c.sched["t_s"], c.sched
    window = (times >= c.t_abort) & (times <= c.t_abort + c.grace_s) & c.moved
    hits = np.nonzero(window & ~c.entering & ~_may_stand_in(c) & (sched["count"] <= c.without + 1e-9))[0]
    if not len(hits):
        return c.verdict("other_traffic_logged", requests=c.foreign_logged)
    left = int(hits[0])
    c.tp["left_scheduler"] = float(times[left])
    c.ev.count_after, c.ev.ledger_after = float(sched["count"][left]), float(c.without[left])
    c.ev.count_reading = c.count_reading(left, c.without[left])
    c.ev.release_ms = round((times[left] - c.t_abort) * 1000, 1)
    return c.verdict("released_beside_traffic", requests=c.foreign_logged, after_ms=c.ev.release_ms)


def _may_stand_in(c: VllmCase) -> np.ndarray:
    """Per sample of the case's stretch: a request the ledger still holds may have left the engine
    already, and a count at the ledger's could then hold this one in its place: a cancelled one with no
    abort line, or one its client completed that, at the fastest a sequence runs (alone, a quarter
    added), could have ended by then (a lagging client). Everywhere, where that rate is unknown."""
    times, r = c.sched["t_s"], c.reqs
    rate = None if c.solo_rate is None else 1.25 * c.solo_rate
    sent = ~np.isnan(r.sent) & (r.ids != c.rid)
    t_in = np.where(np.isnan(c.added_s), r.sent, c.added_s)
    # a cancelled one with no abort line: from its cancel, while the ledger holds it
    lost = sent & ~np.isnan(r.cancel) & ~np.isfinite(c.aborted_s)
    lo, hi = np.maximum(t_in, r.cancel), r.ends(c.ledger_ends, fallback=np.full(len(r.ids), math.inf))
    # any other not cancelled: from where it could have run out, to its client's close
    read = sent & np.isnan(r.cancel)
    with np.errstate(invalid="ignore"):
        runs = t_in + r.max_tokens / rate if rate else t_in
        timed = read & (r.max_tokens > 0)
    lo = np.where(read, np.where(timed, runs, t_in), lo)
    hi = np.where(read, np.nan_to_num(r.closed, nan=math.inf), hi)
    keep = lost | read
    if len(times):
        keep &= (lo <= times[-1]) & (hi > times[0])
    return in_between(times, lo[keep], hi[keep]).any(axis=0)


def _lost_beside_traffic(c: VllmCase) -> CancelVerdict:
    """No abort, the request entered: still in the engine at the end of the grace if, made at the
    rate of one sequence running alone (no sequence is faster; a quarter added), its tokens take longer
    than from its entry to the end of the grace. Other traffic cannot make that rate look slower."""
    tokens = None if c.lrow is None or pd.isna(c.lrow.get("max_tokens")) else int(c.lrow["max_tokens"])
    if c.solo_rate is None or not tokens:
        return c.verdict("other_traffic_logged", requests=c.foreign_logged)
    rate = 1.25 * c.solo_rate
    t_in = min(c.englog.added[(c.target, c.rid)])
    finish_s = t_in + tokens / rate - c.t_stop
    if finish_s <= c.grace_s + max(LOG_SLACK_S, c.englog.resolution_of(c.target, c.rid)):
        return c.verdict("other_traffic_logged", requests=c.foreign_logged)
    return c.verdict("no_abort_beside_traffic", rate=rate, tokens=tokens, finish_s=finish_s,
                     requests=c.foreign_logged)


# after the shared guards, in order; the last always gives a verdict
EVIDENCE_RULES = (resubmitted, beside_traffic, without_abort, ran_ahead_without_log, no_baseline, released, no_samples_in_grace,
                  held)


def _settled(gen: np.ndarray) -> np.ndarray:
    """VllmCase.settled over the samples of `gen` (generation_tokens_total)."""
    rises = np.nonzero(gen[1:] > gen[:-1])[0] + 1
    k = np.searchsorted(rises, np.arange(len(gen)), side="right")
    out = np.full(len(gen), -1)
    two = k >= 2
    out[two] = rises[k[two] - 2] - 1
    return out


def _within(at: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Per (lo, hi]: how many of the instants `at` fall in it (NaN: in none)."""
    srt = np.sort(at[~np.isnan(at)])
    return np.searchsorted(srt, hi, side="right") - np.searchsorted(srt, lo, side="right")


def _moved_since(sched: dict[str, np.ndarray], t: float) -> np.ndarray:
    """Per sample: a sample at or after `t` that moved (count, KV or generated tokens) since the last
    one before `t`, or follows one that did. Gauges refresh only on an engine step: a release is only
    shown by a refreshed sample."""
    times = sched["t_s"]
    pre = np.nonzero(times < t)[0]
    if not len(pre):
        return np.ones(len(times), dtype=bool)
    p = pre[-1]
    moved = np.zeros(len(times), dtype=bool)
    for col in ("count", "kv", "gen_tokens"):
        vals = sched[col]
        moved |= ~np.isclose(vals, vals[p], equal_nan=True)
    return np.maximum.accumulate(moved & (times >= t))


def _three_without(still: np.ndarray) -> np.ndarray:
    """Per refreshed sample: it and the next two do not count the request. Gone is only believed from
    three in a row: a request sent after the stop is in the ledger a step before the server counts it,
    and must not read as this one leaving."""
    out = ~still
    for k in (1, 2):
        out[:-k] &= ~still[k:]
    return out


def _log_holes(gaps: _Gaps, englog: _EngineLog, target: str | None, lo: float, hi: float) -> list[str]:
    """Where the engine log of `target` could not be read, or may have lost lines, within [lo, hi]: what
    each hole was, in words (`gaps`: the run's gaps of `target`)."""
    out = []
    mine = _gaps_over(gaps, lo, hi)
    mine = mine[(mine["source"] == ENGINE_LOG) & (mine["kind"] == "error")] if len(mine) else mine
    if len(mine):
        out.append(f"it could not be read from {mine['t_s'].min():.1f} to {mine['end_t_s'].max():.1f} s")
    for tgt, start, t, why in englog.losses:
        if tgt == target and start <= hi and t >= lo:
            out.append(f"{why or 'a possible loss'}, between {start:.1f} and {t:.1f} s")
    return out


class _Gaps:
    """A target's gaps as arrays by column (t_s, end_t_s, kind, source): read for every cancel, a frame's
    filter costs more than the cancel's rules."""

    COLUMNS = ("t_s", "end_t_s", "kind", "source")

    def __init__(self, cols: dict[str, np.ndarray]):
        self.cols = cols

    def __len__(self) -> int:
        return len(self.cols["t_s"])

    def __getitem__(self, key):
        return self.cols[key] if isinstance(key, str) else _Gaps({c: a[key] for c, a in self.cols.items()})


def _target_gaps(run: Run, target: str | None) -> _Gaps:
    """The run's gaps of `target` (any of its sources)."""
    gaps = run.gaps
    if gaps.empty or "end_t_s" not in gaps:
        return _Gaps({c: np.array([], dtype=float if c.endswith("t_s") else object) for c in _Gaps.COLUMNS})
    # (as pandas compares: a gap of no target is no target's)
    mine = gaps["target"].to_numpy(dtype=object) == target if target is not None else np.zeros(len(gaps), bool)
    return _Gaps({c: gaps[c].to_numpy(dtype=float if c.endswith("t_s") else object)[mine] for c in _Gaps.COLUMNS})


def _gaps_over(gaps: _Gaps, t_from: float, t_to: float) -> _Gaps:
    """Those of a target's `gaps` that overlap [t_from, t_to]."""
    return gaps[(gaps["t_s"] <= t_to) & (gaps["end_t_s"] >= t_from)]


def _scrape_spans(run: Run, target: str | None, times: np.ndarray) -> np.ndarray:
    """Per sample instant of `target`'s scheduler: how long its scrape took to answer (s; 0 where the run did not
    record it)."""
    sc = run.scrapes
    if sc is None or sc.empty or not len(times):
        return np.zeros(len(times))
    sc = sc[(sc["target"] == target) & (sc["ok"] == 1)] if target is not None else sc[sc["ok"] == 1]
    at = pd.Series(sc["duration_ns"].to_numpy(float) / 1e9, index=sc["t_s"].to_numpy(float).round(6))
    at = at[~at.index.duplicated(keep="last")]  # as a dict built in row order keeps the last
    return at.reindex(np.round(times.astype(float), 6)).fillna(0.0).to_numpy(float)


def _outage_end(gaps: _Gaps, t_from: float, t_to: float) -> float:
    """The end of the last scrape outage of a target's `gaps` that overlaps [t_from, t_to]; -inf without one."""
    outages = _gaps_over(gaps, t_from, t_to)
    outages = outages[outages["kind"] == "error"] if len(outages) else outages
    return float(outages["end_t_s"].max()) if len(outages) else -math.inf


def _restart_in(gaps: _Gaps, sched: dict[str, np.ndarray], t_from: float, t_to: float,
                spans: np.ndarray) -> str | None:
    """How an engine restart shows between the instants `t_from` and `t_to`, else None: the target
    lost in between, or the engine's token counter going back (a new process counts from 0) and
    staying back. A scrape outage that covers part of the window stretches it to the first sample
    after the outage: a restart takes longer than any grace, and only that sample shows it."""
    mine = _gaps_over(gaps, t_from, t_to)
    if len(mine) and (mine["kind"] == "lost").any():
        return "the target was lost"
    t_to = max(t_to, _outage_end(gaps, t_from, t_to) + 0.5)
    times, gen = sched["t_s"], sched["gen_tokens"]
    # the dips are looked for up to t_to, and each is checked on the samples after it, past t_to too
    sel = (times >= t_from) & ~np.isnan(gen)
    vals, at = gen[sel], times[sel]
    # a sample is stamped when its read started, and its body was built somewhere before the read ended:
    # two reads that overlap (a ticker woke late and caught up: two reads 70 us apart, seen answering 54 and
    # 82 ms later, the later one with fewer tokens) can answer out of order. Only a read started after an
    # earlier one had its answer can show the counter gone back
    ends = at + spans[sel]
    for i in range(1, int(np.searchsorted(at, t_to, side="right"))):
        answered = ends[:i] <= at[i]
        if not answered.any():
            continue
        peak = vals[:i][answered].max()
        # and it stays back: a dip that the next samples climb out of at once is not a restart (at the end
        # of the stretch, the samples left are all there is to go by)
        if vals[i] < peak and (vals[i:i + 3] < peak).all():
            return "generation_tokens_total went back"
    return None
