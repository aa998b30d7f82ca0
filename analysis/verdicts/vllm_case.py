"""One vLLM cancel read against the model of who is in the engine (vllm_frames.py): its stretch of the scheduler,
the ledger's requests beside it, and what the count can and cannot say at each sample."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

import numpy as np
import pandas as pd

from cancelwatch.analysis.bounds import BASELINE_S, BEFORE_S, ENTER_S, LAG_S, PACE_MARGIN, READ_BACK_S, WHOLE
from cancelwatch.analysis.evidence import Evidence
from cancelwatch.analysis.verdicts.core import (
    ASSUMED_LEFT_RULES, COUNT_READING_RULES, HORIZON_S, LOG_SLACK_S, NO_APP, NO_LOG, NO_LOG_COUNT_RULES, RACE_TOKENS,
    CancelVerdict, Case, engine_log_state, first_probe_s
)
from cancelwatch.analysis.verdicts.requests import Requests, in_between, sum_through, weighted_between
from cancelwatch.analysis.verdicts.vllm_frames import _Frame, _pool_blocks, _settled
from cancelwatch.analysis.verdicts.vllm_log import _EngineLog, _Gaps, _gaps_over, _log_holes, _outage_end
from cancelwatch.runstore.reader import Run
from cancelwatch.runstore.records import WATCHED_SCENARIO


class _Baseline(NamedTuple):
    before: np.ndarray  # per sample of the case's stretch: in the second before the stop
    count_before: float | None  # the server's count at the last of them (Evidence.count_before); None when none
    ledger_before: float | None  # the ledger's sequences in the server there (Evidence.ledger_before)
    kv_before: float  # KV usage at the last of them; NaN when none
    # the server counted fewer requests than the ledger there, and not only by other requests with no token at
    # their clients yet (the engine may not count them yet): the engine ran ahead of a client, maybe this one's.
    # Where it did not, this request surely held KV there
    ahead: bool


class _Kept(NamedTuple):
    """VllmCase.kept_at_grace_end."""
    excess: np.ndarray  # per sample of the grace: the count beyond the ledger's others and their unseen ends
    at_end: int  # the grace's last refreshed sample, in `excess` (-1: none refreshed)
    i: int | None  # that sample in the stretch (None: no sample in the grace)
    read_at: int | None  # where the excess is read: i, or the first sample past it whose gauges hold those ends
    value: float | None  # the excess there
    stepping: bool  # generation_tokens_total rose across the grace
    generated: float | None  # by how much


class _LedgerRows(NamedTuple):
    """VllmCase.ledger_rows: the ledger's requests with no first token at the stretch's start."""
    ids: np.ndarray
    seqs: np.ndarray  # sequences the server runs for each
    counted: np.ndarray  # rows x samples: where the ledger counts it in the engine (as ledger_inflight does)
    first: np.ndarray  # when its first token reached its client (inf: never)
    added: np.ndarray  # its first Added line (-inf: none)
    sent: np.ndarray  # when its client sent it


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
    hits_at_admission: float | None = None  # prefix-cache hit tokens while it was admitted (None: unknown)
    frame_cols: dict = field(default_factory=dict)  # the target's whole scheduler frame (sched is its stretch)
    solo_rate: float | None = None  # _Frame.solo_rate
    # request id -> where the ledger stops counting it, when not its client's close (ledger_inflight)
    ledger_ends: dict[str, float] = field(default_factory=dict)
    assumed_gone: dict[str, float] = field(default_factory=dict)  # _Frame.assumed_gone
    not_entered: frozenset[str] = frozenset()  # the ledger's requests the log shows never entered
    app_answer: str | None = None  # what the app answered an explicit cancel (None: no explicit cancel)
    assumed: set = field(default_factory=set)  # codes of ASSUMPTIONS the readings so far rest on (Evidence.assumes)
    reqs: Requests | None = None  # the ledger as arrays (_Frame.reqs), and per row the log's word on this target:
    added_s: np.ndarray | None = None  # its first Added line (NaN: none)
    aborted_s: np.ndarray | None = None  # its first abort line (inf: none)
    gaps: "_Gaps | None" = None  # the run's gaps of this target
    # per row of reqs: where the ledger stops counting the request (ledger_ends, else its client's close; inf while
    # open), as at this cancel's turn (_Frame.ends_s)
    ends_s: np.ndarray | None = None
    delivered: tuple[np.ndarray, np.ndarray] | None = None  # _Frame.delivered
    quiet_s: np.ndarray | None = None  # _Frame.quiet_s

    @cached_property
    def baseline(self) -> _Baseline:
        """The stretch before the stop (BASELINE_S), read once (every verdict reports it: `verdict`)."""
        times = self.sched["t_s"]
        before = (times >= self.t_stop - BASELINE_S) & (times < self.t_stop)
        count_before = float(self.sched["count"][before][-1]) if before.any() else None
        ledger_before = float(self.inflight[before][-1]) if before.any() else None
        kv_before = float(self.sched["kv"][before][-1]) if before.any() else math.nan
        ahead = False
        if count_before is not None and ledger_before is not None:
            b = np.nonzero(before)[0][-1]
            rows = self.ledger_rows
            # below the ledger's by the requests the engine may not count yet alone (entering_rows) whose first token
            # then reached their client within the grace (from then the count holds them: one that never showed one
            # may stay uncounted, and a kept request stand in its place to the grace's end): none ran ahead, unless
            # this one is one of them, or the engine ended one by itself unread, in the stretch or before it, that
            # may stand in its place
            this = rows.ids == self.rid
            entering = float(rows.seqs[~this & self.entering_rows[:, b] & (rows.first <= self.t_end)].sum())
            unsure = entering > WHOLE and count_before >= ledger_before - entering - WHOLE
            maybe_uncounted = bool((rows.counted[this, b] & (rows.first[this] > self.sched["t_s"][b])).any()) \
                or self.rid in self.not_entered
            not_yet_counted = unsure and not maybe_uncounted and self.ends_unread is not None \
                and self.ends_unread[b] < WHOLE
            ahead = count_before < ledger_before - WHOLE and not not_yet_counted
        return _Baseline(before, count_before, ledger_before, kv_before, ahead)

    @property
    def pace(self) -> float | None:
        """The fastest a sequence can run, tokens/s: PACE_MARGIN times the fastest one sequence went alone in the
        frame (solo_tokens_per_s: no sequence in a batch runs faster than one alone). The whole run's frame when it is
        judged whole, the window's in a watch: the fastest over more of the run is the safer bound (a review built
        false releases from the pace of the cancel's own few seconds: a starved host, a long prompt slowing every step
        there). None where none ran alone: nothing bounds it."""
        return None if self.solo_rate is None else PACE_MARGIN * self.solo_rate

    @cached_property
    def runs_out_from(self) -> np.ndarray:
        """Per row of reqs: the earliest the engine could have ended the request by itself. The driver's (ignore_eos)
        only once its max_tokens are made at the pace, from its send; any other from its send; the driver's where
        nothing bounds the pace (-inf)."""
        r, rate = self.reqs, self.pace
        out = r.sent.copy()
        out[r.bounded] = r.sent[r.bounded] + r.max_tokens[r.bounded] / rate if rate else -math.inf
        return out

    @cached_property
    def ends_unread(self) -> np.ndarray | None:
        """Per sample of the stretch: at most how many of the other requests the ledger counts there the engine had
        ended by themselves (vllm:request_success_total: stop, length; never an abort), their clients still reading
        (a slow reader, a hop that buffers). Read from the send of the oldest request the ledger holds open at the
        stretch's first sample (back no further than a cancel's window reaches, BEFORE_S less a scrape's period: a
        window and the whole run read alike): each end the counter shows since, as the gauges hold it (an end the
        API server counts a step before the engine drops its request, a stop string's, is no room yet), less those
        the completed requests' closes read. Each close reads its own ends, one per sequence, and no end is read
        twice; which end is whose is paired from READ_BACK_S before, so that a close just inside reads its own end
        counted just before. A request sent since then reads ends counted after its send and before its close (its
        own are among them, whenever they came: a slow reader's too); one sent before reads only its last
        sequence's end, within LAG_S of its close (an end reaches its client within LAG_S; a slow reader older than
        that is what the bounded look-back does not see). The ends left unread by a sample have at most as many
        owners as the other requests the ledger counts there that were sent, and could have run out
        (runs_out_from), before the latest of them. Above zero, a count at the ledger's may hold a kept request in
        the place of one the engine had ended (a slow reader: its end at 0.8 s, its close at 4 s, a stop at 2 s).
        None where the engine does not say why its requests ended."""
        pairing = self.ends_paired
        if pairing is None:
            return None
        times, r = self.sched["t_s"], self.reqs
        t_a, shown, read_by, _ = pairing
        # in the look-back span, held by the gauges at the sample, not read by then
        held = self.sched["step_s"]
        unread = (shown[:, None] > t_a) & (shown[:, None] <= held) & (read_by[:, None] > times) if len(shown) \
            else np.zeros((0, len(times)), dtype=bool)
        latest = np.max(np.where(unread, shown[:, None], -math.inf), axis=0, initial=-math.inf)
        others = (r.ids != self.rid) & ~np.isnan(r.sent)
        sent, gone, could = r.sent[others], self.ends_s[others], self.runs_out_from[others]
        owners = r.seqs[others] @ ((sent[:, None] <= times) & (times < gone[:, None]) & (could[:, None] < latest))
        return np.minimum(unread.sum(axis=0).astype(float), owners)

    @cached_property
    def ends_paired(self) -> tuple[float, np.ndarray, np.ndarray, np.ndarray] | None:
        """The engine's own ends from the look-back on, each paired with the close that reads it (ends_unread says
        how): (t_a, the look-back's start; per end, by when the counter showed it; per end, the close that read it,
        inf where none did; per end, its reader's row in reqs, -1 where none). None where the engine does not say
        why its requests ended."""
        times, fin, r = self.sched["t_s"], self.sched["finished"], self.reqs
        if not len(times) or np.isnan(fin[0]):
            return None
        t_w = float(times[0])
        with np.errstate(invalid="ignore"):
            open_ = (r.sent <= t_w) & ~(r.closed < t_w)
        t_a = min(max(float(np.nanmin(r.sent[open_])) if open_.any() else t_w, self.t_stop - BEFORE_S + 0.5), t_w)
        t_h = t_a - READ_BACK_S
        rises = self._rises_from(t_h)
        after = np.array([p for p, _ in rises], dtype=float)
        shown = np.array([q for _, q in rises], dtype=float)
        read_by = np.full(len(rises), math.inf)  # per rise: the close that read it
        reader = np.full(len(rises), -1)  # and its row in reqs
        with np.errstate(invalid="ignore"):
            read = r.completed & (r.closed > t_h) & (r.closed <= times[-1])
        for c, sent, n, row in sorted(zip(r.closed[read], r.sent[read], r.seqs[read], np.nonzero(read)[0])):
            since = sent >= t_h
            for k in range(int(n)):
                if not since and k < n - 1:
                    continue  # an early sequence of one sent before: its end may be before the pairing reaches
                lo = sent if since else c - LAG_S
                if lo < t_h:
                    continue
                # its end lies after its send and by its close, in the span the counter says it came in
                ok = np.nonzero((read_by == math.inf) & (np.maximum(after, sent) < np.minimum(shown, c))
                                & (shown >= lo))[0]
                if len(ok):
                    read_by[ok[0]], reader[ok[0]] = c, row
        return t_a, shown, read_by, reader

    def _rises_from(self, t_from: float) -> list[tuple[float, float]]:
        """The engine's own ends the frame's counter shows from `t_from` to the stretch's end, one per end, each as
        (after, by): counted after the read sample before the one that shows it, by that one."""
        times, fin = self.frame_cols["t_s"], self.frame_cols["finished"]
        lo = max(int(np.searchsorted(times, t_from, side="left")) - 1, 0)
        hi = int(np.searchsorted(times, float(self.sched["t_s"][-1]), side="right"))
        read = np.nonzero(~np.isnan(fin[lo:hi]))[0] + lo
        return [(float(times[p]), float(times[q])) for p, q in zip(read[:-1], read[1:])
                for _ in range(int(round(max(fin[q] - fin[p], 0.0))))]

    @cached_property
    def ended_unread_most(self) -> np.ndarray:
        """Per sample of the stretch: the most of the other requests the ledger counts there that the engine may have
        ended by themselves unread: ends_unread, and no fewer than finished_unseen says surely were. A release is
        read against the fewest others the engine can hold: those less these."""
        unread = self.ends_unread
        return self.finished_unseen if unread is None else np.maximum(self.finished_unseen, unread)

    def verdict(self, rule: str, **fields) -> CancelVerdict:
        """Case.verdict, with the second before the stop in the evidence of every verdict, whichever rule gave
        it and whatever it read first, and the assumptions it rests on."""
        b, ev = self.baseline, self.ev
        ev.count_before, ev.ledger_before, ev.kv_before = b.count_before, b.ledger_before, b.kv_before
        if rule in COUNT_READING_RULES | NO_LOG_COUNT_RULES and not self.englog.names_requests(self.target):
            self.assumed.add("no_traffic_beside_the_run")  # a count read with no log to name another's request
        if rule in ASSUMED_LEFT_RULES | {"still_counted_oldest_first"}:
            self.assumed.add("lost_left_oldest_first")
        ev.assumes = sorted(self.assumed) or None
        if b.ahead and ev.note is None:  # a rule's own note says more
            ev.note = ("the server counted fewer requests than the client before the stop: a request had already "
                       "finished in the engine while its tokens were still on their way to the client")
        return super().verdict(rule, **fields)

    @property
    def ahead(self) -> bool:
        return self.baseline.ahead

    @cached_property
    def waiting_at_stop(self) -> bool:
        """The request was still waiting at its stop (behind max_num_seqs), whatever its trigger's name: it
        held no KV, and its release gives none back. vLLM admits first come, first served: with W sequences
        waiting at the last sample before the stop, the last W sequences to enter the engine by then (an
        n>1 request is n of them) were the waiting ones."""
        before = np.nonzero(self.baseline.before)[0]
        return bool(len(before)) and self.rid in {self.reqs.ids[i] for i in self.waiters_at(int(before[-1]))}

    def waiters_at(self, i: int) -> list[int]:
        """The ledger rows waiting at sample `i` of the stretch, newest first. vLLM admits first come, first
        served: with W sequences waiting there, the last W sequences to enter the engine by then (an n>1 request
        is n of them) were the waiting ones; the oldest of them is the next let in."""
        t_b, w = float(self.sched["t_s"][i]), float(self.sched["waiting"][i])
        if math.isnan(w) or w < WHOLE:
            return []
        r, logged = self.reqs, ~np.isnan(self.added_s)
        # not sent, or (the log names this target's requests) another target's, is in none
        keep = ~np.isnan(r.sent) & (logged | (not self.englog.names_requests(self.target)))
        t_in = np.where(logged, self.added_s, r.sent)
        t_out = np.where(np.isfinite(self.aborted_s), self.aborted_s, np.nan_to_num(r.closed, nan=math.inf))
        with np.errstate(invalid="ignore"):
            inside = np.nonzero(keep & (t_in <= t_b) & (t_b < t_out))[0]  # in the engine at that sample
        newest, seqs = [], 0.0
        for _, k in sorted(((float(t_in[k]), int(k)) for k in inside), reverse=True):
            if seqs >= w - WHOLE:
                break
            newest.append(k)
            seqs += float(r.seqs[k])
        return newest

    def others_leaving(self, queued: int, t_in: float, t_first: float, j: int, i_in: int) -> list[str]:
        """What else may have left the engine between the last sample holding this request (`t_in`, sample `i_in`) and
        the first token of the request waiting behind it (row `queued`; `j`, the first sample at or after it): an end
        of the engine's own (its counter; one it does not count, as good as one), another request's abort line, or
        its client's close where the engine's leaving is not logged (a cancel with no abort line may leave the
        engine any time after its close)."""
        fin = self.sched["finished"]
        own = float(fin[j] - fin[i_in])
        out = ["an end of the engine's own"] if own > 0 else ["an end its counter did not read"] if own != 0 else []
        r = self.reqs
        others = (r.ids != self.rid) & (np.arange(len(r.ids)) != queued)
        aborted = np.isfinite(self.aborted_s)
        with np.errstate(invalid="ignore"):
            left = others & aborted & (self.aborted_s > t_in) & (self.aborted_s < t_first)
            closed = others & ~aborted & (r.closed < t_first) & (r.closed > t_in - (0.0 if self.has_log else self.grace_s))
            closed &= ~r.completed | (r.closed > t_in)  # a completed one before the sample had left by then
        return out + [str(x) for x in r.ids[left | closed]]

    @cached_property
    def seat_taken(self) -> np.ndarray:
        """Per sample of the stretch: every seat of the engine was taken at the last sample before this request's abort
        (running at max_num_seqs, the shape cancelwatch started the engine with), a request waited behind it, and that
        request got in by the sample with nothing else leaving the engine in between (others_leaving; no preemption):
        the seat it took was this one's, and with it the blocks this one held. A newcomer longer than this one, or
        neighbours growing into new blocks, keep KV usage from falling (seen behind a browser's Stop in CI: the
        request let in prefilled into more blocks than the cancelled one gave back). False everywhere where the
        abort or the engine's seats are not known."""
        times, sched = self.sched["t_s"], self.sched
        out = np.zeros(len(times), dtype=bool)
        shape = (((self.run.info.get("engine") or {}).get("targets") or {}).get(self.target or "") or {}).get("shape")
        seats = (shape or {}).get("max_num_seqs")
        i_in = int(np.searchsorted(times, self.t_ref, side="right")) - 1
        if self.t_abort is None or not isinstance(seats, int) or i_in < 0:
            return out
        if not sched["count"][i_in] - sched["waiting"][i_in] >= seats - WHOLE:
            return out
        waiters = self.waiters_at(i_in)
        r = self.reqs
        if not waiters or self.rid in {r.ids[k] for k in waiters}:
            return out
        k = waiters[-1]  # the oldest: the next let in
        t_first = float(r.first[k])
        j = int(np.searchsorted(times, t_first, side="left"))
        if not max(float(times[i_in]), self.t_abort) < t_first or j >= len(times):
            return out
        pre = sched["preemptions"]
        if np.isnan(pre[j]) or np.isnan(pre[i_in]) or pre[j] > pre[i_in]:
            return out  # a preempted request gives its seat back too
        if self.others_leaving(k, float(times[i_in]), t_first, j, i_in):
            return out
        out[j:] = True
        return out

    def judged_beside_traffic(self) -> bool:
        return self.has_log and self.englog.names_requests(self.target)

    @cached_property
    def kv_waived(self) -> str | None:
        """Why no KV drop is asked of a request that held KV at its stop: the scheduler preempted a
        request in the window (this one's blocks may have gone back before its stop), or the prefix
        cache gave it part of its prompt while another request of the ledger ran beside it (the shared
        blocks stay held by that one, and what this one gives back can be less than the others take)."""
        times, pre = self.sched["t_s"], self.sched["preemptions"]
        win = (times >= self.t_stop - BASELINE_S) & (times <= self.t_end) & ~np.isnan(pre)
        if win.sum() >= 2 and pre[win][-1] > pre[win][0]:
            return "preempted"
        before = self.baseline.before
        others = float(self.inflight[before][-1]) - self.n if before.any() else 0.0
        if self.hits_at_admission and self.hits_at_admission > 0 and others >= 1:
            return "prefix_shared"
        return None

    @cached_property
    def foreign_logged(self) -> int | None:
        """Requests the engine's log names that the ledger does not know, entering in the window; None without
        a log."""
        return self.englog.foreign_between(self.target, self.t_stop - BASELINE_S, self.t_end) if self.has_log else None

    def foreign_traffic(self) -> tuple[int | None, int]:
        over = self.sched["count"] > self.inflight + self.ended_unseen + WHOLE
        return self.foreign_logged, int((over & self.baseline.before).sum())

    def restart(self) -> str | None:
        return _restart_in(self.gaps, self.sched, self.t_stop - BASELINE_S, self.t_end, self.sched["scrape_s"])

    def log_gap(self) -> str | None:
        if not self.has_log:
            return None
        holes = _log_holes(self.gaps, self.englog, self.target, self.t_stop - BASELINE_S, self.t_end)
        return holes[0] if holes else None

    def log_clock_off(self) -> dict | None:
        clock = self.englog.clock(self.target)
        return None if not self.has_log or clock.agrees else {"lo_s": clock.lo_s, "hi_s": clock.hi_s}

    @cached_property
    def n(self) -> int:
        lrow = self.lrow
        return 1 if lrow is None or pd.isna(lrow.get("n")) else int(lrow["n"])

    @cached_property
    def without(self) -> np.ndarray:
        """Per sample of the stretch: what the server should count without this request. The ledger keeps a
        request with no abort in flight from its stop until gone_until; the other requests stay as they are."""
        times = self.sched["t_s"]
        return self.inflight - self.n * ((times >= self.t_stop) & (times < self.gone_until))

    @cached_property
    def stopped_beside(self) -> np.ndarray:
        """Per sample of the stretch: sequences of other requests whose clients had stopped them, with no abort
        line, that the ledger counts in the engine there (as `inflight` does: from their Added line, until
        gone_until; they may run on for nobody too). Any of them may be the one a drop in the count lost: with
        two leaked requests in the engine, a count one lower shows one of them gone, not which (seen: three
        leaked through a proxy, each read as gone at the first end)."""
        r = self.reqs
        keep = (r.ids != self.rid) & ~self.not_entered_rows & ~np.isnan(r.cancel) & ~np.isnan(r.sent) \
            & ~np.isfinite(self.aborted_s)
        t_in = np.maximum(np.maximum(r.sent, r.cancel), np.nan_to_num(self.added_s, nan=-math.inf))
        return weighted_between(self.sched["t_s"], t_in[keep], self.ends_s[keep], r.seqs[keep])

    @cached_property
    def settled(self) -> np.ndarray:
        """Per sample of the stretch: the sample the gauges there hold every end before (-1: none known, fewer
        than two steps seen). A rise of generation_tokens_total is a step's output; that step was scheduled
        (its gauges made, the aborts before it taken) before it, maybe before the sample ahead of it (seen: a
        step of 2 tokens stretched over 50 ms with two aborts in it, its count still 4). The step after it was
        scheduled after that sample: the gauges hold every end before the sample ahead of the second-latest
        rise."""
        return _settled(self.sched["gen_tokens"])

    @cached_property
    def ended_unseen(self) -> np.ndarray:
        """Per sample of the stretch: sequences of other requests the ledger ended (their abort, their close)
        after the engine's last step before that sample. The gauges are the engine's as of its last step
        (generation_tokens_total rose since the sample before): an end after it is not in them yet, and read
        against a ledger that has it, the count reads one too high (seen under AIPerf on two cores: a step of
        the engine stalled 0.3 s while two other cancels' aborts came, and the stretch's excess was theirs)."""
        _, seqs, ended = self._ended_after_last_step
        return seqs @ ended

    @cached_property
    def _ended_after_last_step(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The other requests the ledger ended: (ids, sequences, per request and sample of the stretch: ended
        after the engine's last step before that sample), for ended_unseen and count_reading."""
        # the last step as of each sample, read on the whole frame: at the stretch's first samples it is before them
        times, last_step = self.sched["t_s"], self.sched["step_s"]
        r, gone = self.reqs, self.ends_s
        keep = (r.ids != self.rid) & ~np.isnan(r.sent) & np.isfinite(gone)
        if len(times):  # the steps only go on: a row ended after the stretch, or before its first step, is in none
            keep &= (gone <= times[-1]) & (gone > last_step[0])
        g = gone[keep][:, None]
        return r.ids[keep], r.seqs[keep], (times >= g) & (last_step < g)

    def taken_in_its_place(self, kv_before: float) -> np.ndarray:
        """Per sample of the stretch: the count holds the ledger's requests surely counted there and no other
        (count_surely: not this one), one of them a newcomer the gauges did not count at the stop, and KV usage
        is no higher than at the stop. Under steady load the step that drops an aborted request admits the next
        in its place: the newcomer's prefill takes the freed blocks, and KV usage cannot fall (seen under AIPerf
        at concurrency 4: two cancels' aborts and two new requests' Added lines in the same 5 ms, the count at 4
        throughout). A newcomer holds blocks once counted: usage no higher with it counted and this one not
        says this one's blocks went back. A newcomer is one that entered (its Added line) from the abort on, or
        one the count at the stop did not hold: there too it held the surely counted requests and no other, and
        that one's first token had not reached its client. Where the count is the ledger's only with a request
        not surely counted in it, it can hold this one, leaked, in that one's place, with KV usage no higher for
        the same reason: no release is read there (seen under AIPerf: a newcomer Added by the abort, counted
        from the step after it, in the freed block, another Added as the abort came not counted yet: the count,
        3, below the ledger's, 4, was exactly the surely counted requests)."""
        times, sched = self.sched["t_s"], self.sched
        ids, _, counted, first, added, _ = self.ledger_rows
        doubt = self.englog.entry_doubt_s(self.target)
        new = (ids != self.rid) & (added >= self.t_ref - LOG_SLACK_S - doubt)
        before = np.nonzero(self.baseline.before)[0]
        if len(before) and self.count_surely_with_this[before[-1]]:
            b = before[-1]
            new |= (ids != self.rid) & counted[:, b] & (first > times[b])
        if len(before):
            # one waiting at the stop holds no blocks; let in after it, it takes the freed ones (seen behind a browser's
            # Stop with the engine full: the request queued behind it got in at the next step, KV usage unchanged)
            waiting = self.reqs.ids[self.waiters_at(int(before[-1]))]
            new |= (ids != self.rid) & np.isin(ids, waiting) & (first > times[before[-1]])
        surely_new = (counted[new] & (times >= first[new, None])).any(axis=0)
        return surely_new & self.count_surely & (sched["kv"] <= kv_before + 1e-12)

    @cached_property
    def ledger_rows(self) -> _LedgerRows:
        """The ledger's requests whose first token had not reached their client at the stretch's start, less those
        it stopped counting by then (they count nowhere in it)."""
        times, r = self.sched["t_s"], self.reqs
        if not len(times):
            keep = np.zeros(len(r.ids), dtype=bool)
        else:
            with np.errstate(invalid="ignore"):  # sent before the stretch's end, no first token by its start
                keep = (r.sent <= times[-1]) & (r.first > times[0]) & (self.ends_s > times[0])
        keep &= ~self.not_entered_rows
        added = np.nan_to_num(self.added_s[keep], nan=-math.inf)
        sent, end = r.sent[keep], self.ends_s[keep]
        counted = in_between(times, np.maximum(sent, added), end)
        return _LedgerRows(r.ids[keep], r.seqs[keep], counted, r.first[keep], added, sent)

    @cached_property
    def not_entered_rows(self) -> np.ndarray:
        return np.isin(self.reqs.ids, list(self.not_entered)) if self.not_entered else np.zeros(len(self.reqs.ids), bool)

    def _count_surely(self, unseen: np.ndarray, ledger: np.ndarray) -> np.ndarray:
        exact = (np.abs(self.sched["count"] - (ledger - unseen)) < WHOLE) & (self.finished_unseen < WHOLE)
        if self.ends_unread is None:
            # a sure one the engine had ended (a slow reader) may leave room in the count for another: with none
            # unseen, the count is the ledger's whole (as before vLLM said why its requests ended); with some,
            # that room is theirs or this one's, and nothing says which
            return exact & (unseen < WHOLE)
        # the ends as of the sample, not of the gauges (an end counted before the engine drops its request only
        # makes the count less sure): room one of them left is this one's as much as any other's
        return exact & (self.ended_unread_most < WHOLE)

    @cached_property
    def count_surely(self) -> np.ndarray:
        """Per sample of the stretch: the count holds the other requests the ledger counts that are surely
        counted by the engine, and no other. The ledger counts a request from its Added line, the gauges only
        from the engine's next step (on a starved host, seconds later); vLLM sets them from a step before it
        sends that step's tokens on, so one whose first token reached its client is surely counted (vLLM 0.32's
        output handler yields before it sets them only in a step of over 128 outputs, or with a stop string's
        abort to send, and for no longer than that: a scrape served in between is not ruled out). One the
        ledger ended after the engine's last step may be counted still (ended_unseen). A count of exactly the
        sure ones, with no request ended by itself that the ledger still counts (finished_unseen), holds none
        else: not this one, nor those the engine may not count yet or may count still."""
        return self._count_surely(self.others_unseen, self.without)

    @cached_property
    def entering_rows(self) -> np.ndarray:
        """Rows of ledger_rows x samples of the stretch: where the ledger counts the request and the gauges may not
        count it yet: no first token at its client, and it entered less than ENTER_S before: by its Added line
        where the log names it (the line's doubt more), else by its send (LAG_S more for a hop). Past that the engine
        surely counts one, waiting or running: a non-streaming request, or one queued behind max_num_seqs, shows no
        token for long and is counted all the same. The one notion of a request entering, with the log or without."""
        _, _, counted, first, added, sent = self.ledger_rows
        times = self.sched["t_s"]
        entry = np.where(np.isfinite(added), added + self.englog.entry_doubt_s(self.target), sent + LAG_S)
        return counted & (times < first[:, None]) & (times < entry[:, None] + ENTER_S)

    @cached_property
    def others_entering(self) -> np.ndarray:
        """Per sample of the stretch: sequences of the other requests the gauges may not count yet (entering_rows)."""
        others = self.ledger_rows.ids != self.rid
        return self.ledger_rows.seqs[others] @ self.entering_rows[others]

    @cached_property
    def others_unseen(self) -> np.ndarray:
        """Per sample of the stretch: sequences of the other requests the ledger counts whose first token had not
        reached their client: the engine may not count them yet (count_surely)."""
        ids, seqs, counted, first, _, _ = self.ledger_rows
        others = ids != self.rid
        return seqs[others] @ (counted[others] & (self.sched["t_s"] < first[others, None]))

    def confirmed_past_ended_unseen(self, count_ok: np.ndarray, bound: np.ndarray) -> np.ndarray:
        """Per sample of the stretch: a count reconciled there (`count_ok`) only by other requests the ledger
        ended after the engine's last step (ended_unseen: the gauges may count them still) is borne out where the
        gauges first hold those ends (the first sample whose gauges hold every end before this one: settled),
        and so on, until a sample reconciled with no such allowance. Until then the count may hold this request
        in their place (seen through a proxy that never passed the cancel on, no request log: a neighbour that
        ended 43 ms before a sample left room in a count of 1 for this request, running on for 13 s, and the
        neighbour's blocks going back read as this one's; at half the sampling rate, the probe's end then left
        the same room at the sample that was to bear it out). True where the count needs no such allowance."""
        # over the bound less that allowance: reconciled, if at all, only by those ends
        allowed = (self.ended_unseen > WHOLE) & (self.sched["count"] > bound - self.ended_unseen + WHOLE) & count_ok
        out = np.ones(len(allowed), dtype=bool)
        for i in np.nonzero(allowed)[0]:
            k = self.past_unseen_ends(int(i), allowed)
            out[i] = k is not None and bool(count_ok[k])
        return out

    def past_unseen_ends(self, i: int, allowed: np.ndarray) -> int | None:
        """From sample `i` on, each reading that rests on ends after the engine's last step (`allowed`) followed to
        where the gauges hold those ends: the first sample whose reading does not; None where the stretch ends
        first."""
        while allowed[i]:
            j = self.where_ends_settle(i)
            if j is None or j <= i:
                return None
            i = j
        return i

    def where_ends_settle(self, i: int) -> int | None:
        """The first sample, from `i` on, whose gauges hold every end before sample `i` (settled); None where the
        stretch holds none."""
        settled = self._settled_ever
        j = max(int(np.searchsorted(settled, i, side="left")), i)
        return j if j < len(settled) else None

    @cached_property
    def _settled_ever(self) -> np.ndarray:
        return np.maximum.accumulate(self.settled)  # the gauges never un-hold an end

    def count_reading(self, i: int, compared_with: float | None = None, also_open: list[dict] = ()) -> dict:
        """What the count at sample `i` of the stretch was read against, as data (Evidence.count_reading): the
        engine's count; the fewest and the most of the other requests the engine could hold there, by the ledger
        and what it cannot see; the requests that keep those two apart, each with why (`also_open`: more the
        rule allowed for); and the bound the rule compared the count with, where it compared one."""
        times = self.sched["t_s"]
        t = float(times[i])
        ids, seqs, counted, first, _, _ = self.ledger_rows
        others = ids != self.rid
        no_token = others & counted[:, i] & (t < first)
        open_ = [{"request_id": str(r), "reason": "first_token_not_at_client"} for r in ids[no_token]]
        ended_ids, _, ended = self._ended_after_last_step
        open_ += [{"request_id": str(r), "reason": "ended_after_engines_last_step"} for r in ended_ids[ended[:, i]]]
        unread = int(round(float(self.ended_unread_most[i])))
        if unread:
            open_.append({"request_id": None, "reason": "ended_by_itself_unread", "count": unread})
        others_now = float(self.without[i])
        return {"at_s": round(t, 3), "count": float(self.sched["count"][i]),
                "others_fewest": max(0.0, others_now - float(seqs[no_token].sum()) - unread),
                "others_most": others_now + float(self.ended_unseen[i]),
                "compared_with": None if compared_with is None else float(compared_with),
                "open": open_ + list(also_open)}

    @cached_property
    def unseen_with_this(self) -> np.ndarray:
        """Per sample of the stretch: sequences the ledger counts whose first token had not reached their client,
        this request's among them (before its stop)."""
        _, seqs, counted, first, _, _ = self.ledger_rows
        unseen = seqs @ (counted & (self.sched["t_s"] < first[:, None]))
        if self.rid in self.not_entered and self.lrow is not None:
            # the log shows it never entered, yet it is the ledger's until its stop (judge_vllm's case)
            times, t0 = self.sched["t_s"], self.run.info["started_mono_ns"]
            unseen = unseen + self.n * ((times >= (self.lrow["sent_mono_ns"] - t0) / 1e9) & (times < self.t_stop))
        return unseen

    @cached_property
    def count_surely_with_this(self) -> np.ndarray:
        """count_surely with this request among those the engine may not count yet (before its stop)."""
        return self._count_surely(self.unseen_with_this, self.inflight)

    @cached_property
    def finished_unseen(self) -> np.ndarray:
        """Per sample of the stretch: requests the engine had ended by themselves that the ledger still counts,
        at the least. From the stretch's first sample (a second before the stop: a watch's window holds it
        too), every end of the engine's own (vllm:request_success_total: series.own_ends) is one of the
        requests the ledger counts, or one it no longer counts there: one whose end reached its client; one
        it stopped counting in the stretch (a cancel, an error) that could have ended before its abort line
        (the driver's requests, with ignore_eos, only once 1.25 times the fastest one sequence went in the
        window could have made their max_tokens; another only with no abort line: the API server logs none
        for a request that ended before its client left); one it stopped counting before, as many as the
        engine counted beyond the ledger at the stretch's first sample. More ends than those, up to the
        requests the ledger counts: the ledger counts requests the engine had ended. A client reading slowly,
        or a hop buffering, ends a request in the ledger long after the engine ended it: counted by the
        ledger and not by the engine, it stands in, in a count at the ledger's, for this one kept
        (engine_done.py cannot tell: the kept one fills the count; an end longer before the stop is its,
        where the log names every request)."""
        sched = self.sched
        times, fin = sched["t_s"], sched["finished"]
        if not len(times) or np.isnan(fin[0]):
            return np.zeros(len(times))  # the engine does not say why its requests ended
        t_w, r = float(times[0]), self.reqs
        sent, ends, t_abort, seqs = r.sent, self.ends_s, self.aborted_s, r.seqs
        completed = r.completed & np.isfinite(r.closed)
        # the earliest each could have ended by itself: one that may end at any token (not the driver's) before
        # its abort line only as its last output crossed its client's leaving, a race the log cannot show
        from_s = np.where(np.isfinite(t_abort), t_abort, -math.inf)
        bounded = r.bounded
        from_s[bounded] = self.runs_out_from[bounded]
        # each request the ledger no longer counts that may have ended by itself in the stretch, from when
        with np.errstate(invalid="ignore"):
            could = ~np.isnan(sent) & np.where(completed, ends > t_w,
                                               np.isfinite(ends) & (t_abort > t_w) & (from_s < t_abort))
        start = np.maximum(ends, from_s)
        early = could & ~completed & (ends < t_w)
        late = could & ~early
        surplus = np.nan_to_num(sched["count"][0] - self.inflight[0] - self.ended_unseen[0])
        explained = sum_through(times, start[late], seqs[late]) \
            + np.minimum(max(surplus, 0.0), sum_through(times, start[early], seqs[early]))
        # the counter as of the gauges: an end the API server made (a stop string) is counted a step or two
        # before the engine drops the request
        rose = np.nan_to_num(fin[np.maximum(self.settled, 0)] - fin[0])
        return np.clip(rose - explained, 0.0, np.maximum(self.inflight, 0.0))

    @cached_property
    def blocks_of_the_running(self) -> np.ndarray:
        """Per sample of the stretch: every KV block in use is one the running requests hold, at one each (KV
        usage is blocks in use over num_gpu_blocks - 1, from vllm:cache_config_info), and no running request
        shares a block with another: the prefix cache gave no prompt a hit, and the scheduler preempted none,
        since the first of them entered (blocks are shared through a hit, or a preempted request resumed from
        the cache). A running request holds at least one block of its own (its last: vLLM never takes a
        prompt's last token from the cache), so none is left for one the count no longer holds (read where the
        count holds the surely counted requests and no other: count_surely). Seen under AIPerf at
        concurrency 4: an abort, and in the same step two newcomers (one on its way at the stop): 3 blocks
        for 3 requests at the stop, 4 for 4 after it, usage never lower within the grace."""
        times, sched = self.sched["t_s"], self.sched
        out = np.zeros(len(times), dtype=bool)
        pool = _pool_blocks(self.run, self.target)
        hits = sched["prefix_hits"]
        if pool is None or not len(times):
            return out
        # the earliest entry of a ledger request in the engine from the stop on: no hit may come after it
        r = self.reqs
        live = ~np.isnan(r.sent) & ~(self.ends_s < self.t_stop)
        first_in = float(np.min(np.where(np.isnan(self.added_s), r.sent, self.added_s - LOG_SLACK_S)[live],
                                initial=math.inf))
        all_t, all_hits = self.frame_cols["t_s"], self.frame_cols["prefix_hits"]
        i0 = int(np.searchsorted(all_t, first_in, side="right")) - 1
        if i0 < 0 or np.isnan(all_hits[i0]):
            return out  # hits not read from before the first entry: sharing cannot be ruled out
        base = all_hits[i0]
        running = sched["count"] - np.nan_to_num(sched["waiting"])
        used = np.round(sched["kv"] * (pool - 1))
        pre = sched["preemptions"]
        with np.errstate(invalid="ignore"):
            no_hit = np.logical_and.accumulate(~np.isnan(hits) & (hits <= base))
            # a preempted request resumed from the cache shares blocks without the hits counter moving (vLLM
            # counts its hits apart and does not serve them)
            pre_base = self.frame_cols["preemptions"][i0]
            no_preempt = np.logical_and.accumulate(~np.isnan(pre) & (pre <= pre_base)) if not np.isnan(pre_base) \
                else np.zeros(len(times), dtype=bool)
            return no_hit & no_preempt & self.count_surely & (used <= running) & (times >= first_in)

    @cached_property
    def entering(self) -> np.ndarray:
        """Per sample of the stretch: another request of the ledger may not be counted by the gauges yet
        (entering_rows): a count at the ledger's there could hold this one in its place."""
        return self.others_entering > WHOLE

    @cached_property
    def entries(self) -> list[float]:
        """When each engine request under this id first entered the engine, by its log, in time order."""
        return sorted(self.englog.entered.get((self.target, self.rid), {}).values())

    @cached_property
    def remaining(self) -> int | None:
        """Tokens the client had still to receive at the stop (a race when only a few); None: not known."""
        lrow = self.lrow
        if lrow is None or pd.isna(lrow.get("max_tokens")) or self.tokens_at_cancel is None:
            return None
        return int(lrow["max_tokens"]) * self.n - int(self.tokens_at_cancel)

    def own_ends_between(self, t_from: float, t_to: float) -> float | None:
        """Requests the engine ended by themselves from `t_from` to `t_to`, both included (its frame's
        vllm:request_success_total, by finish reason); None where it does not say or the frame holds neither end."""
        times, fin = self.frame_cols["t_s"], self.frame_cols["finished"]
        lo = int(np.searchsorted(times, t_from, side="left")) - 1  # the sample before: an end at t_from counts
        hi = int(np.searchsorted(times, t_to, side="right")) - 1
        if lo < 0 or hi < lo or np.isnan(fin[lo]) or np.isnan(fin[hi]):
            return None
        return float(fin[hi] - fin[lo])

    def may_have_run_out_by(self, t: float) -> str | None:
        """With no abort known (no request log, no relay), whether the request could have ended on its own by `t`
        (what it could have run out, in words), else None. The driver's requests (ignore_eos) cannot before their
        max_tokens at the pace (VllmCase.pace), from their
        send (a hop that buffers, or a non-streaming answer, holds back tokens the engine had made). Any of them
        can have run out by then, but an end of its own is one of the engine's (vllm:request_success_total, by
        finish reason, counts no abort; vLLM counts it in the step that drops the request, or before): where the
        counter rose from the stop to `t` by no more than the other requests whose end reached their client then,
        none was this one's (seen straight to the engine: a race's cancel two tokens before the end, the count one
        lower at the first sample after the stop and the counter not moved, the abort having won)."""
        if self.t_abort is not None:
            return None
        lrow, fastest, t0 = self.lrow, self.pace, self.run.info["started_mono_ns"]
        tokens_out = None  # what it could have run out by then, by its tokens
        if lrow is not None and lrow.get("scenario") != WATCHED_SCENARIO and not pd.isna(lrow.get("max_tokens")) \
                and not pd.isna(lrow.get("sent_mono_ns")) and fastest:
            tokens = int(lrow["max_tokens"])
            if t < (lrow["sent_mono_ns"] - t0) / 1e9 + tokens / fastest:
                self.assumed.add("no_faster_than_the_pace_margin")
                return None
            tokens_out = f"its {tokens} token(s) (at {fastest:.0f} tokens/s from its send)"
        if tokens_out is not None:
            nobody = self.made_for_nobody_at_most(t)
            if nobody is not None and nobody < tokens * self.n - self.received:
                # running out, it would have made for nobody every token its client had not got (a chunk is a token
                # or more): the engine made fewer
                self.ev.tokens_for_nobody_at_most = nobody
                return None
        # the counter and the clients' reads both to `t`: read later, other requests' ends outnumber the reads
        # (seen: a burst's releases read as ends of their own); a read counted later than the counter excuses an end
        # of this one's own by a neighbour's end read a moment after (a watched request that ran out in the grace)
        times, fin = self.sched["t_s"], self.sched["finished"]
        before = np.nonzero(self.baseline.before)[0]
        at = int(np.searchsorted(times, t, side="right")) - 1
        if not len(before) or at < 0 or np.isnan(fin[before[-1]]) or np.isnan(fin[at]) or self.ends_paired is None:
            return tokens_out or "its last tokens (the engine does not say why its requests ended)"
        # each end counted paired with the close that reads it (ends_paired): a close after the last sample before the
        # stop reads an end counted before that sample too (an end counted a step before the request left, a
        # stop string's; a scrape answered after its tick), and excuses none of this one's
        t_b, t_at = float(times[before[-1]]), float(times[at])
        _, shown, read_by, reader = self.ends_paired
        mine = reader == self.reqs.row.get(self.rid, -2)  # its own close reads no other's end
        if not ((shown > t_b) & (shown <= t_at) & ((read_by > t_at) | mine)).any():
            return None
        return tokens_out or "its last tokens (the engine ended requests of its own then that no other's end accounts for)"

    def ended_by_itself(self) -> dict | None:
        """Where the engine surely ended this request by itself after its stop, with no abort known (no request log):
        the fields of the verdict that says so, else None. The engine's count at the baseline's last sample holds
        this request (the engine had not run ahead of its client there), and its own ends (vllm:request_success_total,
        which counts no abort) from that sample to the first after the stop at which it held nothing number as many
        as it held plus the requests that could have entered since (sent by that read's answer, and not yet counted:
        entering_rows's notion): every one of them left by its own end, this one too. None of them ended before the
        first sample LAG_S after the stop, so this one's end came after its cancel, passed on, would have reached the
        engine. A request sent earlier with no token at its client yet was in that count or never came
        (counted_once_sent). Said only where the server's view moved on past the stop: every read from the baseline to
        that sample answered within LAG_S and the generation counter risen (an API server that stalls serves its
        metrics, counts its ends and handles disconnects on one loop: its frozen figures would show no end where the
        engine had one), and only where the ledger knows how many engine requests each entering request is (the
        driver's: a watched row may stand for a batch of prompts)."""
        if self.ahead or self.t_abort is not None:
            return None
        times, fin, count, gen = (self.sched[k] for k in ("t_s", "finished", "count", "gen_tokens"))
        spans = self.sched["scrape_s"]
        before = np.nonzero(self.baseline.before)[0]
        # a cancel passed on reaches the engine within LAG_S: an end before then may have beaten it (a race)
        read = np.nonzero(~np.isnan(fin) & (times >= self.t_stop + LAG_S))[0]
        idle = read[(count[read] == 0) & (times[read] <= self.t_end)]
        if not len(before) or not len(read) or not len(idle):
            return None
        b, a, i = int(before[-1]), int(read[0]), int(idle[0])  # b: the sample `ahead` was read at
        if np.isnan(fin[b]) or np.isnan(count[b]) or fin[a] != fin[b]:
            return None  # an end between: maybe this one's, before its cancel could have come
        if not gen[a] > gen[b] or (spans[b:a + 1] > LAG_S).any():
            return None
        t_b, t_i, r = float(times[b]), float(times[i]), self.reqs
        with np.errstate(invalid="ignore"):
            unseen = (r.ids != self.rid) & (r.sent <= t_i + float(spans[i])) & (r.first > t_b)
            entering = unseen & (r.sent + LAG_S + ENTER_S > t_b)
        if (entering & (r.scenario == WATCHED_SCENARIO)).any():
            return None
        ends, held, more = float(fin[i] - fin[b]), float(count[b]), float(r.seqs[entering].sum())
        if ends < WHOLE or abs(ends - (held + more)) > WHOLE:
            return None  # some left otherwise (an abort), or the run did not see every request
        if (unseen & ~entering).any():
            self.assumed.add("counted_once_sent")
        # it was still there at the last read before the first of those ends
        span = read[read <= i]
        last_without = span[int(np.nonzero(fin[span] > fin[a])[0][0]) - 1]
        return {"by_s": t_i - self.t_stop, "ends": ends, "held": held, "entering": more,
                "still_s": float(times[last_without]) - self.t_stop, "t_left": t_i}

    @property
    def received(self) -> int:
        """The content chunks its client got, each at least one of its tokens (0 where the ledger has no row)."""
        return 0 if self.lrow is None or pd.isna(self.lrow.get("chunks")) else int(self.lrow["chunks"])

    def made_for_nobody_at_most(self, t: float) -> float | None:
        """At most how many tokens the engine made, from the last instant before this request's send with no request
        of the run open to the first sample of its counter at or after `t`, that reached none of the run's clients:
        generation_tokens_total's rise less the chunks its clients got from that instant to `t` less LAG_S (each chunk
        a token or more the engine made then, and counted by `t`). Its tokens made for a client that left are in it,
        so are those of traffic the run did not send. None where the run did not count its clients' chunks, or the
        samples do not cover the stretch (the counter went back: a restart)."""
        if self.delivered is None or self.lrow is None or pd.isna(self.lrow.get("sent_mono_ns")) or not len(self.quiet_s):
            return None
        sent = (self.lrow["sent_mono_ns"] - self.run.info["started_mono_ns"]) / 1e9
        k = int(np.searchsorted(self.quiet_s, sent, side="right")) - 1
        if k < 0:
            return None
        quiet = float(self.quiet_s[k])
        times, gen = self.frame_cols["t_s"], self.frame_cols["gen_tokens"]
        read = np.nonzero(~np.isnan(gen))[0]
        # from a read answered by the quiet instant (a scrape stamped before it and answered after holds tokens made
        # after it); within BEFORE_S of the stop, where the cancel's own window holds it too (judged live or whole,
        # the same answer)
        a = read[times[read] + self.frame_cols["scrape_s"][read] <= quiet]
        b = read[times[read] >= t]
        if not len(a) or not len(b) or times[a[-1]] < self.t_stop - BEFORE_S:
            return None
        g = gen[a[-1]:b[0] + 1]
        g = g[~np.isnan(g)]
        if (np.diff(g) < 0).any():
            return None
        d_t, d_v = self.delivered
        lo = int(np.searchsorted(d_t, quiet, side="left"))  # the first count at or after the quiet instant
        hi = int(np.searchsorted(d_t, t - LAG_S, side="right")) - 1  # the last at or before t less the lag
        got = float(d_v[hi] - d_v[lo]) if lo < len(d_t) and hi > lo else 0.0
        return max(float(g[-1] - g[0]) - got, 0.0)

    @cached_property
    def moved(self) -> np.ndarray:
        return _moved_since(self.sched, self.t_ref if self.t_abort is not None else self.t_stop)

    @cached_property
    def in_grace(self) -> np.ndarray:
        times = self.sched["t_s"]
        return (times >= self.t_ref) & (times <= self.t_ref + self.grace_s)

    @cached_property
    def kept_at_grace_end(self) -> _Kept:
        """How many requests the count holds beyond the ledger's others (`without`) where the grace ends: at its
        last refreshed sample (one taken between the abort and the engine's next step still shows the count from
        before it), less the other requests' ends after the engine's last step (ended_unseen: not in its gauges
        yet); where the count is within the ledger's only by those ends, at the first sample whose gauges hold
        them. What `held` reads a leak by, and what shows a request the engine ran ahead of before the stop still
        there after it."""
        sched, in_grace = self.sched, self.in_grace
        gen = sched["gen_tokens"][in_grace]
        gen = gen[~np.isnan(gen)]
        all_excess = sched["count"] - self.without - self.ended_unseen
        excess = all_excess[in_grace]
        refreshed = np.nonzero(self.moved[in_grace])[0]
        at_end = int(refreshed[-1]) if len(refreshed) else -1
        value, i, k = (float(excess[at_end]) if len(excess) else None), None, None
        if len(excess):
            i = int(np.nonzero(in_grace)[0][at_end])
            allowed = (all_excess <= 0) & (self.ended_unseen > WHOLE) & (sched["count"] > self.without + WHOLE)
            k = self.past_unseen_ends(i, allowed)
            if k is not None:
                value = float(all_excess[k])
        return _Kept(excess, at_end, i, i if k is None else k, value, len(gen) >= 2 and gen[-1] > gen[0],
                     float(gen[-1] - gen[0]) if len(gen) >= 2 else None)

    def lost_in_app(self) -> dict | None:
        # the client reads on until the app ends the stream: many tokens after the stop and an end past the
        # grace say the cancel did not take, but tokens a buffering hop held back say nothing of the engine:
        # `confirmed` only on the engine's word (engine_doubt)
        lrow = self.lrow
        if self.app_answer is None or lrow is None or pd.isna(lrow.get("closed_mono_ns")):
            return None
        if self.app_answer.startswith("already_"):
            return None  # the app says the request had ended before the cancel came: the race's rule
        tokens = 0 if pd.isna(lrow.get("tokens_after_cancel")) else int(lrow["tokens_after_cancel"])
        after_s = (float(lrow["closed_mono_ns"]) - self.run.info["started_mono_ns"]) / 1e9 - self.t_stop
        if tokens <= RACE_TOKENS * self.n or after_s <= self.grace_s:
            return None
        doubt, reading = self.engine_doubt()
        return {"answer": self.app_answer, "tokens": tokens, "after_s": after_s, "grace_s": self.grace_s,
                "confirmed": doubt is None, "doubt": doubt or "", "reading": reading}

    def engine_doubt(self) -> tuple[str | None, dict | None]:
        """(None, the count reading at the grace's last sample read) where the engine's samples show it kept this request across the grace after the stop: at
        every sample there the server counted each request the ledger had open, this one included (less
        those whose client read their end within LAG_S after: a hop delivers an end a moment after the
        engine made it; and those sent within LAG_S before: a hop and the API server hand a request on a
        moment after its send), and its token counter rose. Else what stands in the way, in words: another
        target stopped in the scenario (the count cannot say which one the engine kept), other traffic, a
        restart, a hole in the engine's log or a log clock that cannot be placed, the engine ahead of the
        client before the stop, too few samples, a counter that did not rise, a sample short of the ledger
        (with that sample's count reading: Evidence.count_reading, the ledger's requests ending or starting
        around it open).

        Where the engine had run ahead of the client before the stop (it counted fewer than the ledger: a
        request it had finished was still reaching its client; CI: the neighbour's end, just before the stop),
        the count cannot say which request was gone, the target included. Only the samples after every
        other request open then has been read to its end are read, and only those no request ending or
        starting around them could stand in for the target at: the server counting the ledger's whole open
        set there holds the target."""
        ahead = "the engine had run ahead of the client before the stop"
        blocked = self._doubt_before_reading()
        if blocked:
            return blocked, None
        r, times = self.reqs, self.sched["t_s"]
        # the ledger's open requests with this one among them, whatever the frame made of its stay (its client's
        # close, the count's surplus): that is what the count must hold
        count, gen, inflight = self.sched["count"], self.sched["gen_tokens"], self.without + self.n
        grace = (times >= self.t_stop) & (times <= self.t_stop + self.grace_s) & ~np.isnan(count) & ~np.isnan(gen)
        if self.ahead:
            grace &= times > self.ahead_read_until()
        others = r.ids != self.rid
        closes, sends = r.closed[others], r.sent[others]  # NaN: never closed (never sent), never in a span
        # the server read its gauges somewhere in the scrape's span (CI: an app busy generating answered its
        # /metrics ~1 s after the tick): a request whose client read its end by then may be gone, and one sent
        # by then may be counted though the ledger's tick does not hold it yet; one sent within LAG_S before
        # the tick may not be the engine's yet
        at = np.flatnonzero(grace)
        spans = self.sched["scrape_s"][at]
        ending = _within(closes, times[at], times[at] + spans + LAG_S)
        starting = _within(sends, times[at] - LAG_S, times[at])
        arriving = _within(sends, times[at], times[at] + spans)
        if self.ahead:
            # no slack where any request might stand in for the target
            keep = (ending == 0) & (starting == 0) & (arriving == 0)
            at, spans, ending, starting, arriving = at[keep], spans[keep], ending[keep], starting[keep], arriving[keep]
        if len(at) < 2:
            return (ahead if self.ahead else f"{len(at)} scheduler sample(s) answered in the grace"), None
        if not gen[at][-1] > gen[at][0]:
            return "the engine's token counter did not rise across the grace", None
        for i, t, k, f, e, s, a in zip(at, times[at], count[at], inflight[at], ending, starting, arriving):
            if k - a < f - e - s - WHOLE:
                late = f", {a} sent while its scrape was being answered" if a else ""
                return ((f"{t - self.t_stop:.2f} s after the stop the server counted {k:g} request(s){late} where "
                         f"the ledger had {f:g} open"), self._reading_near(i, f - e - s + a))
        i = at[-1]
        return None, self._reading_near(i, inflight[i] - ending[-1] - starting[-1] + arriving[-1])

    def _reading_near(self, i: int, held_to: float) -> dict:
        """count_reading at sample `i`, with the ledger's other requests whose end or start around it (engine_doubt's
        allowances) leaves the reading open."""
        r, t, sp = self.reqs, float(self.sched["t_s"][i]), float(self.sched["scrape_s"][i])
        others = r.ids != self.rid
        ids, closes, sends = r.ids[others].astype(str), r.closed[others], r.sent[others]
        with np.errstate(invalid="ignore"):
            near = [(ids[(closes > t) & (closes <= t + sp + LAG_S)], "end_read_within_lag"),
                    (ids[(sends <= t) & (sends > t - LAG_S)], "sent_within_lag"),
                    (ids[(sends > t) & (sends <= t + sp)], "sent_during_its_scrape")]
        return self.count_reading(i, held_to, [{"request_id": str(x), "reason": why} for xs, why in near for x in xs])

    def _doubt_before_reading(self) -> str | None:
        """What keeps engine_doubt from reading the count at all, in words; None where nothing does."""
        if self.restart():
            return "the engine restarted in the window"
        if self.log_gap() or self.log_clock_off():
            return "the engine log cannot be read across the window"
        logged, counted = self.foreign_traffic()
        if logged or counted >= 2:
            return "requests the run did not send reached the engine in the window"
        r = self.reqs
        mates = (r.ids != self.rid) & ((r.scenario == self.scenario) if self.scenario is not None else False)
        if (mates & ~np.isnan(r.cancel)).any():
            return "another request of the scenario was cancelled beside it"
        return None

    def ahead_read_until(self) -> float:
        """When the last of the other requests the ledger had open at the sample before the stop was read to
        its end (plus LAG_S), the engine having run ahead of the client there: from then on no request the
        engine finished early is still on its way. inf where one of them never ended."""
        times, r = self.sched["t_s"], self.reqs
        t_b = float(times[self.baseline.before][-1])
        sent, gone = r.sent, r.ends(self.ledger_ends, fallback=r.closed)  # NaN: never closed
        open_then = (r.ids != self.rid) & (sent <= t_b) & ~(gone <= t_b)
        return float(np.max(gone[open_then], initial=t_b)) + LAG_S if not np.isnan(gone[open_then]).any() else math.inf

    def samples_in_grace(self) -> int | None:
        # only where the run recorded a hole in the scheduler's scrapes across the grace (failed or missed
        # ticks): a rate chosen slow (--hz) leaves few samples and no hole, and is not an outage
        hole = _gaps_over(self.gaps, self.t_ref, self.t_ref + self.grace_s)
        if not len(hole) or not (hole["source"] == "vllm").any():
            return None
        return int(self.in_grace.sum())

    def note_race(self) -> None:
        if self.remaining is not None and self.remaining <= RACE_TOKENS:
            self.ev.race = f"the stop came {self.remaining} token(s) before the end: the completion could win"


def _case(run: Run, frame: _Frame, englog: _EngineLog, trace: dict, same: dict, *, data: dict, rid: str,
          target: str | None, lrow: dict | None, t_stop: float, grace_s: float, t0: int, missed: dict | None,
          gone_until: float) -> VllmCase:
    cols_all, inflight_all, ledger_ends, not_entered = frame.cols, frame.inflight, frame.ends, frame.not_entered
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
    sources = _sources(app_src if t_app is not None else None, abort_source if t_abort is not None else None,
                       has_log, t_probe is not None, data.get("scenario") == WATCHED_SCENARIO)
    terminal = None if lrow is None else lrow["terminal_state"]
    completed = terminal == "completed" and t_abort is None
    t_ref = _release_from(t_abort, (lrow["closed_mono_ns"] - t0) / 1e9 if completed and lrow is not None else None,
                          has_log, t_closed, t_stop)
    # each cancel looks at its own stretch of the run: an hour at 20 Hz is 72,000 samples a series
    lo = int(np.searchsorted(cols_all["t_s"], t_stop - BASELINE_S, side="left"))
    t_end = max(t_ref, t_stop) + grace_s
    # past the horizon only where a scrape outage covers the window: the first sample after it is what
    # shows an engine restart (a slow engine takes longer than the horizon to come back)
    horizon = max(max(t_ref, t_stop) + HORIZON_S, _outage_end(frame.gaps, t_stop - BASELINE_S, t_end) + 1.0)
    hi = int(np.searchsorted(cols_all["t_s"], horizon, side="right"))
    sched = {c: a[lo:hi] for c, a in cols_all.items()}
    inflight = inflight_all[lo:hi]
    if rid in not_entered and lrow is not None:
        # its own request, that the log does not name, stays the client's count until its stop: the count
        # before the stop is read against it, and the rules say why the log does not name it (never_added)
        n = 1 if pd.isna(lrow.get("n")) else int(lrow["n"])
        inflight = inflight + n * ((sched["t_s"] >= (lrow["sent_mono_ns"] - t0) / 1e9) & (sched["t_s"] < t_stop))
    hits_at_admission = _admission_hits(cols_all, englog.added.get((target, rid)), lrow, t0, t_stop)
    window = (sched["t_s"] >= t_stop - BASELINE_S) & (sched["t_s"] <= t_end)
    ev = Evidence(grace_s=grace_s, metrics_target=target, samples_in_window=int(window.sum()), engine_log=log_state)
    tp = {"user_stop": t_stop, "app_received": t_app,
          "engine_abort": None if t_abort is None else max(t_abort, t_stop), "left_scheduler": None,
          "reusable": t_probe}
    return VllmCase(rid=rid, scenario=data.get("scenario"), phase=data.get("phase"), terminal=terminal, t_stop=t_stop,
                    grace_s=grace_s, ev=ev, tp=tp, sources=sources, completed=completed, missed=missed,
                    t_abort=t_abort, abort_source=abort_source,
                    abort_resolution_s=englog.resolution_of(target, rid) if t_log_abort is not None else 0.0,
                    run=run, englog=englog, target=target, has_log=has_log, t_log_abort=t_log_abort, t_ref=t_ref,
                    t_end=t_end, sched=sched, inflight=inflight, lrow=lrow,
                    tokens_at_cancel=data.get("tokens_at_cancel"), gone_until=gone_until,
                    hits_at_admission=hits_at_admission, frame_cols=cols_all, solo_rate=frame.solo_rate,
                    ledger_ends=ledger_ends, assumed_gone=frame.assumed_gone, not_entered=not_entered,
                    reqs=frame.reqs, added_s=frame.added_s, aborted_s=frame.aborted_s, gaps=frame.gaps,
                    ends_s=frame.ends_s.copy(), delivered=frame.delivered, quiet_s=frame.quiet_s)


# a watch sends nothing of its own: no probe measures when the freed capacity was handed out again
WATCHED_REUSE = "a watch sends no probe: when the freed capacity was handed out again is not measured"


def _sources(app: str | None, abort: str | None, has_log: bool, probe: bool, watched: bool) -> dict:
    """Each timepoint's source, or why it has none (`watched`: a watch's cancel, which no probe follows)."""
    return {
        "user_stop": ("client", None),
        "app_received": (app, None) if app else (None, NO_APP),
        "engine_abort": (abort, None) if abort else (None, "no abort in the engine log" if has_log else NO_LOG),
        "left_scheduler": (None, "not seen in the samples"),
        "reusable": ("client", None) if probe else (None, WATCHED_REUSE if watched else "no probe got a first token"),
    }


def _release_from(t_abort: float | None, t_completed: float | None, has_log: bool, t_closed: float | None,
                  t_stop: float) -> float:
    """The instant the release is looked for from: the engine's abort, else the completion the client read, else
    (no log) the client's own close, else the stop itself; never before the stop, but for a completion."""
    if t_completed is not None:
        return t_completed
    if t_abort is not None:
        t_ref = t_abort
    elif has_log:
        t_ref = t_stop
    else:
        t_ref = t_closed if t_closed is not None else t_stop
    return max(t_ref, t_stop)


def _admission_hits(cols: dict[str, np.ndarray], added: list[float] | None, lrow: dict | None, t0: int,
                    t_stop: float) -> float | None:
    """Prompt tokens the prefix cache gave while this request was admitted: prefix_cache_hits_total's
    rise from the last sample before it entered (its Added line, else its send) to the first at or after
    its first token (else its stop). The driver sends nothing else meanwhile; None where unknown."""
    if lrow is None or pd.isna(lrow.get("sent_mono_ns")):
        return None
    t_in = min(added) if added else (lrow["sent_mono_ns"] - t0) / 1e9
    first = lrow.get("first_token_mono_ns")
    t_first = t_stop if first is None or pd.isna(first) else (first - t0) / 1e9
    t, hits = cols["t_s"], cols["prefix_hits"]
    i0, i1 = int(np.searchsorted(t, t_in, side="right")) - 1, int(np.searchsorted(t, t_first, side="left"))
    if i0 < 0 or i1 >= len(t) or np.isnan(hits[i0]) or np.isnan(hits[i1]):
        return None
    return float(hits[i1] - hits[i0])


def _within(at: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Per (lo, hi]: how many of the instants `at` fall in it (NaN: in none)."""
    srt = np.sort(at[~np.isnan(at)])
    return np.searchsorted(srt, hi, side="right") - np.searchsorted(srt, lo, side="right")


MOVED_STRETCH = 256  # samples _moved_since and _restart_in read first, doubled each time they read further


def _moved_since(sched: dict[str, np.ndarray], t: float) -> np.ndarray:
    """Per sample: a sample at or after `t` that moved (count, KV or generated tokens) since the last
    one before `t`, or follows one that did. Gauges refresh only on an engine step: a release is only
    shown by a refreshed sample."""
    times = sched["t_s"]
    p = int(np.searchsorted(times, t, side="left")) - 1  # the last sample before `t` (the samples are in order)
    if p < 0:
        return np.ones(len(times), dtype=bool)
    out = np.zeros(len(times), dtype=bool)
    # the first sample from `t` on that moved, looked for a stretch at a time: it is near `t`, and an hour's run
    # read whole holds 70 000 samples for each of its hundreds of cancels
    lo, step = p + 1, MOVED_STRETCH
    while lo < len(times):
        hi = min(len(times), lo + step)
        moved = np.zeros(hi - lo, dtype=bool)
        for col in ("count", "kv", "gen_tokens"):
            vals = sched[col]
            moved |= ~np.isclose(vals[lo:hi], vals[p], equal_nan=True)
        first = np.flatnonzero(moved)
        if len(first):
            out[lo + int(first[0]):] = True
            break
        lo, step = hi, 2 * step  # the stretch doubles: a run whose gauges stay put is read in a few passes
    return out


def _three_without(still: np.ndarray) -> np.ndarray:
    """Per refreshed sample: it and the next two do not count the request. Gone is only believed from
    three in a row: a request sent after the stop is in the ledger a step before the server counts it,
    and must not read as this one leaving."""
    out = ~still
    for k in (1, 2):
        out[:-k] &= ~still[k:]
    return out


def _restart_in(gaps: _Gaps, sched: dict[str, np.ndarray], t_from: float, t_to: float,
                spans: np.ndarray) -> str | None:
    """How an engine restart shows between the instants `t_from` and `t_to`, else None: the target
    lost in between, or the engine's token counter going back (a new process counts from 0) and
    staying back. A scrape outage that covers part of the window stretches it to the first sample
    after the outage: a restart takes longer than any grace, and only that sample shows it."""
    mine = _gaps_over(gaps, t_from, t_to)
    if len(mine) and (mine["kind"] == "lost").any():
        return "the target was lost"
    t_to = max(t_to, _outage_end(gaps, t_from, t_to) + 0.5)
    times, gen = sched["t_s"], sched["gen_tokens"]
    # the dips are looked for up to t_to, and each is checked on the next two readings after it, past t_to too: the
    # samples from t_from to two readings past t_to (the samples are in order; a run read whole holds 70 000)
    lo, hi = int(np.searchsorted(times, t_from, side="left")), int(np.searchsorted(times, t_to, side="right"))
    end = hi
    step = MOVED_STRETCH
    while end < len(times) and np.count_nonzero(~np.isnan(gen[hi:end])) < 2:
        end, step = min(len(times), end + step), 2 * step
    gen, times, spans = gen[lo:end], times[lo:end], spans[lo:end]
    sel = ~np.isnan(gen)
    vals, at = gen[sel], times[sel]
    # a sample is stamped when its read started, and its body was built somewhere before the read ended:
    # two reads that overlap (a ticker woke late and caught up: two reads 70 us apart, seen answering 54 and
    # 82 ms later, the later one with fewer tokens) can answer out of order. Only a read started after an
    # earlier one had its answer can show the counter gone back
    ends = at + spans[sel]
    # per reading i: the highest count read by a reading j < i answered by the time i started (j is among them from
    # the first reading started at or after its answer, or from j + 1)
    n = len(vals)
    joins = np.maximum(np.searchsorted(at, ends, side="left"), np.arange(1, n + 1))
    peak = np.full(n + 1, -np.inf)
    np.maximum.at(peak, np.minimum(joins, n), vals)
    peak = np.maximum.accumulate(peak[:n])
    # and it stays back: a dip that the next samples climb out of at once is not a restart (at the end
    # of the stretch, the samples left are all there is to go by)
    back = vals < peak
    for k in (1, 2):
        back[:-k] &= vals[k:] < peak[:-k]
    back[:1] = False
    back[int(np.searchsorted(at, t_to, side="right")):] = False
    return "generation_tokens_total went back" if back.any() else None

