"""Per-cancel verdicts: reconcile what the client knows (the ledger) with what the scheduler reports.

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
"""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd

from analysis.evidence import Evidence
from analysis.series import scheduler_frame
from analysis.summary import sampling_stats
from analysis.triton_verdicts import is_triton_run, judge_triton, server_request_counts
# the vocabulary, also read from here by the rest of analysis and the readers (analysis.verdicts is the
# public entry explore.ipynb documents)
from analysis.verdict_core import (  # noqa: F401
    GRACE_S,
    HORIZON_S,
    LATENCIES,
    LOG_SLACK_S,
    MIN_SAMPLES,
    NO_APP,
    NO_LOG,
    POINT_LABELS,
    RACE_TOKENS,
    SOURCE_LABELS,
    SOURCES,
    STOP_TO_ABORT,
    TIMEPOINTS,
    CancelVerdict,
    latency_key,
    latency_label,
    engine_log_state,
    run_grace_s,
)
from runstore.reader import Run
from runstore.records import DriveSettings

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


# what a cancel asks of the ledger rows of its scenario (who ran beside it, who was sent after it)
LEDGER_ARRAYS = {"role": ("role", object), "sent": ("sent_mono_ns", float), "first": ("first_token_mono_ns", float),
                 "state": ("terminal_state", object), "chunks": ("chunks", float)}
NO_REQUESTS = {key: np.array([], dtype=dtype) for key, (_, dtype) in LEDGER_ARRAYS.items()}


def ledger_by_scenario(ledger: pd.DataFrame) -> dict[str, dict[str, np.ndarray]]:
    """Per scenario, the ledger as numpy arrays sorted by send time: hundreds of cancels look here."""
    out = {}
    columns = [col for col, _ in LEDGER_ARRAYS.values()]
    for name, g in ledger.groupby("scenario", dropna=False):
        g = g.sort_values("sent_mono_ns").reindex(columns=columns)  # a column a ledger lacks reads as unknown
        out[name] = {key: g[col].to_numpy(dtype=dtype) for key, (col, dtype) in LEDGER_ARRAYS.items()}
    return out


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


def judge_run(run: Run, grace_s: float | None = None, metrics_target: str | None = None) -> list[CancelVerdict]:
    """One verdict per cancel; `grace_s` defaults to the run's own."""
    grace_s = run_grace_s(run) if grace_s is None else grace_s

    if is_triton_run(run):
        return judge_triton(run, grace_s)  # another server, its own evidence
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

    # request id -> instant it left the engine as far as the evidence goes: the engine log's abort,
    # else the relay's; where the log was read and shows no abort, the request may still be there
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
        cid, rid, scenario, phase = data.get("cancel_id"), stop.request_id, data.get("scenario"), data.get("phase")
        target = target_of(data)
        lrow = rows.get(rid)
        terminal = None if lrow is None else lrow["terminal_state"]
        out.append(_judge_one(run, frame_for(target), englog, trace, by_scenario.get(scenario, NO_REQUESTS),
                              rid=rid, cid=cid, scenario=scenario, phase=phase, target=target, lrow=lrow,
                              terminal=terminal, t_stop=float(stop.t_s), grace_s=grace_s, t0=t0,
                              tokens_at_cancel=data.get("tokens_at_cancel"), missed=missed.get(rid),
                              gone_until=gone_at.get(rid, math.inf)))
    return out


