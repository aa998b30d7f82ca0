"""Who is in the engine at each sample, as the evidence bounds it: the ledger's requests each counted from its entry
(its Added line, else its send) to where it left (its abort, its client's close, where the engine was done with it,
an idle engine, the count's surplus letting the lost ones go oldest first), per target, once per run."""

from __future__ import annotations

import json
import math
from typing import NamedTuple

import numpy as np
import pandas as pd

from cancelwatch.analysis.bounds import ENTER_S, LAG_S, SURPLUS_HOLD_S, WHOLE
from cancelwatch.analysis.ghosts import EngineReading, Ghosts
from cancelwatch.analysis.rows import event_rows
from cancelwatch.analysis.series import scheduler_columns, scrape_spans
from cancelwatch.analysis.verdicts.core import LOG_SLACK_S, engine_log_state
from cancelwatch.analysis.verdicts.engine_done import solo_tokens_per_s
from cancelwatch.analysis.verdicts.requests import Requests, quiet_instants, requests_of, weighted_between
from cancelwatch.analysis.verdicts.vllm_log import _EngineLog, _Gaps, _target_gaps, _trace_events
from cancelwatch.runstore.reader import Run
from cancelwatch.runstore.records import WATCHED_SCENARIO

CLIENT_CHUNKS = "client_chunks_total"  # collectors/sources/clients.py's METRIC: analysis imports no collector


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


def _gone_at(run: Run, stops: list, englog: _EngineLog, trace: dict,
             target_of) -> tuple[dict[str, float], frozenset[str]]:
    """Request id -> instant it left the engine as far as the evidence goes: the engine log's abort,
    else the relay's; where the log was read and shows no abort, the request may still be there. And the
    stopped requests with no abort at all (neither the log's nor the relay's)."""
    gone_at: dict[str, float] = {}
    unaborted = set()
    ends = np.sort(np.array([row.t_s for row in event_rows(run, "scenario_end")], dtype=float))
    for row in stops:
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
        self.stops = event_rows(run, "user_stop")  # the stops' rows, in the events' order
        self.trace = _trace_events(run)
        self.englog = _EngineLog(run, set(run.ledger["request_id"]) if not run.ledger.empty else set())
        self.reqs = requests_of(run.ledger, self.t0)
        self.quiet_s = quiet_instants(self.reqs)  # of the ledger alone: the same for every target and pass
        self.evidence_gone, self.unaborted = _gone_at(run, self.stops, self.englog, self.trace, self.target_of)
        self.stopped = {s.request_id: (float(s.t_s), self.target_of(json.loads(s.data)))
                        for s in self.stops}
        self.evidence: dict = {}  # target -> _TargetEvidence
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
            base = self._evidence(target)
            cols, added, entered, not_entered, within = (base.cols, base.added, base.entered, base.not_entered,
                                                         base.within)
            times = cols["t_s"]
            gone = _gone_by_idle(self.gone_at, self.stopped, target, cols, entered, within)
            ends = {**gone, **englog.done_with(run, target, cols, gone, added)} if len(times) else gone
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
                    ends = {**gone, **englog.done_with(run, target, cols, gone, added)}
            inflight = ledger_inflight(ledger, self.t0, times, ends, added, not_entered, self.reqs) if len(times) \
                else np.array([])
            self.frames[target] = _Frame(cols, inflight, base.solo, ends, not_entered, gone, assumed, self.reqs,
                                         base.added_s, base.aborted_s, base.gaps, self.reqs.ends(ends),
                                         base.delivered, self.quiet_s)
        return self.frames[target]

    def _evidence(self, target: str | None) -> _TargetEvidence:
        """What a target's frame reads that no verdict changes (its scheduler, the log's entries, the gaps): built
        once, though the frames are made anew each pass (told)."""
        if target not in self.evidence:
            run, ledger, englog = self.run, self.run.ledger, self.englog
            sched = scheduler_columns(run, target)
            added = self.added(target)
            cols = {c: sched[c] for c in ("t_s", "count", "waiting", "kv", "gen_tokens", "prefix_hits", "preemptions",
                                          "finished")}
            cols["scrape_s"] = scrape_spans(run, target, cols["t_s"], "vllm")
            settled = _settled(cols["gen_tokens"])
            cols["step_s"] = np.where(settled >= 0, cols["t_s"][np.maximum(settled, 0)], -math.inf)
            within = LOG_SLACK_S + englog.entry_doubt_s(target) + ENTER_S
            solo = solo_tokens_per_s(cols["t_s"], cols["count"] - np.nan_to_num(cols["waiting"]), cols["waiting"],
                                     cols["gen_tokens"]) if len(cols["t_s"]) else None
            self.evidence[target] = _TargetEvidence(
                cols, added, self.entered(target, added, within), englog.not_entered(run, ledger, target), within, solo,
                self.reqs.per_row(englog.added, target, math.nan), self.reqs.per_row(englog.aborted, target, math.inf),
                _target_gaps(run, target), _delivered(run, target))
        return self.evidence[target]


