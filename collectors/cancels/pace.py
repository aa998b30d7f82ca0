"""How long the engine may still be busy after a scenario: from the pace its own streams showed.

A target whose cancel was lost keeps generating until its max_tokens. The driver waits for the engine
to go idle before the next scenario, or that scenario's verdicts meet work the client no longer knows of
(and say `inconclusive`, rightly). How long that takes is the engine's speed times what is left: a CPU
engine under a quota, a loaded GPU or a long max_tokens all outlast a fixed wait. The pace is measured in
the scenario itself, from the streams that ran to their end beside the cancelled ones (the neighbour, the
fillers, the probe): the slowest of them, since a leaked request runs at least as fast once alone.
"""

from __future__ import annotations

from dataclasses import dataclass

# the wait never drops under this: a scenario without a stream to measure (all non-streaming) keeps
# what the driver always allowed
FLOOR_S = 90.0
# nor grows past this: a scenario asking for 100k tokens on a slow engine says `engine_not_idle` after
# 15 minutes rather than hold the run for hours
CEILING_S = 900.0
# what is left is estimated at the slowest pace seen, then given half again and 10 s (prefill of a
# target cancelled while queued, the scheduler's own step)
MARGIN, SLACK_S = 1.5, 10.0


@dataclass(frozen=True)
class IdleWait:
    """timeout_s: how long to wait for an idle engine; token_s: the slowest decode interval seen (s per
    token, None: no stream to measure); first_token_s: the slowest time to first token seen; left_tokens:
    the most tokens a cancelled target could still generate per sequence."""

    timeout_s: float
    token_s: float | None
    first_token_s: float | None
    left_tokens: int


def _stream_pace(row) -> tuple[float, float] | None:
    """(s per token, s to first token) of a stream that completed with at least two tokens per sequence."""
    if row.terminal_state != "completed" or None in (row.sent_mono_ns, row.first_token_mono_ns, row.closed_mono_ns):
        return None
    per_seq = row.chunks / max(1, row.n)
    if per_seq < 2:
        return None
    return ((row.closed_mono_ns - row.first_token_mono_ns) / 1e9 / (per_seq - 1),
            (row.first_token_mono_ns - row.sent_mono_ns) / 1e9)


def idle_wait(reqs: list) -> IdleWait:
    """The wait for an idle engine after a scenario whose requests (Request objects, streaming or not)
    have all ended on the client's side: those that completed give the pace; any that did not (cancelled
    targets, a request the client gave up on) may still run in the engine up to their max_tokens."""
    paces = [p for p in (_stream_pace(r.row) for r in reqs if r.stream) if p is not None]
    token_s = max((p[0] for p in paces), default=None)
    first_s = max((p[1] for p in paces), default=None)
    left = 0
    for r in reqs:
        row = r.row
        if row.terminal_state == "completed":
            continue  # nothing of it is left in the engine
        got = row.chunks / max(1, row.n) if r.stream else 0
        left = max(left, int(max(0, row.max_tokens - got)))
    if token_s is None or left == 0:
        return IdleWait(FLOOR_S, token_s, first_s, left)
    estimate = left * token_s + (first_s or 0.0)
    return IdleWait(min(CEILING_S, max(FLOOR_S, MARGIN * estimate + SLACK_S)), token_s, first_s, left)
