"""The run's requests as the vLLM model reads them: one row per ledger request, its instants in seconds since the
run started, as arrays. Built once per run (and the log's word once per target), so that judging a cancel reads
only the rows whose stay in the engine can touch its stretch: an hour's run holds thousands of requests and
hundreds of cancels, and reading every row for every cancel made judging it whole quadratic."""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import pandas as pd

from cancelwatch.runstore.records import WATCHED_SCENARIO


class Requests(NamedTuple):
    ids: np.ndarray  # the client's request ids (object)
    row: dict[str, int]  # request id -> its row
    seqs: np.ndarray  # sequences the server runs for each (the n of a completion)
    sent: np.ndarray  # NaN: never sent
    first: np.ndarray  # its first token at its client; inf: none
    closed: np.ndarray  # its client done with it; NaN: still open
    cancel: np.ndarray  # its client's cancel; NaN: none
    completed: np.ndarray  # its client read it to its end
    bounded: np.ndarray  # the driver's (ignore_eos): it runs to max_tokens unless stopped
    scenario: np.ndarray  # object
    max_tokens: np.ndarray  # NaN: not known

    def ends(self, ends: dict[str, float], fallback: np.ndarray | None = None) -> np.ndarray:
        """Per row: where the ledger stops counting it: its end in `ends` (an abort, where the evidence puts a lost
        request's leaving), else `fallback` (default: its client's close; inf while open)."""
        out = np.nan_to_num(self.closed, nan=math.inf) if fallback is None else fallback.copy()
        for rid, t in ends.items():
            i = self.row.get(rid)
            if i is not None:
                out[i] = t
        return out

    def per_row(self, by_id: dict[str, list[float]], target: str | None, default: float) -> np.ndarray:
        """Per row: the first instant `by_id` holds for (target, its id) (the log's Added or abort lines);
        `default` where none."""
        out = np.full(len(self.ids), default)
        for (tgt, rid), ts in by_id.items():
            i = self.row.get(rid)
            if tgt == target and i is not None and ts:
                out[i] = min(ts)
        return out


def requests_of(ledger: pd.DataFrame, t0_ns: int) -> Requests:
    def secs(col: str) -> np.ndarray:
        return (ledger[col].to_numpy(dtype=float, na_value=np.nan) - t0_ns) / 1e9 if col in ledger \
            else np.full(len(ledger), math.nan)

    def text(col: str) -> np.ndarray:  # a missing value (None, NaN, pd.NA) as None
        if col not in ledger:
            return np.full(len(ledger), None, dtype=object)
        values = ledger[col].to_numpy(dtype=object)
        return np.where(pd.isna(values), None, values)

    ids = ledger["request_id"].to_numpy(dtype=object) if "request_id" in ledger else np.array([], dtype=object)
    seqs = ledger["n"].to_numpy(dtype=float, na_value=np.nan) if "n" in ledger else np.ones(len(ledger))
    seqs = np.where(np.isnan(seqs), 1.0, np.floor(seqs))
    max_tokens = ledger["max_tokens"].to_numpy(dtype=float, na_value=np.nan) if "max_tokens" in ledger \
        else np.full(len(ledger), math.nan)
    scenario = text("scenario")
    completed = text("terminal_state") == "completed"
    with np.errstate(invalid="ignore"):
        bounded = (scenario != WATCHED_SCENARIO) & (max_tokens > 0)
    return Requests(ids=ids, row={rid: i for i, rid in enumerate(ids)}, seqs=seqs, sent=secs("sent_mono_ns"),
                    first=np.nan_to_num(secs("first_token_mono_ns"), nan=math.inf), closed=secs("closed_mono_ns"),
                    cancel=secs("cancel_mono_ns"), completed=completed, bounded=bounded, scenario=scenario,
                    max_tokens=max_tokens)


