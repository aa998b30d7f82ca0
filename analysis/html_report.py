"""A self-contained HTML report of a run: the dashboard's figures and tables in one file that opens
offline (plotly.js is embedded, nothing is fetched)."""

from __future__ import annotations

import html

import pandas as pd
import plotly.graph_objects as go
from plotly.offline import get_plotlyjs

from cancelwatch.analysis.anatomy import cancel_summary, summary_figure
from cancelwatch.analysis.cancel_table import VERDICT_COLOURS, cancel_table, cancel_window
from cancelwatch.analysis.capacity import capacity, capacity_figure, capacity_frame
from cancelwatch.analysis.explain import memory_story, pick_story_cancel
from cancelwatch.analysis.facts import run_facts
from cancelwatch.analysis.ghosts import GHOST_CAPTION, ghost_headline, ghost_view
from cancelwatch.analysis.timeline import timeline_figure
from cancelwatch.analysis.verdicts import CancelVerdict, ghosts_of
from cancelwatch.runstore.reader import Run

CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1200px; color: #222; }
table { border-collapse: collapse; font-size: 13px; margin: 0.5em 0 1.5em; }
th, td { border: 1px solid #ddd; padding: 3px 8px; text-align: left; }
th { background: #f3f3f3; }
.story { background: #f6f8fa; border-left: 4px solid #4c78a8; padding: 0.6em 1em; font-size: 15px; }
.sample { background: #fff4d6; border: 1px solid #f0c36d; padding: 0.4em 0.8em; }
.summary { border: 2px solid #222; padding: 0.6em 1em; margin-bottom: 1.5em; }
.headline { font-size: 20px; font-weight: 600; margin: 0.2em 0 0.4em; }
.which { font-size: 13px; font-weight: 400; color: #555; }
"""


def facts_frame(facts: dict) -> pd.DataFrame:
    rows = [("run", f"{facts['run_id']} · {facts['name'] or ''}"), ("status", facts["status"]),
            ("started (UTC)", facts["started_utc"]),
            ("duration", f"{facts['duration_s']:.1f} s" if facts["duration_s"] else "still recording"),
            ("engine", facts["engine"] + (f" · {facts['version']}" if facts.get("version") else "")), ("model", facts["served_model"] or facts["model"] or "n/a"),
            ("targets", ", ".join(f"{t['label']} = {t['url']}" for t in facts["targets"])),
            ("memory shown", {"nvml": "GPU memory from NVML", "process": "engine process memory (no GPU in this run)",
                              "none": "not sampled"}[facts["memory_source"]]),
            ("sampling", f"{facts['hz']} Hz asked; gap ticks: {facts['gap_ticks']}")]
    for pool in facts["kv_pools"]:
        size = f"{pool['bytes'] / 1024**2:.0f} MiB" if pool["bytes"] else "bytes unknown"
        rows.append((f"KV pool {pool['target']}",
                     f"{pool['blocks']} blocks × {pool['block_size']} tokens = {pool['tokens']} tokens, {size}"))
    for s in facts["sampling"]:
        rows.append((f"source {s['source']}/{s['target']}",
                     f"{s['effective_hz']:.1f} Hz, {s['scrapes_ok']} scrapes, {s['gaps']} gaps ({s['gap_ticks']} ticks)"))
    return pd.DataFrame(rows, columns=["fact", "value"])


def styled_cancel_table(table: pd.DataFrame) -> str:
    def colour(v):
        return f"background-color: {VERDICT_COLOURS.get(v, '#fff')}; color: white; font-weight: 600"

    # a Styler writes cells as they are: the scenario names and request ids come from the run, so escape them
    return (table.style.map(colour, subset=["verdict"]).format(precision=1, na_rep="–", escape="html")
            .format_index(escape="html", axis=1).hide(axis="index").to_html())


def _fig_html(fig: go.Figure) -> str:
    return fig.to_html(full_html=False, include_plotlyjs=False, config={"displaylogo": False})


def report_html(run: Run, verdicts: list[CancelVerdict], context_len: int = 2048, sample: bool = False) -> str:
    facts = run_facts(run)
    cap = capacity(run, context_len)
    table = cancel_table(run, verdicts)
    story = pick_story_cancel(verdicts)
    parts = [f"<h1>cancelwatch: run {run.id} {html.escape(facts['name'] or '')}</h1>"]
    if sample:
        parts.append('<p class="sample">This is the sample run shipped with cancelwatch, recorded from the embedded '
                     "engine. Record your own with <code>make demo</code>.</p>")
    summary = cancel_summary(run, story) if story is not None else None
    if summary is not None:
        # the five-second picture: one cancel, memory before and after, in the run's own numbers
        parts.append('<div class="summary"><p class="headline">' + html.escape(summary["sentence"][0].upper()
                     + summary["sentence"][1:]) + f' <span class="which">({html.escape(story.scenario)}, '
                     f"{html.escape(story.request_id)}, {html.escape(story.verdict)})</span></p>"
                     + _fig_html(summary_figure(summary)) + "</div>")
    parts.append('<h2>Why is GPU memory still high?</h2><div class="story">'
                 + "".join(f"<p>{html.escape(s)}</p>" for s in memory_story(run, verdicts, None)) + "</div>")
    if story is not None:
        parts.append(f"<h3>One cancel up close: {html.escape(story.scenario)} ({html.escape(story.verdict)})</h3>"
                     '<div class="story">' + "".join(f"<p>{html.escape(s)}</p>" for s in memory_story(run, verdicts, story))
                     + "</div>")
        parts.append(_fig_html(timeline_figure(run, verdicts, x_range=cancel_window(story), highlight=story.request_id,
                                               height=700)))
    parts.append("<h2>Timeline</h2>" + _fig_html(timeline_figure(run, verdicts)))
    parts.append(f"<h2>Cancels ({len(table)})</h2>" + (styled_cancel_table(table) if len(table) else "<p>none</p>"))
    ghosts = ghosts_of(run, verdicts)
    if not ghosts.empty:  # the request ids come from the run: to_html escapes them
        parts.append(f"<h2>{html.escape(ghost_headline(ghosts))}</h2><p>{html.escape(GHOST_CAPTION)}</p>"
                     + ghost_view(ghosts).to_html(index=False, na_rep="–"))
    parts.append("<h2>Capacity</h2>" + _fig_html(capacity_figure([(f"run {run.id}", cap)]))
                 + capacity_frame(cap).to_html(index=False))
    parts.append("<h2>Run facts</h2>" + facts_frame(facts).to_html(index=False))
    return ("<!DOCTYPE html><html><head><meta charset=\"utf-8\">"
            f"<title>cancelwatch run {run.id}</title><style>{CSS}</style>"
            f"<script type=\"text/javascript\">{get_plotlyjs()}</script></head><body>"
            + "\n".join(parts) + "</body></html>")
