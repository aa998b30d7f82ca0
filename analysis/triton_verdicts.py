"""Per-cancel verdicts for Triton runs, from the server's own evidence (never the client's CANCELLED).

What each timepoint rests on:
  user_stop      the client's cancel call, or the moment its deadline/timeout fired (client)
  app_received   null: the client talks to Triton directly (no app on this path)
  engine_abort   the model's own log line saying it saw the cancel and stopped (engine_log), or, for a
                 request the core dropped while queued (it never reached the model), the first sample
                 where the core's failure{reason="CANCELED"} count for the model rose (samples)
  left_scheduler the first sample at or after the abort where the model's active gauge fell below its
                 level at the stop (executing), or the model's pending count fell (queued) (samples)
  reusable       the probe's first response (client)

Verdicts:
  released      the model logged the cancel (or the core counted the queued drop) within the grace,
                and the model's gauge followed
  leaked        the model ran the request to its end after the stop (its `finished` line): the cancel
                never reached it (HTTP carries none for a non-streaming request), or the backend does
                not poll is_cancelled; or the cancel came only after the grace; or, without a log, the
                model's active gauge stayed up and its steps kept rising through the grace
  stale_gauge   the model logged the cancel, but its active gauge did not fall within the grace
  inconclusive  the request had ended before the stop, no server evidence names it, too few samples
"""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd

from analysis.evidence import Evidence
from analysis.verdicts import MIN_SAMPLES, NO_APP, LOG_SLACK_S, CancelVerdict, _log_state
from runstore.reader import Run

TRITON = "triton"


def is_triton_run(run: Run) -> bool:
    return (run.info.get("engine") or {}).get("engine") == TRITON


def model_series(run: Run, metric: str, target: str | None, **labels: str) -> tuple[np.ndarray, np.ndarray]:
    """(instants, values) of one metric summed over the label sets that match `labels` per scrape."""
    df = run.series(metric, target=target)
    if df.empty:
        return np.array([]), np.array([])
    if labels:
        parsed = {cat: json.loads(cat) for cat in df["labels"].astype(str).unique()}
        keep = [cat for cat, d in parsed.items() if all(d.get(k) == v for k, v in labels.items())]
        df = df[df["labels"].astype(str).isin(keep)]
        if df.empty:
            return np.array([]), np.array([])
    g = df.groupby("scrape_id", observed=True).agg(t_s=("t_s", "first"), value=("value", "sum")).sort_values("t_s")
    return g["t_s"].to_numpy(dtype=float), g["value"].to_numpy(dtype=float)


def _before(times: np.ndarray, values: np.ndarray, t: float) -> float | None:
    i = int(np.searchsorted(times, t, side="left")) - 1
    return float(values[i]) if i >= 0 else None


def _first(times: np.ndarray, mask: np.ndarray) -> float | None:
    hit = np.nonzero(mask)[0]
    return float(times[hit[0]]) if len(hit) else None


class _ServerLog:
    """The model log's lines per request: first instant of each kind, and each line's detail."""

    def __init__(self, run: Run):
        self.at: dict[tuple[str, str], list[float]] = {}
        self.detail: dict[tuple[str, str], str] = {}
        ev = run.events
        if ev.empty:
            return
        for row in ev[ev["kind"].isin(["engine_added", "engine_aborted", "engine_finished"])].itertuples(index=False):
            key = (row.kind, row.request_id)
            self.at.setdefault(key, []).append(float(row.t_s))
            self.detail.setdefault(key, json.loads(row.data).get("detail", ""))

    def first(self, kind: str, rid: str, after: float = -math.inf) -> float | None:
        times = [t for t in self.at.get((kind, rid), []) if t >= after]
        return min(times) if times else None


def judge_triton(run: Run, grace_s: float) -> list[CancelVerdict]:
    ev_all = run.events
    ledger = run.ledger
    if ev_all.empty or ledger.empty:
        return []
    t0 = run.info["started_mono_ns"]
    targets = [t["label"] for t in run.info.get("targets", [])]
    target = targets[0] if targets else None
    log_state = _log_state(run, target)
    has_log = log_state == "read"
    slog = _ServerLog(run)
    rows = {r["request_id"]: r for r in ledger.to_dict("records")}
    scrape_times = np.sort(run.series("requests_waiting", target=target)["t_s"].to_numpy(dtype=float))
    out = []
    for stop in ev_all[ev_all["kind"] == "user_stop"].itertuples(index=False):
        data = json.loads(stop.data)
        out.append(_judge_one(run, slog, rows, ledger, scrape_times, data=data, rid=stop.request_id,
                              t_stop=float(stop.t_s), t0=t0, target=target, grace_s=grace_s, has_log=has_log,
                              log_state=log_state))
    return out


