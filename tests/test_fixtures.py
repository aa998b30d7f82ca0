"""The recorded /metrics fixtures say where they come from, and tests/fixtures/record.py (which re-records
them) writes that header; the header changes nothing a parser reads."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cancelwatch.collectors.sources.vllm import parse_vllm_metrics
from tests.conftest import FIXTURES, ROOT
from tests.fixtures.record import fixture_header, main, read_header

BODIES = sorted((FIXTURES / "vllm").rglob("*.txt"))
RECORD = FIXTURES / "record.py"


def without_header(text: str) -> str:
    n = len(read_header(text))
    return "".join(text.splitlines(keepends=True)[n:])


def families(text: str) -> list:
    return [(f.name, f.type, sorted((s.name, tuple(sorted(s.labels.items())), s.value) for s in f.samples))
            for f in text_string_to_metric_families(text)]


def test_there_are_fixtures():
    assert {p.relative_to(FIXTURES / "vllm").as_posix() for p in BODIES} >= {
        "0.32/idle.txt", "0.32/loaded.txt", "0.32/after_cancel.txt", "0.10-style.txt"}


@pytest.mark.parametrize("path", BODIES, ids=lambda p: p.relative_to(FIXTURES / "vllm").as_posix())
def test_every_fixture_starts_with_a_provenance_header(path):
    text = path.read_text()
    head = read_header(text)
    assert head.get("title"), f"{path} does not start with '# cancelwatch fixture: ...'"
    lines = text.splitlines()[: len(head)]
    assert all(line.startswith("# ") and not line.startswith(("# HELP ", "# TYPE ")) for line in lines)
    # it names the engine and its version, and the command that made it (or that none did)
    engine = re.fullmatch(r"vLLM (\d+\.\d+)(\.\d+)?( .*)?", head.get("engine", ""))
    assert engine, head
    assert head.get("command"), head
    if path.parent.name != "vllm":  # recorded from a server of that version: tests/fixtures/vllm/<version>/
        assert engine.group(1) == path.parent.name
        assert head["state"] == path.stem
        assert "tests/fixtures/record.py --target http://127.0.0.1:" in head["command"]
        assert f"--state {path.stem} --out tests/fixtures/vllm/{path.parent.name}/" in head["command"]
        assert "'tiny'" in head["shape"] and "64 KV blocks x 128 tokens" in head["shape"]
    else:  # made by hand, and saying so
        assert head["state"] == "hand-made" and head["command"].startswith("none")
        assert "by hand" in head["recorded"]


@pytest.mark.parametrize("path", BODIES, ids=lambda p: p.relative_to(FIXTURES / "vllm").as_posix())
def test_the_header_changes_nothing_a_parser_reads(path):
    text = path.read_text()
    body = without_header(text)
    assert len(body) < len(text)
    assert sorted(parse_vllm_metrics(text, 1, 2), key=repr) == sorted(parse_vllm_metrics(body, 1, 2), key=repr)
    assert families(text) == families(body)  # prometheus_client reads the whole file the same


def test_the_header_writer_round_trips():
    head = fixture_header(engine="vLLM", version="0.32.0", state="loaded", shape="model tiny, 64 KV blocks x 128\ntokens",
                          recorded="2026-01-01T00:00:00Z from http://127.0.0.1:8000",
                          command="python tests/fixtures/record.py --target http://127.0.0.1:8000 --state loaded --out x/")
    lines = head.splitlines()
    assert lines[0] == "# cancelwatch fixture: vLLM /metrics body"
    assert all(line.startswith("# ") and not line.startswith(("# HELP", "# TYPE")) for line in lines)
    body = (FIXTURES / "vllm" / "0.32" / "loaded.txt").read_text()
    assert read_header(head + without_header(body)) == {
        "title": "vLLM /metrics body", "engine": "vLLM 0.32.0", "state": "loaded",
        "shape": "model tiny, 64 KV blocks x 128 tokens",  # one line, whatever was passed
        "recorded": "2026-01-01T00:00:00Z from http://127.0.0.1:8000",
        "command": "python tests/fixtures/record.py --target http://127.0.0.1:8000 --state loaded --out x/"}
    assert read_header(without_header(body)) == {}  # no title line: no header


def test_record_script_runs_from_a_checkout_and_refuses_remote_targets(tmp_path):
    res = subprocess.run([sys.executable, str(RECORD), "--help"], capture_output=True, text=True, cwd=tmp_path,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    assert "--state {idle,loaded,after_cancel}" in res.stdout and "--target" in res.stdout
    res = subprocess.run([sys.executable, str(RECORD), "--target", "http://192.0.2.1:8000", "--state", "idle",
                          "--out", str(tmp_path)], capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert res.returncode == 2 and "loopback" in res.stderr
    assert not list(tmp_path.iterdir())


def test_record_idle_from_a_loopback_server(metrics_server, tmp_path, capsys):
    """The whole script, in process, against a recorded body served on loopback (no engine)."""
    served = without_header((FIXTURES / "vllm" / "0.32" / "idle.txt").read_text())
    server = metrics_server(served, version="0.32.0")
    argv = ["--target", server.url, "--state", "idle", "--out", str(tmp_path / "out"), "--timeout", "10"]
    assert main(argv) == 0, capsys.readouterr().err
    written = (tmp_path / "out" / "idle.txt").read_text()
    head = read_header(written)
    assert head["engine"] == "vLLM 0.32.0" and head["state"] == "idle"
    assert head["command"] == shlex.join(["python", "tests/fixtures/record.py", *argv])
    assert head["shape"] == "model tiny, 64 KV blocks x 128 tokens"
    assert without_header(written) == served  # the body exactly as served
    assert "/version" in server.paths and "/metrics" in server.paths
    assert str(ROOT) not in head["command"]