def _judge_one(run: Run, frame, englog: _EngineLog, trace: dict, same: dict, *, rid: str, cid: str,
               scenario: str, phase: str, target: str | None, lrow: dict | None, terminal: str | None,
               t_stop: float, grace_s: float, t0: int, tokens_at_cancel: int | None = None,
               missed: dict | None = None, gone_until: float = math.inf) -> CancelVerdict:
    cols_all, inflight_all = frame
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
    later = same["sent"] >= cancel_ns
    probe_firsts = same["first"][later & (same["role"] == "probe")]
    probe_firsts = probe_firsts[~np.isnan(probe_firsts)]
    t_probe = float((probe_firsts.min() - t0) / 1e9) if len(probe_firsts) else None
    tp = {"user_stop": t_stop, "app_received": t_app, "engine_abort": t_abort, "left_scheduler": None,
          "reusable": t_probe}
    sources = {
        "user_stop": ("client", None),
        "app_received": (app_src, None) if t_app is not None else (None, NO_APP),
        "engine_abort": (("engine_log" if t_log_abort is not None else "relay", None) if t_abort is not None
                         else (None, "no abort in the engine log" if has_log else NO_LOG)),
        "left_scheduler": (None, "not seen in the samples"),
        "reusable": ("client", None) if t_probe is not None else (None, "no probe got a first token"),
    }

    def verdict(kind: str, why: str | None = None) -> CancelVerdict:
        if why is not None:
            ev.why = why
        if tp["left_scheduler"] is not None:
            sources["left_scheduler"] = ("samples", None)
        v = CancelVerdict(rid, scenario, phase, tp, kind, ev, terminal)
        v.sources = {p: {"source": src, "reason": reason} for p, (src, reason) in sources.items()}
        return v

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
    times, inflight = sched["t_s"], inflight_all[lo:hi]
    t_end = max(t_ref, t_stop) + grace_s
    window = (times >= t_stop - 1.0) & (times <= t_end)
    ev = Evidence(grace_s=grace_s, metrics_target=target, samples_in_window=int(window.sum()),
                  race="completed before the cancel took effect" if completed else None,
                  engine_log=log_state)
    if completed and missed is not None:
        ev.race = None  # not a race at the end: the scenario never got to cancel where it meant to
        return verdict("inconclusive", f"the request completed before the stop: the scenario's trigger "
                       f"({missed.get('trigger')}) was never reached, so there was nothing to cancel")
    if completed:
        return verdict("inconclusive", "the completion won the race: the client read the request's end before "
                       "the cancel took effect, so this cancel cannot show a release")
    if ev.samples_in_window < MIN_SAMPLES:
        if not ev.samples_in_window:
            # a scrape outage over the whole window (the g rule's case, reached before the grace is looked at)
            return verdict("inconclusive", "no samples from the engine from 1 s before the stop to the end of the "
                           "grace: a scrape outage, nothing to judge the release by")
        return verdict("inconclusive", f"too few samples around the cancel ({ev.samples_in_window})")
    before = (times >= t_stop - 1.0) & (times < t_stop)
    ev.count_before = float(sched["count"][before][-1]) if before.any() else None
    ev.ledger_before = float(inflight[before][-1]) if before.any() else None
    kv_before = float(sched["kv"][before][-1]) if before.any() else math.nan
    ev.kv_before = kv_before
    ahead = ev.count_before is not None and ev.ledger_before is not None and ev.count_before < ev.ledger_before
    if ahead:
        ev.note = ("the server counted fewer requests than the client before the stop: a request had already "
                   "finished in the engine while its tokens were still on their way to the client")
    # other traffic anywhere in the window: requests the engine log names and the ledger does not
    # know, or the server counting more than the ledger before the stop
    ev.foreign_requests = englog.foreign_between(target, t_stop - 1.0, t_end) if has_log else None
    foreign_before = int(((sched["count"] > inflight + 0.5) & before).sum())
    if ev.foreign_requests:
        return verdict("inconclusive", f"other traffic was present: {ev.foreign_requests} request(s) the ledger "
                       "does not know entered the engine in this cancel's window (engine log)")
    if foreign_before >= 2:
        return verdict("inconclusive", f"other traffic was present: the server counted more requests than the "
                       f"ledger before the cancel ({foreign_before} samples)")
    restart = _restart_in(run, target, sched, t_stop - 1.0, t_end)
    if restart:
        # gauges of a new engine start at 0: a release would be read into what is only a restart
        return verdict("inconclusive", f"engine restarted inside this cancel's window ({restart}): nothing "
                       "to judge the release by")
    resolution = englog.resolution_of(target, rid) if t_log_abort is not None else 0.0
    if t_abort is not None and t_abort - t_stop > grace_s:
        # the abort came, but so late that the engine generated for nobody through the whole grace
        ev.kept_running_ms = round((t_abort - t_stop) * 1000, 1)
        return verdict("leaked", f"the abort reached the engine only {t_abort - t_stop:.1f} s after the stop, past the "
                       f"{grace_s:g} s grace: the request kept running for nobody until then")
    if t_abort is not None and t_abort + resolution - t_stop > grace_s:
        # a stamp rounded down to the second: the abort came somewhere in [stamp, stamp + 1 s)
        return verdict("inconclusive", f"the engine log stamps its abort line to {resolution:g} s only: it came "
                       f"between {t_abort - t_stop:.1f} and {t_abort + resolution - t_stop:.1f} s after the stop, "
                       f"so whether within the {grace_s:g} s grace cannot be told (log with milliseconds)")
    if resolution > 0.01:
        sources["engine_abort"] = ("engine_log", f"the log stamps it to {resolution:g} s (rounded down)")
    n = 1 if lrow is None or pd.isna(lrow.get("n")) else int(lrow["n"])
    remaining = None
    if lrow is not None and not pd.isna(lrow.get("max_tokens")) and tokens_at_cancel is not None:
        remaining = int(lrow["max_tokens"]) * n - int(tokens_at_cancel)
    moved = _moved_since(sched, t_ref if t_abort is not None else t_stop)
    if has_log and t_abort is None:
        return _judge_without_abort(run, englog, verdict, ev, sched, inflight, moved, target=target, rid=rid,
                                    n=n, t_stop=t_stop, ahead=ahead, tp=tp, remaining=remaining,
                                    gone_until=gone_until, grace_s=grace_s)
    if ahead and t_abort is None:
        if remaining is not None and remaining <= RACE_TOKENS:
            ev.race = f"the stop came {remaining} token(s) before the end: the completion could win"
        return verdict("inconclusive", "the engine had already finished the request before the stop (the server "
                       "counted fewer requests than the client) and no engine log shows an abort: nothing was "
                       "left to cancel")
    if not before.any():
        # no baseline: what the request held, and so what its release must give back, is unknown
        return verdict("inconclusive", "no samples from the engine in the second before the stop: nothing shows "
                       "what the request held, so its release cannot be shown")
    after = np.nonzero(times >= t_ref)[0]
    # a request the gauges counted at the stop held KV there, and must give it back; one they never
    # counted (the engine was mid-step when it came and went) shows its release by the count alone
    needs_kv_drop = phase in ("prefill", "decode", "in_flight") and not math.isnan(kv_before) and not ahead
    below = sched["kv"] < kv_before if not math.isnan(kv_before) else np.zeros(len(times), dtype=bool)
    drop = after[below[after]]
    ev.kv_drop_s = float(times[drop[0]]) if len(drop) else None
    count_ok_all = sched["count"] <= inflight + 1e-9
    grace_end = int(np.searchsorted(times, t_ref + grace_s, side="right"))
    # the count must stay reconciled to the end of the grace: a probe sent right after the abort
    # can stand in for a request that never left until the server counts the probe too
    count_ok = count_ok_all.copy()
    if grace_end:
        count_ok[:grace_end] = np.logical_and.accumulate(count_ok_all[:grace_end][::-1])[::-1]
    # a request that held KV must give it back: the probe taking blocks does not excuse a KV usage
    # that never fell
    kv_ok = below if needs_kv_drop else np.ones(len(times), dtype=bool)
    ok = count_ok & kv_ok & moved
    hits = after[ok[after]]
    left = int(hits[0]) if len(hits) else None
    if left is not None and times[left] - t_ref <= grace_s:
        tp["left_scheduler"] = float(times[left])
        ev.count_after = float(sched["count"][left])
        ev.ledger_after = float(inflight[left])
        ev.kv_after = float(sched["kv"][left])
        ev.release_ms = round((times[left] - t_ref) * 1000, 1)
        ev.samples_to_release = int(left - after[0]) + 1
        if t_probe is None:
            ev.probe = "not admitted"
        return verdict("released")
    if left is not None:
        tp["left_scheduler"] = float(times[left])
    in_grace = (times >= t_ref) & (times <= t_ref + grace_s)
    if in_grace.sum() < 2:
        # a scrape outage across the grace: neither a leak nor a stale gauge can be told from nothing
        return verdict("inconclusive", f"no samples from the engine across the grace ({int(in_grace.sum())} in "
                       f"{grace_s:g} s): a scrape outage, nothing to judge the release by")
    gen = sched["gen_tokens"][in_grace]
    gen = gen[~np.isnan(gen)]
    stepping = len(gen) >= 2 and gen[-1] > gen[0]
    excess = sched["count"][in_grace] - inflight[in_grace]
    ev.excess_max = float(excess.max()) if len(excess) else None
    ev.engine_stepping = bool(stepping)
    ev.generation_tokens_delta = float(gen[-1] - gen[0]) if len(gen) >= 2 else None
    if not len(excess) or excess.max() <= 0:
        refreshed = bool(moved[in_grace].any())
        ev.gauges_refreshed = refreshed
        if not refreshed:
            return verdict("stale_gauge", "no engine step refreshed the gauges within the grace: they are stale "
                           "until the next step")
        return verdict("inconclusive", "the count reconciled but KV usage did not fall within the grace")
    if t_log_abort is not None:
        # the log names every request (no foreign id in the window) and this one's abort: an excess
        # that stays is the engine keeping a request it was told to drop
        if stepping:
            return verdict("leaked", "the engine logged the abort, yet still counts the request after the grace "
                           "while it keeps generating: the abort did not free it")
        return verdict("stale_gauge", "the engine logged the abort; the gauges stayed up but no tokens were "
                       "generated: stale until the next step")
    if stepping:
        return verdict("leaked", "the server still counts the request after the grace while it keeps generating")
    return verdict("stale_gauge", "gauges stayed up but no tokens were generated: stale until the next step")


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