def _judge_one(run: Run, slog: _ServerLog, rows: dict, ledger: pd.DataFrame, scrape_times: np.ndarray, *,
               data: dict, rid: str, t_stop: float, t0: int, target: str | None, grace_s: float, has_log: bool,
               log_state: str) -> CancelVerdict:
    model, mode, scenario = data.get("model"), data.get("mode"), data.get("scenario")
    lrow = rows.get(rid)
    terminal = None if lrow is None else lrow["terminal_state"]
    t_added = slog.first("engine_added", rid)
    t_cancel_line = slog.first("engine_aborted", rid, t_stop - LOG_SLACK_S)
    t_finished = slog.first("engine_finished", rid)
    polls = "poll=false" not in slog.detail.get(("engine_added", rid), "")
    phase = data.get("phase")
    if has_log:
        phase = "executing" if t_added is not None and t_added < t_stop else "queued"
    # the probe of this scenario, sent after the stop: its first response is the capacity handed out again
    same = ledger[(ledger["scenario"] == scenario) & (ledger["role"] == "probe")]
    firsts = same["first_token_mono_ns"].dropna()
    firsts = firsts[same.loc[firsts.index, "sent_mono_ns"] >= (lrow["cancel_mono_ns"] if lrow is not None and not
                                                                 pd.isna(lrow["cancel_mono_ns"]) else -math.inf)]
    t_probe = float((firsts.min() - t0) / 1e9) if len(firsts) else None
    tp = {"user_stop": t_stop, "app_received": None, "engine_abort": None, "left_scheduler": None, "reusable": t_probe}
    sources = {"user_stop": ("client", None), "app_received": (None, NO_APP),
               "engine_abort": (None, "no cancel in the server log" if has_log else "no server log"),
               "left_scheduler": (None, "not seen in the samples"),
               "reusable": ("client", None) if t_probe is not None else (None, "no probe got a first response")}
    window = (scrape_times >= t_stop - 1.0) & (scrape_times <= t_stop + grace_s)
    ev = Evidence(grace_s=grace_s, metrics_target=target, samples_in_window=int(window.sum()), engine_log=log_state)
    ev.model, ev.server_phase, ev.expected = model, phase if has_log else None, data.get("expect")

    def verdict(kind: str, why: str | None = None) -> CancelVerdict:
        if why is not None:
            ev.why = why
        v = CancelVerdict(rid, scenario, phase, tp, kind, ev, terminal)
        v.sources = {p: {"source": src, "reason": reason} for p, (src, reason) in sources.items()}
        return v

    if terminal == "completed":
        ev.race = "completed before the cancel took effect"
        return verdict("inconclusive", "the request completed before the cancel took effect: nothing to cancel")
    if ev.samples_in_window < MIN_SAMPLES:
        return verdict("inconclusive", f"too few samples around the cancel ({ev.samples_in_window})")

    t_act, v_act = model_series(run, "model_active_requests", target, model=model)
    t_steps, v_steps = model_series(run, "model_steps_total", target, model=model)
    t_pend, v_pend = model_series(run, "triton_pending_requests", target, model=model)
    t_canc, v_canc = model_series(run, "triton_request_failure_total", target, model=model, reason="CANCELED")
    active_before = _before(t_act, v_act, t_stop) if len(t_act) else None
    if has_log and t_finished is not None and t_finished < t_stop - LOG_SLACK_S:
        return verdict("inconclusive", "the server had finished the request before the stop (its model log): "
                       "nothing was left to cancel")

    def left_after(t_from: float, times: np.ndarray, values: np.ndarray, before: float | None) -> float | None:
        if before is None or not len(times):
            return None
        sel = (times >= t_from - LOG_SLACK_S) & (times <= t_from + grace_s)
        return _first(times, sel & (values < before - 0.5))

    if has_log and t_cancel_line is None and t_finished is not None:
        # the model ran it to its end after the stop: whatever the client saw, the server worked for nobody
        ev.kept_running_ms = round((t_finished - t_stop) * 1000, 1)
        t_left = left_after(t_finished, t_act, v_act, active_before)
        if t_left is not None:
            tp["left_scheduler"] = t_left
            sources["left_scheduler"] = ("samples", None)
        ran = f"the model ran the request to its end {t_finished - t_stop:.1f} s after the stop (its log)"
        if mode == "http_timeout":
            return verdict("leaked", f"HTTP carries no cancel for a non-streaming request: the client's timeout "
                           f"closed only its own side, and {ran}")
        if not polls:
            return verdict("leaked", f"the backend does not poll is_cancelled: the cancel reached the server, "
                           f"yet {ran}")
        return verdict("leaked", f"the cancel never reached the model: {ran}")
    if t_cancel_line is not None:
        tp["engine_abort"] = t_cancel_line
        sources["engine_abort"] = ("engine_log", None)
        if t_cancel_line - t_stop > grace_s:
            ev.kept_running_ms = round((t_cancel_line - t_stop) * 1000, 1)
            return verdict("leaked", f"the model saw the cancel only {t_cancel_line - t_stop:.1f} s after the stop, "
                           f"past the {grace_s:g} s grace: it ran for nobody until then")
        t_left = left_after(t_cancel_line, t_act, v_act, active_before)
        if t_left is None:
            return verdict("stale_gauge", "the model logged the cancel, but its active gauge did not fall within "
                           "the grace")
        tp["left_scheduler"] = t_left
        sources["left_scheduler"] = ("samples", None)
        ev.count_after = float(v_act[np.searchsorted(t_act, t_left)])
        ev.release_ms = round((t_left - t_cancel_line) * 1000, 1)
        return verdict("released")
    # no line of the model for the cancel: a request the core dropped in its queue never reached it
    canc_before = _before(t_canc, v_canc, t_stop)
    t_dropped = None
    if canc_before is not None:
        sel = (t_canc >= t_stop) & (t_canc <= t_stop + grace_s)
        t_dropped = _first(t_canc, sel & (v_canc > canc_before + 0.5))
    if t_dropped is not None and (t_added is None or t_added > t_stop + grace_s or not has_log):
        ev.canceled_failures_delta = float(v_canc[np.searchsorted(t_canc, t_dropped)] - canc_before)
        tp["engine_abort"] = t_dropped
        sources["engine_abort"] = ("samples", "the core's failure{reason=\"CANCELED\"} count rose")
        pend_before = _before(t_pend, v_pend, t_stop)
        t_left = left_after(t_stop, t_pend, v_pend, pend_before) if pend_before is not None else None
        tp["left_scheduler"] = t_left if t_left is not None else t_dropped
        sources["left_scheduler"] = ("samples", None)
        ev.release_ms = round((tp["left_scheduler"] - t_dropped) * 1000, 1)
        return verdict("released", None)
    if not has_log:
        # metrics alone: the model's own gauge and step counter (cancelwatch's models publish both)
        t_left = left_after(t_stop, t_act, v_act, active_before)
        if t_left is not None:
            tp["left_scheduler"] = t_left
            sources["left_scheduler"] = ("samples", None)
            return verdict("released", "no server log: the release rests on the model's active gauge alone")
        end = t_stop + grace_s
        steps_in = v_steps[(t_steps > t_stop + 0.5) & (t_steps <= end)] if len(t_steps) else np.array([])
        if active_before and len(steps_in) >= 2 and steps_in[-1] > steps_in[0]:
            return verdict("leaked", "no server log; the model's active gauge stayed up and its steps kept rising "
                           "through the grace")
        return verdict("inconclusive", "no server evidence names this request (no server log, no CANCELED drop, "
                       "no model gauge): the client's CANCELLED alone proves nothing")
    if t_added is None:
        return verdict("inconclusive", "the server log never names this request and the core counted no CANCELED "
                       "drop: nothing shows the server had it")
    still = t_finished is None
    return verdict("leaked" if still else "inconclusive",
                   "the model started the request and logged no cancel and no end: it was still running at the end "
                   "of the run" if still else "the model's log is incomplete for this request")


def server_request_counts(run: Run) -> list[dict]:
    """Per model: requests the ledger sent (request_sent events) against those the server counted (success
    plus failure of every reason, over the run). A server count above the ledger's is a silent resubmit."""
    ev = run.events
    if ev.empty:
        return []
    sent: dict[str, int] = {}
    for row in ev[ev["kind"] == "request_sent"].itertuples(index=False):
        model = json.loads(row.data).get("model")
        sent[model] = sent.get(model, 0) + 1
    targets = [t["label"] for t in run.info.get("targets", [])]
    target = targets[0] if targets else None
    out = []
    for model in sorted(sent):
        counted = 0.0
        for metric in ("triton_request_success_total", "triton_request_failure_total"):
            _, v = model_series(run, metric, target, model=model)
            counted += float(v[-1] - v[0]) if len(v) >= 2 else 0.0
        out.append({"model": model, "sent": sent[model], "server_counted": int(round(counted)),
                    "ok": counted <= sent[model] + 1e-9})
    return out
