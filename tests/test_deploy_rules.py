"""The alert rules in deploy/ under the real promtool: they parse, and their unit tests (a leak fires the
page, a quiet canary fires after its `for`, a slow p95 release fires the ticket) pass; a broken
expectation makes promtool fail, so the test can fail."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.prometheus

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"


def promtool() -> str:
    binary = shutil.which("promtool")
    if binary is None:
        pytest.fail("no promtool: `make prometheus` (make test does) installs Debian's prometheus package")
    return binary


def test_rules_parse_and_their_unit_tests_pass():
    check = subprocess.run([promtool(), "check", "rules", str(DEPLOY / "cancelwatch-rules.yml")],
                           capture_output=True, text=True)
    assert check.returncode == 0 and "4 rules found" in check.stdout, check.stdout + check.stderr
    res = subprocess.run([promtool(), "test", "rules", "rules_test.yml"], cwd=DEPLOY / "tests", capture_output=True,
                         text=True)
    assert res.returncode == 0, res.stdout + res.stderr


def test_a_wrong_expectation_fails(tmp_path):
    (tmp_path / "tests").mkdir()
    shutil.copy(DEPLOY / "cancelwatch-rules.yml", tmp_path / "cancelwatch-rules.yml")
    text = (DEPLOY / "tests" / "rules_test.yml").read_text().replace("scenario: decode", "scenario: disconnect")
    (tmp_path / "tests" / "rules_test.yml").write_text(text)
    res = subprocess.run([promtool(), "test", "rules", "rules_test.yml"], cwd=tmp_path / "tests",
                         capture_output=True, text=True)
    assert res.returncode != 0 and "CancelwatchCancelLeaked" in res.stdout + res.stderr


def test_the_scrape_example_is_a_valid_prometheus_config(tmp_path):
    shutil.copy(DEPLOY / "prometheus-scrape.yml", tmp_path / "prometheus.yml")
    shutil.copy(DEPLOY / "cancelwatch-rules.yml", tmp_path / "cancelwatch-rules.yml")
    res = subprocess.run([promtool(), "check", "config", str(tmp_path / "prometheus.yml")], capture_output=True,
                         text=True)
    assert res.returncode == 0, res.stdout + res.stderr
