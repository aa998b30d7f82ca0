"""The vocabulary of a cancel's verdict and the shared rungs of its ladder, read by every engine family's
rules: the five timepoints and their labels, the latencies between them, what a timepoint rests on, the
constants of judging, the verdict record, the table of rules (each verdict's `rule` code with its
sentence), and the guards every cancel passes before its family weighs its own evidence. Here, below
the family modules (vllm.py, triton.py), so neither imports the other's privates."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from cancelwatch.analysis.bounds import GRACE_S, HORIZON_S, LOG_SLACK_S, MIN_SAMPLES, RACE_TOKENS  # noqa: F401 - the rules read them from here too
from cancelwatch.analysis.evidence import Evidence
from cancelwatch.runstore.reader import Run
from cancelwatch.runstore.records import DriveSettings

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
# and the one a reader asks first, whole even where no app stands between the client and the engine
STOP_TO_ABORT = ("user_stop", "engine_abort")


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
    # timepoint -> {"source": one of SOURCES or None, "reason": why there is no value, or None}
    sources: dict = field(default_factory=dict)
    # the components of the path in order from the client, as the taps saw the cancel cross them
    # (analysis.hops.HopStep); empty for a run without taps
    hops: list = field(default_factory=list)

    @property
    def rule(self) -> str | None:
        """The code of the rule that gave the verdict (a key of RULES); kept beside `why` in the evidence."""
        return self.evidence.rule

    def latency_ms(self, a: str, b: str) -> float | None:
        """Duration, ms from timepoint `a` to `b`; None when either was not reached."""
        ta, tb = self.timepoints.get(a), self.timepoints.get(b)
        return None if ta is None or tb is None else round((tb - ta) * 1000, 1)

    def latencies(self) -> dict:
        return {latency_key(a, b): self.latency_ms(a, b) for a, b in (*LATENCIES, STOP_TO_ABORT)}

    def source_of(self, point: str) -> str | None:
        return (self.sources.get(point) or {}).get("source")

    def source_label(self, point: str) -> str | None:
        """Where the point came from, in words (`engine log`); None when it has no source."""
        src = self.source_of(point)
        return SOURCE_LABELS.get(src, src) if src else None

    def source_reason(self, point: str) -> str | None:
        return (self.sources.get(point) or {}).get("reason")

    def client_left_s(self) -> float:
        """Where the client side closed, s since the run started: what the grace counts from. The user_stop
        timepoint, unless that is a page's Stop click (Evidence.client_left_s)."""
        left = self.evidence.client_left_s
        return self.timepoints["user_stop"] if left is None else left

    def sources_text(self) -> str:
        """Where each timepoint came from, in words: `engine abort: engine log · app received: none (no
        app on this path) · ...`."""
        parts = []
        for p in TIMEPOINTS:
            if p in self.sources:
                what = self.source_label(p) or f"none ({self.source_reason(p) or 'not reached'})"
                parts.append(f"{POINT_LABELS[p]}: {what}")
        return " · ".join(parts)

    def as_json(self) -> dict:
        return {"request_id": self.request_id, "scenario": self.scenario, "phase_at_cancel": self.phase_at_cancel,
                "timepoints": dict(self.timepoints), "timepoint_sources": dict(self.sources), "verdict": self.verdict, "evidence": self.evidence.as_json(),
                "terminal_state": self.terminal_state, "latencies_ms": self.latencies(),
                "hops": [h.as_json(self.timepoints["user_stop"]) for h in self.hops]}


def run_grace_s(run: Run) -> float:
    """Duration, s: the grace window the run was recorded with (`record --grace`), else the default."""
    grace_s = DriveSettings.of_run(run.info.get("settings")).grace_s
    return GRACE_S if grace_s is None else grace_s


# what each timepoint rests on, in every table and JSON: where its value came from
SOURCES = ("engine_log", "relay", "client", "samples", "tap", "page", "app", "queued")
SOURCE_LABELS = {"engine_log": "engine log", "relay": "relay (in the app)", "client": "client",
                 "samples": "scheduler samples", "tap": "tap (a socket close)", "page": "page (its Stop click)",
                 "app": "app (its own word)", "queued": "a request queued behind it (its first token)"}
# app_received from a tap in front of an app: the app's connection went, not a receipt it acknowledged
TAP_RECEIVED = "the app's connection from its client closed"
NO_APP = "no app on this path"
NO_LOG = "no engine log"


def engine_log_state(run: Run, target: str | None) -> str:
    """"read" when the engine log of `target` was followed during the run, else why not."""
    logs = (run.info.get("engine") or {}).get("engine_log")
    if not logs:
        return "the run has no engine log facts (recorded before engine logs were read)"
    entry = logs.get(target) or {}
    return "read" if entry.get("path") else (entry.get("off") or NO_LOG)


