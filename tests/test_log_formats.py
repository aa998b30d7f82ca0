"""The engine log as users have it: vLLM's default format (whole seconds, no year, a run across New
Year), the abort line of vLLM before 0.10.1, colour codes; and a log that names no requests at all (vLLM
without --enable-log-requests) or no abort for any cancel, said so, never read as cancels that were lost."""

from __future__ import annotations

from datetime import datetime

from cancelwatch.analysis.protocol import protocol_markdown
from cancelwatch.analysis.verdicts import judge_run, report_document
from cancelwatch.collectors.sources.engine_log import EngineLogSource, parse_line
from cancelwatch.runstore.reader import load_run
from tests.conftest import ROOT

SAMPLE = ROOT / "dashboard" / "sample" / "sample.db"
ID = "cmpl-cw-decode-target-3ee19b60-0-01234567"


def test_vllms_default_format_and_the_old_abort_line_are_read():
    # vLLM's own logging: `%m-%d %H:%M:%S`, the process in parentheses, whole seconds
    kind, ids, _, res = parse_line(f"(APIServer pid=4242) INFO 06-02 10:00:00 [logger.py:43] Added request {ID}.", 2026)
    assert (kind, ids, res) == ("engine_added", [ID], 1.0)
    # before vLLM 0.10.1: `Aborted request <id>.`, one id a line
    assert parse_line(f"INFO 06-02 10:00:01 [async_llm_engine.py:1] Aborted request {ID}.", 2026)[:2] == (
        "engine_aborted", [ID])
    # coloured level names (a terminal's, kept by `script` or a tee)
    assert parse_line(f"\x1b[32mINFO\x1b[0m 06-02 10:00:01 [x.py:1] Aborted request(s) {ID},{ID}.", 2026)[:2] == (
        "engine_aborted", [ID, ID])


def test_a_run_across_new_year_keeps_its_lines_in_order():
    near = datetime(2027, 1, 1, 0, 0, 5)  # read five seconds into 2027, by a source made in 2026
    old = parse_line(f"INFO 12-31 23:59:58 [x.py:1] Added request {ID}.", 2026, near=near)[2]
    new = parse_line(f"INFO 01-01 00:00:03 [x.py:1] Aborted request {ID}.", 2026, near=near)[2]
    assert datetime.fromtimestamp(old / 1e9).year == 2026 and datetime.fromtimestamp(new / 1e9).year == 2027
    assert 0 < (new - old) / 1e9 == 5.0


def test_the_source_follows_a_default_format_log_with_colours(tmp_path):
    log = tmp_path / "vllm.log"
    log.write_text("")
    src = EngineLogSource(str(log), target="t0")
    with log.open("a") as f:
        f.write(f"\x1b[32mINFO\x1b[0m 06-02 10:00:00 [logger.py:43] Added request {ID}.\n"
                f"INFO 06-02 10:00:01 [async_llm.py:1] Aborted request {ID}.\n")
    samples = src.sample(0, 0)
    assert [s.value for s in samples] == [1.0, 1.0]
    events = src.take_events()
    assert [(e.kind, e.request_id, e.data["resolution_s"]) for e in events] == [
        ("engine_added", "cw-decode-target-3ee19b60", 1.0), ("engine_aborted", "cw-decode-target-3ee19b60", 1.0)]


def sample_without(*kinds: str):
    run = load_run(SAMPLE, "latest")
    run.events = run.events[~run.events["kind"].isin(kinds)].reset_index(drop=True)
    return run


def test_a_log_that_names_no_requests_is_said_so_never_a_lost_cancel():
    """vLLM without --enable-log-requests writes neither line: the log was read and is silent on every
    request, which says nothing of any one cancel."""
    run = sample_without("engine_added", "engine_aborted")
    verdicts = judge_run(run)
    assert {(v.verdict, v.evidence.rule) for v in verdicts} == {("inconclusive", "log_names_no_requests")}
    assert all("--enable-log-requests" in v.evidence.why for v in verdicts)
    assert all(v.sources["engine_abort"]["reason"] == "the engine log names no requests" for v in verdicts)
    doc = report_document(run, verdicts=verdicts)
    (note,) = doc["engine_log_notes"]
    assert "names no requests" in note and "--enable-log-requests" in note
    text = protocol_markdown(run, doc)
    assert note in text and "never reached" not in text


def test_a_log_with_no_abort_line_for_any_cancel_says_what_it_reads():
    run = sample_without("engine_aborted")
    doc = report_document(run)
    (note,) = doc["engine_log_notes"]
    assert "no abort line for any of the run's 6 cancel(s)" in note and "Aborted request <id>." in note
    assert note in protocol_markdown(run, doc)
    assert all(c["verdict"] != "released" for c in doc["cancels"])  # no abort: none is released on the log


def test_a_clean_run_has_no_note():
    assert report_document(load_run(SAMPLE, "latest"))["engine_log_notes"] == []
