"""Per-cancel verdicts: reconcile what the client knows (the ledger) with what the scheduler reports.

Timepoints of a cancel, in seconds since the run started:
  user_stop      the driver decided to cancel (event)
  app_received   the cancel reached the request's task (event)
  engine_abort   the connection to the engine was closed / abort() returned (event)
  left_scheduler first sample at or after engine_abort where the server's running+waiting is no more
                 than the ledger's in-flight requests, and, for a request that held KV (prefill,
                 decode), KV usage is below its level at user_stop
  reusable       the probe's first token: the freed capacity was handed out again

Verdicts: released (left_scheduler within the grace window), leaked (the server still counts more
than the ledger after the grace while the engine keeps stepping), stale_gauge (the same, but
generation_tokens_total is flat: gauges pinned between steps), inconclusive (foreign traffic before
the cancel, too few samples, no samples across the grace, an engine restart in the window).
Never judged by request_success_total{finished_reason="abort"}:
vLLM does not count client disconnects there.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from analysis.evidence import Evidence
from analysis.series import scheduler_frame
from analysis.summary import sampling_stats
from runstore.reader import Run
from runstore.records import DriveSettings

GRACE_S = 2.0
MIN_SAMPLES = 5
HORIZON_S = 60.0  # how far past the abort a request that did not leave in the grace is followed
TIMEPOINTS = ("user_stop", "app_received", "engine_abort", "left_scheduler", "reusable")
POINT_LABELS = {
    "user_stop": "user stop",
    "app_received": "app received",
    "engine_abort": "engine abort",
    "left_scheduler": "left scheduler",
    "reusable": "reusable",
}
# the four latencies: from each timepoint to the next
LATENCIES = tuple(zip(TIMEPOINTS, TIMEPOINTS[1:]))


def latency_key(a: str, b: str) -> str:
    """The latency's key in the report's JSON: `user_stop->app_received_ms`."""
    return f"{a}->{b}_ms"


def latency_label(a: str, b: str) -> str:
    """The latency's name in every table shown to a person: `user stop → app received (ms)`."""
    return f"{POINT_LABELS[a]} → {POINT_LABELS[b]} (ms)"


@dataclass
class CancelVerdict:
    request_id: str
    scenario: str
    phase_at_cancel: str
    timepoints: dict  # timepoint -> instant, s since the run started; None where not reached
    verdict: str
    evidence: Evidence
    terminal_state: str | None = None

    def latency_ms(self, a: str, b: str) -> float | None:
        """Duration, ms from timepoint `a` to `b`; None when either was not reached."""
        ta, tb = self.timepoints.get(a), self.timepoints.get(b)
        return None if ta is None or tb is None else round((tb - ta) * 1000, 1)

    def latencies(self) -> dict:
        return {latency_key(a, b): self.latency_ms(a, b) for a, b in LATENCIES}

    def as_json(self) -> dict:
        return {"request_id": self.request_id, "scenario": self.scenario, "phase_at_cancel": self.phase_at_cancel,
                "timepoints": dict(self.timepoints), "verdict": self.verdict, "evidence": self.evidence.as_json(),
                "terminal_state": self.terminal_state, "latencies_ms": self.latencies()}


def ledger_inflight(ledger: pd.DataFrame, t0_ns: int, times: np.ndarray, aborted_at: dict[str, float]) -> np.ndarray:
    """Sequences the client believes are in the server at each of `times` (instants, s since the run
    started): sent and not yet closed, or not yet aborted (`aborted_at`: request id -> instant)."""
    counts = np.zeros(len(times))
    for row in ledger.itertuples(index=False):
        if pd.isna(row.sent_mono_ns):
            continue
        t_sent = (row.sent_mono_ns - t0_ns) / 1e9
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


def run_grace_s(run: Run) -> float:
    """Duration, s: the grace window the run was recorded with (`record --grace`), else the default."""
    grace_s = DriveSettings.of_run(run.info.get("settings")).grace_s
    return GRACE_S if grace_s is None else grace_s