# ------------------------------------------------------------------------------------------ the ledger
# what a cancel asks of the ledger rows of its scenario (who ran beside it, who was sent after it)
LEDGER_ARRAYS = {"role": ("role", object), "sent": ("sent_mono_ns", float), "first": ("first_token_mono_ns", float),
                 "state": ("terminal_state", object), "chunks": ("chunks", float)}
NO_REQUESTS = {key: np.array([], dtype=dtype) for key, (_, dtype) in LEDGER_ARRAYS.items()}


def ledger_by_scenario(ledger) -> dict[str, dict[str, np.ndarray]]:
    """Per scenario, the ledger as numpy arrays sorted by send time: hundreds of cancels look here."""
    if not len(ledger) or "scenario" not in ledger:
        return {}
    # a column a ledger lacks reads as unknown
    cols = {key: ledger[col].to_numpy(dtype=dtype) if col in ledger else np.full(len(ledger), np.nan, dtype=dtype)
            for key, (col, dtype) in LEDGER_ARRAYS.items()}
    codes, names = pd.factorize(ledger["scenario"], use_na_sentinel=False)
    out = {}
    for k, name in enumerate(names):
        idx = np.nonzero(codes == k)[0]
        idx = idx[np.argsort(cols["sent"][idx], kind="stable")]
        out[name] = {key: a[idx] for key, a in cols.items()}
    return out


def first_probe_s(same: dict[str, np.ndarray], sent_from_ns: float, t0: int) -> float | None:
    """Instant, s since the run started, of the first token of a probe of the scenario (`same`, as
    ledger_by_scenario holds it) sent at or after `sent_from_ns`: the freed capacity handed out again."""
    firsts = same["first"][(same["sent"] >= sent_from_ns) & (same["role"] == "probe")]
    firsts = firsts[~np.isnan(firsts)]
    return float((firsts.min() - t0) / 1e9) if len(firsts) else None


# ------------------------------------------------------------------------------------------ the rules
RELEASED, LEAKED, STALE_GAUGE, INCONCLUSIVE = "released", "leaked", "stale_gauge", "inconclusive"
VERDICTS = (RELEASED, LEAKED, STALE_GAUGE, INCONCLUSIVE)


@dataclass(frozen=True)
class Rule:
    """A rung of the ladder: the verdict it gives and what `why` says (a str.format template over the
    fields the rule passes). A plain release (`quiet`) leaves `why` empty: its sentence only documents it."""

    verdict: str
    sentence: str
    quiet: bool = False
    race: bool = False  # the evidence concluded a race the completion won: neither a release nor a leak


