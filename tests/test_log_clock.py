"""The engine log's clock, found from the run itself (analysis/verdicts/log_clock.py): a log whose lines
are off by a few seconds or by a time zone is moved back onto the run's clock and its cancels judged as
if it were not; a shift the requests disagree on makes every verdict that rests on the log inconclusive.
The run is the shipped sample (a real default-suite recording on the embedded vLLM, ms stamps), its log
lines moved as a container in UTC or a host with its clock off would have written them."""

from __future__ import annotations

import json

import pytest

from cancelwatch.analysis.facts import run_facts
from cancelwatch.analysis.protocol import protocol_markdown
from cancelwatch.analysis.verdicts import GRACE_S, judge_run, log_clocks, report_document
from cancelwatch.runstore.reader import load_run
from tests.conftest import ROOT

SAMPLE = ROOT / "dashboard" / "sample" / "sample.db"
LOG_KINDS = ("engine_added", "engine_aborted")


def sample(shift_s: float = 0.0, only=None):
    """The sample run with its engine log lines `shift_s` later than they were written (of the requests
    `only(request_id)` picks, else all)."""
    run = load_run(SAMPLE, "latest")
    lines = run.events["kind"].isin(LOG_KINDS)
    if only is not None:
        lines &= run.events["request_id"].map(lambda rid: isinstance(rid, str) and only(rid))
    run.events.loc[lines, "t_s"] += shift_s
    return run


def aborts_after_their_stops(run) -> list[float]:
    ev = run.events
    stops = ev[ev["kind"] == "user_stop"].set_index("request_id")["t_s"]
    aborts = ev[ev["kind"] == "engine_aborted"].groupby("request_id")["t_s"].min()
    return [float(aborts[r] - stops[r]) for r in stops.index if r in aborts.index]


def test_the_sample_log_agrees_with_its_run_and_nothing_moves():
    (clock,) = log_clocks(sample()).values()
    assert clock.agrees and clock.offset_s == 0.0 and clock.requests >= 10
    assert clock.lo_s <= 0.0 <= clock.hi_s and clock.spread_s < 1.0
    assert [v.verdict for v in judge_run(sample())] == ["released"] * 6


@pytest.mark.parametrize("shift_s", [3.0, -3.0, 28800.0, -19800.0])
def test_a_log_off_by_seconds_or_a_zone_is_moved_back_and_judged_the_same(shift_s):
    """+3 s: a host clock ahead; 28800 s: a container logging in UTC beside a recorder 8 h west of it;
    -19800 s: one 5 h 30 east. Read as they are, the aborts fall seconds or hours from their stops."""
    run = sample(shift_s)
    assert all(abs(d) > GRACE_S for d in aborts_after_their_stops(run))  # as written, no abort is in the grace
    (clock,) = log_clocks(run).values()
    assert clock.agrees and clock.offset_s == pytest.approx(-shift_s, abs=0.06), clock
    assert clock.lo_s <= -shift_s <= clock.hi_s
    base = {v.request_id: (v.verdict, v.evidence.rule, v.timepoints["engine_abort"]) for v in judge_run(sample())}
    moved = {v.request_id: (v.verdict, v.evidence.rule, v.timepoints["engine_abort"]) for v in judge_run(run)}
    assert {r: v[:2] for r, v in moved.items()} == {r: v[:2] for r, v in base.items()}
    assert all(moved[r][2] == pytest.approx(base[r][2], abs=0.06) for r in base)
    facts = run_facts(run)["engine_log_clock"]
    assert facts[0]["offset_s"] == pytest.approx(-shift_s, abs=0.06) and facts[0]["agrees"] is True
    assert report_document(run)["engine_log_clock"] == facts
    assert f"its lines are moved by {facts[0]['offset_s']:+.3f} s" in protocol_markdown(run, report_document(run))
    assert any("stamped" in n for n in report_document(run)["engine_log_notes"])