class _TargetEvidence(NamedTuple):
    """A target's frame's parts that do not depend on where the lost requests left (_RunFrames._evidence)."""

    cols: dict[str, np.ndarray]
    added: dict
    entered: dict
    not_entered: frozenset[str]
    within: float  # how long after its Added line a request is surely counted
    solo: float | None
    added_s: np.ndarray
    aborted_s: np.ndarray
    gaps: object
    delivered: object


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


class _Frame(NamedTuple):
    """One target's scheduler and the ledger against it, shared by every cancel judged on that target."""

    cols: dict[str, np.ndarray]  # the scheduler frame: t_s, count, waiting, kv, gen_tokens, ...
    inflight: np.ndarray  # the ledger's sequences in the engine at each sample (ledger_inflight)
    solo_rate: float | None  # tokens/s of one sequence running alone, the fastest in the frame (VllmCase.pace)
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
    # the chunks that reached the run's clients of this target by each instant (collectors/sources/clients.py):
    # (instants, counts) in time order; None where the run did not count them (a watch, a run before the count)
    delivered: tuple[np.ndarray, np.ndarray] | None
    quiet_s: np.ndarray  # requests.quiet_instants: no request of the run open there


def _delivered(run: Run, target: str | None) -> tuple[np.ndarray, np.ndarray] | None:
    t, v = (a.astype(float) for a in run.series_arrays(CLIENT_CHUNKS, ("t_s", "value"), target))
    if not len(t):
        return None
    order = np.argsort(t, kind="stable")
    return t[order], v[order]


def _settled(gen: np.ndarray) -> np.ndarray:
    """VllmCase.settled over the samples of `gen` (generation_tokens_total)."""
    rises = np.nonzero(gen[1:] > gen[:-1])[0] + 1
    k = np.searchsorted(rises, np.arange(len(gen)), side="right")
    out = np.full(len(gen), -1)
    two = k >= 2
    out[two] = rises[k[two] - 2] - 1
    return out


def ends_beyond_the_run(run: Run) -> str | None:
    """Where the engine ended more requests by themselves (vllm:request_success_total by finish reason: stop, length;
    never an abort) than the run's requests and those it held at its first sample could: requests the run did not see
    reached the engine, and a count read as the run's alone may hold them. vLLM counts an end per sequence (an n>1
    request's children each end), as the ledger counts its sequences; a counter that fell (a restart) counts from its
    next rise. Said only where the ledger says how many engine requests each of its requests made, the driver's (a
    watch's row may stand for a batch of prompts, a beam search or a tool's calls, each an engine request of its own),
    on a run of one target (another replica's users are not this one's traffic), read at full resolution (an
    overview's bucket shows its lowest value first: a restart inside it reads as the counter's whole life). None
    elsewhere, and where the run's evidence does not say so."""
    targets, ledger = run.info.get("targets") or [], run.ledger
    if run.info.get("overview") is not None or len(targets) > 1 or not len(ledger) or \
            ("scenario" in ledger and (ledger["scenario"] == WATCHED_SCENARIO).any()):
        return None
    target = targets[0]["label"] if targets else None
    cols = scheduler_columns(run, target)  # the own-ends counter beside the gauges, read once
    fin, count = cols["finished"][~np.isnan(cols["finished"])], cols["count"]
    if len(fin) < 2 or not len(count) or np.isnan(count[0]):
        return None
    ended = float(np.clip(np.diff(fin), 0.0, None).sum())
    could = float(requests_of(ledger, run.info["started_mono_ns"]).seqs.sum()) + float(count[0])
    if ended <= could + WHOLE:
        return None
    return (f"the engine ended {ended:.0f} request(s) by themselves (vllm:request_success_total: stop, length), more "
            f"than the {could:.0f} the run sent or found in the engine when it began")