NOTHING_TO_SHOW = "so this cancel cannot show whether cancels reach the engine"
# every verdict's `rule`, once: stable codes (tests, alerts and readers of `report --json` key on them;
# the sentences may be reworded). Shared guards first, then each family's evidence rules.
RULES: dict[str, Rule] = {
    # the shared guards (this module)
    "trigger_never_reached": Rule(INCONCLUSIVE, "the request completed before the stop: the scenario's trigger "
                                  "({trigger}) was never reached, so there was nothing to cancel"),
    "app_lost_cancel": Rule(LEAKED, "the app answered '{answer}' to the explicit cancel, yet the engine went on "
                            "with the request: it still counted it and kept generating across the {grace_s:g} s "
                            "grace, and {tokens} tokens reached the client after the stop, to its end "
                            "{after_s:.1f} s later (a cancel endpoint that does nothing, the wrong owner, a replica "
                            "that does not hold the request)"),
    "app_lost_unconfirmed": Rule(INCONCLUSIVE, "the app answered '{answer}' to the explicit cancel, yet {tokens} "
                                 "tokens reached the client after the stop, to the request's end {after_s:.1f} s "
                                 "later: not a race the completion won, but the engine's samples cannot show it "
                                 "still held the request across the {grace_s:g} s grace ({doubt}; or a hop "
                                 "buffered tokens made before the stop)"),
    "completion_won_race": Rule(INCONCLUSIVE, "the completion won the race: the client read the request's end "
                                "before the cancel took effect, so this cancel cannot show a release", race=True),
    "log_clock_disagrees": Rule(INCONCLUSIVE, "the engine log's clock disagrees with the run's: its 'Added "
                                "request' lines cannot all fall between their requests' sends and first tokens (one "
                                "request puts the log {lo_s:+.3f} s off or more, another {hi_s:+.3f} s or less), so "
                                "nothing it says can be placed against the stop; give the log's zone with "
                                "--engine-log-tz, or check the engine host's clock"),
    "engine_log_gap": Rule(INCONCLUSIVE, "the engine log may have lost lines inside this cancel's window ({how}): "
                           "a missing abort or Added line proves nothing there; rotate the log by renaming it, "
                           "not with copytruncate"),
    "no_samples": Rule(INCONCLUSIVE, "no samples from the engine from 1 s before the stop to the end of the grace: "
                       "a scrape outage, nothing to judge the release by"),
    "too_few_samples": Rule(INCONCLUSIVE, "too few samples around the cancel ({samples})"),
    "other_traffic_logged": Rule(INCONCLUSIVE, "other traffic was present: {requests} request(s) the ledger does "
                                 "not know entered the engine in this cancel's window (engine log)"),
    "released_beside_traffic": Rule(RELEASED, "the engine logged the abort, and with other traffic in the window "
                                    "({requests} request(s) the ledger does not know, named by the engine log) "
                                    "the server still counted no more requests than the ledger {after_ms:.0f} ms "
                                    "after it: the request had left the scheduler"),
    "no_abort_beside_traffic": Rule(LEAKED, "the cancel never reached the engine: its log names the request "
                                    "entering and no abort for it, and at the fastest this engine made tokens in "
                                    "this cancel's stretch of the run ({rate:.0f} a second a sequence, a quarter added) it could not have run out its "
                                    "{tokens} tokens before {finish_s:.1f} s after the stop, past the grace: it "
                                    "kept generating for nobody (judged on the log beside {requests} request(s) "
                                    "of other traffic)"),
    "other_traffic_counted": Rule(INCONCLUSIVE, "other traffic was present: the server counted more requests than "
                                  "the ledger before the cancel ({samples} samples)"),
    "engine_restarted": Rule(INCONCLUSIVE, "engine restarted inside this cancel's window ({how}): nothing to judge "
                             "the release by"),
    "finished_before_stop": Rule(INCONCLUSIVE, "the server had finished the request before the stop (its log): "
                                 "nothing was left to cancel"),
    "abort_after_grace": Rule(LEAKED, "the abort reached the engine only {late_s:.1f} s after the stop, past the "
                              "{grace_s:g} s grace: the request kept running for nobody until then"),
    "abort_stamp_straddles_grace": Rule(INCONCLUSIVE, "the engine log places its abort line to within "
                                        "{resolution_s:.3g} s only (its stamps' rounding, and how closely the run "
                                        "pins its clock down): it came between {from_s:.1f} and {to_s:.1f} s after "
                                        "the stop, so whether within the {grace_s:g} s grace cannot be told (log "
                                        "with milliseconds, on the recorder's clock)"),
    # vLLM (vllm.py): the engine log's lines, the scheduler's gauges against the ledger
    "entered_after_stop": Rule(LEAKED, "the request entered the engine only {after_s:.1f} s after its client had "
                               "left, and the engine's log shows no abort of it: something on the path held the "
                               "request and sent it on after the client was gone, and the engine ran it for nobody"),
    "resubmitted_after_stop": Rule(LEAKED, "the request entered the engine again {after_s:.1f} s after the stop (a "
                                   "second 'Added request' line for its id): something on the path, a gateway "
                                   "retrying upstream after its client left, sent it once more, and the engine ran "
                                   "it for nobody"),
    "log_names_no_requests": Rule(INCONCLUSIVE, "the engine log names no requests (not one 'Added request' line): "
                                  "start vLLM with --enable-log-requests; without it the log cannot show whether "
                                  "this cancel reached the engine"),
    "renamed_untold": Rule(INCONCLUSIVE, "the engine log names no request by this one's id, and {lines} request(s) "
                           "it does not know entered the engine between this one's send and its first token: "
                           "something on the path gives requests ids of its own (X-Request-Id), and which of "
                           "them is this one cannot be told. Pass X-Request-Id through to the engine"),
    "never_added": Rule(INCONCLUSIVE, "the engine log never names this request (no 'Added request' line): the "
                        "engine may never have had it, so the cancel had nothing to act on"),
    "aborted_before_stop": Rule(INCONCLUSIVE, "the engine's log shows this request aborted {before_ms:.0f} ms "
                                f"before the stop: nothing was left to cancel, {NOTHING_TO_SHOW}"),
    "already_finished": Rule(INCONCLUSIVE, "the engine had already finished the request before the stop (the "
                             "server counted fewer requests than the client, and its log shows no abort): nothing "
                             f"was left to cancel, {NOTHING_TO_SHOW}"),
    "no_refresh_after_stop": Rule(INCONCLUSIVE, "no engine log abort, and no sample after the stop refreshed the "
                                  "gauges: nothing shows where the request went"),
    "finished_on_its_own": Rule(INCONCLUSIVE, "the request was gone from the engine at the first sample after the "
                                "stop, with no abort in its log: it had finished on its own as the cancel came, "
                                f"{NOTHING_TO_SHOW}"),
    "ran_out_its_last_tokens": Rule(INCONCLUSIVE, "the completion won the race: no abort in the engine log, and the "
                                    "request ran its last {remaining} token(s) out, {left}", race=True),
    "no_abort_ran_to_end": Rule(LEAKED, "the cancel never reached the engine: no abort for this request in the "
                                "engine's log, and it kept running {kept_ms:.0f} ms after the stop and left only at "
                                "its natural end"),
    "no_abort_left_among_others": Rule(LEAKED, "the cancel never reached the engine: no abort for this request in "
                                       "the engine's log, and it was still in the engine {still_s:.1f} s after the "
                                       "stop; {others} other request(s) whose cancels were lost were in the engine "
                                       "beside it, and its count cannot tell which of them left when it fell: this "
                                       "one had left by {by_s:.1f} s after the stop"),
    "no_abort_left_oldest_first": Rule(LEAKED, "the cancel never reached the engine: no abort for this request in "
                                       "the engine's log, and it was still in the engine {still_s:.1f} s after the "
                                       "stop; {others} other request(s) whose cancels were lost were in the engine "
                                       "beside it, and its count cannot tell which left at each fall: taking the "
                                       "oldest to go first (as requests of one length do), this one had left by "
                                       "{by_s:.1f} s after the stop"),
    "ended_by_itself_after_stop": Rule(LEAKED, "the cancel never reached the engine: with no abort known (no engine "
                                       "log), every request the engine held before the stop ended by itself, this "
                                       "one among them, by {by_s:.2f} s after it (vllm:request_success_total, "
                                       "which counts no abort, rose by {ends:.0f}: the {held:.0f} it held and "
                                       "{entering:.0f} that could have entered since), none of them before a cancel "
                                       "passed on would have reached it: it was still there {still_s:.2f} s after "
                                       "the stop and ran to its end for nobody"),
    "no_abort_still_there": Rule(LEAKED, "the cancel never reached the engine: no abort for this request in the "
                                 "engine's log, and it was still in the engine {after_s:.1f} s after the stop"),
    "already_finished_no_log": Rule(INCONCLUSIVE, "the engine had already finished the request before the stop "
                                    "(the server counted fewer requests than the client) and no engine log shows "
                                    "an abort: nothing was left to cancel"),
    "gone_may_have_run_out": Rule(INCONCLUSIVE, "with no abort known (no engine log), the count shows the request "
                                  "gone {after_s:.2f} s after the stop, and it may have run out {tokens} by then "
                                  "on its own: a release and a cancel lost on the way look the same (pass "
                                  "--engine-log with a vLLM started with --enable-log-requests to tell them apart)"),
    "no_baseline": Rule(INCONCLUSIVE, "no samples from the engine in the second before the stop: nothing shows what "
                        "the request held, so its release cannot be shown"),
    "released": Rule(RELEASED, "the server's count fell to the ledger's, and KV usage below its level at the stop "
                     "where the request held KV, within the grace after the abort", quiet=True),
    "no_samples_in_grace": Rule(INCONCLUSIVE, "too few samples from the engine across the grace ({samples} in "
                                "{grace_s:g} s): a scrape outage, nothing to judge the release by"),
    "gauges_not_refreshed": Rule(STALE_GAUGE, "no engine step refreshed the gauges within the grace: they are stale "
                                 "until the next step"),
    "kv_did_not_fall": Rule(INCONCLUSIVE, "the count reconciled but KV usage did not fall within the grace"),
    "finished_unseen": Rule(INCONCLUSIVE, "the count reconciled only with {unread} request(s) the engine had ended "
                            "by themselves (vllm:request_success_total rose) that no end the clients read accounts "
                            "for: requests whose clients had not read their end yet (a slow reader, a hop that "
                            "buffers) or other traffic's. Counted by the ledger and not by the engine, they may "
                            "stand in for this one: `cancelwatch report --grace` long enough to reach past their "
                            "ends tells"),
    "abort_logged_still_generating": Rule(LEAKED, "the engine logged the abort, yet still counts the request after "
                                          "the grace while it keeps generating: the abort did not free it"),
    "abort_logged_gauges_stale": Rule(STALE_GAUGE, "the engine logged the abort; the gauges stayed up but no tokens "
                                      "were generated: stale until the next step"),
    "still_counted_generating": Rule(LEAKED, "the server still counts the request after the grace while it keeps "
                                     "generating"),
    "still_counted_oldest_first": Rule(LEAKED, "the server still counts a request in this one's place after the "
                                       "grace while it keeps generating, and no abort is known; {others} other "
                                       "request(s) whose cancels were lost left at falls of the count that cannot "
                                       "say which left: taking the oldest to go first (as requests of one length "
                                       "do), it is this one"),
    "counted_beside_lost": Rule(INCONCLUSIVE, "the server still counts a request in this one's place after the "
                                "grace, and no abort is known; {others} other request(s) whose cancels were lost "
                                "left at falls of the count that the engine's own ends (vllm:request_success_total) "
                                "do not account for: those were aborts, and which request each took the count cannot "
                                "say (this one's cancel may have gone through while an older one stays)"),
    "gauges_stale": Rule(STALE_GAUGE, "gauges stayed up but no tokens were generated: stale until the next step"),
    # Triton (triton.py): the models' log lines, their gauges, the core's counters
    "model_cancelled_before_stop": Rule(INCONCLUSIVE, "the model logged a cancel of this request {before_ms:.0f} ms "
                                        "before the stop: it had ended before this cancel, which cannot show a "
                                        "release"),
    "model_ended_with_error": Rule(INCONCLUSIVE, "the model ended the request with an error ({detail}) {after_s:.2f} "
                                   "s after the stop, not on the cancel"),
    "natural_end_with_stop": Rule(INCONCLUSIVE, "the request's natural end came with the stop: a race the end may "
                                  "have won", race=True),
    "http_carries_no_cancel": Rule(LEAKED, "HTTP carries no cancel for a non-streaming request: the client's timeout "
                                   "closed only its own side, and the model ran the request to its end {after_s:.1f} "
                                   "s after the stop (its log)"),
    "backend_does_not_poll": Rule(LEAKED, "the backend does not poll is_cancelled: the cancel reached the server, yet "
                                  "the model ran the request to its end {after_s:.1f} s after the stop (its log)"),
    "cancel_never_reached_model": Rule(LEAKED, "the cancel never reached the model: the model ran the request to its "
                                       "end {after_s:.1f} s after the stop (its log)"),
    "released_on_log_alone": Rule(RELEASED, "no model gauge: the release rests on the model's own log line alone"),
    "gauge_did_not_fall": Rule(STALE_GAUGE, "the model logged the cancel, but its active gauge did not fall to its "
                               "other requests within the grace"),
    "model_kept_buffer": Rule(LEAKED, "the model logged the cancel and its active gauge fell, but its buffer gauge "
                              "never gave the request's share back within the {grace_s:g} s grace ({held_mib:.1f} "
                              "MiB still held beyond its other requests): the model's word is not a release"),
    "model_released": Rule(RELEASED, "the model logged the cancel within the grace and its active gauge fell to its "
                           "other requests", quiet=True),
    "dropped_in_queue": Rule(RELEASED, "the core dropped the request from its queue: its CANCELED failures for the "
                             "model rose within the grace", quiet=True),
    "due_to_end_with_stop": Rule(INCONCLUSIVE, "no server log, and the request was due to end with the stop: a race",
                                 race=True),
    "gauge_fell_end_unknown": Rule(INCONCLUSIVE, "no server log: the model's active gauge fell, but nothing says "
                                   "whether the request was due to end then anyway"),
    "gauge_fell_before_natural_end": Rule(RELEASED, "no server log: the release rests on the model's active gauge "
                                          "falling {early_s:.1f} s before the request's natural end"),
    "gauge_up_to_natural_end": Rule(LEAKED, "no server log; the model's active gauge stayed up until the request's "
                                    "natural end: it ran for nobody"),
    "gauge_up_through_grace": Rule(LEAKED, "no server log; the model's active gauge stayed up through the grace: it "
                                   "ran for nobody"),
    "steps_kept_rising": Rule(LEAKED, "no server log; the model's active gauge stayed up and its steps kept rising "
                              "through the grace"),
    "gauge_within_others": Rule(INCONCLUSIVE, "no server log; the model's count after the stop is within what its "
                                "other requests can make it: they, not this one, may be what it counts"),
    "gauge_up_no_steps": Rule(INCONCLUSIVE, "no server log; the model's count held the request through the grace, "
                              "but its steps did not rise: nothing says whether it still worked on it"),
    "no_gauge_reading": Rule(INCONCLUSIVE, "no server log, and no reading of the model's gauge between the stop and "
                             "{until}: nothing shows whether the request stayed"),
    "no_server_evidence": Rule(INCONCLUSIVE, "no server evidence names this request (no server log, no CANCELED "
                               "drop, no model gauge): the client's CANCELLED alone proves nothing"),
    "canceled_rise_shared": Rule(INCONCLUSIVE, "the core's CANCELED failures for the model rose within the grace, "
                                 "but {others} other request(s) of the model stopped before any answer may have been "
                                 "dropped from its queue in its place: which the core dropped cannot be told"),
    "never_named": Rule(INCONCLUSIVE, "the server log never names this request and the core counted no CANCELED "
                        "drop: nothing shows the server had it"),
    "still_running_at_end": Rule(LEAKED, "the model started the request and logged no cancel and no end: it was "
                                 "still running at the end of the run"),
}
# the rules that read the scheduler's count at a deciding sample: their evidence carries count_reading (the count,
# the fewest and the most other requests the engine could hold there, and the requests that keep those apart)
# (app_lost_unconfirmed carries one where a sample short of the ledger kept it open, none where too few samples or
# other traffic did)
COUNT_READING_RULES = frozenset({"released", "released_beside_traffic", "gauges_not_refreshed", "kv_did_not_fall",
                                 "finished_unseen", "abort_logged_still_generating", "abort_logged_gauges_stale",
                                 "still_counted_generating", "gauges_stale", "app_lost_cancel",
                                 "still_counted_oldest_first", "counted_beside_lost",
                                 # Triton's, without its log
                                 "gauge_fell_end_unknown", "gauge_fell_before_natural_end", "gauge_up_to_natural_end",
                                 "gauge_up_through_grace", "steps_kept_rising", "gauge_within_others",
                                 "gauge_up_no_steps",
                                 # Triton's: its CANCELED count, against the requests that may have made it
                                 "canceled_rise_shared"})
