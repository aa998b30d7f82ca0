"""The main timeline: memory as a band, KV usage, running/waiting, prefix-cache hit rate and every
cancel's five timepoints, on one time axis in seconds since the run started.

Long runs are downsampled per trace on the server (MinMax-LTTB from tsdownsample), to about
`max_points` per trace in the visible range. Cancels and gaps are drawn from their own tables and are
never downsampled. A gap in sampling breaks the line: no value is drawn where none was read.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots
from tsdownsample import MinMaxLTTBDownsampler

from cancelwatch.analysis.anatomy import PART_STYLE, PARTS, memory_anatomy
from cancelwatch.analysis.cancel_table import VERDICT_COLOURS
from cancelwatch.analysis.facts import scheduler_targets
from cancelwatch.analysis.series import sample_period
from cancelwatch.analysis.traces import GiB, Trace, memory_traces, metric_traces
from cancelwatch.analysis.verdicts import POINT_LABELS, TIMEPOINTS, CancelVerdict
from cancelwatch.runstore.reader import Run

MAX_POINTS = 1500
MAX_SHADED_GAPS = 200
HIT_RATE_WINDOW_S = 2.0
ROWS = ("memory", "kv", "requests", "prefix", "cancels")
ROW_TITLES = {
    "nvml": "GPU memory (NVML), GiB: the flat total is reserved memory; the KV pool's used part inside it moves",
    "process": ("engine process memory (RSS, the CPU analogue of reserved VRAM), GiB: the flat total is reserved "
                "memory; the KV pool's used part inside it moves"),
    "none": "memory: not sampled in this run",
}
TARGET_DASH = ("solid", "dot", "dash", "longdash")


def _breaks(run: Run, tr: Trace) -> np.ndarray:
    """Times where the line must break: the start of every gap of this source and target, and any
    silence longer than three sample periods."""
    out = []
    g = run.gaps
    if not g.empty:
        mine = g[(g["source"] == tr.source) & (g["target"] == tr.target)]
        out.append(mine["t_s"].to_numpy(dtype=float))
    if len(tr.t) > 2:
        dt = np.diff(tr.t)
        period = sample_period(run, tr.t)  # the baseline's: a burst's denser samples are no measure of silence
        if period > 0:
            big = np.nonzero(dt > 3 * period)[0]
            out.append(tr.t[big] + period)
    return np.unique(np.concatenate(out)) if out else np.array([])


def downsample(t: np.ndarray, v: np.ndarray, n_out: int) -> tuple[np.ndarray, np.ndarray]:
    """At most about `n_out` points, keeping each bucket's extremes (MinMax-LTTB)."""
    ok = ~np.isnan(v)
    t, v = t[ok], v[ok]
    if len(t) <= n_out:
        return t, v
    idx = MinMaxLTTBDownsampler().downsample(np.ascontiguousarray(t), np.ascontiguousarray(v), n_out=n_out)
    return t[idx], v[idx]


def _prepare(run: Run, tr: Trace, x_range, n_out: int) -> tuple[np.ndarray, np.ndarray]:
    t, v = tr.t, tr.v
    if x_range is not None:
        lo, hi = x_range
        i0 = max(int(np.searchsorted(t, lo, side="left")) - 1, 0)
        i1 = int(np.searchsorted(t, hi, side="right")) + 1
        t, v = t[i0:i1], v[i0:i1]
    t, v = downsample(t, v, n_out)
    br = _breaks(run, tr)
    if len(br) and len(t):
        br = br[(br > t[0]) & (br < t[-1])]
        idx = np.searchsorted(t, br)
        t = np.insert(t, idx, br)
        v = np.insert(v, idx, np.nan)
    return t, v


def hit_rate_traces(run: Run, window_s: float = HIT_RATE_WINDOW_S) -> list[Trace]:
    """Per target, the prefix-cache hit rate over a sliding window: new hit tokens / new queried
    tokens. NaN where nothing was queried in the window (a rate of nothing is not zero)."""
    queries = {q.target: q for q in metric_traces(run, "prefix_cache_queries_tokens_total")}
    out = []
    for h in metric_traces(run, "prefix_cache_hits_tokens_total"):
        q = queries.get(h.target)
        if q is None:
            continue
        qv = np.interp(h.t, q.t, q.v) if len(q.t) else np.full(len(h.t), np.nan)
        j = np.searchsorted(h.t, h.t - window_s, side="left")
        dh, dq = h.v - h.v[j], qv - qv[j]
        with np.errstate(invalid="ignore", divide="ignore"):
            rate = np.where(dq > 0, dh / dq, np.nan)
        out.append(Trace(h.target, h.source, h.target, h.t, np.clip(rate, 0, 1)))
    return out