def judge_run(run: Run, grace_s: float | None = None, metrics_target: str | None = None) -> list[CancelVerdict]:
    """One verdict per cancel; `grace_s` defaults to the run's own."""
    grace_s = run_grace_s(run) if grace_s is None else grace_s
    t0 = run.info["started_mono_ns"]
    targets = [t["label"] for t in run.info.get("targets", [])]
    default_target = metrics_target or (targets[0] if targets else None)
    frames: dict = {}
    ledger = run.ledger
    stops = _events(run, "user_stop")
    if stops.empty or ledger.empty:
        return []

    # (kind, cancel id) -> first time, read once from the events' JSON
    trace: dict[tuple[str, str], float] = {}
    for row in run.events.itertuples(index=False):
        key = (row.kind, json.loads(row.data).get("cancel_id"))
        trace.setdefault(key, float(row.t_s))

    def event_time(kind: str, cancel_id: str) -> float | None:
        return trace.get((kind, cancel_id))

    aborted_at = {}  # request id -> instant of its engine abort
    for row in stops.itertuples(index=False):
        t = event_time("engine_abort", json.loads(row.data).get("cancel_id"))
        if t is not None:
            aborted_at[row.request_id] = t

    def frame_for(target):
        if target not in frames:
            sched = scheduler_frame(run, target)
            times = sched["t_s"].to_numpy()
            inflight = ledger_inflight(ledger, t0, times, aborted_at) if len(times) else np.array([])
            cols = {c: sched[c].to_numpy(dtype=float) for c in ("t_s", "count", "kv", "gen_tokens")}
            frames[target] = (cols, inflight)
        return frames[target]

    rows = {r["request_id"]: r for r in ledger.to_dict("records")}
    by_scenario = ledger_by_scenario(ledger)
    out = []
    for stop in stops.itertuples(index=False):
        data = json.loads(stop.data)
        cid, rid, scenario, phase = data.get("cancel_id"), stop.request_id, data.get("scenario"), data.get("phase")
        target = data.get("metrics_target") or default_target
        if target not in targets and default_target is not None:
            target = default_target
        cols_all, inflight_all = frame_for(target)
        t_stop = float(stop.t_s)
        t_app, t_abort = event_time("app_received", cid), event_time("engine_abort", cid)
        lrow = rows.get(rid)
        terminal = None if lrow is None else lrow["terminal_state"]
        same = by_scenario.get(scenario, NO_REQUESTS)
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
        # the request finished on its own before the cancel took effect: it left like any completion
        t_ref = t_abort if t_abort is not None else (
            (lrow["closed_mono_ns"] - t0) / 1e9 if lrow is not None and terminal == "completed" else None)
        # each cancel looks at its own stretch of the run: an hour at 20 Hz is 72,000 samples a series
        lo = int(np.searchsorted(cols_all["t_s"], t_stop - 1.0, side="left"))
        hi = int(np.searchsorted(cols_all["t_s"], max(t_ref or t_stop, t_stop) + HORIZON_S, side="right"))
        sched = {c: a[lo:hi] for c, a in cols_all.items()}
        times, inflight = sched["t_s"], inflight_all[lo:hi]
        window = (times >= t_stop - 1.0) & (times <= (t_ref or t_stop) + grace_s)
        ev = Evidence(grace_s=grace_s, metrics_target=target, samples_in_window=int(window.sum()),
                      race="completed before the cancel took effect" if terminal == "completed" else None)
        if t_ref is None or ev.samples_in_window < MIN_SAMPLES:
            ev.why = "no abort recorded" if t_ref is None else "too few samples around the cancel"
            out.append(CancelVerdict(rid, scenario, phase, tp, "inconclusive", ev, terminal))
            continue
        before = (times >= t_stop - 1.0) & (times < t_stop)
        foreign = (sched["count"] > inflight + 0.5) & before
        ev.count_before = float(sched["count"][before][-1]) if before.any() else None
        ev.ledger_before = float(inflight[before][-1]) if before.any() else None
        kv_before = float(sched["kv"][before][-1]) if before.any() else math.nan
        if ev.count_before is not None and ev.ledger_before is not None and ev.count_before < ev.ledger_before:
            ev.note = ("the server counted fewer requests than the client before the stop: a request had already "
                       "finished in the engine while its tokens were still on their way to the client")
        ev.kv_before = kv_before
        if foreign.sum() >= 2:
            ev.why = f"the server counted more requests than the ledger before the cancel ({int(foreign.sum())} samples): foreign traffic"
            out.append(CancelVerdict(rid, scenario, phase, tp, "inconclusive", ev, terminal))
            continue
        restart = _restart_in(run, target, sched, t_stop - 1.0, t_ref + grace_s)
        if restart:
            # gauges of a new engine start at 0: a release would be read into what is only a restart
            ev.why = f"the engine restarted inside this cancel's window ({restart}): nothing to judge the release by"
            out.append(CancelVerdict(rid, scenario, phase, tp, "inconclusive", ev, terminal))
            continue
        after = np.nonzero(times >= t_ref)[0]
        needs_kv_drop = phase in ("prefill", "decode", "in_flight") and terminal != "completed" and not math.isnan(kv_before)
        # requests sent after the stop may take the freed blocks once they run; before their first
        # token the KV drop must show on its own
        firsts = same["first"][later]
        firsts = firsts[~np.isnan(firsts)]
        t_others_first = float((firsts.min() - t0) / 1e9) if len(firsts) else math.inf
        kv_vals = sched["kv"]
        below = kv_vals < kv_before if not math.isnan(kv_before) else np.zeros(len(times), dtype=bool)
        drop = after[below[after]]
        ev.kv_drop_s = float(times[drop[0]]) if len(drop) else None
        count_ok_all = sched["count"] <= inflight + 1e-9
        # gauges refresh only on an engine step: a release is only shown by a sample that moved
        # (count, KV or generated tokens) since the last one before the abort
        pre = np.nonzero(times < t_ref)[0]
        moved = np.zeros(len(times), dtype=bool)
        if len(pre):
            p = pre[-1]
            for col in ("count", "kv", "gen_tokens"):
                vals = sched[col]
                moved |= ~np.isclose(vals, vals[p], equal_nan=True)
        moved = np.maximum.accumulate(moved & (times >= t_ref)) if len(times) else moved
        grace_end = int(np.searchsorted(times, t_ref + grace_s, side="right"))
        # the count must stay reconciled to the end of the grace: a probe sent right after the abort
        # can stand in for a request that never left until the server counts the probe too
        count_ok = count_ok_all.copy()
        if grace_end:
            count_ok[:grace_end] = np.logical_and.accumulate(count_ok_all[:grace_end][::-1])[::-1]
        kv_ok = (times >= t_others_first) | below if needs_kv_drop else np.ones(len(times), dtype=bool)
        ok = count_ok & kv_ok & (moved if len(pre) else True)
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
            out.append(CancelVerdict(rid, scenario, phase, tp, "released", ev, terminal))
            continue
        if left is not None:
            tp["left_scheduler"] = float(times[left])
        in_grace = (times >= t_ref) & (times <= t_ref + grace_s)
        if in_grace.sum() < 2:
            # a scrape outage across the grace: neither a leak nor a stale gauge can be told from nothing
            ev.why = (f"no samples from the engine across the grace ({int(in_grace.sum())} in {grace_s:g} s): "
                      "a scrape outage, nothing to judge the release by")
            out.append(CancelVerdict(rid, scenario, phase, tp, "inconclusive", ev, terminal))
            continue
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
                ev.why = "no engine step refreshed the gauges within the grace: they are stale until the next step"
                out.append(CancelVerdict(rid, scenario, phase, tp, "stale_gauge", ev, terminal))
            else:
                ev.why = "the count reconciled but KV usage did not fall within the grace"
                out.append(CancelVerdict(rid, scenario, phase, tp, "inconclusive", ev, terminal))
            continue
        verdict = "leaked" if stepping else "stale_gauge"
        ev.why = ("the server still counts the request after the grace while it keeps generating"
                  if stepping else "gauges stayed up but no tokens were generated: stale until the next step")
        out.append(CancelVerdict(rid, scenario, phase, tp, verdict, ev, terminal))
    return out


