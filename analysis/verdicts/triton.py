"""Triton's evidence rules, from the server's own evidence (never the client's CANCELLED).

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
                (a model that says so and stops counting the request but keeps the bytes it held, by its
                buffer gauge, is leaked)
  stale_gauge   the model logged the cancel, but its active gauge did not fall within the grace
  inconclusive  the request had ended before the stop, no server evidence names it, too few samples

The shared guards (core.GUARDS) come first; EVIDENCE_RULES are this family's rungs after them.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import pandas as pd

from cancelwatch.analysis.bounds import BASELINE_S, LEDGER_LAG_S, NATURAL_END_SPREAD_S, RACE_S, WHOLE
from cancelwatch.analysis.rows import event_rows, frame_dicts
from cancelwatch.analysis.series import scrape_spans
from cancelwatch.analysis.verdicts.requests import Requests, Stays, requests_of, weighted_between
from cancelwatch.analysis.evidence import Evidence
from cancelwatch.analysis.verdicts.core import (
    LOG_SLACK_S,
    NO_APP,
    NO_REQUESTS,
    CancelVerdict,
    Case,
    engine_log_state,
    first_probe_s,
    judge,
    ledger_by_scenario,
)
from cancelwatch.runstore.reader import Run

TRITON = "triton"


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
    # a scrape whose values are all missing is no reading (pandas' plain sum would make it 0)
    g = df.groupby("scrape_id", observed=True).agg(t_s=("t_s", "first"), value=("value", lambda v: v.sum(min_count=1)))
    g = g[np.isfinite(g["value"].to_numpy(dtype=float))].sort_values("t_s")
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
        self._stays: dict = {}
        ev = run.events
        if ev.empty:
            return
        for row in event_rows(run, "engine_added", "engine_aborted", "engine_finished"):
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
        ids, start, end = self.stays(model)
        others = ids != rid
        return weighted_between(times, start[others], end[others], np.ones(int(others.sum())))

    def stays(self, model: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ids, from, to) of each request of `model` its log has starting: from its `started` line to its first
        `cancelled` or finished line after it (inf: none), as the vLLM model's stays are read (requests.py)."""
        if model not in self._stays:
            rows = []
            for other, m in self.model.items():
                start = self.first("engine_added", other) if m == model else None
                if start is None:
                    continue
                ends = [t for t in (self.first("engine_aborted", other, start),
                                    self.first("engine_finished", other, start)) if t is not None]
                rows.append((other, start, min(ends) if ends else math.inf))
            self._stays[model] = (np.array([r[0] for r in rows], dtype=object), np.array([r[1] for r in rows], float),
                                  np.array([r[2] for r in rows], float))
        return self._stays[model]


def judge_triton(run: Run, grace_s: float, metrics_target: str | None = None,
                 only: set[str] | None = None) -> list[CancelVerdict]:
    """One verdict per cancel of a Triton run, on its first target (`metrics_target` is vLLM's choice). Every
    cancel is judged, `only` or not (judge_run keeps those asked for): nothing here leaves any out yet."""
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
    rows = {r["request_id"]: r for r in frame_dicts(ledger)}
    by_scenario = ledger_by_scenario(ledger)
    scrape_times = np.sort(run.series("requests_waiting", target=target)["t_s"].to_numpy(dtype=float))
    stops = event_rows(run, "user_stop")
    missed = {r.request_id: json.loads(r.data) for r in event_rows(run, "trigger_missed")}
    datas = [json.loads(stop.data) for stop in stops]
    sent = [(r.request_id, json.loads(r.data).get("model"), float(r.t_s)) for r in event_rows(run, "request_sent")]
    models = {rid: model for rid, model, _ in sent}
    # requests the run sent with no ledger row (a run cut off before its scenario's rows were written): their model,
    # and when their client let them go at the soonest: their stop, else their send
    unrowed = {rid: (model, t) for rid, model, t in sent if rid not in rows}
    unrowed.update({stop.request_id: (data.get("model"), float(stop.t_s))
                    for stop, data in zip(stops, datas) if stop.request_id not in rows})
    spans = {r: (row.get("sent_mono_ns"), row.get("closed_mono_ns")) for r, row in rows.items()}
    reqs = requests_of(ledger, t0)
    row_models = np.array([models.get(rid) for rid in reqs.ids], dtype=object)
    seen_leaving: dict[str, float] = {}
    out = []
    for stop, data in zip(stops, datas):
        case = _case(run, slog, rows, by_scenario.get(data.get("scenario"), NO_REQUESTS), scrape_times, data=data,
                     rid=stop.request_id, t_stop=float(stop.t_s), t0=t0, target=target, grace_s=grace_s,
                     log_state=log_state, missed=missed.get(stop.request_id),
                     unrowed=unrowed,
                     spans=spans, reqs=reqs, row_models=row_models, seen_leaving=seen_leaving)
        v = judge(case, EVIDENCE_RULES)
        if v.timepoints.get("left_scheduler") is not None:
            # the server's own evidence showed it gone: the cancels after it read it so (ledger_stays)
            seen_leaving[v.request_id] = float(v.timepoints["left_scheduler"])
        out.append(v)
    return out


