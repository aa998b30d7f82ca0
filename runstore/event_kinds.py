"""The kinds of event a run holds: the one table of that vocabulary (`EVENT_KINDS`).

Per kind: who writes it (the modules, by import name), what the row's `request_id` is, and what its
`data` (stored as JSON) holds, field by field. Writers name their kinds as strings; the tests read the
writers' source and hold it to this table both ways (tests/test_event_kinds.py), and hold docs/run-format.md
("What a run holds") to it. Times are the row's `wall_ns`/`mono_ns`; an event from an engine's log is
stamped with the engine's clock as the line says it (`clock`, `resolution_s`).
"""

from __future__ import annotations

from dataclasses import dataclass

RUNNER = "collectors.cancels.runner"
DRIVER = "collectors.cancels.driver"
TRITON_DRIVER = "collectors.cancels.triton_driver"
ENGINE_LOG = "collectors.sources.engine_log"
TRITON_LOG = "collectors.sources.triton_log"
TAP = "collectors.sources.tap"
WATCH = "collectors.recording.watch_ledger"

# every event the drivers write carries it (collectors/cancels/driver.py: event_record)
METRICS_TARGET = ("metrics_target", "label of the target whose scheduler the driver watched")
# every event read off an engine's log carries them
LOG_DATA = (
    ("engine_request_id", "the request's id as the engine logged it"),
    ("clock", "engine_log: the time is the engine's, as its line says it"),
    ("resolution_s", "seconds, the log's time resolution (0.001: milliseconds; 1: vLLM's default format)"),
    ("target", "label of the engine whose log it is"),
)
TRITON_LOG_DATA = (
    ("model", "Triton only: the model that logged the line"),
    ("detail", "Triton only: the line's event and what follows it (`started ms=500 poll=true`)"),
)


@dataclass(frozen=True)
class EventKind:
    """name: the `kind` stored; written_by: the modules that write it; about: the moment it marks;
    request_id: whose id the row's request_id is ("" where it has none); data: (field, meaning) of
    each key its `data` may hold (a family's own keys say so)."""

    name: str
    written_by: tuple[str, ...]
    about: str
    request_id: str
    data: tuple[tuple[str, str], ...]

    @property
    def fields(self) -> tuple[str, ...]:
        return tuple(f for f, _ in self.data)