# what a verdict can rest on that its evidence alone does not show: code -> what is assumed. A verdict names those it
# rests on (evidence.assumes), and the report says where the run's own evidence contradicts one (run_assumptions)
ASSUMPTIONS = {
    "no_traffic_beside_the_run": "no request the run did not see reached the engine around the cancel: the engine's "
                                 "log names no requests (vLLM's default without --enable-log-requests), so the count "
                                 "cannot tell another client's request from this one",
    "lost_left_oldest_first": "the stopped requests with no abort known left the engine oldest first: a fall of the "
                              "count says how many left, not which",
    "counted_once_sent": "a request the client sent was in the engine's count within ENTER_S + LAG_S of its send "
                         "(analysis/bounds.py), before any of its tokens reached its client: a hop that held it longer "
                         "left its room in the count to this one",
    "traffic_beside_held_steady": "the requests the run did not send held steady through the cancel (as many as "
                                  "the model's count held beyond the run's at the stop; none where it held none): "
                                  "without its log, Triton's gauge cannot tell another client's request from this "
                                  "one, and the core's CANCELED count cannot tell another client's drop from this "
                                  "one's",
    "no_faster_than_the_pace_margin": "no sequence ran faster than the fastest one went alone in the window, a "
                                      "quarter added (analysis/bounds.py, PACE_MARGIN): the request could not have "
                                      "made its tokens sooner",
}
# the rules that show other traffic reaching the engine: where the run's own evidence contradicts
# no_traffic_beside_the_run
TRAFFIC_RULES = frozenset({"other_traffic_logged", "other_traffic_counted", "released_beside_traffic",
                           "no_abort_beside_traffic"})