def test_a_shift_the_requests_disagree_on_makes_every_log_verdict_inconclusive():
    """The targets' lines 3 s late, the neighbours' and probes' where they were: no one offset puts every
    Added line between its send and its first token, so nothing the log says is placed against a stop."""
    run = sample(3.0, only=lambda rid: "target" in rid)
    (clock,) = log_clocks(run).values()
    assert not clock.agrees and clock.lo_s > clock.hi_s
    verdicts = judge_run(run)
    assert {(v.verdict, v.evidence.rule) for v in verdicts} == {("inconclusive", "log_clock_disagrees")}
    assert "--engine-log-tz" in verdicts[0].evidence.why
    doc = report_document(run)
    assert doc["engine_log_clock"][0]["agrees"] is False
    assert "disagrees with the run's" in protocol_markdown(run, report_document(run))
    assert json.dumps(doc)  # the bounds are plain numbers in the JSON


def test_a_log_zone_given_reads_the_stamps_in_it():
    from datetime import datetime, timezone
    from zoneinfo import ZoneInfo

    from cancelwatch.collectors.sources.engine_log import parse_line

    line = "INFO 12-01 08:00:00 [logger.py:43] Added request cmpl-cw-decode-target-3ee19b60-0-01234567."
    kind, ids, wall_ns, res = parse_line(line, 2026, ZoneInfo("UTC"))
    assert (kind, res) == ("engine_added", 1.0)
    assert wall_ns == int(datetime(2026, 12, 1, 8, tzinfo=timezone.utc).timestamp()) * 10**9
    _, _, kolkata_ns, _ = parse_line(line, 2026, ZoneInfo("Asia/Kolkata"))
    assert wall_ns - kolkata_ns == 19800 * 10**9  # 08:00 in Kolkata came 5 h 30 before 08:00 UTC


@pytest.mark.parametrize("command, args, said_part", [
    ("sample", ["--target", "http://127.0.0.1:9"], "is not a time zone: give an IANA name"),
    ("record", ["--target", "http://127.0.0.1:9"], "is not a time zone: give an IANA name"),
    ("canary", ["--target", "http://127.0.0.1:9", "--rounds", "1"], "is not a time zone: give an IANA name"),
])
def test_a_zone_the_database_does_not_know_is_one_line(tmp_path, command, args, said_part):
    from tests.conftest import cli

    store = tmp_path / "cw.db"
    res = cli(command, *args, "--engine-log-tz", "Mars/Olympus_Mons", "--store", str(store))
    said = [line for line in (res.stdout + res.stderr).splitlines() if line.strip()]
    assert res.returncode == 2 and len(said) == 1 and said_part in said[0], said
    assert not store.exists()


@pytest.mark.parametrize("hold_s", [0.06, 0.2])
def test_a_gateway_that_holds_each_request_before_the_engine_does_not_make_a_shifted_log_leak(hold_s):
    """The offset puts each Added line at the earliest its request allows (right at its send): a gateway
    that holds requests for `hold_s` first makes every moved line read that much early, an abort 5 ms after
    its stop then 55 ms before it. The verdicts allow for how far the offset is from pinned down."""
    run = sample(3.0)
    added = run.events["kind"] == "engine_added"
    run.events.loc[added, "t_s"] += hold_s
    # the hold delays what the client gets back as much: each first token comes that much later too
    run.ledger["first_token_mono_ns"] += int(hold_s * 1e9)
    (clock,) = log_clocks(run).values()
    # the truth (-3 s) lies in the allowed offsets, the hold within how far they are from pinned down
    assert clock.offset_s == pytest.approx(-3.0 - hold_s, abs=0.06) and clock.lo_s <= -3.0 <= clock.hi_s
    assert clock.uncertainty_s >= hold_s
    assert {(v.verdict, v.evidence.rule) for v in judge_run(run)} == {("released", "released")}


