"""The engine log rotated during a recording (issue: verdicts on users' stacks, point 3): renamed away
(logrotate's default, a writer that reopens later) it loses no line, the old file read to its end and
beside the new one while its writer still holds it; cut short in place (copytruncate) the run says where a
line may be missing, and a cancel judged on the log there is inconclusive, as is one inside a read error.
The recordings are real (`cancelwatch sample --engine-log`, against a fixture /metrics server); the
test writes the vLLM lines through its own open file, as an engine's stdout does."""

from __future__ import annotations

import json
import os
import shutil
import time

import pandas as pd

from cancelwatch.analysis.verdicts import judge_run
from cancelwatch.collectors.sources.engine_log import EngineLogSource
from cancelwatch.runstore.reader import load_run
from tests.conftest import FIXTURES, cli_popen
from tests.fixture_server import MetricsFixtureServer
from tests.test_engine_log import millisecond_line
from tests.test_verdicts import ADDED, build_run, steady_gen

LOADED = FIXTURES / "vllm" / "0.32" / "loaded.txt"
LINES = 60  # per recording, one every 50 ms: 3 s


def line(i: int) -> str:
    return millisecond_line(f"Added request cmpl-cw-rot-target-{i:04d}-0-0123abcd.", time.time()) + "\n"


def record_while(tmp_path, rotate, duration_s: float = 6) -> tuple[object, list[str]]:
    """`sample --engine-log` for the time a writer appends LINES lines, calling `rotate(log, fh)` halfway
    (it returns the file the writer goes on with); the run, and the ids written."""
    log = tmp_path / "engine.log"
    log.write_text("")
    store = tmp_path / "cw.db"
    written = []
    with MetricsFixtureServer(LOADED) as server:
        proc = cli_popen("sample", "--target", server.url, "--engine-log", str(log), "--duration", str(duration_s), "--hz", "20",
                         "--nvml", "off", "--store", str(store))
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:  # the source reads from where the log ends when it starts
                try:
                    if load_run(store, "latest", metrics=[]).info["status"] == "running":
                        break
                except Exception:  # noqa: BLE001 - the store or its run may not exist yet
                    pass
                time.sleep(0.1)
            time.sleep(0.5)
            fh = open(log, "a", buffering=1)  # noqa: SIM115 - the writer's own descriptor, as an engine's
            for i in range(LINES):
                if i == LINES // 2:
                    fh = rotate(log, fh)
                fh.write(line(i))
                written.append(f"cw-rot-target-{i:04d}")
                time.sleep(0.05)
            fh.close()
            out, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 0, out + err
    return load_run(store, "latest"), written


def added_ids(run) -> list[str]:
    ev = run.events
    return sorted(ev[ev["kind"] == "engine_added"]["request_id"])


def test_a_log_renamed_away_during_a_recording_loses_no_line(tmp_path):
    def rename(log, fh):
        os.rename(log, log.with_suffix(".log.1"))
        for i in range(5):  # the writer goes on in the old file until it reopens (logrotate's postrotate)
            fh.write(millisecond_line(f"Added request cmpl-cw-rot-old-{i}-0-0123abcd.", time.time()) + "\n")
            time.sleep(0.05)
        fh.close()
        return open(log, "a", buffering=1)  # noqa: SIM115

    run, written = record_while(tmp_path, rename)
    assert added_ids(run) == sorted([*written, *(f"cw-rot-old-{i}" for i in range(5))])
    assert (run.events["kind"] == "engine_log_gap").sum() == 0  # nothing may be missing


def test_lines_read_from_a_log_renamed_away_for_good_are_kept_after_its_path_is_given_up(tmp_path):
    # the log is renamed away and never made again; its writer goes on in it for longer than ROTATED_S.
    # From then on each read drains what was written and then fails (the path is gone): the lines it
    # drained must reach the run with that failed read, not wait for a read that never succeeds again
    old_lines = []

    def rename_for_good(log, fh):
        os.rename(log, log.with_suffix(".log.1"))
        end = time.monotonic() + EngineLogSource.ROTATED_S + 2.0
        i = 0
        while time.monotonic() < end:
            fh.write(millisecond_line(f"Added request cmpl-cw-rot-gone-{i:04d}-0-0123abcd.", time.time()) + "\n")
            old_lines.append(f"cw-rot-gone-{i:04d}")
            i += 1
            time.sleep(0.05)
        fh.close()
        return open(os.devnull, "a")  # noqa: SIM115 - what the writer goes on with is read by no one

    run, written = record_while(tmp_path, rename_for_good, duration_s=EngineLogSource.ROTATED_S + 6)
    assert added_ids(run) == sorted([*written[:LINES // 2], *old_lines])
    assert (run.gaps["source"] == "engine_log").any(), run.gaps  # the reads that failed are a gap


def test_a_log_cut_short_in_place_says_where_a_line_may_be_missing(tmp_path):
    def copytruncate(log, fh):
        shutil.copy(log, log.with_suffix(".log.1"))
        fh.truncate(0)
        fh.seek(0)
        return fh

    run, written = record_while(tmp_path, copytruncate)
    gaps = run.events[run.events["kind"] == "engine_log_gap"]
    assert len(gaps) == 1, run.events["kind"].value_counts()
    data = json.loads(gaps.iloc[0]["data"])
    assert "cut short in place" in data["why"] and data["from_mono_ns"] <= gaps.iloc[0]["mono_ns"]
    # the lines after the truncation are all read; of those before, the ones read in time
    assert set(written[LINES // 2:]) <= set(added_ids(run))


def test_a_read_error_of_the_log_inside_the_window_makes_the_cancel_inconclusive():
    run = build_run(lambda t: 2.0, lambda t: 0.4, steady_gen, engine_log=ADDED)  # no abort: would be leaked
    (v,) = judge_run(run)
    assert v.verdict == "leaked"
    run.gaps = pd.DataFrame([{"source": "engine_log", "target": "t0", "kind": "error", "t_s": 1.8, "end_t_s": 2.4,
                              "ticks": 12, "detail": "engine log /var/log/engine.log: Permission denied"}])
    (v,) = judge_run(run)
    assert (v.verdict, v.evidence.rule) == ("inconclusive", "engine_log_gap") and "1.8 to 2.4 s" in v.evidence.why