# the total keeps the name the memory row always gave it: NVML's used per GPU, the engine's RSS
TOTAL_NAMES = {"process": "process memory", "nvml": "used"}


def _add_anatomy(fig: go.Figure, run: Run, a, x_range, max_points: int, row: int) -> None:
    """The memory total as a line over its parts, stacked in bytes (analysis/anatomy.py). Every part
    is cut at the same instants as the total, so the stack adds up to the line wherever it is drawn."""

    t, total = a.t, a.total
    keep = np.arange(len(t))
    if x_range is not None and len(t):
        lo, hi = x_range
        i0 = max(int(np.searchsorted(t, lo, side="left")) - 1, 0)
        i1 = int(np.searchsorted(t, hi, side="right")) + 1
        keep = keep[i0:i1]
    if len(keep) > max_points:
        ok = keep[~np.isnan(total[keep])]
        idx = MinMaxLTTBDownsampler().downsample(np.ascontiguousarray(t[ok]), np.ascontiguousarray(total[ok]),
                                                 n_out=max_points)
        keep = ok[idx]
    tt = t[keep]
    br = _breaks(run, Trace(a.name, a.source, a.target, tt, total[keep]))
    br = br[(br > tt[0]) & (br < tt[-1])] if len(br) and len(tt) else np.array([])
    at = np.searchsorted(tt, br)

    def cut(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return np.insert(tt, at, br), np.insert(values[keep], at, np.nan)

    for part in PARTS:
        if part not in a.parts:
            continue
        colour, shape = PART_STYLE[part]
        x, y = cut(a.parts[part])
        fig.add_trace(go.Scatter(x=x, y=y / GiB, name=f"{a.name} {part}", meta={"legend": "other memory" if part == "other" else part}, mode="lines",
                                 stackgroup=f"anatomy {a.name}",
                                 line=dict(width=0.5, color=colour), fillcolor=colour,
                                 fillpattern=dict(shape=shape, fgcolor="#333333", size=6, solidity=0.15) if shape else None,
                                 legendgroup="memory", hoveron="points+fills",
                                 hovertemplate="%{y:.3f} GiB<extra>%{fullData.name}</extra>"),
                      row=row, col=1)
    x, y = cut(total)
    fig.add_trace(go.Scatter(x=x, y=y / GiB, name=f"{a.name} {TOTAL_NAMES.get(a.kind, 'memory')}",
                             meta={"legend": TOTAL_NAMES.get(a.kind, "memory")},
                             mode="lines", line=dict(color="#222222", width=2), legendgroup="memory",
                             hovertemplate="%{y:.3f} GiB<extra>%{fullData.name}</extra>"),
                  row=row, col=1)


def _add_memory(fig: go.Figure, run: Run, mem, x_range, max_points: int, row: int) -> None:
    """The memory row: each process's anatomy stacked under its total where it has one, else its used, reserved
    or process memory as measured."""
    stacked = {a.name: a for a in memory_anatomy(run) if a.parts}
    for a in stacked.values():
        _add_anatomy(fig, run, a, x_range, max_points, row)
    for role, tr in mem:
        if role in ("used", "rss") and tr.name in stacked:
            continue  # drawn as the anatomy's total line
        t, v = _prepare(run, tr, x_range, max_points)
        if role == "used":
            fig.add_trace(go.Scatter(x=t, y=v / GiB, name=f"{tr.name} used", meta={"legend": "used"},
                                     fill="tozeroy", mode="lines",
                                     line=dict(color="#4c78a8", width=1), legendgroup="memory",
                                     hovertemplate="%{y:.3f} GiB<extra>%{fullData.name}</extra>"),
                          row=row, col=1)
        elif role == "reserved":
            fig.add_trace(go.Scatter(x=t, y=v / GiB, name=f"{tr.name} + reserved by the driver",
                                     meta={"legend": "+ reserved by the driver"}, fill="tonexty",
                                     mode="lines", line=dict(color="#9ecae9", width=1), legendgroup="memory",
                                     hovertemplate="%{y:.3f} GiB<extra>%{fullData.name}</extra>"),
                          row=row, col=1)
        else:
            fig.add_trace(go.Scatter(x=t, y=v / GiB, name=f"{tr.name} process memory",
                                     meta={"legend": "process memory"}, fill="tozeroy", mode="lines",
                                     line=dict(width=1), legendgroup="memory",
                                     hovertemplate="%{y:.3f} GiB<extra>%{fullData.name}</extra>"),
                          row=row, col=1)


def _each_once(fig: go.Figure) -> None:
    """One legend entry per kind of line (`meta.legend`: "used", "KV usage", "running", ...), however many
    processes and targets draw one. A kind drawn once keeps its full name (`KV usage t0`); a kind drawn for several
    is named by its kind, the first of them names the entry and the entry shows or hides them all, and each keeps
    its full name (`meta.name`, trace_name) as its text, which its hover shows (a fill's hover shows the text):
    substituted by plotly, never part of the template, as a name from the run is."""
    labels = [tr.meta.get("legend") if isinstance(tr.meta, dict) else None for tr in fig.data]
    seen: set[str] = set()
    for tr, label in zip(fig.data, labels):
        if label is None:
            continue
        full = tr.name
        if labels.count(label) == 1:
            tr.update(meta={"legend": label, "name": full})
            continue
        if tr.hovertemplate:
            tr.hovertemplate = tr.hovertemplate.replace("%{fullData.name}", "%{text}")
        tr.update(name=label, legendgroup=label, showlegend=label not in seen, meta={"legend": label, "name": full},
                  text=full)
        seen.add(label)


def trace_name(tr) -> str | None:
    """A timeline trace's full name (`KV usage t0`), where its legend entry names only its kind."""
    return tr.meta.get("name", tr.name) if isinstance(tr.meta, dict) else tr.name


def cancel_points(verdicts: list[CancelVerdict]) -> pd.DataFrame:
    rows = []
    for v in verdicts:
        for p in TIMEPOINTS:
            t = v.timepoints.get(p)
            if t is not None:
                rows.append({"request_id": v.request_id, "scenario": v.scenario, "verdict": v.verdict,
                             "point": POINT_LABELS[p], "t_s": t})
    return pd.DataFrame(rows, columns=["request_id", "scenario", "verdict", "point", "t_s"])


def timeline_figure(run: Run, verdicts: list[CancelVerdict], x_range: tuple[float, float] | None = None,
                    max_points: int = MAX_POINTS, highlight: str | None = None, height: int = 900) -> go.Figure:
    kind, mem = memory_traces(run)
    fig = make_subplots(
        rows=len(ROWS), cols=1, shared_xaxes=True, vertical_spacing=0.045,
        row_heights=[0.24, 0.2, 0.2, 0.14, 0.22],
        subplot_titles=[ROW_TITLES[kind], "KV-cache usage, %", "requests running (solid) and waiting (dashed)",
                        f"prefix-cache hit rate, % ({HIT_RATE_WINDOW_S:g} s window)",
                        "cancels: the five timepoints (colour = verdict)"
                        + (" and the path's hops" if any(v.hops for v in verdicts) else "")],
    )
    row = {name: i + 1 for i, name in enumerate(ROWS)}
    targets = scheduler_targets(run)
    dash = {t: TARGET_DASH[i % len(TARGET_DASH)] for i, t in enumerate(targets)}
    _add_memory(fig, run, mem, x_range, max_points, row["memory"])
    _add_scheduler(fig, run, x_range, max_points, row, dash)
    _each_once(fig)
    if len(targets) > 1:  # the legend names each kind once: the line style says whose, once per target
        for t in targets:
            fig.add_trace(go.Scatter(x=[None], y=[None], mode="lines", name=f"{t}: {dash[t]} lines",
                                     line=dict(color="#888888", dash=dash[t], width=1.5), hoverinfo="skip"),
                          row=row["kv"], col=1)
    shapes = _add_cancels(fig, verdicts, row["cancels"], x_range, highlight) + _add_gaps(fig, run, x_range)
    _add_hops(fig, verdicts, row["cancels"], x_range)
    # set once: plotly re-validates every shape on each layout update, seconds for a long run
    fig.layout.shapes = tuple(shapes)
    fig.update_yaxes(rangemode="tozero", row=row["memory"], col=1)
    fig.update_yaxes(range=[0, 105], row=row["kv"], col=1)
    fig.update_yaxes(rangemode="tozero", row=row["requests"], col=1)
    fig.update_yaxes(range=[0, 105], row=row["prefix"], col=1)
    fig.update_yaxes(categoryorder="array", categoryarray=_cancel_rows(verdicts), row=row["cancels"], col=1)
    fig.update_xaxes(title_text="seconds since the run started", row=len(ROWS), col=1)
    if x_range is not None:
        fig.update_xaxes(range=list(x_range))
    fig.update_layout(height=height, margin=dict(l=60, r=20, t=40, b=40), hovermode="closest",
                      legend=dict(orientation="h", y=-0.06), uirevision=str(x_range))
    for ann in fig.layout.annotations:
        ann.font.size = 12
    return fig


def _add_scheduler(fig: go.Figure, run: Run, x_range, max_points: int, row: dict, dash: dict) -> None:
    """The scheduler's rows: KV usage, requests running and waiting, the prefix-cache hit rate, per target."""
    for tr in metric_traces(run, "kv_cache_usage_ratio"):
        t, v = _prepare(run, tr, x_range, max_points)
        fig.add_trace(go.Scatter(x=t, y=100 * v, name=f"KV usage {tr.target}", meta={"legend": "KV usage"},
                                 mode="lines",
                                 line=dict(color="#e45756", dash=dash.get(tr.target, "solid"), width=1.5),
                                 hovertemplate="%{y:.1f} %<extra>%{fullData.name}</extra>"),
                      row=row["kv"], col=1)
    for metric, label, colour, style in (("requests_running", "running", "#54a24b", "solid"),
                                         ("requests_waiting", "waiting", "#f58518", "dash")):
        for tr in metric_traces(run, metric):
            t, v = _prepare(run, tr, x_range, max_points)
            fig.add_trace(go.Scatter(x=t, y=v, name=f"{label} {tr.target}", meta={"legend": label}, mode="lines",
                                     line_shape="hv",
                                     line=dict(color=colour, dash=style, width=1.5),
                                     hovertemplate="%{y:.0f}<extra>%{fullData.name}</extra>"),
                          row=row["requests"], col=1)
    for tr in hit_rate_traces(run):
        t, v = _prepare(run, tr, x_range, max_points)
        fig.add_trace(go.Scatter(x=t, y=100 * v, name=f"prefix hit rate {tr.target}",
                                 meta={"legend": "prefix hit rate"}, mode="lines",
                                 line=dict(color="#b279a2", dash=dash.get(tr.target, "solid"), width=1.5),
                                 hovertemplate="%{y:.0f} %<extra>%{fullData.name}</extra>"),
                      row=row["prefix"], col=1)


def _add_cancels(fig: go.Figure, verdicts: list[CancelVerdict], row: int, x_range, highlight: str | None) -> list[dict]:
    lo, hi = x_range if x_range is not None else (-math.inf, math.inf)
    by_verdict: dict[str, dict[str, list]] = {}
    shapes: list[dict] = []
    for v in verdicts:
        pts = [(p, v.timepoints.get(p)) for p in TIMEPOINTS if v.timepoints.get(p) is not None]
        if not pts or pts[-1][1] < lo or pts[0][1] > hi:
            continue
        d = by_verdict.setdefault(v.verdict, {"x": [], "y": [], "text": [], "size": []})
        for p, t in pts:
            d["x"].append(t)
            d["y"].append(POINT_LABELS[p])
            d["text"].append(f"{v.request_id}<br>{v.scenario} · {v.phase_at_cancel} · {v.verdict}<br>{POINT_LABELS[p]}")
            d["size"].append(12 if v.request_id == highlight else 7)
        d["x"].append(None)
        d["y"].append(None)
        d["text"].append(None)
        d["size"].append(7)
        colour = VERDICT_COLOURS.get(v.verdict, "#333")
        width = 2.5 if v.request_id == highlight else 1
        # the user stop, across every row: where to look in the memory and scheduler rows
        t = v.timepoints["user_stop"]
        shapes.append(dict(type="line", xref="x", yref="paper", x0=t, x1=t, y0=0, y1=1, opacity=0.6,
                           line=dict(color=colour, width=width, dash="dot")))
    for verdict, d in by_verdict.items():
        fig.add_trace(go.Scatter(x=d["x"], y=d["y"], text=d["text"], mode="lines+markers", name=f"cancel: {verdict}",
                                 marker=dict(color=VERDICT_COLOURS.get(verdict, "#333"), size=d["size"]),
                                 line=dict(color=VERDICT_COLOURS.get(verdict, "#333"), width=1),
                                 hovertemplate="%{text}<br>t = %{x:.3f} s<extra></extra>"),
                      row=row, col=1)
    return shapes


def hop_label(hop: str) -> str:
    """The timeline row of a tapped component: where the cancel reached it and how long it held it."""
    return f"→ {hop}"


def _cancel_rows(verdicts: list[CancelVerdict]) -> list[str]:
    """The cancels row's categories, bottom to top: the timepoints, with a row per tapped component (in
    order from the client) under the user stop."""
    hops = list(dict.fromkeys(s.hop for v in verdicts for s in v.hops))
    rows = [POINT_LABELS[p] for p in reversed(TIMEPOINTS)]
    return rows[:-1] + [hop_label(h) for h in reversed(hops)] + rows[-1:]


def _add_hops(fig: go.Figure, verdicts: list[CancelVerdict], row: int, x_range) -> None:
    """Each cancel's way through the taps: on its component's row, from the instant the cancel reached it to
    the one it passed it on (or, where it did not, to its upstream's end: a thick red stretch)."""
    lo, hi = x_range if x_range is not None else (-math.inf, math.inf)
    passed = {"x": [], "y": [], "text": []}
    kept = {"x": [], "y": [], "text": []}
    for v in verdicts:
        for s in v.hops:
            if s.reached_s is None:
                continue
            stop = s.passed_s if s.passed_s is not None and s.passed_s - s.reached_s <= v.evidence.grace_s else None
            end = stop if stop is not None else (s.passed_s or s.upstream_end_s or s.reached_s)
            if end < lo or s.reached_s > hi:
                continue
            d = passed if stop is not None else kept
            what = (f"passed on after {s.held_ms:g} ms" if stop is not None
                    else "not passed on within the grace (its upstream stayed open)")
            text = f"{v.request_id}<br>{s.hop}: its client side closed ({s.reached_how}), {what}"
            d["x"] += [s.reached_s, end, None]
            d["y"] += [hop_label(s.hop)] * 2 + [None]
            d["text"] += [text, text, None]
    for d, name, colour, width in ((passed, "cancel passed on at a hop", "#1a9850", 2),
                                   (kept, "cancel kept at a hop", "#d73027", 5)):
        if d["x"]:
            fig.add_trace(go.Scatter(x=d["x"], y=d["y"], text=d["text"], mode="lines+markers", name=name,
                                     line=dict(color=colour, width=width), marker=dict(color=colour, size=6),
                                     hovertemplate="%{text}<br>t = %{x:.3f} s<extra></extra>"), row=row, col=1)


def _add_gaps(fig: go.Figure, run: Run, x_range) -> list[dict]:
    g = run.gaps
    if g.empty:
        return []
    lo, hi = x_range if x_range is not None else (-math.inf, math.inf)
    g = g[(g["end_t_s"] >= lo) & (g["t_s"] <= hi)].sort_values("t_s")
    if len(g) > MAX_SHADED_GAPS:
        # the lines still break at every gap; only the shading is thinned
        g = g.iloc[np.linspace(0, len(g) - 1, MAX_SHADED_GAPS).astype(int)]
    shapes = []
    for r in g.itertuples(index=False):
        lost = r.kind == "lost"
        shapes.append(dict(type="rect", xref="x", yref="paper", x0=r.t_s, x1=max(r.end_t_s, r.t_s + 0.05), y0=0, y1=1,
                           fillcolor="#d62728" if lost else "#999999", opacity=0.25 if lost else 0.15, line_width=0,
                           layer="below"))
    fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name="sampling gap (no reading)",
                             marker=dict(symbol="square", color="#999999", size=10)), row=1, col=1)
    return shapes
