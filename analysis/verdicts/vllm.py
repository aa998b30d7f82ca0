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
Never judged by request_success_total{finished_reason="abort"}:
vLLM does not count client disconnects there.

The shared guards (core.GUARDS) come first; EVIDENCE_RULES are this family's rungs after them.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

import numpy as np
import pandas as pd

from analysis.evidence import Evidence
from analysis.series import scheduler_frame
from analysis.verdicts.core import (
    HORIZON_S,
    LOG_SLACK_S,
    NO_APP,
    NO_LOG,
    NO_REQUESTS,
    RACE_TOKENS,
    CancelVerdict,
    Case,
    climb,
    engine_log_state,
    first_probe_s,
    judge,
    ledger_by_scenario,
)
from runstore.reader import Run

VLLM = "vllm"


def ledger_inflight(ledger: pd.DataFrame, t0_ns: int, times: np.ndarray, aborted_at: dict[str, float],
                    added_at: dict[str, float] | None = None) -> np.ndarray:
    """Sequences the client believes are in the server at each of `times` (instants, s since the run
    started): sent and not yet closed, or not yet aborted (`aborted_at`: request id -> instant). Where
    the engine's log says when a request entered the engine (`added_at`), it counts from then: a request
    still on its way (a proxy, the API server) is not yet the engine's."""
    counts = np.zeros(len(times))
    added_at = added_at or {}
    for row in ledger.itertuples(index=False):
        if pd.isna(row.sent_mono_ns):
            continue
        t_sent = max((row.sent_mono_ns - t0_ns) / 1e9, added_at.get(row.request_id, -math.inf))
        t_gone = aborted_at.get(row.request_id)
        if t_gone is None:
            closed = row.closed_mono_ns
            t_gone = math.inf if pd.isna(closed) else (closed - t0_ns) / 1e9
        n = 1 if pd.isna(row.n) else int(row.n)
        counts += n * ((times >= t_sent) & (times < t_gone))
    return counts


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
        # an abort line's stamp is its time rounded down to this (vLLM's default format: whole seconds)
        self.resolution: dict[tuple[str, str], float] = {}
        ev = run.events
        if ev.empty:
            return
        logged = ev[ev["kind"].isin(["engine_added", "engine_aborted"])]
        for row in logged.itertuples(index=False):
            data = json.loads(row.data)
            target = data.get("target")
            rid = _ledger_id(row.request_id, data.get("engine_request_id"), known)
            if row.kind == "engine_aborted":
                self.aborted.setdefault((target, rid), []).append(float(row.t_s))
                self.resolution[(target, rid)] = float(data.get("resolution_s") or 0.001)
            else:
                self.added.setdefault((target, rid), []).append(float(row.t_s))
                if rid not in known:
                    self.foreign.setdefault(target, []).append(float(row.t_s))

    def abort_after(self, target: str | None, rid: str, t: float) -> float | None:
        slack = max(LOG_SLACK_S, self.resolution_of(target, rid))
        times = [x for x in self.aborted.get((target, rid), []) if x >= t - slack]
        return min(times) if times else None

    def resolution_of(self, target: str | None, rid: str) -> float:
        return self.resolution.get((target, rid), 0.001)

    def was_added(self, target: str | None, rid: str) -> bool:
        return (target, rid) in self.added

    def foreign_between(self, target: str | None, lo: float, hi: float) -> int:
        return sum(1 for x in self.foreign.get(target, []) if lo <= x <= hi)


def _ledger_id(client_id: str | None, engine_request_id: str | None, known: set[str]) -> str | None:
    """The ledger's id for an engine log line. The source reads the client id back by stripping the
    suffixes vLLM adds, but a client id may itself end like one (the driver's end in 8 hex, as vLLM's
    chat suffix from 0.14 on does): where that reading is not in the ledger, the longest ledger id the
    engine's id starts with is the one."""
    if client_id in known or not engine_request_id:
        return client_id
    rest = engine_request_id.split("_", 1)[1] if engine_request_id[:1].isdigit() and "_" in engine_request_id \
        else engine_request_id
    rest = rest.split("-", 1)[1] if rest.startswith(("chatcmpl-", "cmpl-")) else rest
    parts = rest.split("-")
    for i in range(len(parts), 0, -1):
        if "-".join(parts[:i]) in known:
            return "-".join(parts[:i])
    return client_id