def _judge_without_abort(run: Run, englog: _EngineLog, verdict, ev: Evidence, sched: dict, inflight: np.ndarray,
                         moved: np.ndarray, *, target: str | None, rid: str, n: int, t_stop: float, ahead: bool,
                         tp: dict, remaining: int | None = None, gone_until: float = math.inf,
                         grace_s: float = GRACE_S) -> CancelVerdict:
    """The engine's log was read and names no abort of this request after its stop: either the engine
    no longer held it (it finished first, or never got it), or the cancel never reached the engine.
    `remaining`: tokens the client had still to receive at the stop (a race when only a few)."""
    if remaining is not None and remaining <= RACE_TOKENS:
        ev.race = f"the stop came {remaining} token(s) before the end: the completion could win"
    if not englog.was_added(target, rid):
        return verdict("inconclusive", "the engine log never names this request (no 'Added request' line): the "
                       "engine may never have had it, so the cancel had nothing to act on")
    early = [x for x in englog.aborted.get((target, rid), []) if x < t_stop - LOG_SLACK_S]
    if early and ahead:
        # the engine ended it itself before the client's stop (an error in the stream, another cancel)
        return verdict("inconclusive", f"the engine's log shows this request aborted {1000 * (t_stop - max(early)):.0f} "
                       "ms before the stop: nothing was left to cancel, so this cancel cannot show whether cancels "
                       "reach the engine")
    already = ("the engine had already finished the request before the stop (the server counted fewer requests "
               "than the client, and its log shows no abort): nothing was left to cancel, so this cancel cannot "
               "show whether cancels reach the engine")
    times = sched["t_s"]
    # the ledger keeps the request in flight (no abort): without it, what the server should count
    without = inflight - n * ((times >= t_stop) & (times < gone_until))
    refreshed_after = np.nonzero((times >= t_stop) & moved)[0]
    if not len(refreshed_after):
        return verdict("inconclusive", already if ahead else "no engine log abort, and no sample after the stop "
                       "refreshed the gauges: nothing shows where the request went")
    still = sched["count"][refreshed_after] > without[refreshed_after] + 1e-9
    run3 = _three_without(still)
    if ahead:
        # the gauges did not count it at the stop (finished, or not yet counted: a long prefill step):
        # only the engine counting it after the stop shows it was still there
        first = np.nonzero(still & (times[refreshed_after] <= t_stop + grace_s))[0]
        if not len(first):
            return verdict("inconclusive", already)
        refreshed_after, still = refreshed_after[first[0]:], still[first[0]:]
        run3 = _three_without(still)
    elif not still[0] and run3[0]:
        return verdict("inconclusive", "the request was gone from the engine at the first sample after the stop, "
                       "with no abort in its log: it had finished on its own as the cancel came, so this cancel "
                       "cannot show whether cancels reach the engine")
    gone = refreshed_after[run3]
    if ev.race and len(gone):
        # a few tokens before the end, a request that ran them out looks the same whether the cancel
        # was lost or only too late: neither can be shown
        tp["left_scheduler"] = float(times[gone[0]])
        return verdict("inconclusive", f"the completion won the race: no abort in the engine log, and the request "
                       f"ran its last {remaining} token(s) out, leaving {1000 * (times[gone[0]] - t_stop):.0f} ms "
                       "after the stop")
    if len(gone):
        tp["left_scheduler"] = float(times[gone[0]])
        ev.kept_running_ms = round((times[gone[0]] - t_stop) * 1000, 1)
        ran = f"it kept running {ev.kept_running_ms:.0f} ms after the stop and left only at its natural end"
    else:
        ran = f"it was still in the engine {times[refreshed_after[-1]] - t_stop:.1f} s after the stop"
    return verdict("leaked", f"the cancel never reached the engine: no abort for this request in the engine's "
                   f"log, and {ran}")


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


def neighbours_ok(run: Run) -> bool:
    nb = run.ledger[run.ledger["role"] == "neighbour"] if not run.ledger.empty else run.ledger
    return bool(len(nb)) and bool((nb["terminal_state"] == "completed").all())


def report_document(run: Run, grace_s: float | None = None, verdicts: list[CancelVerdict] | None = None) -> dict:
    """The report of a run; pass `verdicts` when they are already judged."""
    verdicts = judge_run(run, grace_s) if verdicts is None else verdicts
    stats = sampling_stats(run)
    driven = DriveSettings.of_run(run.info.get("settings")).driven_target

    extra = {"engine": "triton", "server_requests": server_request_counts(run)} if is_triton_run(run) else {}
    return {
        "run_id": run.id,
        "name": run.info.get("name"),
        "target": driven or (run.info["targets"][0]["url"] if run.info.get("targets") else None),
        "metrics_url": run.info["targets"][0]["url"] if run.info.get("targets") else None,
        "status": run.info["status"],
        "neighbours_ok": neighbours_ok(run),
        "sampling": json.loads(stats.to_json(orient="records")) if not stats.empty else [],
        "cancels": [v.as_json() for v in verdicts],
        **extra,
    }
