"""The Grafana dashboard in deploy/ (deploy/grafana_dashboard.py builds it with grafana-foundation-sdk): the JSON
there is what the code builds, every query names only metrics the watch or the canary serve and together they show
what an operator asks of them (cancels by verdict and rule, ghosts and the oldest one's age, tokens made for
nobody, release time percentiles); under the real promtool every query parses as PromQL."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from cancelwatch.canary_commands import CanaryMetrics
from cancelwatch.watch_commands import WatchMetrics

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}


def builder():
    spec = importlib.util.spec_from_file_location("grafana_dashboard", DEPLOY / "grafana_dashboard.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def served() -> set[str]:
    """Every series name the watch's and the canary's registries expose, by each family's type."""
    names = set()
    for registry in (WatchMetrics().registry, CanaryMetrics().registry):
        for family in registry.collect():
            names |= {family.name + s for s in SUFFIXES[family.type]}
    return names


def exprs(doc: dict) -> list[str]:
    return [t["expr"] for p in doc["panels"] for t in p.get("targets") or []]


def test_the_dashboard_in_deploy_is_what_the_code_builds():
    written = (DEPLOY / "cancelwatch-grafana.json").read_text()
    assert written == builder().render(), "deploy/cancelwatch-grafana.json is stale: run " \
                                          ".venv/bin/python deploy/grafana_dashboard.py"


def test_every_query_names_a_served_metric_and_the_operators_questions_are_answered():
    doc = json.loads(builder().render())
    queries = exprs(doc)
    used = {name for q in queries for name in re.findall(r"\bcancelwatch_[a-z_]+", q)}
    assert used and used <= served(), sorted(used - served())
    for wanted in ("cancelwatch_watched_cancels_total", "cancelwatch_ghost_requests",
                   "cancelwatch_ghost_oldest_seconds", "cancelwatch_engine_tokens_after_client_left_total",
                   "cancelwatch_watched_release_seconds_bucket", "cancelwatch_cancels_total",
                   "cancelwatch_cancel_release_seconds_bucket", "cancelwatch_last_round_timestamp_seconds"):
        assert wanted in used, wanted
    assert any("by (rule)" in q for q in queries) and any("by (verdict)" in q for q in queries)
    assert sum("histogram_quantile(0.95" in q for q in queries) >= 2
    # every panel reads the Prometheus the importer picks
    panels = [p for p in doc["panels"] if p["type"] != "row"]
    assert all(p["datasource"] == {"type": "prometheus", "uid": "${datasource}"} for p in panels)
    assert [v["name"] for v in doc["templating"]["list"]] == ["datasource"]
    assert len({p["title"] for p in panels}) == len(panels)


def test_a_query_on_a_metric_nobody_serves_is_caught():
    assert "cancelwatch_watched_cancel_total" not in served()  # a typo of the counter's name


@pytest.mark.prometheus
def test_every_query_is_promql(tmp_path):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("no promtool: `make prometheus` (make test does) installs Debian's prometheus package")
    # Grafana's interval variables, as Grafana fills them in
    queries = [q.replace("$__rate_interval", "1m").replace("$__range", "6h") for q in exprs(json.loads(builder().render()))]
    rules = {"groups": [{"name": "dashboard", "rules": [{"record": f"dashboard:q{i}", "expr": q}
                                                        for i, q in enumerate(queries)]}]}
    (tmp_path / "rules.yml").write_text(json.dumps(rules))  # JSON is YAML
    check = subprocess.run([promtool, "check", "rules", str(tmp_path / "rules.yml")], capture_output=True, text=True)
    assert check.returncode == 0 and f"{len(queries)} rules found" in check.stdout, check.stdout + check.stderr
    # and a broken one fails
    rules["groups"][0]["rules"].append({"record": "dashboard:broken", "expr": "sum by (verdict (x)"})
    (tmp_path / "rules.yml").write_text(json.dumps(rules))
    assert subprocess.run([promtool, "check", "rules", str(tmp_path / "rules.yml")], capture_output=True).returncode


def test_the_watch_serves_every_series_a_verdict_can_count_from_zero():
    # a series that first appears at 1 is no increase: the first leak of a rule would pass the panels and the alert by
    from prometheus_client import generate_latest

    from cancelwatch.analysis.verdicts import RULES

    metrics = WatchMetrics()
    metrics.start_at_zero()
    text = generate_latest(metrics.registry).decode()
    for code, rule in RULES.items():
        assert f'cancelwatch_watched_cancels_total{{rule="{code}",verdict="{rule.verdict}"}} 0.0' in text, code
    for attribution in ("attributed", "at_most"):
        assert f'cancelwatch_engine_tokens_after_client_left_total{{attribution="{attribution}"}} 0.0' in text
