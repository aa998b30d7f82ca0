"""When the engine was done with a request its client was still reading.

The ledger keeps a request in flight until its client closes it. A client that reads slowly, or a proxy
that buffers, closes long after the engine generated the last token: vLLM runs ahead of its readers and
writes no per-request finish line. Counted in flight all that time, such a request stands in, in the
ledger, for another the engine still holds, and hides it: a lost cancel beside a lagging neighbour reads
as "the server counts no more than the ledger".

The server's evidence ends it earlier: the scheduler's count falls, the engine's log names no abort
that could explain the fall, and from there the server keeps counting fewer requests than the ledger
(longer than any lag between a log line, a scrape and a client's close). One of the requests the ledger
still counts was then finished by the engine: the one whose tokens the engine would have made first
(requests in one batch step together, so the one admitted earliest with the fewest tokens to make). When
that is a request the client completed, the ledger ends it at that sample. When it could as well be
another (a cancelled request with no abort line that ran out its tokens, or any request finishing within
a second of it), when a request waited in the queue on the way (it ran later than its admission says),
or when the fall is not exactly the sequences of the requests picked (an n>1 request's children end
apart), nothing is moved: which left cannot be told, and the verdict keeps the ledger's reading.

Only where the log names every request of the target (Added lines, no request the ledger does not
know): without it a fall may be an unlogged abort or other traffic ending.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from cancelwatch.analysis.bounds import AMBIGUOUS_S, PERSIST_PERIODS, PERSIST_S, WHOLE



@dataclass
class _Row:
    rid: str
    n: int
    t_in: float  # entered the engine (its Added line, else its send)
    t_out: float  # the ledger's end: its close, or for a cancelled request the evidence's (gone_at)
    completed: bool  # the client got it to its end (no cancel)
    tokens: float  # tokens per sequence the engine had to make (inf: unknown)


def _rows(ledger: list, t0_ns: int, gone_at: dict[str, float], added_at: dict[str, float]) -> list[_Row]:
    rows = []
    for r in ledger:
        if pd.isna(r.sent_mono_ns):
            continue
        t_in = max((r.sent_mono_ns - t0_ns) / 1e9, added_at.get(r.request_id, -math.inf))
        t_out = gone_at.get(r.request_id)
        if t_out is None:
            t_out = math.inf if pd.isna(r.closed_mono_ns) else (r.closed_mono_ns - t0_ns) / 1e9
        n = 1 if pd.isna(getattr(r, "n", 1)) else int(getattr(r, "n", 1))
        # a ledger written by hand (or by an older recorder) may lack a column: unknown, never a guess
        completed = getattr(r, "terminal_state", None) == "completed" and pd.isna(getattr(r, "cancel_mono_ns", None))
        chunks, max_tokens = getattr(r, "chunks", None), getattr(r, "max_tokens", None)
        # the driver asks for max_tokens with ignore_eos: a completed request made exactly that many a
        # sequence (its chunks can be fewer: a slow reader gets deltas merged); without it, its chunks.
        # How long the engine needed unknown: counted, never taken for the first to have finished
        if not pd.isna(max_tokens) and max_tokens:
            tokens = float(max_tokens)
        elif completed and not pd.isna(chunks) and chunks:
            tokens = float(int(chunks) // max(n, 1))
        else:
            tokens = math.inf
        rows.append(_Row(r.request_id, n, t_in, t_out, completed, tokens))
    return rows


def tokens_per_s(times: np.ndarray, running: np.ndarray, gen: np.ndarray) -> float | None:
    """Tokens a running sequence gets per second: generation_tokens_total's rise over the sequences the
    scheduler ran, over the run's intervals with something running."""
    ok = ~(np.isnan(running[:-1]) | np.isnan(gen[:-1]) | np.isnan(gen[1:]))
    dt, dg, run_ = np.diff(times)[ok], np.diff(gen)[ok], running[:-1][ok]
    busy = (run_ >= 1) & (dg >= 0) & (dt > 0)
    seq_s = float((run_[busy] * dt[busy]).sum())
    return float(dg[busy].sum()) / seq_s if seq_s > 0 and dg[busy].sum() > 0 else None


def solo_tokens_per_s(times: np.ndarray, running: np.ndarray, waiting: np.ndarray, gen: np.ndarray,
                      min_span_s: float = 0.3) -> float | None:
    """The tokens a second one sequence gets running alone: generation_tokens_total's rise over the
    fastest stretch of at least `min_span_s` with exactly one request running and none waiting. No
    sequence in a batch runs faster than one alone (a step serves them all), and other traffic's
    prefills only slow steps down: an upper bound of every sequence's rate in the run, however busy."""
    alone = (running == 1) & (np.nan_to_num(waiting) == 0) & ~np.isnan(gen)
    best = None
    i = 0
    while i < len(times):
        if not alone[i]:
            i += 1
            continue
        j = i
        while j + 1 < len(times) and alone[j + 1] and gen[j + 1] >= gen[j]:
            j += 1
        # within one stretch alone, every sub-stretch of min_span_s or more
        for a in range(i, j + 1):
            b = int(np.searchsorted(times, times[a] + min_span_s, side="left"))
            if b <= j:
                rate = (gen[b] - gen[a]) / (times[b] - times[a])
                best = rate if best is None or rate > best else best
        i = j + 1
    return best if best and best > 0 else None