# the rules, besides the count's readings, that read the engine's counters as the run's requests' alone (no log to
# name another's request)
NO_LOG_COUNT_RULES = frozenset({"gone_may_have_run_out", "ended_by_itself_after_stop"})


def run_assumptions(verdicts: list, traffic_beyond: str | None = None) -> list[dict]:
    """Per assumption the run's verdicts rest on (ASSUMPTIONS): what it is, which verdicts rest on it, and where the
    run's own evidence contradicts it (None: nowhere it can tell). `traffic_beyond`: the run's own evidence, beyond
    its cancels', of requests it did not send reaching the engine (its family's Family.traffic_beyond)."""
    out = []
    for code, what in ASSUMPTIONS.items():
        resting = [v.request_id for v in verdicts if code in (v.evidence.assumes or [])]
        if not resting:
            continue
        contradicted = None
        if code == "no_traffic_beside_the_run":
            seen = [v.request_id for v in verdicts if v.evidence.rule in TRAFFIC_RULES]
            said = [f"{len(seen)} cancel(s) of the run saw requests it did not send reach the engine "
                    f"({', '.join(seen[:3])}{', ...' if len(seen) > 3 else ''})"] if seen else []
            contradicted = "; ".join(said + ([traffic_beyond] if traffic_beyond else [])) or None
        out.append({"assumption": code, "what": what, "verdicts": len(resting), "request_ids": resting,
                     "contradicted": contradicted})
    return out