def _trace_events(run: Run) -> dict[tuple[str, str], tuple[float, str]]:
    """(kind, cancel id) -> (first instant, source) of the driver's trace events. Events of runs
    recorded before sources were written carry none: on HTTP paths those were the client's own stamps."""
    trace: dict[tuple[str, str], tuple[float, str]] = {}
    for row in run.events.itertuples(index=False):
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


def _gone_at(run: Run, stops: pd.DataFrame, englog: _EngineLog, trace: dict, target_of) -> dict[str, float]:
    """Request id -> instant it left the engine as far as the evidence goes: the engine log's abort,
    else the relay's; where the log was read and shows no abort, the request may still be there."""
    gone_at: dict[str, float] = {}
    ends = np.sort(_events(run, "scenario_end")["t_s"].to_numpy(dtype=float)) if not run.events.empty else np.array([])
    for row in stops.itertuples(index=False):
        data = json.loads(row.data)
        target, cid = target_of(data), data.get("cancel_id")
        t_log = englog.abort_after(target, row.request_id, float(row.t_s))
        t_relay = trace.get(("engine_abort", cid), (None, None))[0]
        if t_log is not None or t_relay is not None:
            # a stamp rounded down to the second can read before the stop that caused it
            gone_at[row.request_id] = max(float(row.t_s), min(t for t in (t_log, t_relay) if t is not None))
        elif engine_log_state(run, target) == "read":
            # no abort: it may still be there, at most until its scenario ended (the driver waits for
            # the engine to go idle first); past that, the server counting it is the next one's excess
            k = int(np.searchsorted(ends, float(row.t_s)))
            gone_at[row.request_id] = float(ends[k]) if k < len(ends) else math.inf
        elif ("client_closed", cid) in trace:
            gone_at[row.request_id] = trace[("client_closed", cid)][0]
    return gone_at


def judge_vllm(run: Run, grace_s: float, metrics_target: str | None = None) -> list[CancelVerdict]:
    """One verdict per cancel of a vLLM run, judged against the scheduler of `metrics_target` (default:
    the target each stop names, else the run's first)."""
    t0 = run.info["started_mono_ns"]
    targets = [t["label"] for t in run.info.get("targets", [])]
    default_target = metrics_target or (targets[0] if targets else None)
    frames: dict = {}
    ledger = run.ledger
    stops = _events(run, "user_stop")
    if stops.empty or ledger.empty:
        return []

    trace = _trace_events(run)
    missed = {r.request_id: json.loads(r.data) for r in _events(run, "trigger_missed").itertuples(index=False)}
    known = set(ledger["request_id"])
    englog = _EngineLog(run, known)

    def target_of(data: dict) -> str | None:
        target = data.get("metrics_target") or default_target
        return default_target if target not in targets and default_target is not None else target

    gone_at = _gone_at(run, stops, englog, trace, target_of)

    def frame_for(target):
        if target not in frames:
            sched = scheduler_frame(run, target)
            times = sched["t_s"].to_numpy()
            added = {rid: min(ts) for (tgt, rid), ts in englog.added.items() if tgt == target}
            inflight = ledger_inflight(ledger, t0, times, gone_at, added) if len(times) else np.array([])
            cols = {c: sched[c].to_numpy(dtype=float) for c in ("t_s", "count", "kv", "gen_tokens")}
            frames[target] = (cols, inflight)
        return frames[target]

    rows = {r["request_id"]: r for r in ledger.to_dict("records")}
    by_scenario = ledger_by_scenario(ledger)
    out = []
    for stop in stops.itertuples(index=False):
        data = json.loads(stop.data)
        rid, scenario, target = stop.request_id, data.get("scenario"), target_of(data)
        case = _case(run, frame_for(target), englog, trace, by_scenario.get(scenario, NO_REQUESTS), data=data,
                     rid=rid, target=target, lrow=rows.get(rid), t_stop=float(stop.t_s), grace_s=grace_s, t0=t0,
                     missed=missed.get(rid), gone_until=gone_at.get(rid, math.inf))
        out.append(judge(case, EVIDENCE_RULES))
    return out


