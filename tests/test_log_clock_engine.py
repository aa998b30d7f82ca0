"""The engine log as users have it, on the real engine: an engine started the way users start one (vLLM's
own log format: whole seconds, no year; --enable-log-requests) whose processes log in UTC, as one in a
container does, beside a recorder in another zone that has no state of it and reads its log through
--engine-log. Read as the recorder's local time its lines are 5 h 30 off: the run finds that offset from
its own requests and judges the cancels as on one clock; --engine-log-tz UTC reads the stamps right at once."""

from __future__ import annotations

import json

import pytest

from analysis.facts import run_facts
from runstore.reader import load_run
from tests.conftest import _start_engine, _stop_engine, cli
from tests.test_cancels_engine import assert_recorded

RECORDER_TZ, KOLKATA_S = "Asia/Kolkata", 19800  # UTC+5:30: no daylight saving, never the recorder's by chance
# whole-second stamps place an abort only to within ~1.6 s: under the default 2 s grace a disconnect noticed
# 0.8 s late (CI) straddles the grace's end and is honestly inconclusive. These tests are about the clock,
# not the grace: a wide one keeps every abort decidable
GRACE_S = "6"
pytestmark = pytest.mark.timeout(1800)


@pytest.fixture(scope="module")
def utc_engine(tmp_path_factory):
    """An engine in a home of its own, logging in vLLM's own format in UTC (TZ=UTC in its environment)."""
    home = tmp_path_factory.mktemp("users-engine")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TZ", "UTC")
        state = _start_engine(home, vllm_log_format=True)
    yield home, state
    left = _stop_engine(home, state)
    assert not left, f"engine down left processes behind: {left}"


def recorded(utc_engine, tmp_path, monkeypatch, scenarios: str, *extra, timeout: float = 600, awkward_ok=False):
    """`record` as the user runs it: in another zone, another home (no state of the engine), --engine-log."""
    home, state = utc_engine
    monkeypatch.setenv("TZ", RECORDER_TZ)
    store = tmp_path / "cw.db"
    res = cli("record", "--target", state.url, "--engine-log", state.log_path, "--scenario", scenarios,
              "--store", str(store), *extra, home=tmp_path / "recorder-home", timeout=timeout)
    doc = json.loads(cli("report", "latest", "--json", "--store", str(store)).stdout)
    run = load_run(store, "latest")
    if awkward_ok:  # the default suite on a busy machine: one awkward cancel said as such, as in test_cancels_engine
        assert_recorded(res, doc, run)
    else:
        assert res.returncode == 0, res.stdout + res.stderr + json.dumps(doc["cancels"], indent=1)
    return doc, run_facts(run)


def test_a_utc_log_beside_a_recorder_in_kolkata_is_moved_back(utc_engine, tmp_path, monkeypatch):
    doc, facts = recorded(utc_engine, tmp_path, monkeypatch, "decode,disconnect", "--grace", GRACE_S)
    (clock,) = facts["engine_log_clock"]
    # read as Kolkata time the lines are 5 h 30 early; whole-second stamps: the offset within a second
    assert clock["agrees"] and abs(clock["offset_s"] - KOLKATA_S) <= 1.1, clock
    assert clock["lo_s"] <= KOLKATA_S <= clock["hi_s"] and clock["resolution_s"] == 1.0, clock
    assert [(c["scenario"], c["verdict"]) for c in doc["cancels"]] == [("decode", "released"),
                                                                       ("disconnect", "released")], doc["cancels"]
    for c in doc["cancels"]:
        assert c["timepoint_sources"]["engine_abort"]["source"] == "engine_log", c
        # placed on the run's clock: after the stop, inside the grace (not 5 h 30 away)
        assert 0.0 <= c["timepoints"]["engine_abort"] - c["timepoints"]["user_stop"] < float(GRACE_S), c
    assert doc["engine_log_clock"] == facts["engine_log_clock"]
    assert any("stamped" in note for note in doc["engine_log_notes"]), doc["engine_log_notes"]


def test_told_the_logs_zone_nothing_is_moved(utc_engine, tmp_path, monkeypatch):
    doc, facts = recorded(utc_engine, tmp_path, monkeypatch, "decode,disconnect", "--engine-log-tz", "UTC",
                          "--grace", GRACE_S)
    (clock,) = facts["engine_log_clock"]
    assert clock["agrees"] and clock["offset_s"] == 0.0 and clock["lo_s"] <= 0.0 <= clock["hi_s"], clock
    assert [c["verdict"] for c in doc["cancels"]] == ["released", "released"], doc["cancels"]
    assert doc["engine_log_notes"] == []


# every phase and request shape of the default suite the two tests above leave out (they cancel in decode,
# streamed and cut off); the rest of the suite (chat, burst, the relay's inproc) is the same abort line again,
# and recording it here too cost 270 s of CI's suite (the default suite is recorded direct in test_cancels_engine)
OTHER_PHASES = "queued,prefill,race,nonstream_timeout,n2,resubmit"


def test_every_other_phase_direct_through_engine_log_is_released(utc_engine, tmp_path, monkeypatch):
    """The queued, prefill, race, timeout, n=2 and resubmit cancels against the engine a user started, its log
    read through --engine-log: every cancel released, each on the engine's own abort line."""
    doc, _ = recorded(utc_engine, tmp_path, monkeypatch, OTHER_PHASES, "--grace", GRACE_S, timeout=1500,
                      awkward_ok=True)
    assert {c["scenario"] for c in doc["cancels"]} == set(OTHER_PHASES.split(",")), json.dumps(doc["cancels"])
    released = [c for c in doc["cancels"] if c["verdict"] == "released"]
    assert len(released) >= len(doc["cancels"]) - 1, json.dumps(doc["cancels"])
    assert {c["timepoint_sources"]["engine_abort"]["source"] for c in released} <= {"engine_log", "relay"}


def test_the_log_was_in_vllms_own_format(utc_engine):
    """Last: by now the engine has logged the requests of the recordings above."""
    home, state = utc_engine
    added = [line for line in open(state.log_path, errors="replace") if "Added request" in line]
    assert added, "the engine logged no Added request line"
    # `INFO MM-DD HH:MM:SS [file:line]`: no year, whole seconds
    assert all(" [" in line and line.split(" [")[0][-9:-8] == " " for line in added), added[:2]
