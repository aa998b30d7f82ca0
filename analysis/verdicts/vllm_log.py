"""What the vLLM rules read besides the samples: the engine's request log (its Added and abort lines, by the
ledger's ids), the hops' trace events, and where the run could not see (its gaps, its scrapes' spans)."""

from __future__ import annotations

import json
import math
from collections import Counter

import numpy as np
import pandas as pd

from cancelwatch.analysis.rows import event_rows, ledger_rows
from cancelwatch.analysis.series import sample_period
from cancelwatch.analysis.verdicts.core import LOG_SLACK_S, engine_log_state
from cancelwatch.analysis.verdicts.engine_done import engine_done_at
from cancelwatch.analysis.verdicts.log_clock import LogClock, log_evidence
from cancelwatch.analysis.verdicts.log_ids import LogIds
from cancelwatch.runstore.reader import Run
ENGINE_LOG = "engine_log"  # the source name of the engine log's gaps (collectors/sources/engine_log.py)
NAMES_NO_REQUESTS = "the engine log names no requests"


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
    notes = []
    stops = len(run.events_of("user_stop"))
    lines = run.events_of("engine_added", "engine_aborted")
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
    return run.events_of(kind)


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
        for row in event_rows(run, "engine_log_gap"):
            data = json.loads(row.data)
            self.losses.append((data.get("target"), (float(data.get("from_mono_ns") or t0) - t0) / 1e9,
                                float(row.t_s), data.get("why")))
        for row in event_rows(run, "engine_added", "engine_aborted"):
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
        if any(tgt == target and off_lo <= offset <= off_hi for tgt, off_lo, off_hi in run.log_offsets_read):
            offset = 0.0  # a window read its lines where their stamps put them: they cover its span (load_window)
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

    def done_with(self, run: Run, target: str | None, sched: dict[str, np.ndarray],
                  gone_at: dict[str, float], added: dict[str, float]) -> dict[str, float]:
        """Completed requests the engine was done with before their client closed them (engine_done.py):
        only where this log names every request of the target."""
        if not self.names_requests(target) or self.foreign.get(target):
            return {}
        aborts = [(x, rid) for (tgt, rid), xs in self.aborted.items() if tgt == target for x in xs]
        slack = max([LOG_SLACK_S] + [self.resolution_of(target, rid) for _, rid in aborts])
        self.ended_early[target] = engine_done_at(
            ledger_rows(run), run.info["started_mono_ns"], sched, sample_period(run, sched["t_s"]), gone_at, added,
            np.array([x for x, _ in aborts], dtype=float), slack)
        return self.ended_early[target]


def _trace_events(run: Run) -> dict[tuple[str, str], tuple[float, str]]:
    """(kind, cancel id) -> (first instant, source) of the driver's trace events. Events of runs
    recorded before sources were written carry none: on HTTP paths those were the client's own stamps."""
    trace: dict[tuple[str, str], tuple[float, str]] = {}
    for row in event_rows(run, "app_received", "engine_abort", "client_closed"):
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
    mine = gaps["target"].to_numpy(dtype=object) == target if target is not None and "target" in gaps \
        else np.zeros(len(gaps), bool)
    return _Gaps({c: (gaps[c].to_numpy(dtype=float if c.endswith("t_s") else object) if c in gaps
                      else np.full(len(gaps), None, dtype=object))[mine] for c in _Gaps.COLUMNS})


def _gaps_over(gaps: _Gaps, t_from: float, t_to: float) -> _Gaps:
    """Those of a target's `gaps` that overlap [t_from, t_to]."""
    return gaps[(gaps["t_s"] <= t_to) & (gaps["end_t_s"] >= t_from)]


def _outage_end(gaps: _Gaps, t_from: float, t_to: float) -> float:
    """The end of the last scrape outage of a target's `gaps` that overlaps [t_from, t_to]; -inf without one."""
    outages = _gaps_over(gaps, t_from, t_to)
    outages = outages[outages["kind"] == "error"] if len(outages) else outages
    return float(outages["end_t_s"].max()) if len(outages) else -math.inf