class _Baseline(NamedTuple):
    before: np.ndarray  # per sample of the case's stretch: in the second before the stop
    kv_before: float  # KV usage at the last of them; NaN when none
    ahead: bool  # the server counted fewer requests than the ledger there: the engine ran ahead


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

    @cached_property
    def baseline(self) -> _Baseline:
        """The second before the stop, read once; its evidence is reported from here on."""
        times, ev = self.sched["t_s"], self.ev
        before = (times >= self.t_stop - 1.0) & (times < self.t_stop)
        ev.count_before = float(self.sched["count"][before][-1]) if before.any() else None
        ev.ledger_before = float(self.inflight[before][-1]) if before.any() else None
        kv_before = float(self.sched["kv"][before][-1]) if before.any() else math.nan
        ev.kv_before = kv_before
        ahead = ev.count_before is not None and ev.ledger_before is not None and ev.count_before < ev.ledger_before
        if ahead:
            ev.note = ("the server counted fewer requests than the client before the stop: a request had already "
                       "finished in the engine while its tokens were still on their way to the client")
        return _Baseline(before, kv_before, ahead)

    @property
    def ahead(self) -> bool:
        return self.baseline.ahead

    def foreign_traffic(self) -> tuple[int | None, int]:
        before = self.baseline.before
        self.ev.foreign_requests = self.englog.foreign_between(self.target, self.t_stop - 1.0, self.t_end) \
            if self.has_log else None
        return self.ev.foreign_requests, int(((self.sched["count"] > self.inflight + 0.5) & before).sum())

    def restart(self) -> str | None:
        return _restart_in(self.run, self.target, self.sched, self.t_stop - 1.0, self.t_end)

    @cached_property
    def n(self) -> int:
        lrow = self.lrow
        return 1 if lrow is None or pd.isna(lrow.get("n")) else int(lrow["n"])

    @cached_property
    def remaining(self) -> int | None:
        """Tokens the client had still to receive at the stop (a race when only a few); None: not known."""
        lrow = self.lrow
        if lrow is None or pd.isna(lrow.get("max_tokens")) or self.tokens_at_cancel is None:
            return None
        return int(lrow["max_tokens"]) * self.n - int(self.tokens_at_cancel)

    @cached_property
    def moved(self) -> np.ndarray:
        return _moved_since(self.sched, self.t_ref if self.t_abort is not None else self.t_stop)

    @cached_property
    def in_grace(self) -> np.ndarray:
        times = self.sched["t_s"]
        return (times >= self.t_ref) & (times <= self.t_ref + self.grace_s)

    def note_race(self) -> None:
        if self.remaining is not None and self.remaining <= RACE_TOKENS:
            self.ev.race = f"the stop came {self.remaining} token(s) before the end: the completion could win"


def _case(run: Run, frame, englog: _EngineLog, trace: dict, same: dict, *, data: dict, rid: str,
          target: str | None, lrow: dict | None, t_stop: float, grace_s: float, t0: int, missed: dict | None,
          gone_until: float) -> VllmCase:
    cols_all, inflight_all = frame
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
    hi = int(np.searchsorted(cols_all["t_s"], max(t_ref, t_stop) + HORIZON_S, side="right"))
    sched = {c: a[lo:hi] for c, a in cols_all.items()}
    t_end = max(t_ref, t_stop) + grace_s
    window = (sched["t_s"] >= t_stop - 1.0) & (sched["t_s"] <= t_end)
    ev = Evidence(grace_s=grace_s, metrics_target=target, samples_in_window=int(window.sum()), engine_log=log_state)
    tp = {"user_stop": t_stop, "app_received": t_app, "engine_abort": t_abort, "left_scheduler": None,
          "reusable": t_probe}
    return VllmCase(rid=rid, scenario=data.get("scenario"), phase=data.get("phase"), terminal=terminal, t_stop=t_stop,
                    grace_s=grace_s, ev=ev, tp=tp, sources=sources, completed=completed, missed=missed,
                    t_abort=t_abort, abort_source=abort_source,
                    abort_resolution_s=englog.resolution_of(target, rid) if t_log_abort is not None else 0.0,
                    run=run, englog=englog, target=target, has_log=has_log, t_log_abort=t_log_abort, t_ref=t_ref,
                    t_end=t_end, sched=sched, inflight=inflight_all[lo:hi], lrow=lrow,
                    tokens_at_cancel=data.get("tokens_at_cancel"), gone_until=gone_until)