_KINDS = (
    EventKind("scenario_start", (RUNNER,), "a scenario's repeat begins", "", (
        ("scenario", "the scenario's name"),
        ("repeat", "index of this repeat, from 0"),
        ("proves", "what the scenario is built to show, in words"),
        ("expect", "Triton only: the verdict the scenario is built to show"),
        METRICS_TARGET)),
    EventKind("scenario_end", (RUNNER,),
              "a scenario's repeat is over: its requests ended and the grace window was sampled", "", (
                  ("scenario", "the scenario's name"),
                  ("repeat", "index of this repeat, from 0"),
                  METRICS_TARGET)),
    EventKind("request_sent", (TRITON_DRIVER,), "Triton only: a request goes out", "the request's client id", (
        ("scenario", "the scenario's name"),
        ("role", "target | neighbour | probe | filler"),
        ("model", "the Triton model asked"),
        ("call", "the way the request is made and given up on (the scenario's call)"),
        ("call_object", "the tritonclient call it maps to"),
        ("protocol", "grpc | http"),
        METRICS_TARGET)),
    EventKind("user_stop", (DRIVER, TRITON_DRIVER, WATCH),
              "the driver decides to cancel (the client's clock); a watch: a real client left, as its tap saw it",
              "the cancelled target's client id", (
                  ("scenario", "the scenario's name"),
                  ("phase", "where the request was: prefill | queued | decode | completed | in_flight (a timeout), "
                            "or the Triton scenario's phase"),
                  ("cancel_id", "the cancel's id, shared by its trace events"),
                  ("mode", "how it gives up: the scenario's mode (vLLM), call (Triton), client_gone (a watch)"),
                  ("tokens_at_cancel", "content chunks received when it stopped"),
                  ("raised_after_deadline_ms", "vLLM timeout mode: milliseconds from the deadline to the client's "
                                               "timeout raising (None: it never raised)"),
                  ("model", "Triton only: the model asked"),
                  ("expect", "Triton only: the verdict the scenario is built to show"),
                  ("engine", "Triton only: triton"),
                  ("inputs", "Triton only: the request's inputs, what it would have done on its own"),
                  ("step_s", "Triton only: seconds between responses as the client saw them (None: fewer than two)"),
                  ("sent_mono_ns", "Triton only: when the request was sent (monotonic ns)"),
                  METRICS_TARGET)),
    EventKind("trigger_missed", (DRIVER, TRITON_DRIVER),
              "the cancel went out, but not where the scenario meant (its trigger never held)",
              "the first target's client id", (
                  ("scenario", "the scenario's name"),
                  ("trigger", "the trigger that was not met"),
                  ("trigger_value", "vLLM only: the trigger's value (ms or tokens)"),
                  ("chunks", "per target, content chunks received by then"),
                  ("done", "per target, whether it had ended by then"),
                  ("running", "the scheduler's running requests, last sampled"),
                  ("waiting", "the scheduler's waiting requests, last sampled"),
                  METRICS_TARGET)),
    EventKind("app_answered", (DRIVER,), "the app answered the explicit cancel call (the client's clock)",
              "the cancelled target's client id", (
                  ("cancel_id", "the cancel's id (the user_stop's)"),
                  ("answer", "what the app said: its `result` (relay_app: abort_sent, abort_failed, abort_unconfirmed, "
                             "abort_pending, rejected_not_owner, kept_until_registered, not_here, already_completed, "
                             "...), `HTTP <status>` without one, or `no answer: <error>`"),
                  ("source", "app: who said it"),
                  METRICS_TARGET)),
    EventKind("app_received", (DRIVER,), "the cancel reached the request's task in the relay app (its clock)",
              "the cancelled target's client id", (
                  ("cancel_id", "the cancel's id (the user_stop's)"),
                  ("source", "relay: who measured it"),
                  METRICS_TARGET)),
    EventKind("engine_abort", (DRIVER,), "the relay app's abort() of the request returned (the relay's word)",
              "the cancelled target's client id", (
                  ("cancel_id", "the cancel's id (the user_stop's)"),
                  ("source", "relay: who measured it"),
                  METRICS_TARGET)),
    EventKind("client_closed", (DRIVER, TRITON_DRIVER, WATCH),
              "the client was done with the stopped request (its own view, never the server's evidence)",
              "the stopped target's client id", (
                  ("cancel_id", "the cancel's id (the user_stop's)"),
                  ("source", "who measured it: client, or tap (a watch: the tap saw the client's close)"),
                  ("client_saw", "Triton only: how the call ended for the client (CANCELLED, a deadline, ...)"),
                  METRICS_TARGET)),
    EventKind("probe_sent", (RUNNER,), "the probe goes out into the capacity the cancel freed",
              "the probe's client id", (
                  ("scenario", "the scenario's name"),
                  METRICS_TARGET)),
    EventKind("engine_not_idle", (RUNNER,),
              "the wait for an idle engine ran out: the next scenario starts beside work the client does not know",
              "", (
                  ("waited_s", "seconds waited"),
                  ("running", "the scheduler's running requests, last sampled"),
                  ("waiting", "the scheduler's waiting requests, last sampled"),
                  ("token_s", "vLLM only: the slowest seconds per token seen, which the wait followed"),
                  ("first_token_s", "vLLM only: the slowest seconds to a first token seen"),
                  ("left_tokens", "vLLM only: the most tokens a cancelled target could still generate"),
                  METRICS_TARGET)),
    EventKind("engine_added", (ENGINE_LOG, TRITON_LOG),
              "the engine's log says a request entered it (vLLM `Added request`, a Triton model's started)",
              "the client id read back from the engine's id (None: not cancelwatch's, someone else's traffic)",
              (*LOG_DATA, *TRITON_LOG_DATA)),
    EventKind("engine_aborted", (ENGINE_LOG, TRITON_LOG),
              "the engine's log says it aborted a request (vLLM `Aborted request(s)`, a Triton model's cancelled)",
              "the client id read back from the engine's id (None: not cancelwatch's)",
              (*LOG_DATA, *TRITON_LOG_DATA)),
    EventKind("engine_log_gap", (ENGINE_LOG,),
              "the engine log was cut short in place (copytruncate, an engine restarted into it): lines written "
              "between the last read and this instant may be lost", "None", (
                  ("target", "label of the target whose log it is"),
                  ("from_mono_ns", "monotonic ns of the last read before: the stretch a line may be missing from"),
                  ("why", "what happened to the log, in words"))),
    EventKind("engine_finished", (TRITON_LOG,),
              "Triton only: a model's log says a request ended on its own (finished, or an error)",
              "the request's client id", (*LOG_DATA, *TRITON_LOG_DATA)),
)

# every event a tap writes carries them
TAP_DATA = (("hop", "the tap's name: the component it feeds"),
            ("conn", "the connection's number at that tap, from 1"))
# what passed of a request's response body, where a tap event names a request
BODY_DATA = (("chunks", "SSE data events of the response that passed (a token each on a stream; [DONE] not "
                        "counted)"),
             ("first_body_mono_ns", "monotonic ns of the response body's first byte (None: none passed)"),
             ("sse_done", "the stream's last event (`data: [DONE]`), or a chunk with a finish_reason for each choice "
                          "the request asked for, had passed: the answer was whole, whatever the transport's framing "
                          "did after"))