def engine_done_at(ledger: list, t0_ns: int, sched: dict[str, np.ndarray], period_s: float,
                   gone_at: dict[str, float], added_at: dict[str, float], abort_times: np.ndarray,
                   abort_slack_s: float) -> dict[str, float]:
    """Request id -> the sample from which the engine no longer held a request its client completed
    later: the server's count fell there with no abort line within `abort_slack_s` of the fall, and
    stayed below the ledger's. `ledger`: its rows (analysis.rows.frame_rows). `gone_at`, `added_at`: the
    ledger's ends of cancelled requests and the log's admissions, as ledger_inflight reads them; `abort_times`:
    every abort line of the target."""
    times, count = sched["t_s"], sched["count"]
    rate = tokens_per_s(times, count - np.nan_to_num(sched["waiting"]), sched["gen_tokens"])
    rows = _rows(ledger, t0_ns, gone_at, added_at)
    if rate is None or not any(r.completed for r in rows) or len(times) < 3:
        return {}
    done: dict[str, float] = {}
    persist_s = max(PERSIST_S, PERSIST_PERIODS * period_s)

    # each row's span as arrays, its end moved where it is found done: a day's run has thousands of rows and
    # hundreds of falls, and a loop over the rows for each fall cost seconds (bench/dashboard.py at 24 h)
    t_in = np.array([r.t_in for r in rows], dtype=float)
    t_out = np.array([r.t_out for r in rows], dtype=float)
    seqs_of = np.array([r.n for r in rows], dtype=float)
    at = {r.rid: k for k, r in enumerate(rows)}

    def inflight(t: np.ndarray) -> np.ndarray:
        if not len(t):
            return np.zeros(0)
        near = np.nonzero((t_in <= t.max()) & (t_out > t.min()))[0]  # the rows that overlap these instants
        inside = (t[:, None] >= t_in[near]) & (t[:, None] < t_out[near])
        return inside.astype(float) @ seqs_of[near]

    valid = np.nonzero(~np.isnan(count))[0]
    # the falls of the count, between consecutive readings, found at once, and each read on its own stretch (the
    # readings are in order): an hour's run holds 70 000 readings
    at_valid = times[valid]
    for k in np.flatnonzero(count[valid[:-1]] - count[valid[1:]] >= WHOLE) + 1:
        i, h = valid[k], valid[k - 1]
        fell = count[h] - count[i]
        if len(abort_times) and np.any((abort_times > times[h] - abort_slack_s) & (abort_times <= times[i] + abort_slack_s)):
            continue  # an abort explains the fall, or its line lags it
        ahead = valid[np.searchsorted(at_valid, times[i], side="left"):
                      np.searchsorted(at_valid, times[i] + persist_s, side="right")]
        if times[valid[-1]] < times[i] + persist_s:
            continue  # the run ends before the fall is shown to last
        short = int(round(min(fell, -np.max(count[ahead] - inflight(times[ahead])))))
        if short < 1:
            continue
        # in the engine at the sample before the fall, and still counted by the ledger after it
        there = [rows[k] for k in np.nonzero((t_in <= times[h]) & (t_out > times[i]))[0]]
        if not there:
            continue
        # a request that waited ran later than its admission says: which would finish first is unknown
        span = slice(np.searchsorted(times, min(r.t_in for r in there), side="left"),
                     np.searchsorted(times, times[i], side="right"))
        if np.nan_to_num(sched["waiting"][span]).max(initial=0.0) >= WHOLE:
            continue
        for r in _which_left(there, short, rate):
            done[r.rid] = float(times[i])
            t_out[at[r.rid]] = float(times[i])
    return done


def _which_left(there: list, short: int, rate: float) -> list:
    """Of the requests in the engine before a fall of `short` sequences, the ones the engine would have finished
    first at `rate`: exactly those sequences, each a request the client completed, with a clear gap to the next
    one the engine would finish; else which left cannot be told, and none (nothing is moved)."""
    there = sorted(there, key=lambda r: r.t_in + r.tokens / rate)
    chosen, seqs = [], 0
    for r in there:
        if seqs >= short:
            break
        chosen.append(r)
        seqs += r.n
    rest = there[len(chosen):]
    last = max(r.t_in + r.tokens / rate for r in chosen)
    if seqs != short or not all(r.completed for r in chosen) or math.isinf(last):
        return []
    if rest and rest[0].t_in + rest[0].tokens / rate < last + AMBIGUOUS_S:
        return []
    return chosen