# the rules whose evidence concluded a race the completion won (the acceptance counts them apart)
RACE_RULES = frozenset(code for code, r in RULES.items() if r.race)
# run.info key: request id -> when an earlier verdict saw a request, stopped with no abort, leave the engine. A
# watch judges each cancel on a window of the run whose samples start just before its stop; a lost cancel
# judged before it left the engine before those samples, and without this the window's ledger would hold it
SEEN_LEAVING = "seen_leaving"
# the rules whose left_scheduler is when the request had left by, not when it left (others left beside it)
LEFT_BY_RULES = frozenset({"no_abort_left_among_others", "no_abort_left_oldest_first", "ended_by_itself_after_stop"})
# the rules whose left_scheduler rests on an assumption (which lost request a fall took): never told to the
# cancels judged after it as where the request left (judge_vllm's passes, a watch's windows)
ASSUMED_LEFT_RULES = frozenset({"no_abort_left_oldest_first"})


def left_seen_at(v: CancelVerdict) -> float | None:
    """When `v` saw its request leave the engine, as evidence for the cancels judged after it: None where it did
    not, where that time rests on the oldest-first reading (ASSUMED_LEFT_RULES), or where no engine log was read:
    that instant is then the count's own, read against the lost requests the count's surplus already holds
    (vllm.py, _gone_by_surplus), and told back it would take a request out where the count only shows that one
    of several left."""
    if v.rule in ASSUMED_LEFT_RULES or v.evidence.engine_log != "read":
        return None
    return v.timepoints.get("left_scheduler")
