"""The gateway matrix: per gateway configuration and scenario, whether the gateway passed the cancel on
(the tap behind it saw it close its upstream within the grace), how long that took, and the verdict the
engine's evidence gave. Read from the runs `cancelwatch matrix` recorded, one run a row, each run's taps
named for the components they feed; written as Markdown and as one self-contained HTML page."""

from __future__ import annotations

import html
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from cancelwatch.analysis.verdicts import CancelVerdict, judge_run, run_grace_s
from cancelwatch.analysis.verdicts.core import INCONCLUSIVE
from cancelwatch.runstore.reader import Run

DIRECT = "direct"


@dataclass
class Cell:
    """One scenario through one configuration. passed_on: cancels the gateway passed on within the grace
    (direct: that the engine logged an abort for); delays: ms each took through the gateway (direct: stop
    to the engine's abort); stopped_at: where cancels that were not passed on stopped; unsent: cancels
    whose request the engine never had (rule never_added: there was nothing to pass on)."""

    scenario: str
    cancels: int = 0
    passed_on: int = 0
    delays_ms: list[float] = field(default_factory=list)
    verdicts: Counter = field(default_factory=Counter)
    stopped_at: Counter = field(default_factory=Counter)
    unsent: int = 0

    @property
    def p50_ms(self) -> float | None:
        return round(float(np.median(self.delays_ms)), 1) if self.delays_ms else None

    @property
    def max_ms(self) -> float | None:
        return round(max(self.delays_ms), 1) if self.delays_ms else None

    def passed_text(self) -> str:
        if not self.cancels:
            return "no cancel"
        if self.unsent == self.cancels:
            return "never reached the engine"
        asked = self.cancels - self.unsent  # a request the engine never had had no cancel to pass on
        text = "yes" if self.passed_on == asked else "no" if self.passed_on == 0 else f"{self.passed_on} of {asked}"
        return text + (f" ({self.unsent} never reached the engine)" if self.unsent else "")

    def verdict_text(self) -> str:
        """Each verdict with its count (an inconclusive one keyed with its rule by _cell)."""
        return ", ".join(f"{v}" if n == 1 else f"{v} ×{n}" for v, n in sorted(self.verdicts.items())) or "none"


@dataclass
class Row:
    """One configuration: the gateway (None: direct to the engine), what it is and what ran, its cells."""

    name: str
    product: str
    version: str
    setting: str
    config: str
    run_id: int | None
    cells: list[Cell]
    error: str | None = None


def _cell(scenario: str, verdicts: list[CancelVerdict], hop: str | None, grace_s: float) -> Cell:
    cell = Cell(scenario)
    for v in verdicts:
        cell.cancels += 1
        # an inconclusive verdict is read with its rule: the rule says what to do about it
        cell.verdicts[v.verdict if v.verdict != INCONCLUSIVE else f"{INCONCLUSIVE} ({v.rule})"] += 1
        if v.rule == "never_added":
            cell.unsent += 1
            continue
        if hop is None:
            ms = v.latency_ms("user_stop", "engine_abort")
            if ms is not None:
                cell.passed_on += 1
                cell.delays_ms.append(ms)
            continue
        step = next((s for s in v.hops if s.hop == hop), None)
        if step is not None and step.held_ms is not None and step.held_ms <= grace_s * 1000:
            cell.passed_on += 1
            cell.delays_ms.append(step.held_ms)
        elif v.evidence.stopped_at:
            cell.stopped_at[v.evidence.stopped_at] += 1
    return cell


def matrix_row(run: Run, *, name: str, product: str, version: str, setting: str, config: str,
               hop: str | None, scenarios: list[str]) -> Row:
    """The row of one configuration from its run: `hop` is the tap in front of the gateway (None: direct)."""
    verdicts, grace_s = judge_run(run), run_grace_s(run)
    cells = [_cell(s, [v for v in verdicts if v.scenario == s], hop, grace_s) for s in scenarios]
    return Row(name, product, version, setting, config, run.id, cells)


