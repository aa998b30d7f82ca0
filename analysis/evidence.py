"""What a verdict rests on: the numbers `judge_run` read for one cancel, with their units.

Instants are seconds since the run started; durations carry their unit in the name. `judge_run`
stops at the first check a cancel does not pass, so a field is reported (the `evidence` of
`cancelwatch report --json`) only once its stage was reached. A reached field keeps its key even
when its value is unknown (None); an unreached one has no key, so a reader of the JSON can tell
"not measured" from "measured, nothing there":

  always                 grace_s, metrics_target, samples_in_window
  every vLLM verdict     count_before, ledger_before, with kv_before (NaN with no sample in the second before
                         the stop): the second before the stop, written with the verdict whichever rule gave it
  past the traffic guard foreign_requests, where an engine log is read
  past foreign traffic   kv_drop_s, with release_ms (released) or engine_stepping (not released)
  not released           excess_max, excess_at_grace_end, generation_tokens_delta, with engine_stepping
  every judged cancel    rule (the code of the rule that gave the verdict), with why where it says one and
                         rule_fields where its sentence has figures
  any other field        when it is not None
"""

from __future__ import annotations

from dataclasses import Field, dataclass, field, fields

ALWAYS = "always"
REPORTED_WITH = "reported_with"


def _always():
    return field(metadata={ALWAYS: True})


def _with(*anchors: str):
    """Reported whenever one of `anchors` is not None, even when this field is None."""
    return field(default=None, metadata={REPORTED_WITH: anchors})