# the rules of a cancel that never reached the engine: its log names no abort of a request it ran on
LOST_CANCEL_RULES = frozenset({"no_abort_ran_to_end", "no_abort_still_there", "no_abort_left_among_others",
                               "no_abort_left_oldest_first", "ended_by_itself_after_stop"})


# ------------------------------------------------------------------------------------------ the ladder
@dataclass(kw_only=True, eq=False)
class Case:
    """One cancel on its way down the ladder: what its verdict will carry, and the facts the shared
    guards read, set by its family before the ladder runs. A family's case adds its own evidence and
    answers `foreign_traffic` and `restart` where it can tell them; the defaults say it cannot."""

    rid: str
    scenario: str | None
    phase: str | None
    terminal: str | None
    t_stop: float
    grace_s: float
    ev: Evidence
    tp: dict  # timepoint -> instant, s since the run started, or None
    sources: dict  # timepoint -> (source, reason why there is none)
    completed: bool = False  # the client read the request's end before the cancel took effect
    missed: dict | None = None  # the trigger_missed event's data: the scenario never got to cancel
    t_finished: float | None = None  # the engine's log: the request ran to its end then (None: no such line)
    t_abort: float | None = None  # the engine's abort after the stop, on the server's word
    abort_source: str | None = None  # what t_abort rests on (one of SOURCES)
    abort_resolution_s: float = 0.0  # what the abort's stamp is rounded down to

    def foreign_traffic(self) -> tuple[int | None, int]:
        """(requests the engine's log names that the ledger does not know, in the window; samples where the
        server counted more than the ledger before the stop). (None, 0): the family cannot tell."""
        return None, 0

    def restart(self) -> str | None:
        """How an engine restart shows inside the window, else None."""
        return None

    def judged_beside_traffic(self) -> bool:
        """Whether this cancel can be judged with other traffic in its window, on per-request evidence
        (an engine log naming every request): its family's rules then weigh that traffic themselves."""
        return False

    def log_gap(self) -> str | None:
        """How the engine log may have lost lines inside the window (a read error, a log cut short in
        place), when the verdict would rest on it; None where it lost none, or no log is read."""
        return None

    def lost_in_app(self) -> dict | None:
        """An explicit cancel the app answered while the request ran on to its end, past the grace: the
        sentence's fields (answer, tokens, after_s, grace_s), `confirmed`, whether the engine's evidence
        shows it went on with the request, and `doubt`, what stands in the way where it does not; None
        otherwise, or where the family cannot tell."""
        return None

    def samples_in_grace(self) -> int | None:
        """How many scheduler samples lie in the grace after the abort (or the stop), where the run recorded
        a hole in the scrapes there; None where it recorded none, or the family does not say."""
        return None

    def log_clock_off(self) -> dict | None:
        """When the verdict would rest on an engine log whose clock cannot be placed on the run's: the
        offsets its requests allow (lo_s above hi_s); None where it can, or no log is read."""
        return None

    def verdict(self, rule: str, **fields) -> CancelVerdict:
        """The verdict of `rule` (a key of RULES), its sentence filled with `fields`."""
        r = RULES[rule]
        self.ev.rule = rule
        self.ev.rule_fields = {k: _plain(v) for k, v in fields.items()} or None
        if not r.quiet:
            self.ev.why = r.sentence.format(**fields)
        if self.tp["left_scheduler"] is not None:
            self.sources["left_scheduler"] = ("samples", None)
        v = CancelVerdict(self.rid, self.scenario, self.phase, self.tp, r.verdict, self.ev, self.terminal)
        v.sources = {p: {"source": src, "reason": reason} for p, (src, reason) in self.sources.items()}
        return v


def _plain(value):
    """A rule's field as JSON holds it: numpy's numbers as Python's."""
    return value.item() if isinstance(value, np.generic) else value


Step = Callable[[Case], CancelVerdict | None]


def climb(case: Case, rules: Sequence[Step]) -> CancelVerdict | None:
    """The first verdict of `rules`, tried in order; None when none gives one."""
    for rule in rules:
        verdict = rule(case)
        if verdict is not None:
            return verdict
    return None


def app_lost_cancel(c: Case) -> CancelVerdict | None:
    # before the race: a request that ran to its end many tokens after an explicit cancel did not win a
    # race, the app lost the cancel (the client keeps reading until the app ends the stream)
    lost = c.lost_in_app() if c.completed else None
    if lost is None:
        return None
    c.ev.app_answer = lost["answer"]
    c.ev.count_reading = lost.pop("reading", None)
    if not lost.pop("confirmed"):
        return c.verdict("app_lost_unconfirmed", **lost)
    c.ev.kept_running_ms = round(lost["after_s"] * 1000, 1)
    return c.verdict("app_lost_cancel", **lost)