def _natural_end(data: dict, t_stop: float, t0: int) -> tuple[float | None, bool]:
    """The instant, s since the run started, the request would have ended on its own at the earliest:
    the slow model's run time from its sending (queueing only delays it), or the generator's tokens left
    at the step the client saw. None when the run does not say. And whether it is from its sending."""
    inputs = data.get("inputs") or {}
    if "MS" in inputs and data.get("sent_mono_ns"):
        return (data["sent_mono_ns"] - t0) / 1e9 + inputs["MS"] / 1000.0, True
    if "N" in inputs and data.get("step_s"):
        left = max(0, int(inputs["N"]) - int(data.get("tokens_at_cancel") or 0))
        return t_stop + left * float(data["step_s"]), False
    return None, False


@dataclass(kw_only=True, eq=False)
class TritonCase(Case):
    """A Triton cancel: the model's log lines for it, and the model's and the core's series."""

    slog: _ServerLog
    data: dict  # the user_stop event's data: model, mode, inputs, step_s, ...
    has_log: bool
    t_added: float | None  # the model's `started` line
    t_early_cancel: float | None  # the model's first `cancelled` line, whenever it came
    finished_detail: str
    polls: bool  # the model polls is_cancelled (its `started` line says poll=false when not)
    natural: float | None  # when the request would have ended on its own (see _natural_end)
    # the natural end is from its send (the slow model's run time: the soonest it could end), not from the tokens
    # left at the stop
    natural_from_send: bool
    series: dict[str, tuple[np.ndarray, np.ndarray]]  # active, steps, pending, canceled, buffer: (instants, values)
    run: Run
    unrowed: dict  # request id -> (model, let go at the soonest) of the requests sent with no ledger row
    ledger_spans: dict  # request id -> (sent_mono_ns, closed_mono_ns)
    reqs: Requests | None = None  # the ledger as arrays (requests.py): its stays as the vLLM model reads them
    row_models: np.ndarray | None = None  # per row of reqs: the model its request_sent event names
    seen_leaving: dict | None = None  # request id -> where an earlier cancel's verdict saw its stopped request gone
    shared_drop: dict | None = None  # a CANCELED rise others may have made (dropped_in_queue): its count reading

    @property
    def model(self) -> str | None:
        return self.data.get("model")

    @cached_property
    def natural_latest(self) -> float | None:
        """The latest the request would have ended on its own (None: no natural end known). Its natural end from
        the tokens left at the stop is its end: it was running. From its send (the slow model's run time), that is
        the soonest: the core may have queued it first. It was taken up at the latest by the first reading, from
        LEDGER_LAG_S after its send (it reached the server by then) to the stop, with none of the model's requests
        pending (a request taken up is never queued again); inf where every reading had some pending."""
        natural = self.natural
        if not self.natural_from_send:
            return natural
        sent = (self.data["sent_mono_ns"] - self.run.info["started_mono_ns"]) / 1e9
        t_pend, v_pend = self.series["pending"]
        spans = scrape_spans(self.run, self.ev.metrics_target, t_pend, source=TRITON)
        idle = np.nonzero((t_pend >= sent + LEDGER_LAG_S) & (t_pend <= self.t_stop) & (v_pend < 0.5))[0]
        if not len(idle):
            return math.inf
        return natural + float(t_pend[idle[0]] + spans[idle[0]] - sent)

    @cached_property
    def drop_candidates(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids, instants) of the model's other requests whose drop from the core's queue its CANCELED count may
        hold: each from the instant its client let it go (its cancel or its close: a cancel reaches the server after
        it). A request whose client got an answer, or read it to its end, was taken up by the model, and one the
        model's log names as started too: neither was dropped. A send that names no model may be this model's."""
        r = self.reqs
        unnamed = np.array([m is None for m in self.row_models], dtype=bool)
        rows = ((self.row_models == self.model) | unnamed) & (r.ids != self.rid) & ~r.completed & np.isinf(r.first) \
            & ~np.isnan(r.sent)
        let_go = np.fmin(r.cancel, r.closed)
        rows &= ~np.isnan(let_go)  # a request its client still holds was cancelled by nobody
        ids, at = list(r.ids[rows]), list(let_go[rows])
        for rid, (model, t) in self.unrowed.items():  # sent with no ledger row: let go at its stop, else its send
            if rid != self.rid and model in (self.model, None):
                ids.append(rid)
                at.append(t)
        keep = [not self.has_log or self.slog.first("engine_added", rid) is None for rid in ids]
        return np.array(ids, dtype=object)[keep], np.array(at, dtype=float)[keep]

    def others(self, times: np.ndarray) -> np.ndarray | None:
        """Per instant: the fewest of the model's requests other than this one the server can be counting
        (others_bounds); None without a gauge reading before the stop."""
        bounds = self.others_bounds(times)
        return None if bounds is None else bounds[0]

    def others_bounds(self, times: np.ndarray, spans: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray] | None:
        """Per reading at `times` (its scrape answered over `spans`): (the fewest, the most) of the requests other than
        this one the server can be counting for the model. By its log, the requests it had started and not yet ended
        (both). Without one, a change from its last reading before the stop (baseline): there it counted this one (or
        not yet, sent just before), the ledger's others, and whatever the client does not know, taken as steady
        (traffic_beside_held_steady). From there each of the ledger's others can have left, entered, or neither,
        as its stay allows (ledger_stays: one stay each, never re-entered), so the count moved by as much as they
        did, give or take this one. None without a reading before the stop."""
        if self.has_log:
            running = self.slog.others_running(self.model, self.rid, times)
            return running, running
        base = self.baseline
        if base is None:
            return None
        t_b, span_b, count_b = base
        spans = np.zeros(len(times)) if spans is None else spans
        d_min, d_max = self.ledger_stays.change(t_b, t_b + span_b, times, times + spans)
        surely, maybe = self.own_at_baseline
        return np.maximum(0.0, count_b - float(maybe) + d_min), count_b - float(surely) + d_max

    def stays_out(self, i: int, until: float) -> bool:
        """Whether every reading after reading `i` (this request out there) to `until` bears it out: the count rose
        by no more than the ledger's others can have entered since, as this one, gone, enters no more. A rise
        beyond that is this one, counted again: reading `i` missed it (seen between the core's queue and the
        model's count: dequeued, and not counted by the model yet)."""
        if self.has_log:
            return True
        t_act, v_act = self.counted()
        spans = self.counted_spans
        later = np.nonzero((t_act > t_act[i]) & (t_act < until))[0]
        if not len(later):
            return True
        _, d_max = self.ledger_stays.change(t_act[i], t_act[i] + spans[i], t_act[later], t_act[later] + spans[later])
        return bool(np.all(v_act[later] - v_act[i] <= d_max + WHOLE))

    @cached_property
    def baseline(self) -> tuple[float, float, float] | None:
        """(instant, scrape span, count) of the server's last reading for the model before the stop (counted)."""
        t_act, v_act = self.counted()
        i = int(np.searchsorted(t_act, self.t_stop, side="left")) - 1
        if i < 0:
            return None
        return float(t_act[i]), float(self.counted_spans[i]), float(v_act[i])

    @cached_property
    def own_at_baseline(self) -> tuple[bool, bool]:
        """(surely, maybe) this request was in the baseline's count: maybe, not surely, where it was sent just before
        or the baseline's scrape was answered past the stop; maybe where the ledger does not place it."""
        t_b, span_b, _ = self.baseline
        surely, maybe = self.own_stay.inside(t_b, t_b + span_b)
        return bool(surely.any()), bool(maybe.any() or not len(self.own_stay.ids))

    @cached_property
    def counted_spans(self) -> np.ndarray:
        return scrape_spans(self.run, self.ev.metrics_target, self.counted()[0], source=TRITON)

    @cached_property
    def ledger_stays(self) -> Stays:
        """The ledger's other requests this model's count can hold, as stays in the server (requests.py). Surely the
        server's from LEDGER_LAG_S after the send to LEDGER_LAG_S before the client was done with it (the server takes
        a request up a moment after its send, and ends it, on its own or on its cancel, a moment before its client
        reads the end or cancels); maybe from the send to the client's close. One its client stopped may run on for
        nobody: maybe until its own verdict saw it gone, else to the end of the run (its natural end is only the
        soonest it could end: queued, it ends later). A request whose send names no model may be this model's:
        maybe, never surely, counted."""
        return self._stays(self.reqs.ids != self.rid)

    @cached_property
    def own_stay(self) -> Stays:
        """This request's stay as the others' are read (its send may name another model: it is this one), surely
        the server's up to its stop."""
        return self._stays(self.reqs.ids == self.rid, own=True)

    def _stays(self, rows: np.ndarray, own: bool = False) -> Stays:
        r = self.reqs
        unnamed = np.array([m is None and not own for m in self.row_models], dtype=bool)
        rows = rows & ((self.row_models == self.model) | unnamed | own) & ~np.isnan(r.sent)
        closed = np.nan_to_num(r.closed[rows], nan=math.inf)
        cancel = np.nan_to_num(r.cancel[rows], nan=math.inf)
        # a request its client did not read to its end (stopped, errored, dropped) may run on for nobody: the
        # client's close says nothing of the server's end
        open_ended = ~r.completed[rows]
        done = np.minimum(cancel, closed)
        seen = np.array([(self.seen_leaving or {}).get(rid, math.inf) for rid in r.ids[rows]], dtype=float)
        n = int(rows.sum())
        return Stays(ids=r.ids[rows], weights=np.ones(n),
                     surely_from=np.where(unnamed[rows], math.inf, r.sent[rows] + LEDGER_LAG_S),
                     # this one is dropped after its cancel, never before it (an end of its own in flight at the
                     # stop is the race the race rules read, where the run says when it was due)
                     surely_to=np.full(n, self.t_stop) if own else done - LEDGER_LAG_S,
                     maybe_from=r.sent[rows],
                     # the server's count can trail its client's read of the end too (the answer sent, the gauge
                     # let go after)
                     maybe_to=np.where(open_ended, seen, closed + LEDGER_LAG_S),
                     before=np.where(unnamed[rows], "model_not_named", "sent_within_lag").astype(object),
                     after=np.where(unnamed[rows], "model_not_named",
                                    np.where(open_ended, "stopped_no_server_end", "end_read_within_lag")).astype(object))

    def count_reading(self, i: int, t: float, count: float, fewest: float, most: float) -> dict:
        """What the count at reading `i` (instant `t`) was read against (Evidence.count_reading, as the vLLM rules give
        it): the fewest and the most others, and the requests that keep them apart (at that reading, or at the
        baseline the change is read from)."""
        open_: list[dict] = []
        if not self.has_log and self.baseline is not None:
            t_b, span_b, _ = self.baseline
            span = float(self.counted_spans[i])
            open_ = self.ledger_stays.open_at(t, t + span)
            named = {o["request_id"] for o in open_}
            open_ += [o for o in self.ledger_stays.open_at(t_b, t_b + span_b) if o["request_id"] not in named]
            surely, maybe = self.own_at_baseline
            if maybe and not surely and len(self.own_stay.ids):
                open_.append({"request_id": self.rid, "reason": "sent_within_lag"})
        return {"at_s": round(t, 3), "count": float(count), "others_fewest": float(fewest), "others_most": float(most),
                "compared_with": None, "open": open_}

    def counted(self) -> tuple[np.ndarray, np.ndarray]:
        """(instants, requests) the server counted for the model: executing (its active gauge), and, without
        a log (the ledger's others include requests still queued in the core), its pending ones too."""
        t_act, v_act = self.series["active"]
        t_pend, v_pend = self.series["pending"]
        if self.has_log or not len(t_pend) or not len(t_act):
            return t_act, v_act
        i = np.searchsorted(t_pend, t_act)
        same = (i < len(t_pend)) & (t_pend[np.minimum(i, len(t_pend) - 1)] == t_act)
        pend = np.where(same, v_pend[np.minimum(i, len(t_pend) - 1)], np.nan)
        keep = ~np.isnan(pend)
        return t_act[keep], v_act[keep] + pend[keep]

    def left_after(self, t_from: float) -> float | None:
        """First sample from `t_from` through the grace where the model's active gauge is no more than its
        other requests (by its log; without one, by the ledger): this request no longer counted."""
        t_act, v_act = self.counted()
        if not len(t_act):
            return None
        sel = (t_act >= t_from - LOG_SLACK_S) & (t_act <= t_from + self.grace_s)
        others = self.others(t_act)
        if others is None:
            return None
        return _first(t_act, sel & (v_act <= others + WHOLE))

    def buffer_kept(self, t_left: float) -> float | None:
        """Bytes the model's buffer gauge still held beyond its other requests' share, from `t_left` (the
        active gauge fell) through the grace after the abort, where that stayed above half this request's
        share at every pair of consecutive samples (one low reading, a gauge a line ahead of the log, is not
        a give-back); None where it gave the share back, or no buffer reading can say. A request's share:
        the buffer, less what it held with nothing running before this request was sent, over the active
        count, both read at the same scrape before the stop."""
        t_buf, v_buf = self.series["buffer"]
        t_act, v_act = self.series["active"]
        if not len(t_buf) or not len(t_act):
            return None
        # the scrapes that read both gauges, once: the share and the idle level each come from one scrape
        t_both, i_buf, i_act = np.intersect1d(t_buf, t_act, return_indices=True)
        b_both, a_both = v_buf[i_buf], v_act[i_act]
        j = int(np.searchsorted(t_both, self.t_stop, side="left")) - 1
        if j < 0 or t_both[j] != t_act[int(np.searchsorted(t_act, self.t_stop, side="left")) - 1] or a_both[j] <= 0:
            return None  # no reading of both gauges at the last scrape before the stop
        b_stop, a_stop = float(b_both[j]), float(a_both[j])
        sent = self.ledger_spans.get(self.rid, (None, None))[0]
        t_sent = (sent - self.run.info["started_mono_ns"]) / 1e9 if sent is not None and not pd.isna(sent) else self.t_stop
        idle = b_both[(t_both < t_sent) & (a_both == 0)]
        base = float(idle[-1]) if len(idle) else 0.0  # what the model holds with nothing running (a pool, a hoard)
        share = (b_stop - base) / a_stop
        if share <= 0:
            return None
        sel = (t_buf >= t_left - LOG_SLACK_S) & (t_buf <= max(t_left, self.t_abort or t_left) + self.grace_s)
        if sel.sum() < 2:
            return None
        # the others at the stop and at each sample of the stretch (the co-stopped targets among them)
        others = self.others(np.concatenate(([self.t_stop - 1e-6], t_buf[sel])))
        if others is None:
            return None
        # what the buffer holds beyond this request's share given back, at each sample
        excess = v_buf[sel] - (b_stop - share) - share * (others[1:] - others[0])
        kept = float(np.maximum(excess[:-1], excess[1:]).min())
        return kept if kept > 0.5 * share else None


def _case(run: Run, slog: _ServerLog, rows: dict, same: dict, scrape_times: np.ndarray, *, data: dict, rid: str,
          t_stop: float, t0: int, target: str | None, grace_s: float, log_state: str, missed: dict | None,
          unrowed: dict, spans: dict, reqs: Requests, row_models: np.ndarray,
          seen_leaving: dict) -> TritonCase:
    has_log = log_state == "read"
    model, lrow = data.get("model"), rows.get(rid)
    t_added = slog.first("engine_added", rid)
    phase = data.get("phase")
    if has_log:
        # the model writes `started` a moment after it took the request: a line up to the slack after the
        # stop still means it was running at the stop
        phase = "executing" if t_added is not None and t_added < t_stop + LOG_SLACK_S else "queued"
    # the probe of this scenario, sent after the stop: its first response is the capacity handed out again
    cancel_ns = lrow["cancel_mono_ns"] if lrow is not None and not pd.isna(lrow["cancel_mono_ns"]) else -math.inf
    t_probe = first_probe_s(same, cancel_ns, t0)
    tp = {"user_stop": t_stop, "app_received": None, "engine_abort": None, "left_scheduler": None, "reusable": t_probe}
    sources = {"user_stop": ("client", None), "app_received": (None, NO_APP),
               "engine_abort": (None, "no cancel in the server log" if has_log else "no server log"),
               "left_scheduler": (None, "not seen in the samples"),
               "reusable": ("client", None) if t_probe is not None else (None, "no probe got a first response")}
    window = (scrape_times >= t_stop - BASELINE_S) & (scrape_times <= t_stop + grace_s)
    ev = Evidence(grace_s=grace_s, metrics_target=target, samples_in_window=int(window.sum()), engine_log=log_state)
    ev.model, ev.server_phase, ev.expected = model, phase if has_log else None, data.get("expect")
    series = {"active": model_series(run, "model_active_requests", target, model=model),
              "steps": model_series(run, "model_steps_total", target, model=model),
              "pending": model_series(run, "triton_pending_requests", target, model=model),
              "canceled": model_series(run, "triton_request_failure_total", target, model=model, reason="CANCELED"),
              "buffer": model_series(run, "model_buffer_bytes", target, model=model)}
    terminal = None if lrow is None else lrow["terminal_state"]
    natural, from_send = _natural_end(data, t_stop, t0)
    return TritonCase(rid=rid, scenario=data.get("scenario"), phase=phase, terminal=terminal, t_stop=t_stop,
                      grace_s=grace_s, ev=ev, tp=tp, sources=sources, completed=terminal == "completed", missed=missed,
                      t_finished=slog.first("engine_finished", rid) if has_log else None,
                      t_abort=slog.first("engine_aborted", rid, t_stop - LOG_SLACK_S), abort_source="engine_log",
                      slog=slog, data=data, has_log=has_log, t_added=t_added,
                      t_early_cancel=slog.first("engine_aborted", rid),
                      finished_detail=slog.detail.get(("engine_finished", rid), ""),
                      polls="poll=false" not in slog.detail.get(("engine_added", rid), ""),
                      natural=natural, natural_from_send=from_send, series=series, run=run, unrowed=unrowed,
                      ledger_spans=spans, reqs=reqs, row_models=row_models,
                      seen_leaving=seen_leaving)


# ------------------------------------------------------------------------------------------ the rules
def cancelled_first(c: TritonCase) -> CancelVerdict | None:
    if c.has_log and c.t_abort is None and c.t_early_cancel is not None:
        return c.verdict("model_cancelled_before_stop", before_ms=1000 * (c.t_stop - c.t_early_cancel))
    return None


def ran_to_its_end(c: TritonCase) -> CancelVerdict | None:
    """The model's log has no cancel after the stop, but the request's end (t_finished: only with a log)."""
    if c.t_abort is not None or c.t_finished is None:
        return None
    after_s = c.t_finished - c.t_stop
    if c.finished_detail.startswith("error"):
        return c.verdict("model_ended_with_error", detail=c.finished_detail, after_s=after_s)
    if after_s <= RACE_S + float(c.data.get("step_s") or 0.0):
        c.ev.race = f"the model finished the request {1000 * after_s:.0f} ms after the stop"
        return c.verdict("natural_end_with_stop")
    # the model ran it to its end after the stop: whatever the client saw, the server worked for nobody
    c.ev.kept_running_ms = round(after_s * 1000, 1)
    t_left = c.left_after(c.t_finished)
    if t_left is not None:
        c.tp["left_scheduler"] = t_left
    if c.data.get("mode") == "http_timeout":
        return c.verdict("http_carries_no_cancel", after_s=after_s)
    if not c.polls:
        return c.verdict("backend_does_not_poll", after_s=after_s)
    return c.verdict("cancel_never_reached_model", after_s=after_s)


def cancel_logged(c: TritonCase) -> CancelVerdict | None:
    """The model logged the cancel within the grace (one past it is a shared guard's): its gauge must follow."""
    if c.t_abort is None:
        return None
    t_act, v_act = c.series["active"]
    if not len(t_act):
        c.sources["left_scheduler"] = (None, "the server publishes no active gauge for this model")
        return c.verdict("released_on_log_alone")
    t_left = c.left_after(c.t_abort)
    if t_left is None:
        return c.verdict("gauge_did_not_fall")
    kept = c.buffer_kept(t_left)
    if kept is not None:
        # the request stopped counting, but what it held stayed: the memory was not given back
        c.ev.buffer_kept_bytes = kept
        return c.verdict("model_kept_buffer", held_mib=kept / 2**20, grace_s=c.grace_s)
    c.tp["left_scheduler"] = t_left
    c.ev.count_after = float(v_act[np.searchsorted(t_act, t_left)])
    c.ev.release_ms = round(max(0.0, t_left - c.t_abort) * 1000, 1)
    return c.verdict("model_released")


def dropped_in_queue(c: TritonCase) -> CancelVerdict | None:
    """No line of the model for the cancel: a request the core dropped in its queue never reached it. The core's
    CANCELED count is of drops, not whose: at each reading, the drops it counted since its first reading beyond the
    model's other requests that may have been dropped by then (drop_candidates, each at most once) are this one's,
    traffic beside the run's taken as steady. Released at the first reading in the grace with one such; none
    before the stop (else the count holds drops of requests the run does not know). A rise in the grace that the
    others may have made is kept for canceled_rise_shared (shared_drop)."""
    t_canc, v_canc = c.series["canceled"]
    canc_before = _before(t_canc, v_canc, c.t_stop)
    if canc_before is None:
        return None
    if c.has_log and c.t_added is not None:
        return None  # the model started it: the core never dropped it
    ids, let_go = c.drop_candidates
    answered = t_canc + scrape_spans(c.run, c.ev.metrics_target, t_canc, source=TRITON)
    # drops counted since the first reading (a counter that went back, a restart, counts none), and the others that
    # may have been dropped by the time each reading was answered
    drops = np.concatenate(([0.0], np.cumsum(np.maximum(np.diff(v_canc), 0.0))))
    beyond = drops - np.searchsorted(np.sort(let_go), answered, side="right")
    in_grace = (t_canc >= c.t_stop) & (t_canc <= c.t_stop + c.grace_s)
    proven = np.nonzero(in_grace & (beyond > 0.5))[0]
    if not (beyond[answered < c.t_stop] > 0.5).any() and len(proven):
        t_dropped = float(t_canc[proven[0]])
    else:
        base = int(np.searchsorted(t_canc, c.t_stop, side="left")) - 1
        rose = np.nonzero(in_grace & (drops > drops[base] + WHOLE))[0]
        if len(rose):
            # the others that keep it open: let go since the last reading before the stop where every drop was
            # theirs and every one of them dropped (none since can have been dropped before it)
            i = int(rose[0])
            settled = np.nonzero((np.abs(beyond) < 0.5) & (answered < c.t_stop))[0]
            since = answered[settled[-1]] if len(settled) else -math.inf
            could = sorted(ids[(let_go > since) & (let_go <= answered[i])])
            c.shared_drop = {"at_s": round(float(t_canc[i]), 3), "count": float(drops[i] - drops[base]),
                             "others_fewest": 0.0, "others_most": float(len(could)), "compared_with": None,
                             "open": [{"request_id": rid, "reason": "stopped_may_have_been_dropped"} for rid in could]}
        return None
    c.ev.assumes = ["traffic_beside_held_steady"]  # a drop of another client's request would read as this one's
    c.ev.canceled_failures_delta = float(v_canc[np.searchsorted(t_canc, t_dropped)] - canc_before)
    c.tp["engine_abort"] = t_dropped
    c.sources["engine_abort"] = ("samples", "the core's failure{reason=\"CANCELED\"} count rose")
    t_pend, v_pend = c.series["pending"]
    pend_before = _before(t_pend, v_pend, c.t_stop)
    t_left = None
    if pend_before is not None:
        sel = (t_pend >= c.t_stop) & (t_pend <= c.t_stop + c.grace_s)
        t_left = _first(t_pend, sel & (v_pend < pend_before - WHOLE))
    c.tp["left_scheduler"] = t_left if t_left is not None else t_dropped
    c.ev.release_ms = round(max(0.0, c.tp["left_scheduler"] - t_dropped) * 1000, 1)
    return c.verdict("dropped_in_queue")


def metrics_alone(c: TritonCase) -> CancelVerdict | None:
    """No server log: the model's count against the fewest and the most of its other requests (others_bounds), and
    when the request would have ended anyway. Out where the count is no more than the fewest before then; in where
    it is more than the most at the last reading before then (the grace's end, else its natural end)."""
    if c.has_log:
        return None
    natural, t_stop, grace_s = c.natural, c.t_stop, c.grace_s
    # from its send, the natural end is the soonest it could end: a reading answered before it shows a cancel's work;
    # from the tokens left at the stop, it is an estimate, and a reading within RACE_S of it may show its end
    cut = None if natural is None else natural if c.natural_from_send else natural - RACE_S
    if natural is not None and natural - t_stop <= RACE_S:
        c.ev.race = "the request was due to end with the stop"
        return c.verdict("due_to_end_with_stop")
    t_act, v_act = c.counted()
    bounds = c.others_bounds(t_act, c.counted_spans) if len(t_act) else None
    if bounds is None:
        return c.verdict("no_server_evidence")
    # the gauge cannot tell another client's request from this one: the traffic beside the run's held steady
    c.ev.assumes = ["traffic_beside_held_steady"]
    # the stretch a release must show in: the grace, up to the request's natural end
    until = t_stop + grace_s if natural is None else min(t_stop + grace_s, cut)
    return _fell_before_its_end(c, t_act, v_act, bounds, until, cut) or _counted_after(c, t_act, v_act, bounds, until)


def _fell_before_its_end(c: TritonCase, t_act: np.ndarray, v_act: np.ndarray, bounds: tuple, until: float,
                         cut: float | None) -> CancelVerdict | None:
    """metrics_alone's release: a reading in the stretch with the count no more than the fewest of the others."""
    natural, t_stop, (fewest, most) = c.natural, c.t_stop, bounds
    sel = (t_act >= t_stop) & (t_act <= t_stop + c.grace_s)
    # a reading with the request out, and none after it in the stretch with it surely in: one reading can miss a
    # request between the core's queue and the model's count (dequeued before the model counts it)
    surely_in = np.nonzero((v_act > most + WHOLE) & (t_act > t_stop) & (t_act < until))[0]
    out = np.nonzero(sel & (v_act <= fewest + WHOLE))[0]
    out = out[out > surely_in[-1]] if len(surely_in) else out
    out = [i for i in out if c.stays_out(int(i), until)]
    answered = t_act + c.counted_spans if c.natural_from_send else t_act
    if len(out) and (natural is None or answered[out[0]] < cut):
        i = int(out[0])
        c.tp["left_scheduler"] = float(t_act[i])
        c.ev.count_reading = c.count_reading(i, float(t_act[i]), v_act[i], fewest[i], most[i])
        if natural is None:
            return c.verdict("gauge_fell_end_unknown")
        return c.verdict("gauge_fell_before_natural_end", early_s=natural - t_act[i])
    return None


def _counted_after(c: TritonCase, t_act: np.ndarray, v_act: np.ndarray, bounds: tuple,
                   until: float) -> CancelVerdict:
    """metrics_alone's leak or doubt: the count at the last reading of the stretch against the most of the others."""
    natural, t_stop, grace_s, (fewest, most) = c.natural, c.t_stop, c.grace_s, bounds
    # the last reading before the request would have ended anyway, within the grace. One the core may have queued
    # to the stop has no end of its own to go by (it may end later, and a drop then is a release): the grace's end
    own_end = natural is not None and c.natural_latest - natural <= NATURAL_END_SPREAD_S
    until_in = until if own_end else t_stop + grace_s
    last = np.nonzero((t_act > t_stop) & (t_act < until_in))[0]
    if not len(last):
        return c.verdict("no_gauge_reading", until="its natural end" if until_in < t_stop + grace_s else "the grace's end")
    i = int(last[-1])
    c.ev.count_reading = c.count_reading(i, float(t_act[i]), v_act[i], fewest[i], most[i])
    if v_act[i] <= most[i] + 0.5:
        return c.verdict("gauge_within_others")
    if own_end:
        # the request was surely counted up to its natural end (or the end of the grace), then seen gone
        gone = np.nonzero((t_act >= natural - RACE_S) & (v_act <= fewest + WHOLE))[0]
        t_end = float(t_act[gone[0]]) if len(gone) else None
        if t_end is not None:
            c.tp["left_scheduler"] = t_end
        c.ev.kept_running_ms = round(((t_end if t_end is not None else t_stop + grace_s) - t_stop) * 1000, 1)
        return c.verdict("gauge_up_to_natural_end" if t_end is not None else "gauge_up_through_grace")
    if natural is not None:  # the core may have queued it: counted through the grace, whenever its own end was
        c.ev.kept_running_ms = round(grace_s * 1000, 1)
        return c.verdict("gauge_up_through_grace")
    t_steps, v_steps = c.series["steps"]
    steps_in = v_steps[(t_steps > t_stop + 0.5) & (t_steps <= t_stop + grace_s)] if len(t_steps) else np.array([])
    if len(steps_in) >= 2 and steps_in[-1] > steps_in[0]:
        return c.verdict("steps_kept_rising")
    return c.verdict("gauge_up_no_steps")


def canceled_rise_shared(c: TritonCase) -> CancelVerdict | None:
    """The core counted CANCELED drops of the model within the grace, no more than its other requests that may have
    been dropped by then can account for: whether this one was among them cannot be told."""
    if c.shared_drop is None or c.t_added is not None:
        return None
    c.ev.count_reading = c.shared_drop
    return c.verdict("canceled_rise_shared", others=int(c.shared_drop["others_most"]))


def never_named(c: TritonCase) -> CancelVerdict | None:
    return c.verdict("never_named") if c.t_added is None else None


def still_running(c: TritonCase) -> CancelVerdict:
    return c.verdict("still_running_at_end")


# after the shared guards, in order; the last always gives a verdict
EVIDENCE_RULES = (cancelled_first, ran_to_its_end, cancel_logged, dropped_in_queue, metrics_alone,
                  canceled_rise_shared, never_named, still_running)


def report_fields(run: Run) -> dict:
    """What a Triton run adds to its report document: the family, and the requests each side counted."""
    return {"engine": TRITON, "server_requests": server_request_counts(run)}


def server_request_counts(run: Run) -> list[dict]:
    """Per model: requests the ledger sent (request_sent events) against those the server counted (success
    plus failure of every reason, over the run). A server count above the ledger's is a silent resubmit."""
    ev = run.events
    if ev.empty:
        return []
    sent: dict[str, int] = {}
    for row in event_rows(run, "request_sent"):
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
                    "ok": counted <= sent[model] + WHOLE})
    return out
