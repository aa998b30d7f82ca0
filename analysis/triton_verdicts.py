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
from analysis.verdict_core import LOG_SLACK_S, MIN_SAMPLES, NO_APP, CancelVerdict, engine_log_state
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
    """The model log's lines: per request its model, when it started, and how and when it ended."""

    def __init__(self, run: Run):
        self.at: dict[tuple[str, str], list[float]] = {}
        self.detail: dict[tuple[str, str], str] = {}
        self.model: dict[str, str] = {}
        ev = run.events
        if ev.empty:
            return
        for row in ev[ev["kind"].isin(["engine_added", "engine_aborted", "engine_finished"])].itertuples(index=False):
            key = (row.kind, row.request_id)
            data = json.loads(row.data)
            self.at.setdefault(key, []).append(float(row.t_s))
            self.detail.setdefault(key, data.get("detail", ""))
            self.model.setdefault(row.request_id, data.get("model"))

    @property
    def any(self) -> bool:
        return bool(self.at)

    def first(self, kind: str, rid: str, after: float = -math.inf) -> float | None:
        times = [t for t in self.at.get((kind, rid), []) if t >= after]
        return min(times) if times else None

    def others_running(self, model: str, rid: str, times: np.ndarray) -> np.ndarray:
        """Per instant: requests of `model` other than `rid` the model was running by its log (started,
        not yet cancelled or finished): what its active gauge should show once `rid` is gone."""
        out = np.zeros(len(times))
        for other, m in self.model.items():
            if m != model or other == rid:
                continue
            start = self.first("engine_added", other)
            if start is None:
                continue
            ends = [t for t in (self.first("engine_aborted", other, start), self.first("engine_finished", other, start))
                    if t is not None]
            out += (times >= start) & (times < (min(ends) if ends else math.inf))
        return out


# a natural end this close after the stop is a race the end may have won, not a lost cancel
RACE_S = 0.1


def judge_triton(run: Run, grace_s: float) -> list[CancelVerdict]:
    ev_all = run.events
    ledger = run.ledger
    if ev_all.empty or ledger.empty:
        return []
    t0 = run.info["started_mono_ns"]
    targets = [t["label"] for t in run.info.get("targets", [])]
    target = targets[0] if targets else None
    log_state = engine_log_state(run, target)
    slog = _ServerLog(run)
    if log_state == "read" and not slog.any:
        # a readable file with no line of the models (another log, or --log-info false) is no server log
        log_state = "read, but it holds no line of the models (a log of another server, or --log-info false)"
    has_log = log_state == "read"
    rows = {r["request_id"]: r for r in ledger.to_dict("records")}
    scrape_times = np.sort(run.series("requests_waiting", target=target)["t_s"].to_numpy(dtype=float))
    stops = ev_all[ev_all["kind"] == "user_stop"]
    missed = set(ev_all[ev_all["kind"] == "trigger_missed"]["request_id"])
    # same-model targets stopped at one instant (one stop_stream): a release must show for each of them
    together: dict[tuple, int] = {}
    datas = [json.loads(d) for d in stops["data"]]
    for stop, data in zip(stops.itertuples(index=False), datas):
        key = (data.get("model"), round(float(stop.t_s), 4))
        together[key] = together.get(key, 0) + 1
    out = []
    for stop, data in zip(stops.itertuples(index=False), datas):
        out.append(_judge_one(run, slog, rows, ledger, scrape_times, data=data, rid=stop.request_id,
                              t_stop=float(stop.t_s), t0=t0, target=target, grace_s=grace_s, has_log=has_log,
                              log_state=log_state, missed=stop.request_id in missed,
                              together=together[(data.get("model"), round(float(stop.t_s), 4))]))
    return out


def _natural_end(data: dict, lrow: dict | None, t_stop: float, t0: int) -> float | None:
    """The instant, s since the run started, the request would have ended on its own at the earliest:
    the slow model's run time from its sending (queueing only delays it), or the generator's tokens left
    at the step the client saw. None when the run does not say."""
    inputs = data.get("inputs") or {}
    if "MS" in inputs and data.get("sent_mono_ns"):
        return (data["sent_mono_ns"] - t0) / 1e9 + inputs["MS"] / 1000.0
    if "N" in inputs and data.get("step_s"):
        left = max(0, int(inputs["N"]) - int(data.get("tokens_at_cancel") or 0))
        return t_stop + left * float(data["step_s"])
    return None