def ended_before_stop(c: Case) -> CancelVerdict | None:
    if not c.completed:
        return None
    if c.missed is not None:
        c.ev.race = None  # not a race at the end: the scenario never got to cancel where it meant to
        return c.verdict("trigger_never_reached", trigger=c.missed.get("trigger"))
    c.ev.race = "completed before the cancel took effect"
    return c.verdict("completion_won_race")


def log_clock_disagrees(c: Case) -> CancelVerdict | None:
    # an abort line, an Added line or their absence placed on a clock the run contradicts would be read
    # hours or seconds away from the stop: no verdict rests on it
    off = c.log_clock_off()
    return c.verdict("log_clock_disagrees", **off) if off else None


def engine_log_gap(c: Case) -> CancelVerdict | None:
    # a missing abort line or a missing Added line may be one the log lost: neither says anything then
    how = c.log_gap()
    return c.verdict("engine_log_gap", how=how) if how else None


def too_few_samples(c: Case) -> CancelVerdict | None:
    n = c.ev.samples_in_window
    if n >= MIN_SAMPLES:
        return None
    if not n:  # a scrape outage over the whole window, before the grace is looked at
        return c.verdict("no_samples")
    in_grace = c.samples_in_grace()
    if in_grace is not None and in_grace < 2:
        # the few there are came before the abort: what is missing is the grace, the stretch a verdict
        # reads, and that is the reason to give (an engine frozen, a scrape outage), not the rate
        return c.verdict("no_samples_in_grace", samples=in_grace, grace_s=c.grace_s)
    return c.verdict("too_few_samples", samples=n)


def other_traffic(c: Case) -> CancelVerdict | None:
    # requests the engine log names and the ledger does not know, or the server counting more than the
    # ledger before the stop: another client's requests would be read as this one's
    logged, counted = c.foreign_traffic()
    c.ev.foreign_requests = logged  # reported from this rung on, whatever the verdict
    if logged and not c.judged_beside_traffic():
        return c.verdict("other_traffic_logged", requests=logged)
    if logged:
        return None  # the log names every request, foreign ones too: the family's rules weigh them
    if counted >= 2:
        return c.verdict("other_traffic_counted", samples=counted)
    return None


def engine_restarted(c: Case) -> CancelVerdict | None:
    # gauges of a new engine start at 0: a release would be read into what is only a restart
    how = c.restart()
    return c.verdict("engine_restarted", how=how) if how else None


def finished_by_its_log(c: Case) -> CancelVerdict | None:
    if c.t_finished is not None and c.t_finished < c.t_stop - LOG_SLACK_S:
        return c.verdict("finished_before_stop")
    return None


def abort_after_grace(c: Case) -> CancelVerdict | None:
    if c.t_abort is None:
        return None
    # from here on the abort is this cancel's: every verdict below carries it. A stamp rounded down
    # (whole seconds), on a clock the run placed to within its spread, can read before the stop that
    # caused the abort: reported, it came no earlier than the stop (the checks below keep the stamp)
    c.tp["engine_abort"] = max(c.t_abort, c.t_stop)
    c.sources["engine_abort"] = (c.abort_source, None)
    late_s = c.t_abort - c.t_stop
    if late_s <= c.grace_s:
        return None
    # the abort came, but so late that the engine worked for nobody through the whole grace
    c.ev.kept_running_ms = round(late_s * 1000, 1)
    return c.verdict("abort_after_grace", late_s=late_s, grace_s=c.grace_s)


def abort_stamp_straddles_grace(c: Case) -> CancelVerdict | None:
    res = c.abort_resolution_s
    if c.t_abort is not None and c.t_abort + res - c.t_stop > c.grace_s:
        # a stamp rounded down to the second: the abort came somewhere in [stamp, stamp + 1 s)
        return c.verdict("abort_stamp_straddles_grace", resolution_s=res, from_s=c.t_abort - c.t_stop,
                         to_s=c.t_abort + res - c.t_stop, grace_s=c.grace_s)
    if res > 0.01:
        c.sources["engine_abort"] = (c.abort_source, f"the log places it to within {res:.3g} s (its stamps, its clock)")
    return None


# the rungs every cancel passes, in order, before its family's evidence rules
# (a restart comes before the log's gap: an engine restarted into its log cuts it short, and the restart
# is the reason to give)
GUARDS: tuple[Step, ...] = (app_lost_cancel, ended_before_stop, log_clock_disagrees, too_few_samples, other_traffic, engine_restarted,
                            engine_log_gap, finished_by_its_log, abort_after_grace, abort_stamp_straddles_grace)


def judge(case: Case, evidence_rules: Sequence[Step]) -> CancelVerdict:
    """The verdict of one cancel: the shared guards, then its family's evidence rules, the last of
    which always gives one."""
    verdict = climb(case, (*GUARDS, *evidence_rules))
    if verdict is None:
        raise ValueError(f"no rule judged {case.rid}: a family's last evidence rule must always give a verdict")
    return verdict
