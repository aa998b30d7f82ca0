"""The gateway matrix's cells (analysis/matrix.py), from verdicts as judge_run gives them: what "passed on"
says when a cancel's request never reached the engine, and that an inconclusive verdict names its rule."""

from types import SimpleNamespace

from cancelwatch.analysis.matrix import _cell


def verdict(verdict: str, rule: str, abort_ms: float | None = None, hop_ms: float | None = None,
            stopped_at: str | None = None):
    hops = [] if hop_ms is None else [SimpleNamespace(hop="nginx", held_ms=hop_ms)]
    return SimpleNamespace(verdict=verdict, rule=rule, hops=hops, evidence=SimpleNamespace(stopped_at=stopped_at),
                           latency_ms=lambda a, b: abort_ms)


def test_direct_cancels_the_engine_aborted_are_passed_on():
    cell = _cell("disconnect", [verdict("released", "released", abort_ms=2.0)] * 2, None, 2.0)
    assert (cell.passed_text(), cell.verdict_text(), cell.p50_ms) == ("yes", "released ×2", 2.0)


def test_a_request_the_engine_never_had_is_not_a_cancel_lost():
    never = verdict("inconclusive", "never_added")
    alone = _cell("nonstream_timeout", [never], None, 2.0)
    assert (alone.passed_text(), alone.verdict_text()) == ("never reached the engine", "inconclusive (never_added)")
    beside = _cell("nonstream_timeout", [never, verdict("released", "released", abort_ms=3.0)], None, 2.0)
    assert beside.passed_text() == "yes (1 never reached the engine)"
    assert beside.verdict_text() == "inconclusive (never_added), released"


def test_a_gateway_that_kept_the_cancel_is_a_no_with_where_it_stopped():
    kept = verdict("leaked", "still_counted_generating", stopped_at="nginx")
    cell = _cell("nonstream_timeout", [kept, verdict("released", "released", hop_ms=1.0)], "nginx", 2.0)
    assert cell.passed_text() == "1 of 2" and cell.stopped_at == {"nginx": 1}
    late = _cell("disconnect", [verdict("released", "released", hop_ms=2500.0)], "nginx", 2.0)
    assert late.passed_text() == "no"  # closed upstream, but past the grace
