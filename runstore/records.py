"""What a run is made of, as the writer takes it: one sample record, and the records of scrapes, gaps,
cancel events and the client's request ledger. Units are in the names and the docstrings; every clock
is `time.monotonic_ns()` (`*_mono_ns`) or `time.time_ns()` (`*_wall_ns`)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

Labels = tuple[tuple[str, str], ...]


def freeze_labels(labels: dict[str, str] | None) -> Labels:
    return tuple(sorted((labels or {}).items()))


@dataclass(frozen=True)
class Sample:
    """One value of one series at one instant.

    `wall_ns` is time.time_ns() and `mono_ns` time.monotonic_ns(), both taken when the scrape
    that produced the value started; every sample of one scrape shares them.
    """

    source: str
    metric: str
    value: float
    labels: Labels
    wall_ns: int
    mono_ns: int

    def label(self, key: str, default: str | None = None) -> str | None:
        return dict(self.labels).get(key, default)


@dataclass
class ScrapeRecord:
    """One read of one source.

    source: kind of source (vllm, process, nvml); target: label of what it read
    tick: index of the scheduled tick this read served
    wall_ns, mono_ns: when the read started
    duration_ns: how long the read took
    ok: True when `samples` holds what it read; False: the read failed (a gap says why)
    """

    source: str
    target: str
    tick: int
    wall_ns: int
    mono_ns: int
    duration_ns: int
    ok: bool
    samples: list[Sample] = field(default_factory=list)


@dataclass
class GapRecord:
    """A stretch in which a source gave no samples.

    kind: missed (ticks not read) | error (reads failed) | parse_error (answers unparseable) | lost (a
    critical source failed past `lost_after`)
    start_wall_ns, start_mono_ns, end_mono_ns: the stretch
    ticks: scheduled ticks that gave no samples
    detail: the last error, or why ticks were missed
    """

    source: str
    target: str
    kind: str
    start_wall_ns: int
    start_mono_ns: int
    end_mono_ns: int
    ticks: int
    detail: str = ""


@dataclass
class EventRecord:
    """A moment of a scenario, of the cancel trace or of an engine's log: `kind`, when, for which request,
    and what else is known (`data`, stored as JSON).

    The kinds, who writes each, what its request_id is and what its data holds, field by field, are the
    table `runstore/event_kinds.py: EVENT_KINDS`; a kind outside it is written, and flagged by the writer.
    """

    kind: str
    wall_ns: int
    mono_ns: int
    request_id: str | None = None
    data: dict = field(default_factory=dict)


# the scenario of every request a watch saw (collectors/recording/watch_ledger.py): real traffic, whose bodies the
# recorder did not write. The driver's own requests ask for max_tokens with ignore_eos: each runs to its length
WATCHED_SCENARIO = "watched"


@dataclass
class LedgerRecord:
    """What the client knows of one request.

    request_id: the client's id, sent as X-Request-Id
    role: target | neighbour | probe | filler
    n: sequences the server runs for it (the n of a completion)
    prompt_tokens, max_tokens: tokens asked for
    sent_mono_ns: when the request was sent; first_token_mono_ns: its first streamed token
    chunks: content chunks received (one token each on the tiny model's streams)
    tokens_after_cancel: content chunks received after the cancel was issued
    cancel_mono_ns: when the cancel was issued; closed_mono_ns: when the client was done with it
    terminal_state: completed | cancelled | error; reason: finish_reason or how it was cancelled
    """

    request_id: str
    scenario: str
    role: str
    n: int = 1
    prompt_tokens: int = 0
    max_tokens: int = 0
    sent_mono_ns: int | None = None
    first_token_mono_ns: int | None = None
    chunks: int = 0
    tokens_after_cancel: int = 0
    cancel_mono_ns: int | None = None
    closed_mono_ns: int | None = None
    terminal_state: str | None = None
    reason: str | None = None
    error: str | None = None


@dataclass
class DriveSettings:
    """How a run's scripted cancels were driven, stored in the run's settings under `extra`.

    driven_target: the URL the scenarios talked to (an engine, a gateway or a proxy)
    scenarios: the scenario names run, in order
    grace_s: duration, seconds the scheduler had to reconcile after an abort
    model: the served model the requests named
    relay_url: the relay app given with --relay-url (None: started by cancelwatch when needed)
    """

    driven_target: str | None = None
    scenarios: list[str] = field(default_factory=list)
    grace_s: float | None = None
    model: str | None = None
    relay_url: str | None = None

    @classmethod
    def of_run(cls, settings: dict) -> DriveSettings:
        """From a run's stored settings; a run without scripted cancels gives all None."""
        stored = (settings or {}).get("extra") or {}
        return cls(**{f.name: stored[f.name] for f in fields(cls) if f.name in stored})