@dataclass(kw_only=True)
class Evidence:
    """One cancel's evidence (field order is the JSON's key order).

    grace_s: duration, s the scheduler had to reconcile after the abort
    metrics_target: label of the target whose scheduler metrics judged this cancel
    race: set when the request completed on its own before the cancel took effect
    samples_in_window: count of scheduler samples from 1 s before the stop to the end of the grace
    count_before: requests the server counted (running + waiting) in the last sample before the user
        stop; None when no sample in the second before it
    ledger_before: sequences the client's ledger had in the server at that sample; None when no sample
    note: why the server counted fewer requests than the ledger before the stop
    kv_before: KV-cache usage ratio (0..1) in the last sample before the user stop; NaN when no sample
    kv_drop_s: instant, s since the run started, of the first sample at or after the abort with KV
        usage below kv_before; None when it did not fall in the stretch followed
    kv_drop_waived: why a release was not asked to show KV usage falling though the request held KV at
        its stop: "preempted" (the scheduler preempted a request in the window: this one's blocks may
        have gone back before the stop), "prefix_shared" (the prefix cache gave it part of its prompt
        while another request of the run ran beside it: those blocks stay held), "taken_in_its_place"
        (a request the count did not hold at the stop entered it, with KV usage no higher than at the stop:
        the newcomer's prefill took the freed blocks), "seat_taken" (every seat of the engine taken before the abort,
        max_num_seqs of its shape, and the request waiting behind it let in with nothing else leaving: its seat
        and blocks were this one's, whatever the newcomer's prompt took besides),
        "blocks_of_the_running" (no more blocks in use than running requests, with no prefix-cache hit or
        preemption since the first entered: each holds one of its own, none is left for this one); both
        read only where the count is exactly the other requests of the ledger that are surely counted (their
        first token had reached their client): not this one; None when it was asked
    count_after: requests the server counted in the sample that showed the release
    ledger_after: sequences the ledger had in the server at that sample
    kv_after: KV-cache usage ratio (0..1) at that sample
    count_reading: what the deciding sample's count was read against (a release's first reconciled sample,
        else the grace's last refreshed one; a lost cancel's, the first sample short of the ledger, else the
        grace's last read one): {at_s, count, others_fewest, others_most, compared_with, open},
        others_fewest/most the fewest and the most of the other requests the engine could hold there (the
        ledger's, less those it may not count yet or had ended unread; more those it ended after the engine's
        last step), compared_with the bound the rule held the count to, and open the requests that keep the
        two apart: {request_id, reason} with reason first_token_not_at_client, ended_after_engines_last_step or
        ended_by_itself_unread (request_id None, with their count), and for a lost cancel's reading (app_lost_*)
        end_read_within_lag, sent_within_lag or sent_during_its_scrape, and for a leak read past other lost
        requests (still_counted_oldest_first) assumed_left_oldest_first; for Triton without its log
        sent_within_lag (this one's too, sent just before the reading the change is read from),
        end_read_within_lag, stopped_no_server_end and model_not_named (OPEN_REASONS holds them all); None where
        no count decided
    release_ms: duration, ms from engine abort (the completion, for a race) to left scheduler
    samples_to_release: count of samples from the first at or after the abort to the one that showed
        the release, both included
    probe: "not admitted" when a released cancel's probe never got a first token
    excess_max: requests, the most the server counted beyond the ledger within the grace; None when
        no sample in the grace
    excess_at_grace_end: requests the server counted beyond the ledger at the last refreshed sample at or
        before the end of the grace (the last sample there when none was refreshed): what "still counted
        after the grace" is judged on, never the maximum inside it. Where the count there was within the
        ledger's only by other requests it ended after the engine's last step (the gauges may count them
        still), read at the first sample whose gauges hold those ends
    engine_stepping: generation_tokens_total rose within the grace: the engine kept stepping
    generation_tokens_delta: tokens generated by the whole engine within the grace; None with fewer
        than two samples
    gauges_refreshed: a sample in the grace moved (count, KV or tokens) since the last one before the
        abort: the gauges were refreshed by an engine step
    engine_log: "read" when the engine's own log was followed for this target, else why not
    foreign_requests: count of requests the ledger does not know that entered the engine (its log)
        inside this cancel's window
    lagging_clients: ids of the scenario's requests the engine had finished while their client still read
        them (a slow reader, a buffering proxy): the ledger ends each where the server's count fell with no
        abort line for it, not at its client's close; None when there were none
    log_named_as: the id the engine's log names this request by, where something on the path replaced its
        X-Request-Id with its own: matched as the only unknown request that entered the engine between its
        send and its first token (analysis/verdicts/log_ids.py); None when the log names it by the ledger's
    app_answer: what the app answered an explicit cancel the request then ran on past (`abort_sent`,
        `not_here`, `HTTP 404`, `no answer: ConnectError`, ...)
    kept_running_ms: duration, ms the request stayed in the engine after the stop (from its entry, where the
        engine took it only after the stop) with no abort in the engine's log (a lost cancel); None while it
        was still there at the end of the stretch followed; at least this long where other lost requests
        beside it left with it (no_abort_left_among_others: left_scheduler is then when it had left by)
    tokens_after_client_left: count, tokens the engine generated after the stop for a leaked request, off its
        generation_tokens_total up to the sample showing the request gone (or the end of the stretch followed);
        None where the samples cannot say (analysis/verdicts/paid_tokens.py)
    tokens_after_client_left_is: "attributed" (the engine held nothing else then: all its tokens were this
        request's) or "at_most" (others ran beside it: a bound)
    tokens_for_nobody_at_most: count, tokens the engine made that reached none of the run's clients, at most, from
        the last instant before the request's send with no request of the run open to the sample that shows it gone:
        generation_tokens_total's rise less the chunks the clients got (record counts them). Fewer than the request
        still had to make: it did not run out on its own, the cancel took it out (no request log needed)
    model: Triton: the model that served the request
    server_phase: Triton: queued | executing at the stop, by the model's log (started before it or not)
    expected: the verdict the scenario is built to show (Triton's deaf and HTTP-timeout cases: leaked)
    buffer_kept_bytes: Triton: bytes the model's buffer gauge held beyond its other requests' share at the
        lowest sample of the grace after the cancel, where it never gave this request's share back
    canceled_failures_delta: Triton: count the core's failure{reason="CANCELED"} rose by for the model
        in the grace (a queued request dropped)
    stopped_at: the component of the path where the cancel stopped (the taps of `record --hop` saw its
        client side close, and its upstream stay open past the grace); None where it did not stop at a hop
    path: the cancel's way through the taps in one sentence (analysis/hops.py); None without taps
    client_left_s: where the client side closed, s since the run started, where the user_stop timepoint is the
        page's Stop click instead (analysis/page_stops.py): what the grace and the ghosts' ages count from; None
        where the user_stop is that close itself
    rule_fields: the values the rule's sentence is filled with, by name (docs/rules.md lists them per rule:
        after_s, late_s, how, samples, ...): the figures of `why` as data; None for a rule with none
    assumes: the assumptions the verdict rests on where the evidence alone does not decide (codes of
        analysis.verdicts.ASSUMPTIONS, each with what is assumed); None where it rests on none
    rule: the code of the rule that gave the verdict (a key of analysis.verdicts.RULES, with its sentence)
    why: one sentence, why the verdict is not released (the rule's sentence, filled in)
    """

    grace_s: float = _always()
    metrics_target: str | None = _always()
    race: str | None = None
    samples_in_window: int = _always()
    count_before: float | None = _with("kv_before")
    ledger_before: float | None = _with("kv_before")
    note: str | None = None
    kv_before: float | None = None
    kv_drop_s: float | None = _with("release_ms", "engine_stepping")
    kv_drop_waived: str | None = None
    count_after: float | None = None
    ledger_after: float | None = None
    kv_after: float | None = None
    count_reading: dict | None = None
    release_ms: float | None = None
    samples_to_release: int | None = None
    probe: str | None = None
    excess_max: float | None = _with("engine_stepping")
    excess_at_grace_end: float | None = _with("engine_stepping")
    engine_stepping: bool | None = None
    generation_tokens_delta: float | None = _with("engine_stepping")
    gauges_refreshed: bool | None = None
    engine_log: str | None = None
    foreign_requests: int | None = None
    lagging_clients: list[str] | None = None
    log_named_as: str | None = None
    app_answer: str | None = None
    kept_running_ms: float | None = None
    tokens_after_client_left: float | None = _with("tokens_after_client_left_is")
    tokens_after_client_left_is: str | None = None
    tokens_for_nobody_at_most: float | None = None
    model: str | None = None
    server_phase: str | None = None
    expected: str | None = None
    canceled_failures_delta: float | None = None
    buffer_kept_bytes: float | None = None
    stopped_at: str | None = None
    path: str | None = None
    client_left_s: float | None = None
    rule_fields: dict | None = None
    assumes: list | None = None
    rule: str | None = None
    why: str | None = None

    def as_json(self) -> dict:
        """The reported fields, in field order; NaN stays NaN (json.dumps writes it as NaN)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if self._reported(f)}

    def _reported(self, f: Field) -> bool:
        if f.metadata.get(ALWAYS) or getattr(self, f.name) is not None:
            return True
        return any(getattr(self, anchor) is not None for anchor in f.metadata.get(REPORTED_WITH, ()))


# the reasons a request keeps the fewest and the most of a count reading apart, in words
OPEN_REASONS = {"first_token_not_at_client": "first token not at its client yet",
                "ended_after_engines_last_step": "ended after the engine's last step",
                "ended_by_itself_unread": "ended by the engine, its client still reading",
                # a lost cancel's reading (app_lost_*): the ledger's requests around the sample the engine may
                # not hold though the ledger does, or hold though the ledger does not yet
                "end_read_within_lag": "its end read by its client just after the sample",
                "sent_within_lag": "sent just before the sample",
                "sent_during_its_scrape": "sent while the sample's scrape was being answered",
                # a lost request the ledger took out at a fall of the count, oldest first: it may be there still
                "assumed_left_oldest_first": "taken to have left first, as the oldest of the lost",
                # Triton's, without its log: a request its client stopped; a send that names no model
                "stopped_no_server_end": "stopped by its client; nothing shows the server let it go",
                "model_not_named": "its send names no model: it may be this model's",
                # Triton's CANCELED count: a request the core may have dropped from its queue in this one's place
                "stopped_may_have_been_dropped": "stopped by its client before any answer: the core may have "
                                                 "dropped it"}


def count_reading_text(reading: dict | None) -> str:
    """Evidence.count_reading in words: `count 1 at 2.80 s, other requests 0 to 2, held to 2 (sdk-full-00: ended
    after the engine's last step)`; empty where no count decided."""
    if not reading:
        return ""
    text = (f"count {reading['count']:g} at {reading['at_s']:.2f} s, other requests {reading['others_fewest']:g} "
            f"to {reading['others_most']:g}")
    if reading.get("compared_with") is not None:
        text += f", held to {reading['compared_with']:g}"
    why = [f"{o['request_id'] or str(o.get('count', '')) + ' unnamed'}: {OPEN_REASONS.get(o['reason'], o['reason'])}"
           for o in reading.get("open", [])]
    return text + (f" ({'; '.join(why)})" if why else "")
