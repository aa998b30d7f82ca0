"""`report --format` and how the table reads where stdout is no terminal (a log, a pipe, CI): one line a cancel, its
reason on a line of its own under the table, no cell cut short; `csv` is the dashboard's cancel table, `json` the
report document. `record --format` prints the same at its end (its bad value is refused before anything is sent)."""

from __future__ import annotations

import csv
import io
import json

import pytest

from tests.conftest import cli
from tests.corpus.manifest import load_manifest, unpack


@pytest.fixture(scope="module")
def leaky(tmp_path_factory) -> str:
    """A corpus run through the leaking proxy: cancels released and leaked, the leaked ones with a reason."""
    entry = load_manifest()["runs"]["proxy_default_counted"]
    return str(unpack(entry, tmp_path_factory.mktemp("corpus")))


def test_the_table_in_a_log_is_a_line_a_cancel_with_each_reason_under_it(leaky):
    doc = json.loads(cli("report", "latest", "--json", "--store", leaky).stdout)
    text = cli("report", "latest", "--store", leaky).stdout  # captured: no terminal
    lines = text.splitlines()
    for c in doc["cancels"]:
        short = c["request_id"][-8:]
        rows = [ln for ln in lines if ln.startswith("│") and f" {short} " in ln]
        assert len(rows) == 1 and f" {c['verdict']} " in rows[0], (short, rows)
        why = c["evidence"].get("why")
        if why:
            assert f"  {short}: {why}" in lines, (short, why)
    assert not any("…" in ln for ln in lines), "a cell was cut short"
    assert sum(1 for c in doc["cancels"] if c["evidence"].get("why")) >= 10


def test_csv_is_the_cancel_table_and_json_the_report_document(leaky):
    doc = json.loads(cli("report", "latest", "--json", "--store", leaky).stdout)
    assert json.loads(cli("report", "latest", "--format", "json", "--store", leaky).stdout) == doc
    rows = list(csv.DictReader(io.StringIO(cli("report", "latest", "--format", "csv", "--store", leaky).stdout)))
    assert [(r["request_id"], r["verdict"]) for r in rows] == [(c["request_id"], c["verdict"]) for c in doc["cancels"]]
    assert all(r["evidence"].startswith("rule: ") for r in rows), rows[0]


@pytest.mark.parametrize("command", [["report", "latest"], ["record", "--target", "http://127.0.0.1:9"]])
def test_a_format_it_has_not_is_one_line_and_exit_2(tmp_path, command):
    res = cli(*command, "--format", "yaml", "--store", str(tmp_path / "none.db"))
    assert res.returncode == 2, res.stdout + res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "--format 'yaml': use one of table, json, csv" in lines[0], lines
    assert not (tmp_path / "none.db").exists()