_TAP_KINDS = (
    EventKind("tap_accepted", (TAP,), "a tap accepted a connection from the component before it (or the client)",
              "None", TAP_DATA),
    EventKind("tap_request", (TAP,), "a request head passed a tap (read passively; the bytes pass unchanged)",
              "the request's X-Request-Id as it passed (None: none)", (
                  *TAP_DATA,
                  ("seq", "the request's index on its connection, from 0 (a kept-alive connection carries several)"),
                  ("method", "the request's method"),
                  ("path", "the request's target, up to 200 characters"))),
    EventKind("tap_response", (TAP,), "the first bytes of a request's response passed the tap",
              "the request's X-Request-Id", (*TAP_DATA, ("seq", "the request's index on its connection"),
                                             ("status", "the response's HTTP status"))),
    EventKind("tap_request_body", (TAP,), "a request's body passed the tap to its end (read for what it asks)",
              "the request's X-Request-Id", (
                  *TAP_DATA, ("seq", "the request's index on its connection"),
                  ("model", "the body's `model` (None: not said, or not JSON)"),
                  ("stream", "the body's `stream`"),
                  ("max_tokens", "the body's `max_tokens` (or `max_completion_tokens`)"),
                  ("n", "the body's `n`"))),
    EventKind("tap_response_end", (TAP,), "a request's response passed the tap to its end",
              "the request's X-Request-Id", (*TAP_DATA, ("seq", "the request's index on its connection"),
                                             *BODY_DATA)),
    EventKind("tap_closed", (TAP,),
              "one side of a connection through a tap closed: the tap passed it on at once, as it came",
              "the X-Request-Id of the request whose response was open, else of the connection's last", (
                  *TAP_DATA,
                  ("side", "who closed: client (the component before the tap) or upstream (the one it feeds)"),
                  ("how", "fin (a close, or a half-close: 'I send no more') or rst (a reset)"),
                  ("open_seq", "the request whose response had not ended (None: none was open)"),
                  ("response_ended", "whether the connection's last response had passed to its end"),
                  *BODY_DATA)),
    EventKind("tap_connection_end", (TAP,), "a connection through a tap is over, both sides closed",
              "the X-Request-Id of the request whose response was open (None: none was)", (
                  *TAP_DATA,
                  ("open_seq", "the request whose response never ended (None: none was open)"),
                  ("closed", "side -> fin | rst, as each side closed (a side the tap reset is not in it)"),
                  ("by_tap", "the sides the tap reset on the other's behalf"),
                  ("client_gone", "after a client's FIN: whether its socket was closed (the bytes passed after "
                                  "the FIN met a reset), not half-closed and reading (None: no FIN, or not known)"),
                  *BODY_DATA)),
    EventKind("page_stop", (TAP,),
              "a page reported its user's Stop (a POST to /cancelwatch/stop on its way to the app): the page's word, "
              "read by the tap (analysis/page_stops.py)",
              "the request the page says it stopped (its X-Request-Id; None: not said)", (
                  *TAP_DATA, ("seq", "the report's index on its connection"),
                  ("task_id", "the page's own id for the answer it stopped (its front end's task id)"),
                  ("clicked_wall_ms", "the Stop click, ms since 1970 on the page's clock"),
                  ("sent_wall_ms", "the report's sending, ms since 1970 on the page's clock"),
                  ("why", "why the report cannot be read (not JSON); None where it can"))),
    EventKind("app_receipt", (TAP,),
              "an app reported that its client left before the answer's end (a POST to /cancelwatch/received it sends "
              "upstream): the app's own word on receiving the cancel, read by a tap behind it (analysis/page_stops.py)",
              "the request the app says its client left (its X-Request-Id; None: not said)", (
                  *TAP_DATA, ("seq", "the report's index on its connection"),
                  ("received_wall_ms", "the app seeing its client leave, ms since 1970 on the app's clock"),
                  ("sent_wall_ms", "the report's sending, ms since 1970 on the app's clock"),
                  ("why", "why the report cannot be read (not JSON); None where it can"))),
    EventKind("tap_unparsed", (TAP,), "a tap cannot read the connection as HTTP/1.1: it passes it on untouched",
              "None", (*TAP_DATA, ("why", "why, in words (`encrypted: no request id` for TLS)"))),
    EventKind("tap_refused", (TAP,),
              "a connection past the tap's bound (watch --max-connections): the tap answered it 503 itself and "
              "closed it; it never reached the upstream",
              "None", (*TAP_DATA, ("open", "the connections open through the tap then"))),
    EventKind("tap_upstream_failed", (TAP,),
              "a tap could not reach its upstream for a connection: its client was reset, as a refusal is",
              "None", (*TAP_DATA, ("why", "the error"))),
)

EVENT_KINDS: dict[str, EventKind] = {k.name: k for k in (*_KINDS, *_TAP_KINDS)}
# the kinds stamped with an engine's clock as its log says it (their data has `clock`): a log in another zone
# than the recorder's puts them hours from the run's other events, until the analysis places that clock
ENGINE_CLOCK_KINDS: tuple[str, ...] = tuple(k.name for k in EVENT_KINDS.values()
                                            if any(name == "clock" for name, _ in k.data))