def _judge_one(run: Run, slog: _ServerLog, rows: dict, ledger: pd.DataFrame, scrape_times: np.ndarray, *,
               data: dict, rid: str, t_stop: float, t0: int, target: str | None, grace_s: float, has_log: bool,
               log_state: str, missed: bool = False, together: int = 1) -> CancelVerdict:
    model, mode, scenario = data.get("model"), data.get("mode"), data.get("scenario")
    lrow = rows.get(rid)
    terminal = None if lrow is None else lrow["terminal_state"]
    t_added = slog.first("engine_added", rid)
    t_cancel_line = slog.first("engine_aborted", rid, t_stop - LOG_SLACK_S)
    t_early_cancel = slog.first("engine_aborted", rid)
    t_finished = slog.first("engine_finished", rid)
    finished_detail = slog.detail.get(("engine_finished", rid), "")
    polls = "poll=false" not in slog.detail.get(("engine_added", rid), "")
    phase = data.get("phase")
    if has_log:
        # the model writes `started` a moment after it took the request: a line up to the slack after the
        # stop still means it was running at the stop
        phase = "executing" if t_added is not None and t_added < t_stop + LOG_SLACK_S else "queued"
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
        if missed:
            return verdict("inconclusive", "the request completed before the stop: the scenario's trigger was never "
                           "reached, so there was nothing to cancel")
        ev.race = "completed before the cancel took effect"
        return verdict("inconclusive", "the request completed before the cancel took effect: nothing to cancel")
    if ev.samples_in_window < MIN_SAMPLES:
        return verdict("inconclusive", f"too few samples around the cancel ({ev.samples_in_window})")

    t_act, v_act = model_series(run, "model_active_requests", target, model=model)
    t_steps, v_steps = model_series(run, "model_steps_total", target, model=model)
    t_pend, v_pend = model_series(run, "triton_pending_requests", target, model=model)
    t_canc, v_canc = model_series(run, "triton_request_failure_total", target, model=model, reason="CANCELED")
    has_gauge = len(t_act) > 0
    if has_log and t_finished is not None and t_finished < t_stop - LOG_SLACK_S:
        return verdict("inconclusive", "the server had finished the request before the stop (its model log): "
                       "nothing was left to cancel")
    if has_log and t_cancel_line is None and t_early_cancel is not None:
        return verdict("inconclusive", f"the model logged a cancel of this request {1000 * (t_stop - t_early_cancel):.0f} "
                       "ms before the stop: it had ended before this cancel, which cannot show a release")

    def left_after(t_from: float) -> float | None:
        """First sample from `t_from` through the grace where the model's active gauge is no more than its
        other requests (by its log; without one, by the ledger): this request no longer counted."""
        if not has_gauge:
            return None
        sel = (t_act >= t_from - LOG_SLACK_S) & (t_act <= t_from + grace_s)
        if has_log:
            others = slog.others_running(model, rid, t_act)
        else:
            before = _before(t_act, v_act, t_stop)
            if before is None:
                return None
            others = np.full(len(t_act), before - together)
        return _first(t_act, sel & (v_act <= others + 0.5))

    if has_log and t_cancel_line is None and t_finished is not None:
        if finished_detail.startswith("error"):
            return verdict("inconclusive", f"the model ended the request with an error ({finished_detail}) "
                           f"{t_finished - t_stop:.2f} s after the stop, not on the cancel")
        if t_finished - t_stop <= RACE_S + float(data.get("step_s") or 0.0):
            ev.race = f"the model finished the request {1000 * (t_finished - t_stop):.0f} ms after the stop"
            return verdict("inconclusive", "the request's natural end came with the stop: a race the end may have won")
        # the model ran it to its end after the stop: whatever the client saw, the server worked for nobody
        ev.kept_running_ms = round((t_finished - t_stop) * 1000, 1)
        t_left = left_after(t_finished)
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
        if not has_gauge:
            sources["left_scheduler"] = (None, "the server publishes no active gauge for this model")
            return verdict("released", "no model gauge: the release rests on the model's own log line alone")
        t_left = left_after(t_cancel_line)
        if t_left is None:
            return verdict("stale_gauge", "the model logged the cancel, but its active gauge did not fall to its "
                           "other requests within the grace")
        tp["left_scheduler"] = t_left
        sources["left_scheduler"] = ("samples", None)
        ev.count_after = float(v_act[np.searchsorted(t_act, t_left)])
        ev.release_ms = round(max(0.0, t_left - t_cancel_line) * 1000, 1)
        return verdict("released")
    # no line of the model for the cancel: a request the core dropped in its queue never reached it
    canc_before = _before(t_canc, v_canc, t_stop)
    t_dropped = None
    if canc_before is not None:
        sel = (t_canc >= t_stop) & (t_canc <= t_stop + grace_s)
        # each same-model request stopped at this instant is one CANCELED: all of them must show
        t_dropped = _first(t_canc, sel & (v_canc >= canc_before + together - 0.5))
    if t_dropped is not None and (t_added is None or t_added > t_stop + grace_s or not has_log):
        ev.canceled_failures_delta = float(v_canc[np.searchsorted(t_canc, t_dropped)] - canc_before)
        tp["engine_abort"] = t_dropped
        sources["engine_abort"] = ("samples", "the core's failure{reason=\"CANCELED\"} count rose")
        pend_before = _before(t_pend, v_pend, t_stop)
        t_left = None
        if pend_before is not None:
            sel = (t_pend >= t_stop) & (t_pend <= t_stop + grace_s)
            t_left = _first(t_pend, sel & (v_pend < pend_before - 0.5))
        tp["left_scheduler"] = t_left if t_left is not None else t_dropped
        sources["left_scheduler"] = ("samples", None)
        ev.release_ms = round(max(0.0, tp["left_scheduler"] - t_dropped) * 1000, 1)
        return verdict("released", None)
    if not has_log:
        # metrics alone: the model's own gauge, against when the request would have ended anyway
        natural = _natural_end(data, lrow, t_stop, t0)
        if natural is not None and natural - t_stop <= RACE_S:
            ev.race = "the request was due to end with the stop"
            return verdict("inconclusive", "no server log, and the request was due to end with the stop: a race")
        sel = (t_act >= t_stop) & (t_act <= t_stop + grace_s) if has_gauge else np.array([], dtype=bool)
        before = _before(t_act, v_act, t_stop) if has_gauge else None
        t_fall = _first(t_act, sel & (v_act <= before - together + 0.5)) if before is not None else None
        if t_fall is not None and (natural is None or t_fall < natural - RACE_S):
            tp["left_scheduler"] = t_fall
            sources["left_scheduler"] = ("samples", None)
            if natural is None:
                return verdict("inconclusive", "no server log: the model's active gauge fell, but nothing says "
                               "whether the request was due to end then anyway")
            return verdict("released", "no server log: the release rests on the model's active gauge falling "
                           f"{natural - t_fall:.1f} s before the request's natural end")
        if before is not None and natural is not None:
            # the gauge stayed up to the request's natural end (or the end of the grace)
            ends = (t_act >= natural - RACE_S) & (v_act <= before - together + 0.5)
            t_end = _first(t_act, ends)
            ev.kept_running_ms = round(((t_end if t_end is not None else t_stop + grace_s) - t_stop) * 1000, 1)
            return verdict("leaked", "no server log; the model's active gauge stayed up "
                           + ("until the request's natural end" if t_end is not None else "through the grace")
                           + ": it ran for nobody")
        end = t_stop + grace_s
        steps_in = v_steps[(t_steps > t_stop + 0.5) & (t_steps <= end)] if len(t_steps) else np.array([])
        if before and len(steps_in) >= 2 and steps_in[-1] > steps_in[0] and t_fall is None:
            return verdict("leaked", "no server log; the model's active gauge stayed up and its steps kept rising "
                           "through the grace")
        return verdict("inconclusive", "no server evidence names this request (no server log, no CANCELED drop, "
                       "no model gauge): the client's CANCELLED alone proves nothing")
    if t_added is None:
        return verdict("inconclusive", "the server log never names this request and the core counted no CANCELED "
                       "drop: nothing shows the server had it")
    return verdict("leaked", "the model started the request and logged no cancel and no end: it was still running "
                   "at the end of the run")


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