@pytest.mark.parametrize("shift_s", [3.0, -3.0, 28800.0])
def test_whole_second_stamps_off_by_a_zone_are_judged_as_they_were(shift_s):
    """vLLM's default format: each stamp rounded down to its second, at every phase of the second the
    run's clock may sit at against the engine's. No cancel may come out leaked: released, or inconclusive
    where a whole second cannot tell."""
    import numpy as np

    for phase in np.arange(0.0, 1.0, 0.1):
        run = sample()
        lines = run.events["kind"].isin(LOG_KINDS)
        run.events.loc[lines, "t_s"] = np.floor(run.events.loc[lines, "t_s"] + shift_s + phase) - phase
        run.events.loc[lines, "data"] = run.events.loc[lines, "data"].map(
            lambda d: json.dumps({**json.loads(d), "resolution_s": 1.0}))
        (clock,) = log_clocks(run).values()
        assert clock.agrees and abs(clock.offset_s + shift_s) <= 1.0 + 0.06, (phase, clock)
        verdicts = {(v.verdict, v.evidence.rule) for v in judge_run(run)}
        assert verdicts <= {("released", "released"), ("inconclusive", "abort_stamp_straddles_grace")}, (phase, verdicts)


def test_a_log_no_request_bounds_says_nothing_of_its_clock():
    run = sample()
    run.events = run.events[run.events["kind"] != "engine_added"].reset_index(drop=True)
    assert log_clocks(run) == {} and run_facts(run)["engine_log_clock"] == []


def test_the_live_judge_finds_a_log_in_another_zone_on_each_cancels_window(tmp_path):
    # the corpus's real run of vLLM logging in UTC (its own log format) beside a recorder in Asia/Kolkata: its
    # lines are stored 5 h 30 from the run's clock. The whole run places that clock; a live judge reading each
    # cancel's window by the run's clock found no line of the log there, and every cancel read inconclusive
    # (log_names_no_requests). It places the clock from the log's Added lines and the ledger, once, and reads
    # each window's lines where their stamps put them
    import asyncio

    from cancelwatch.live_judge import LiveJudge, log_offsets_of
    from cancelwatch.analysis.long_runs import stops
    from tests.corpus.manifest import load_manifest, unpack

    entry = load_manifest()["runs"]["utc_vllm_format"]
    store, rid = unpack(entry, tmp_path), int(next(iter(entry["runs"])))
    run = load_run(store, rid)
    whole = {v.request_id: (v.verdict, v.rule) for v in judge_run(run)}
    assert set(whole.values()) == {("released", "released")} and len(whole) == 11
    (target, lo, hi), = log_offsets_of(store, rid)
    assert lo <= 5.5 * 3600 <= hi and hi - lo < 2  # UTC read as Kolkata time: 5 h 30 early, moved on by that
    kept = []
    judge = LiveJudge(store, GRACE_S, said="record")
    judge.start(rid, run.info["started_mono_ns"], lambda: None, keep=lambda _by, rows: kept.extend(rows))
    for request_id, t_stop in stops(run).itertuples(index=False):
        asyncio.run(judge._judge({request_id: t_stop}, last_try=True))
    live = {request_id: (body["verdict"], body["evidence"]["rule"]) for request_id, body in kept}
    assert live == whole


def test_the_requests_a_watch_still_holds_place_the_logs_clock_before_any_row_is_stored(tmp_path):
    # a watch's first cancel is judged while its neighbours are still in flight: their rows are the watch's, not the
    # store's yet. With no stored row to bound it, the clock is placed by theirs
    import sqlite3

    from cancelwatch.live_judge import log_offsets_of
    from tests.corpus.manifest import load_manifest, unpack

    entry = load_manifest()["runs"]["utc_vllm_format"]
    store, rid = unpack(entry, tmp_path), int(next(iter(entry["runs"])))
    rows = load_run(store, rid).ledger
    with sqlite3.connect(store) as con:
        con.execute("DELETE FROM ledger WHERE run_id = ?", (rid,))
    assert log_offsets_of(store, rid) is None
    (_, lo, hi), = log_offsets_of(store, rid, rows.drop(columns=["run_id"]))
    assert lo <= 5.5 * 3600 <= hi