def _restart_in(run: Run, target: str | None, sched: dict[str, np.ndarray], t_from: float,
                t_to: float) -> str | None:
    """How an engine restart shows between the instants `t_from` and `t_to`, else None: the engine's
    token counter going back (a new process counts from 0), or the target lost in between."""
    gen = sched["gen_tokens"][(sched["t_s"] >= t_from) & (sched["t_s"] <= t_to)]
    gen = gen[~np.isnan(gen)]
    if len(gen) >= 2 and (np.diff(gen) < 0).any():
        return "generation_tokens_total went back"
    gaps = run.gaps
    if not gaps.empty and "end_t_s" in gaps:
        lost = gaps[(gaps["kind"] == "lost") & (gaps["target"] == target) & (gaps["t_s"] <= t_to)
                    & (gaps["end_t_s"] >= t_from)]
        if len(lost):
            return "the target was lost"
    return None


def neighbours_ok(run: Run) -> bool:
    nb = run.ledger[run.ledger["role"] == "neighbour"] if not run.ledger.empty else run.ledger
    return bool(len(nb)) and bool((nb["terminal_state"] == "completed").all())


def report_document(run: Run, grace_s: float | None = None, verdicts: list[CancelVerdict] | None = None) -> dict:
    """The report of a run; pass `verdicts` when they are already judged."""
    verdicts = judge_run(run, grace_s) if verdicts is None else verdicts
    stats = sampling_stats(run)
    driven = DriveSettings.of_run(run.info.get("settings")).driven_target
    return {
        "run_id": run.id,
        "name": run.info.get("name"),
        "target": driven or (run.info["targets"][0]["url"] if run.info.get("targets") else None),
        "metrics_url": run.info["targets"][0]["url"] if run.info.get("targets") else None,
        "status": run.info["status"],
        "neighbours_ok": neighbours_ok(run),
        "sampling": json.loads(stats.to_json(orient="records")) if not stats.empty else [],
        "cancels": [v.as_json() for v in verdicts],
    }