def in_between(times: np.ndarray, start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Rows x samples: start <= t < end."""
    return (times >= start[:, None]) & (times < end[:, None])


def weighted_between(times: np.ndarray, start: np.ndarray, end: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Per instant t of `times` (sorted): the weights of the rows with start <= t < end, without a rows x samples
    matrix (a whole run's frame is tens of thousands of samples)."""
    keep = start < end  # NaN compares False: a row never sent counts nowhere
    start, end, weights = start[keep], end[keep], weights[keep]
    return sum_through(times, start, weights) - sum_through(times, end, weights)


def sum_through(times: np.ndarray, at: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Per instant of `times`: the weights of the instants `at` at or before it."""
    order = np.argsort(at, kind="stable")
    cum = np.concatenate(([0.0], np.cumsum(weights[order])))
    return cum[np.searchsorted(at[order], times, side="right")]


def quiet_instants(reqs: Requests) -> np.ndarray:
    """The instants, sorted, at which none of the ledger's requests was open (sent, its client not done with it):
    the sends that found every earlier request closed. From such an instant on, every token that reaches a client of
    the run is one the engine made after it (a client that is done with its request reads nothing more)."""
    sent, closed = reqs.sent, np.nan_to_num(reqs.closed, nan=math.inf)
    live = ~np.isnan(sent)
    sent, closed = sent[live], closed[live]
    order = np.argsort(sent, kind="stable")
    sent, closed = sent[order], closed[order]
    if not len(sent):
        return np.array([])
    # the latest close among the requests sent before each one (requests sent at the same instant start together)
    before = np.concatenate(([-math.inf], np.maximum.accumulate(closed)[:-1]))
    first_of_instant = np.concatenate(([True], sent[1:] > sent[:-1]))
    return sent[first_of_instant & (before <= sent)]


class Stays(NamedTuple):
    """Requests' stays in a server as the evidence bounds them, one row each: surely inside over [surely_from,
    surely_to), maybe inside over [maybe_from, maybe_to) (which holds the first). At each instant the server can
    count no fewer than the sure ones and no more than the maybes; the rows between are the requests that keep a
    count's reading open, each with its reason (OPEN_REASONS in evidence.py): `before` while it may not be counted
    yet, `after` once it may have left. Triton's count readings are read on them (TritonCase.others_bounds)."""

    ids: np.ndarray  # object
    weights: np.ndarray  # what each counts for (a completion's sequences)
    surely_from: np.ndarray
    surely_to: np.ndarray
    maybe_from: np.ndarray
    maybe_to: np.ndarray
    before: np.ndarray  # object: the reason it may not be counted yet
    after: np.ndarray  # object: the reason it may have left

    def inside(self, lo, hi) -> tuple[np.ndarray, np.ndarray]:
        """Rows x readings, each reading held over [lo, hi] (a scrape answered over a span): (surely inside
        throughout, maybe inside at some instant)."""
        lo, hi = np.atleast_1d(lo), np.atleast_1d(hi)
        surely = (self.surely_from[:, None] <= lo) & (hi < self.surely_to[:, None])
        maybe = (self.maybe_from[:, None] <= hi) & (lo < self.maybe_to[:, None])
        return surely, maybe

    def change(self, base_lo: float, base_hi: float, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per reading over [lo, hi]: (the least, the most) the rows' weight inside can have changed by since a
        reading over [base_lo, base_hi]. Each row has one stay: inside at the base and not at the reading, it
        left (-1); outside at the base and inside at the reading, it entered, which only one not surely inside yet
        at the base can have done (+1)."""
        a_min, a_max = (m[:, 0] for m in self.inside(base_lo, base_hi))
        c_min, c_max = self.inside(lo, hi)
        a_min, a_max = a_min[:, None], a_max[:, None]
        d_min = c_min.astype(float) - a_max
        d_max = c_max.astype(float) - a_min
        # in at the reading and out at the base: entered since, unless it had been in and left before the base. Only
        # where the reading surely came after the base: a slow scrape's reading can be answered after a later one's
        after = (np.atleast_1d(lo) >= base_hi)[None, :]
        entered = (c_max & ~a_min) & ~(base_lo < self.surely_from)[:, None] & after
        stays_put = (a_max & c_max) | (~a_min & ~c_min)
        d_max = np.where(entered & stays_put, 0.0, d_max)
        w = self.weights
        return w @ d_min, w @ d_max

    def open_at(self, lo: float, hi: float | None = None) -> list[dict]:
        """The rows that may be inside over [lo, hi] but are not surely: {request_id, reason}."""
        surely, maybe = self.inside(lo, lo if hi is None else hi)
        out = []
        for i in np.nonzero(maybe[:, 0] & ~surely[:, 0])[0]:
            out.append({"request_id": str(self.ids[i]), "reason": self.before[i] if lo < self.surely_from[i]
                        else self.after[i]})
        return out