HEAD = ["gateway", "version", "configuration", "scenario", "passed on", "p50 (ms)", "max (ms)", "verdict"]


def _lines(rows: list[Row]) -> list[list[str]]:
    out = []
    for r in rows:
        if r.error:
            out.append([r.name, r.version, r.setting, "", f"not run: {r.error}", "", "", ""])
            continue
        for c in r.cells:
            stop = f" (stopped at {', '.join(c.stopped_at)})" if c.stopped_at else ""
            out.append([r.name, r.version, r.setting, c.scenario, c.passed_text() + stop,
                        "" if c.p50_ms is None else f"{c.p50_ms:g}", "" if c.max_ms is None else f"{c.max_ms:g}",
                        c.verdict_text()])
    return out


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def matrix_markdown(rows: list[Row], *, command: str, engine: str, when: str) -> str:
    """The matrix as Markdown: what ran, the table, and each configuration's written config."""
    lines = ["# Cancels through gateways", "",
             f"Made by `{command}` on {when}, against {engine}. Per gateway configuration and scenario: whether the "
             "gateway passed the cancel on (the tap behind it saw it close its upstream connection within the "
             "grace; direct: whether the engine logged the abort; never reached the engine: its log never named "
             "the request, so there was nothing to cancel), how long that took (p50 and max, ms: through "
             "the gateway, or from the stop to the engine's abort direct), and the verdict on the engine's "
             "evidence.", "",
             "| " + " | ".join(HEAD) + " |", "|" + "---|" * len(HEAD)]
    lines += ["| " + " | ".join(_md_cell(x) for x in line) + " |" for line in _lines(rows)]
    lines += ["", "## Configurations", ""]
    for r in rows:
        if r.config:
            lines += [f"### {r.name} ({r.product} {r.version}: {r.setting})", "", "```", r.config.rstrip(), "```", ""]
    return "\n".join(lines).rstrip() + "\n"


STYLE = ("body{font-family:system-ui,sans-serif;margin:2em;max-width:72em}table{border-collapse:collapse}"
         "td,th{border:1px solid #ccc;padding:.3em .6em;text-align:left}th{background:#f3f3f3}"
         ".yes{color:#1a9850}.no{color:#d73027}pre{background:#f7f7f7;padding:.6em;overflow:auto}")


def matrix_html(rows: list[Row], *, command: str, engine: str, when: str) -> str:
    """The matrix as one self-contained HTML page (no script, no external file)."""
    e = html.escape
    body = [f"<h1>Cancels through gateways</h1><p>Made by <code>{e(command)}</code> on {e(when)}, against "
            f"{e(engine)}. Passed on: the tap behind the gateway saw it close its upstream connection within the "
            "grace (direct: the engine logged the abort; never reached the engine: its log never named the "
            "request, so there was nothing to cancel). Delays in ms. The verdict rests on the engine's own "
            "evidence.</p>", "<table><tr>" + "".join(f"<th>{e(h)}</th>" for h in HEAD) + "</tr>"]
    for line in _lines(rows):
        cls = "yes" if line[4] == "yes" else "no" if line[4].startswith("no") else ""
        cells = [f"<td>{e(x)}</td>" for x in line]
        cells[4] = f'<td class="{cls}">{e(line[4])}</td>'
        body.append("<tr>" + "".join(cells) + "</tr>")
    body.append("</table><h2>Configurations</h2>")
    for r in rows:
        if r.config:
            body.append(f"<details><summary>{e(r.name)}: {e(r.product)} {e(r.version)}, {e(r.setting)}</summary>"
                        f"<pre>{e(r.config)}</pre></details>")
    return ("<!doctype html><html><head><meta charset=\"utf-8\"><title>Cancels through gateways</title>"
            f"<style>{STYLE}</style></head><body>" + "\n".join(body) + "</body></html>\n")
