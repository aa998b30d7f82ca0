"""The Grafana dashboard for what `cancelwatch watch` (--metrics-listen) and `cancelwatch canary` (--listen) serve,
built in code with grafana-foundation-sdk and written beside the alert rules:

    .venv/bin/python deploy/grafana_dashboard.py      # writes deploy/cancelwatch-grafana.json

Import that file in Grafana (Dashboards, New, Import) and pick the Prometheus that scrapes the watch and the canary
(deploy/prometheus-scrape.yml). tests/test_grafana_dashboard.py checks the file is what this code builds, that every
query names a metric the watch or the canary serves, and (with promtool) that every query is PromQL."""

from __future__ import annotations

import sys
from pathlib import Path

from grafana_foundation_sdk.builders.common import ReduceDataOptions, VizLegendOptions, VizTooltipOptions
from grafana_foundation_sdk.builders.dashboard import Dashboard, DatasourceVariable, Row
from grafana_foundation_sdk.builders.prometheus import Dataquery
from grafana_foundation_sdk.builders.stat import Panel as Stat
from grafana_foundation_sdk.builders.timeseries import Panel as Timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import (BigValueGraphMode, LegendDisplayMode, LegendPlacement, SortOrder,
                                                  TooltipDisplayMode)
from grafana_foundation_sdk.models.dashboard import DataSourceRef

OUT = Path(__file__).resolve().with_name("cancelwatch-grafana.json")
DS = DataSourceRef(type_val="prometheus", uid="${datasource}")
QUANTILES = (0.5, 0.95, 0.99)


def query(expr: str, legend: str, ref: str = "A") -> Dataquery:
    return Dataquery().expr(expr).legend_format(legend).ref_id(ref).datasource(DS)


def series(title: str, unit: str, description: str, *queries: Dataquery) -> Timeseries:
    panel = (Timeseries().title(title).unit(unit).description(description).datasource(DS).height(8).span(12)
             .legend(VizLegendOptions().show_legend(True).display_mode(LegendDisplayMode.LIST)
                     .placement(LegendPlacement.BOTTOM))
             .tooltip(VizTooltipOptions().mode(TooltipDisplayMode.MULTI).sort(SortOrder.DESCENDING)))
    for q in queries:
        panel = panel.with_target(q)
    return panel


def stat(title: str, unit: str, description: str, expr: str) -> Stat:
    return (Stat().title(title).unit(unit).description(description).datasource(DS).height(4).span(6)
            .reduce_options(ReduceDataOptions().calcs(["lastNotNull"]).values(False))
            .graph_mode(BigValueGraphMode.AREA).with_target(query(expr, title)))


def quantiles(histogram: str) -> list[Dataquery]:
    return [query(f"histogram_quantile({q}, sum by (le) (rate({histogram}_bucket[$__rate_interval])))",
                  f"p{round(q * 100)}", chr(ord("A") + i)) for i, q in enumerate(QUANTILES)]


def build() -> Dashboard:
    return (
        Dashboard("cancelwatch: do cancels leave the engine?")
        .uid("cancelwatch")
        .tags(["cancelwatch"])
        .refresh("30s")
        .time("now-6h", "now")
        .with_variable(DatasourceVariable("datasource").label("Prometheus").type("prometheus"))
        .with_row(Row("Watched traffic (cancelwatch watch)"))
        .with_panel(stat("Ghosts now", "short", "Watched cancels judged leaked that the engine may still hold",
                         "sum(cancelwatch_ghost_requests)"))
        .with_panel(stat("Oldest ghost", "s", "How long ago the client of the oldest ghost left",
                         "max(cancelwatch_ghost_oldest_seconds)"))
        .with_panel(stat("Leaked in the range", "short", "Watched cancels judged leaked over the dashboard's range",
                         'sum(increase(cancelwatch_watched_cancels_total{verdict="leaked"}[$__range]))'))
        .with_panel(stat("Tokens for nobody in the range", "short",
                         "Tokens the engine made for leaked cancels after their clients left, where it held nothing "
                         "else (attributed); the bounds where others ran beside them are in the panel below",
                         'sum(increase(cancelwatch_engine_tokens_after_client_left_total{attribution="attributed"}'
                         '[$__range]))'))
        .with_panel(series("Watched cancels by verdict, a minute", "short", "Cancels real clients made, judged",
                           query("60 * sum by (verdict) (rate(cancelwatch_watched_cancels_total[$__rate_interval]))",
                                 "{{verdict}}")))
        .with_panel(series("Watched cancels by rule, a minute", "short",
                           "The rule each verdict rests on (docs/rules.md): a rule that grows says what changed",
                           query("60 * sum by (rule) (rate(cancelwatch_watched_cancels_total[$__rate_interval]))",
                                 "{{rule}}")))
        .with_panel(series("Ghosts", "short", "Leaked requests the engine may still hold",
                           query("sum(cancelwatch_ghost_requests)", "ghosts")))
        .with_panel(series("The oldest ghost's age", "s", "How long ago the client of the oldest ghost left",
                           query("max(cancelwatch_ghost_oldest_seconds)", "oldest ghost")))
        .with_panel(series("Tokens made for nobody", "short",
                           "Per second, off the engine's generation counter: attributed, or at most",
                           query("sum by (attribution) "
                                 "(rate(cancelwatch_engine_tokens_after_client_left_total[$__rate_interval]))",
                                 "{{attribution}}")))
        .with_panel(series("Release time, client left to out of the scheduler", "s",
                           "Released watched cancels", *quantiles("cancelwatch_watched_release_seconds")))
        .with_panel(series("Watched requests and refusals", "reqps", "Requests that asked the engine for work, "
                           "connections past --max-connections, upstream refusals",
                           query("sum(rate(cancelwatch_watched_requests_total[$__rate_interval]))", "requests"),
                           query("sum(rate(cancelwatch_watched_refused_total[$__rate_interval]))", "refused", "B"),
                           query("sum(rate(cancelwatch_watched_upstream_failures_total[$__rate_interval]))",
                                 "upstream failed", "C")))
        .with_row(Row("Canary (cancelwatch canary)"))
        .with_panel(stat("Since the last round", "s", "A canary that stops running says nothing",
                         "time() - max(cancelwatch_last_round_timestamp_seconds)"))
        .with_panel(stat("Failed rounds in the range", "short", "Rounds that failed: target down, a store error",
                         "sum(increase(cancelwatch_round_errors_total[$__range]))"))
        .with_panel(series("Canary cancels by scenario and verdict, an hour", "short", "Its scripted cancels",
                           query("3600 * sum by (scenario, verdict) (rate(cancelwatch_cancels_total[$__rate_interval]))",
                                 "{{scenario}} {{verdict}}")))
        .with_panel(series("Canary release time, user stop to out of the scheduler", "s", "Released canary cancels",
                           *quantiles("cancelwatch_cancel_release_seconds")))
        .with_panel(series("Probe time to first token after a cancel", "s",
                           "The freed capacity handed out again", *quantiles("cancelwatch_probe_ttft_seconds")))
    )


def render() -> str:
    return JSONEncoder(sort_keys=True, indent=2).encode(build().build()) + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT.relative_to(Path.cwd()) if OUT.is_relative_to(Path.cwd()) else OUT}", file=sys.stderr)