# ------------------------------------------------------------------------------------------ the rules
def without_abort(c: VllmCase) -> CancelVerdict | None:
    """The engine's log was read and names no abort of this request after its stop: either the engine
    no longer held it (it finished first, or never got it), or the cancel never reached the engine."""
    if not c.has_log or c.t_abort is not None:
        return None
    c.note_race()
    return climb(c, (never_added, aborted_first, left_on_its_own_or_stayed))


def never_added(c: VllmCase) -> CancelVerdict | None:
    return None if c.englog.was_added(c.target, c.rid) else c.verdict("never_added")


def aborted_first(c: VllmCase) -> CancelVerdict | None:
    early = [x for x in c.englog.aborted.get((c.target, c.rid), []) if x < c.t_stop - LOG_SLACK_S]
    if early and c.ahead:
        # the engine ended it itself before the client's stop (an error in the stream, another cancel)
        return c.verdict("aborted_before_stop", before_ms=1000 * (c.t_stop - max(early)))
    return None


def left_on_its_own_or_stayed(c: VllmCase) -> CancelVerdict:
    """No abort: when the request left the engine after the stop, by the samples that count it."""
    times = c.sched["t_s"]
    # the ledger keeps the request in flight (no abort): without it, what the server should count
    without = c.inflight - c.n * ((times >= c.t_stop) & (times < c.gone_until))
    refreshed_after = np.nonzero((times >= c.t_stop) & c.moved)[0]
    if not len(refreshed_after):
        return c.verdict("already_finished" if c.ahead else "no_refresh_after_stop")
    still = c.sched["count"][refreshed_after] > without[refreshed_after] + 1e-9
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
    if c.ev.race:
        # a few tokens before the end, a request that ran them out looks the same whether the cancel
        # was lost or only too late: neither can be shown
        return c.verdict("ran_out_its_last_tokens", remaining=c.remaining, after_ms=1000 * (times[gone[0]] - c.t_stop))
    c.ev.kept_running_ms = round((times[gone[0]] - c.t_stop) * 1000, 1)
    return c.verdict("no_abort_ran_to_end", kept_ms=c.ev.kept_running_ms)


def ran_ahead_without_log(c: VllmCase) -> CancelVerdict | None:
    if not c.ahead or c.t_abort is not None:
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
    needs_kv_drop = c.phase in ("prefill", "decode", "in_flight") and not math.isnan(kv_before) and not c.ahead
    below = sched["kv"] < kv_before if not math.isnan(kv_before) else np.zeros(len(times), dtype=bool)
    drop = after[below[after]]
    ev.kv_drop_s = float(times[drop[0]]) if len(drop) else None
    count_ok_all = sched["count"] <= c.inflight + 1e-9
    grace_end = int(np.searchsorted(times, t_ref + c.grace_s, side="right"))
    # the count must stay reconciled to the end of the grace: a probe sent right after the abort
    # can stand in for a request that never left until the server counts the probe too
    count_ok = count_ok_all.copy()
    if grace_end:
        count_ok[:grace_end] = np.logical_and.accumulate(count_ok_all[:grace_end][::-1])[::-1]
    # a request that held KV must give it back: the probe taking blocks does not excuse a KV usage
    # that never fell
    kv_ok = below if needs_kv_drop else np.ones(len(times), dtype=bool)
    hits = after[(count_ok & kv_ok & c.moved)[after]]
    if not len(hits):
        return None
    left = int(hits[0])
    c.tp["left_scheduler"] = float(times[left])
    if times[left] - t_ref > c.grace_s:
        return None
    ev.count_after = float(sched["count"][left])
    ev.ledger_after = float(c.inflight[left])
    ev.kv_after = float(sched["kv"][left])
    ev.release_ms = round((times[left] - t_ref) * 1000, 1)
    ev.samples_to_release = int(left - after[0]) + 1
    if c.tp["reusable"] is None:
        ev.probe = "not admitted"
    return c.verdict("released")


def no_samples_in_grace(c: VllmCase) -> CancelVerdict | None:
    # a scrape outage across the grace: neither a leak nor a stale gauge can be told from nothing
    n = int(c.in_grace.sum())
    return c.verdict("no_samples_in_grace", samples=n, grace_s=c.grace_s) if n < 2 else None


def held(c: VllmCase) -> CancelVerdict:
    """Not released, with samples across the grace: the server's excess over the ledger, and whether the
    engine kept stepping, tell a leak from gauges no step refreshed."""
    sched, ev, in_grace = c.sched, c.ev, c.in_grace
    gen = sched["gen_tokens"][in_grace]
    gen = gen[~np.isnan(gen)]
    stepping = len(gen) >= 2 and gen[-1] > gen[0]
    excess = sched["count"][in_grace] - c.inflight[in_grace]
    ev.excess_max = float(excess.max()) if len(excess) else None
    ev.engine_stepping = bool(stepping)
    ev.generation_tokens_delta = float(gen[-1] - gen[0]) if len(gen) >= 2 else None
    if not len(excess) or excess.max() <= 0:
        ev.gauges_refreshed = bool(c.moved[in_grace].any())
        return c.verdict("kv_did_not_fall" if ev.gauges_refreshed else "gauges_not_refreshed")
    if c.t_log_abort is not None:
        # the log names every request (no foreign id in the window) and this one's abort: an excess
        # that stays is the engine keeping a request it was told to drop
        return c.verdict("abort_logged_still_generating" if stepping else "abort_logged_gauges_stale")
    return c.verdict("still_counted_generating" if stepping else "gauges_stale")


# after the shared guards, in order; the last always gives a verdict
EVIDENCE_RULES = (without_abort, ran_ahead_without_log, no_baseline, released, no_samples_in_grace, held)


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


def _restart_in(run: Run, target: str | None, sched: dict[str, np.ndarray], t_from: float,
                t_to: float) -> str | None:
    """How an engine restart shows between the instants `t_from` and `t_to`, else None: the target
    lost in between, or the engine's token counter going back (a new process counts from 0) and
    staying back. A scrape outage that covers part of the window stretches it to the first sample
    after the outage: a restart takes longer than any grace, and only that sample shows it."""
    gaps = run.gaps
    if not gaps.empty and "end_t_s" in gaps:
        mine = gaps[(gaps["target"] == target) & (gaps["t_s"] <= t_to) & (gaps["end_t_s"] >= t_from)]
        if (mine["kind"] == "lost").any():
            return "the target was lost"
        outages = mine[mine["kind"] == "error"]
        if len(outages):
            t_to = max(t_to, float(outages["end_t_s"].max()) + 0.5)
    times, gen = sched["t_s"], sched["gen_tokens"]
    sel = (times >= t_from) & (times <= t_to) & ~np.isnan(gen)
    vals = gen[sel]
    if len(vals) < 2:
        return None
    # two overlapping scrapes can answer out of order (each body is as old as the moment the server
    # built it): a dip that the next samples climb out of at once is not a restart
    peak = np.maximum.accumulate(vals)
    for i in np.nonzero(vals[1:] < peak[:-1])[0] + 1:
        if (vals[i:i + 3] < peak[i - 1]).all():
            return "generation_tokens_total went back"
    return None
