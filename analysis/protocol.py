"""The acceptance protocol of a run: one Markdown document a stakeholder can read and sign off.

What was tested (engine, model, hardware, concurrency), how (each scenario's client method and cancel
scope), under which allowed observation delay (the grace window and the sampling period), which
evidence each timepoint rests on, what came out (verdicts per scenario and per cancel), and which
states the run did not cover. Everything is the run's own: what it did not record is written as not
recorded, never filled in. A builtin scenario definition (passed in by the caller: analysis does not
import the collectors) is used by name only where the run's own record leaves a field open, only when
it agrees with what was recorded, and the protocol says which fields came from it.

Pure: the run and its report document (`analysis.verdicts.report_document`) in, text out.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

from cancelwatch.analysis.evidence import count_reading_text
from cancelwatch.analysis.facts import run_facts
from cancelwatch.analysis.summary import key_figures
from cancelwatch.analysis.verdicts import (
    LATENCIES,
    POINT_LABELS,
    RULES,
    SOURCE_LABELS,
    TIMEPOINTS,
    RACE_RULES,
    TRITON,
    VERDICTS,
    latency_key,
    latency_label,
    run_grace_s,
)
from cancelwatch.runstore.reader import Run
from cancelwatch.runstore.records import DriveSettings

VERDICT_TEXT = {
    "released": "released: left the scheduler within the grace window",
    "leaked": "leaked: still counted after the grace while the engine kept stepping",
    "stale_gauge": "stale gauge: still counted after the grace, but no tokens generated (gauges not refreshed)",
    "inconclusive": "inconclusive: the run cannot tell (foreign traffic, too few samples, restart, no abort)",
}
# the full set of states a cancel can meet; a run is compared against it
PHASES = ("queued", "prefill", "decode", "race/completion")
MODES = ("cancel", "disconnect", "timeout", "explicit")
APIS = ("completions", "chat")
MODE_TEXT = {
    "cancel": "cancel: the client's task is cancelled and its stream closed",
    "disconnect": "disconnect: the client closes the stream, no cancel call",
    "timeout": "timeout: a non-streaming client gives up after its timeout",
    "explicit": "explicit: POST /cancel to the relay app, which awaits AsyncLLM.abort()",
}
# a Triton run's client methods (tritonclient calls, collectors/cancels/triton_calls.py) and phases
TRITON_PHASES = ("queued", "executing")
TRITON_MODE_TEXT = {
    "explicit": "explicit: tritonclient.grpc async_infer's CallContext.cancel()",
    "task_cancel": "task cancel: the asyncio task over tritonclient.grpc.aio stream_infer is cancelled",
    "stream_wide": "stream-wide: stop_stream(cancel_requests=True) cancels every request of the stream",
    "deadline": "deadline: gRPC client_timeout passes while the request runs",
    "disconnect": "disconnect: the request's gRPC channel is closed, no cancel call",
    "http_timeout": "HTTP timeout: a non-streaming KServe v2 POST gives up (HTTP carries no cancel)",
}
POINT_TEXT = {
    "user_stop": "the driver decided to cancel (its own clock)",
    "app_received": "the cancel reached the application serving the request",
    "engine_abort": "the engine aborted the request (the table below says on whose word: the engine's own log, "
                    "the relay app's abort() returning, ...)",
    "left_scheduler": "first scheduler sample at or after the abort where running + waiting is no more than the "
                      "client's in-flight requests and, for a request that held KV, KV usage fell below its level "
                      "at the stop",
    "reusable": "the probe sent after the cancel got its first token (in a watch, a request queued behind it): the "
                "freed capacity was handed out again",
}
GAUGE_NAMES = {"requests_running": "running", "requests_waiting": "waiting"}
NOT_RECORDED = "not recorded"
DASH = "—"


# ------------------------------------------------------------------------------------------ helpers
def is_race(c: Mapping) -> bool:
    """A cancel whose evidence concluded a race the completion won (its rule says so; a race flag noted on
    the way down the ladder is not a conclusion)."""
    return c.get("verdict") == "inconclusive" and (c.get("evidence") or {}).get("rule") in RACE_RULES


def is_expected(c: Mapping) -> bool:
    """A cancel with the verdict its scenario is built to show (Triton's deaf backend and HTTP timeout leak)."""
    expected = (c.get("evidence") or {}).get("expected")
    return expected not in (None, "released") and c.get("verdict") == expected


def accepted(doc: Mapping) -> bool:
    """The acceptance rule (and `cancelwatch report`'s exit 0): at least one cancel released (or showing the
    verdict its scenario is built to show), every other one a race the completion won (counted apart), every
    neighbour completed, and no server counting more requests than the client sent (a silent resubmit). A run
    of races alone shows nothing of cancels reaching the engine: not accepted."""
    cancels = doc.get("cancels", [])
    shown = [c for c in cancels if c["verdict"] == "released" or is_expected(c)]
    no_resubmit = all(r["ok"] for r in doc.get("server_requests", []))
    return (bool(doc.get("neighbours_ok")) and bool(shown) and len(shown) + sum(map(is_race, cancels)) == len(cancels)
            and no_resubmit)


def _accepted_counts(cancels: list[Mapping]) -> str:
    """`all 12 cancels released`, or `10 of 12 cancels released, 2 completions won the race` (a race is
    never counted as a release), and the verdicts scenarios are built to show."""
    released = sum(c["verdict"] == "released" for c in cancels)
    races, expected = sum(map(is_race, cancels)), sum(map(is_expected, cancels))
    if released == len(cancels):
        return f"all {len(cancels)} cancels released"
    parts = [f"{released} of {len(cancels)} cancels released"]
    if races:
        parts.append(f"{races} {'completion' if races == 1 else 'completions'} won the race")
    if expected:
        parts.append(f"{expected} leaked as their scenario is built to show")
    return ", ".join(parts)


def _cell(value) -> str:
    """One Markdown table cell: pipes escaped, one line, an unknown as a dash."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return DASH
    return " ".join(str(value).replace("|", "\\|").split()) or DASH


def _table(header: list[str], rows: list[list]) -> list[str]:
    out = ["| " + " | ".join(_cell(h) for h in header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
    return out


def _num(value, fmt: str = "{:g}") -> str | None:
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(x) else fmt.format(x)


def _ms(value) -> str | None:
    return _num(value, "{:.1f}")


def _short_id(request_id: str | None) -> str:
    rid = str(request_id or "")
    return rid.rsplit("-", 1)[-1][-8:] or rid


def _data(raw) -> dict:
    if isinstance(raw, dict):
        return raw
    try:
        out = json.loads(raw) if isinstance(raw, str) else {}
    except ValueError:
        return {}
    return out if isinstance(out, dict) else {}


def _events(run: Run) -> list[tuple[str, str | None, dict]]:
    ev = run.events
    if ev is None or ev.empty or "kind" not in ev:
        return []
    rids = ev["request_id"] if "request_id" in ev else [None] * len(ev)
    return [(str(k), r if isinstance(r, str) else None, _data(d)) for k, r, d in zip(ev["kind"], rids, ev["data"])]


def _ledger_rows(run: Run) -> list[dict]:
    led = run.ledger
    if led is None or led.empty or "role" not in led:
        return []
    return led.to_dict("records")


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


# ------------------------------------------------------------------------------------------ scenarios
@dataclass
class ScenarioRecord:
    """What the run recorded of one scenario, and what a builtin definition of its name adds."""

    name: str
    repeats: int = 0  # scenario_start events
    proves: str | None = None
    proves_from: str | None = None  # "run" | "builtin"
    modes: list[str] = field(default_factory=list)  # recorded with its user_stop events
    phases: list[str] = field(default_factory=list)
    targets: int = 0  # target requests in the ledger
    fillers: int = 0
    n: list[int] = field(default_factory=list)  # the n of its target requests
    cancels: list[dict] = field(default_factory=list)  # its cancels in the report document
    stops: int = 0  # user_stop events
    builtin: dict | None = None  # the builtin of this name, when it agrees with the record
    builtin_differs: bool = False
    from_builtin: list[str] = field(default_factory=list)  # fields taken from the builtin

    @property
    def per_repeat_targets(self) -> int | None:
        if not self.targets:
            return self.builtin["concurrency"] if self.builtin else None
        return self.targets // self.repeats if self.repeats and self.targets % self.repeats == 0 else self.targets

    @property
    def per_repeat_cancels(self) -> int | None:
        if not self.stops:
            return self.builtin["cancel_count"] if self.builtin else None
        return self.stops // self.repeats if self.repeats and self.stops % self.repeats == 0 else self.stops

    @property
    def mode_values(self) -> list[str]:
        if self.modes:
            return self.modes
        return [self.builtin["mode"]] if self.builtin else []

    @property
    def n_values(self) -> list[int]:
        if self.n:
            return self.n
        return [int(self.builtin["n"])] if self.builtin else []

    @property
    def api(self) -> str | None:
        return self.builtin["api"] if self.builtin else None

    @property
    def stream(self) -> bool | None:
        if self.builtin:
            return bool(self.builtin["stream"])
        return False if self.modes == ["timeout"] else None

    @property
    def trigger(self) -> str | None:
        if not self.builtin:
            return None
        value = _num(self.builtin.get("trigger_value"))
        return f"{self.builtin['trigger']} {value}" if value is not None else self.builtin["trigger"]


def scenario_records(run: Run, doc: Mapping, builtin: Mapping[str, Mapping] | None = None) -> list[ScenarioRecord]:
    """The run's scenarios in the order they ran (then any its settings or cancels name besides)."""
    recs: dict[str, ScenarioRecord] = {}

    def rec(name) -> ScenarioRecord:
        name = str(name)
        if name not in recs:
            recs[name] = ScenarioRecord(name)
        return recs[name]

    for kind, _, data in _events(run):
        if kind == "scenario_start" and data.get("scenario") is not None:
            r = rec(data["scenario"])
            r.repeats += 1
            if data.get("proves") and not r.proves:
                r.proves, r.proves_from = data["proves"], "run"
        elif kind == "user_stop" and data.get("scenario") is not None:
            r = rec(data["scenario"])
            r.stops += 1
            if data.get("mode") and data["mode"] not in r.modes:
                r.modes.append(data["mode"])
    for name in DriveSettings.of_run(run.info.get("settings")).scenarios or []:
        rec(name)
    for row in _ledger_rows(run):
        if row.get("scenario") is None:
            continue
        r = rec(row["scenario"])
        if row.get("role") == "target":
            r.targets += 1
            try:
                n = int(row.get("n"))
            except (TypeError, ValueError):  # unknown (None, NaN): one sequence
                n = 1
            if n not in r.n:
                r.n.append(n)
        elif row.get("role") == "filler":
            r.fillers += 1
    for c in doc.get("cancels", []):
        r = rec(c.get("scenario"))
        r.cancels.append(c)
        phase = c.get("phase_at_cancel")
        if phase and phase not in r.phases:
            r.phases.append(phase)
    for r in recs.values():
        r.n.sort()
        b = (builtin or {}).get(r.name)
        if b is not None:
            _fill_from_builtin(r, b)
    return list(recs.values())


def _fill_from_builtin(r: ScenarioRecord, b: Mapping) -> None:
    """What the run did not record of a scenario, from the built-in one of its name where the run agrees with it."""
    agrees = ((not r.modes or r.modes == [b["mode"]]) and (not r.n or r.n == [int(b["n"])])
              and (not r.targets or r.per_repeat_targets == b["concurrency"])
              and (not r.stops or r.per_repeat_cancels == b["cancel_count"]))
    if not agrees:
        r.builtin_differs = True
        return
    r.builtin = dict(b)
    r.from_builtin = ["API", "stream", "trigger"]
    if not r.modes:
        r.from_builtin.append("client method")
    if not r.targets or not r.stops:
        r.from_builtin.append("cancel scope")
    if not r.proves and b.get("proves"):
        r.proves, r.proves_from = b["proves"], "builtin"
        r.from_builtin.append("what it proves")


def cancel_scope(r: ScenarioRecord) -> str:
    m, k, ns = r.per_repeat_targets, r.per_repeat_cancels, r.n_values
    if m is None and k is None:
        return NOT_RECORDED
    if m and m > 1:
        scope = f"burst: {k if k is not None else '?'} of {m} concurrent requests cancelled at once"
    else:
        scope = "one request"
    big = [n for n in ns if n > 1]
    if big:
        scope += f"; n={big[0]}: every one of its {big[0]} child sequences"
    return scope


def _definition_note(r: ScenarioRecord) -> str:
    if r.builtin_differs:
        return "recorded; differs from the builtin of that name, which is not used"
    if r.builtin is not None:
        return f"recorded; {', '.join(r.from_builtin)} from the builtin definition `{r.name}`"
    if not (r.repeats or r.stops or r.targets):
        return "named in the run's settings; nothing recorded"
    return "recorded; no builtin of this name (API and trigger not recorded)"


# ------------------------------------------------------------------------------------------ sections
def _system_section(run: Run, facts: dict) -> list[str]:
    info = run.info
    engine = info.get("engine") or {}
    engines = engine.get("targets") or {}
    versions = [str(v) for v in (engine.get("version"), *(e.get("version") for e in engines.values())) if v]
    embedded = any(e.get("embedded") for e in engines.values())
    rows = [["Engine", facts["engine"] + ("" if embedded else " (not started by cancelwatch: only its /metrics "
                                                            "and the driven API were seen)")],
            ["Engine version", ", ".join(dict.fromkeys(versions)) if versions else
             f"{NOT_RECORDED} by this run (the run stores no engine version)"],
            ["Model", facts["model"] or NOT_RECORDED],
            ["Served model name", facts["served_model"] or DriveSettings.of_run(info.get("settings")).model
             or NOT_RECORDED],
            ["Targets", ", ".join(f"{t['label']} = {t['url']}" for t in facts["targets"]) or NOT_RECORDED],
            ["Driven target", facts["driven_target"] or NOT_RECORDED]]
    rows.append(["Hardware", _hardware(run, facts, engines)])
    for pool in facts["kv_pools"]:
        if pool["blocks"] or pool["tokens"]:
            size = f", {pool['bytes'] / 1024**2:.0f} MiB" if pool["bytes"] else ""
            pool_text = (f"{pool['blocks'] or '?'} blocks × {pool['block_size'] or '?'} tokens = "
                         f"{pool['tokens'] or '?'} tokens{size}")
            rows.append([f"KV pool ({pool['target']})", pool_text])
    for label, e in engines.items():
        if e.get("command"):
            rows.append([f"Engine command ({label})", "`" + " ".join(map(str, e["command"])) + "`"])
    return ["## 1. System under test", "", *_table(["fact", "value"], rows), ""]


def _hardware(run: Run, facts: dict, engines: dict) -> str:
    parts = []
    host = run.info.get("host")
    if isinstance(host, dict) and host:
        parts.append(", ".join(f"{k}: {v}" for k, v in host.items()))
    nvml = facts.get("nvml")
    if nvml:
        parts.append(f"NVML {nvml}")
    gpus = run.series("gpu_memory_total_bytes") if not run.samples.empty else None
    if gpus is not None and not gpus.empty:
        for labels, g in gpus.groupby("labels", observed=True):
            gpu = _data(labels)
            parts.append(f"GPU {gpu.get('gpu', '?')} ({gpu.get('uuid', 'uuid not recorded')}): "
                         f"{g['value'].max() / 1024**3:.1f} GiB")
    for label, e in engines.items():
        shape = e.get("shape") or {}
        known = [f"{k} {shape[k]}" for k in ("dtype", "gpu_memory_utilization") if shape.get(k) is not None]
        if known:
            parts.append(f"engine {label}: {', '.join(known)}")
    parts.append({"nvml": "memory sampled from NVML", "process": "engine process memory sampled (no GPU readings)",
                  "none": "no memory sampled"}[facts["memory_source"]])
    if not isinstance(host, dict) or not host:
        parts.append("host CPU/GPU model not recorded by this run")
    return "; ".join(parts)


def _concurrency_section(run: Run, recs: list[ScenarioRecord]) -> list[str]:
    info = run.info
    engines = (info.get("engine") or {}).get("targets") or {}
    lines = ["## 2. Concurrency", ""]
    rows = []
    for t in info.get("targets", []):
        label = t["label"]
        shape = (engines.get(label) or {}).get("shape") or {}
        seqs = shape.get("max_num_seqs")
        kv_conc = (info.get("cache") or {}).get(label, {}).get("kv_cache_max_concurrency")
        rows.append([label, f"{seqs} (engine shape)" if seqs is not None else
                     f"{NOT_RECORDED} (engine not started by cancelwatch)",
                     kv_conc if kv_conc not in (None, "None") else NOT_RECORDED])
    if rows:
        lines += _table(["target", "max_num_seqs", "kv_cache_max_concurrency (vLLM cache config)"], rows) + [""]
    peaks = key_figures(run)
    seen = [f"{GAUGE_NAMES[m]} {_num(peaks[m]['max'])}" for m in ("requests_running", "requests_waiting")
            if m in peaks]
    if seen:
        lines += [f"Peak sampled on the scheduler: {', '.join(seen)}.", ""]
    rows = [[r.name, r.per_repeat_targets, r.per_repeat_cancels, ", ".join(map(str, r.n_values)) or None,
             (r.fillers // r.repeats if r.repeats and r.fillers % r.repeats == 0 else r.fillers) if r.targets else None,
             r.repeats or None] for r in recs]
    if rows:
        lines += _table(["scenario", "target requests sent together", "cancelled of them", "n (sequences each)",
                         "fillers", "repeats"], rows)
        lines += ["", ("Besides its targets, each scenario repeat runs one neighbour (must complete unharmed) and, "
                       "after the cancel, one probe (must be admitted into the freed capacity)."), ""]
    return lines



def _scenario_section(recs: list[ScenarioRecord], triton: bool = False) -> list[str]:
    lines = ["## 3. Scenarios: client method and cancel scope", ""]
    texts = TRITON_MODE_TEXT if triton else MODE_TEXT
    if not recs:
        return lines + ["No scenario ran: this run only sampled.", ""]
    rows = []
    for r in recs:
        modes = r.mode_values
        method = "; ".join(texts.get(m, m) for m in modes) if modes else NOT_RECORDED
        stream = r.stream
        rows.append([r.name, r.proves or NOT_RECORDED, method, r.api or NOT_RECORDED,
                     NOT_RECORDED if stream is None else ("yes" if stream else "no"), r.trigger or NOT_RECORDED,
                     cancel_scope(r), _definition_note(r)])
    lines += _table(["scenario", "what it proves", "client method", "API", "streamed", "trigger", "cancel scope",
                     "definition"], rows)
    return lines + [""]


def _delay_section(run: Run, doc: Mapping, facts: dict) -> list[str]:
    recorded = DriveSettings.of_run(run.info.get("settings")).grace_s
    own = run_grace_s(run)
    used = sorted({float(c["evidence"]["grace_s"]) for c in doc.get("cancels", [])
                   if (c.get("evidence") or {}).get("grace_s") is not None})
    grace = used[0] if len(used) == 1 else own
    origin = "recorded with the run: `record --grace`" if recorded is not None else \
        "the default: the run stored none"
    lines = ["## 4. Allowed observation delay", ""]
    if used and used != [own]:
        lines.append(f"- **Grace window: {', '.join(f'{g:g}' for g in used)} s**, given to the report with "
                     f"`--grace`; the run's own is {own:g} s ({origin}).")
    else:
        lines.append(f"- **Grace window: {grace:g} s** ({origin}).")
    lines.append("- A cancel is *released* when the scheduler shows it gone within the grace window after its "
                 "engine abort (after the request's own completion, when it completed first).")
    hz = _num(facts.get("hz"))
    period = 1000.0 / float(hz) if hz and float(hz) > 0 else None
    if hz:
        lines.append(f"- Sampling: {hz} Hz asked (one sample every {period:g} ms). A release shows at the first "
                     f"sample after it, so *engine abort → left scheduler* is an upper bound, late by up to one "
                     f"sampling period.")
        burst = _num(facts.get("burst_hz"))
        if burst:
            lines.append(f"- Bursts: the scheduler source was read at {burst} Hz (one sample every "
                         f"{1000.0 / float(burst):g} ms) from just before each stop for "
                         f"{facts.get('burst_window_s'):g} s, so a release inside that window is late by up to "
                         f"{1000.0 / float(burst):g} ms; statistics over time weight each sample by the time it "
                         f"stands for, so the bursts' extra samples are not extra time.")
    else:
        lines.append(f"- Sampling rate: {NOT_RECORDED}.")
    rows = [[s.get("source"), s.get("target"), _num(s.get("effective_hz"), "{:.2f}"), s.get("scrapes_ok"),
             s.get("scrapes_failed"), s.get("gaps"), s.get("gap_ticks"), _ms(s.get("scrape_p50_ms")),
             _ms(s.get("scrape_p99_ms"))] for s in doc.get("sampling", [])]
    if rows:
        lines += ["", *_table(["source", "target", "effective Hz", "scrapes ok", "scrapes failed", "gaps",
                               "gap ticks", "scrape p50 (ms)", "scrape p99 (ms)"], rows)]
    else:
        lines.append("- No scrape was recorded: the scheduler was not sampled.")
    return lines + [""]


def _source_summary(cancels: list[dict], point: str) -> tuple[str, list[str]]:
    """One cell (which sources backed `point` in these cancels, with counts) and the reasons given
    where none did."""
    counts: Counter = Counter()
    reasons: list[str] = []
    for c in cancels:
        ts = c.get("timepoint_sources")
        entry = ts.get(point) if isinstance(ts, Mapping) else None
        if not isinstance(entry, Mapping):
            counts[NOT_RECORDED] += 1
            continue
        src = entry.get("source")
        counts[SOURCE_LABELS.get(src, src) if src else "none"] += 1
        if entry.get("reason") and entry["reason"] not in reasons:
            reasons.append(str(entry["reason"]))
    cell = ", ".join(f"{name} ×{n}" for name, n in counts.items()) if counts else DASH
    return cell, reasons


def _measurement_section(run: Run, recs: list[ScenarioRecord], doc: Mapping) -> list[str]:
    lines = ["## 5. How release was measured", "", "Each cancel is traced through five timepoints:", ""]
    lines += [f"{i}. **{POINT_LABELS[p]}**: {POINT_TEXT[p]}." for i, p in enumerate(TIMEPOINTS, 1)]
    lines += ["", "### Engine log", ""]
    logs = (run.info.get("engine") or {}).get("engine_log")
    counts = Counter(kind for kind, _, _ in _events(run) if kind in ("engine_added", "engine_aborted"))
    if not isinstance(logs, Mapping) or not logs:
        lines.append(f"Engine log: {NOT_RECORDED} (this run predates engine-log support, or stored nothing about it).")
    else:
        rows = []
        for label, entry in logs.items():
            entry = entry if isinstance(entry, Mapping) else {}
            if entry.get("path"):
                rows.append([label, "followed", entry["path"]])
            else:
                rows.append([label, "not available", entry.get("off") or NOT_RECORDED])
        lines += _table(["target", "engine log", "path, or why not"], rows)
    if isinstance(logs, Mapping) and any(isinstance(e, Mapping) and e.get("path") for e in logs.values()):
        lines += ["", (f"Per-request engine log lines read: {counts['engine_added']} added, "
                       f"{counts['engine_aborted']} aborted.")]
        lines += [line for note in doc.get("engine_log_notes") or [] for line in ("", note)]  # the report's
    lines.append("")
    cancels = [c for r in recs for c in r.cancels]
    lines += ["### Evidence behind each timepoint", ""]
    if not cancels:
        return lines + ["No cancel was recorded.", ""]
    if not any(isinstance(c.get("timepoint_sources"), Mapping) for c in cancels):
        lines += [f"Which evidence backed each timepoint was {NOT_RECORDED} for this run's cancels.", ""]
    rows = []
    notes: dict[tuple[str, str], list[str]] = {}  # (timepoint, reason) -> scenarios
    for r in recs:
        if not r.cancels:
            continue
        row = [r.name]
        for p in TIMEPOINTS:
            cell, reasons = _source_summary(r.cancels, p)
            row.append(cell)
            for why in reasons:
                notes.setdefault((p, why), []).append(r.name)
        rows.append(row)
    lines += _table(["scenario", *(POINT_LABELS[p] for p in TIMEPOINTS)], rows)
    lines.append("")
    if notes:
        lines += ["Where a timepoint has no source (\"none\"), the reason recorded:", ""]
        lines += [f"- {POINT_LABELS[p]}: {why} ({', '.join(names)})" for (p, why), names in notes.items()]
        lines.append("")
    return lines + _hops_section(run, cancels)


def _hop_cell(h: Mapping) -> str:
    if h.get("reached_ms") is None:
        return "not seen" if h.get("matched") else "request not found"
    held = "" if h.get("held_ms") is None else f", passed on after {h['held_ms']:g} ms"
    return f"reached +{h['reached_ms']:g} ms ({h.get('reached_how')}){held or ', not passed on'}"


def _hops_section(run: Run, cancels: list[dict]) -> list[str]:
    """The taps of the path (record --hop) and each cancel's way through them; nothing for a run without."""
    taps = list((run.info.get("settings") or {}).get("hops") or [])
    if not taps:
        return []
    names = [t.get("name") for t in taps]
    lines = ["### The path, hop by hop", "",
             "Taps (`record --hop`, in order from the client): "
             + "; ".join(f"`{t.get('name')}` (listening on {t.get('listen_host')}:{t.get('listen_port')}, in front "
                         f"of {t.get('upstream')})" for t in taps)
             + ". A tap passes bytes and closes on as they come; what it records is a socket close, evidence that "
               "a connection went, not that anybody read a cancel. Times are after the user stop.", ""]
    rows = []
    for c in cancels:
        by = {h["hop"]: h for h in c.get("hops") or []}
        rows.append([_short_id(c.get("request_id")), c.get("scenario"),
                     *(_hop_cell(by[n]) if n in by else NOT_RECORDED for n in names),
                     (c.get("evidence") or {}).get("stopped_at") or "-"])
    lines += _table(["request", "scenario", *names, "stopped at"], rows)
    matched = sorted({c.get("scenario") for c in cancels for h in c.get("hops") or [] if h.get("matched") == "time"})
    if matched:
        lines += ["", f"Matched by time at a tap (a component dropped or rewrote `X-Request-Id`): {', '.join(matched)}."]
    return lines + [""]


def _rule_counts(cancels: list[dict]) -> list[str]:
    """The cancels per rule (the rung of the verdict ladder that decided them), in the rule table's order."""
    by_rule: dict[str | None, list[dict]] = {}
    for c in cancels:
        by_rule.setdefault((c.get("evidence") or {}).get("rule"), []).append(c)
    if not by_rule:
        return []
    order = [r for r in RULES if r in by_rule] + [r for r in by_rule if r not in RULES]
    rows = [[f"`{r}`" if r else NOT_RECORDED, ", ".join(sorted({str(c.get("verdict")) for c in by_rule[r]})),
             len(by_rule[r]), ", ".join(sorted({str(c.get("scenario")) for c in by_rule[r]}))] for r in order]
    return ["Verdicts per rule (what decided each cancel; the per-cancel tables give each one's sentence):", "",
            *_table(["rule", "verdict", "cancels", "scenarios"], rows), ""]


def _outcome_section(doc: Mapping, recs: list[ScenarioRecord]) -> list[str]:
    lines = ["## 6. Outcome", ""]
    cancels = list(doc.get("cancels", []))
    total = Counter(c.get("verdict") for c in cancels)
    rows = [[r.name, len(r.cancels), *(sum(c.get("verdict") == v for c in r.cancels) for v in VERDICTS)]
            for r in recs if r.cancels or r.stops]
    if rows:
        rows.append(["**all**", len(cancels), *(total.get(v, 0) for v in VERDICTS)])
        lines += _table(["scenario", "cancels", *(v.replace("_", " ") for v in VERDICTS)], rows) + [""]
    lines.append(f"Neighbours: {'every neighbour completed' if doc.get('neighbours_ok') else 'not every neighbour completed (or none ran)'}.")
    lines += ["", "Verdicts: " + "; ".join(VERDICT_TEXT[v] for v in VERDICTS) + ".", ""]
    lines += _rule_counts(cancels)
    for r in recs:
        if not r.cancels:
            continue
        counts = Counter(c.get("verdict") for c in r.cancels)
        lines += [f"### {r.name}: " + ", ".join(f"{counts[v]} {v.replace('_', ' ')}" for v in VERDICTS if counts[v]),
                  ""]
        if r.proves:
            lines += [f"Proves: {r.proves}", ""]
        table = []
        for c in r.cancels:
            lat = c.get("latencies_ms") or {}
            ev = c.get("evidence") or {}
            why = ev.get("why") or (f"race: {ev['race']}" if ev.get("race") else None)
            table.append([f"`{_short_id(c.get('request_id'))}`", c.get("phase_at_cancel"), c.get("terminal_state"),
                          f"**{c.get('verdict')}**", *(_ms(lat.get(latency_key(a, b))) for a, b in LATENCIES),
                          f"`{ev['rule']}`" if ev.get("rule") else None, why,
                          count_reading_text(ev.get("count_reading")) or None])
        lines += _table(["request", "phase", "ended as", "verdict", *(latency_label(a, b) for a, b in LATENCIES),
                         "rule", "why", "count read"], table)
        lines.append("")
    if not cancels:
        lines += ["No cancel was recorded in this run.", ""]
    return lines


def coverage(recs: list[ScenarioRecord], doc: Mapping) -> dict[str, dict[str, list[str]]]:
    """{dimension: {state: [scenarios that covered it]}} over the full set of each dimension."""
    triton = doc.get("family") == TRITON
    cov: dict[str, dict[str, list[str]]] = {
        "phase": {p: [] for p in (TRITON_PHASES if triton else PHASES)},
        "client method": {m: [] for m in (TRITON_MODE_TEXT if triton else MODES)},
        **({} if triton else {"API": {a: [] for a in APIS}, "n>1": {"n>1": []}}),
        "burst": {"burst (K of M)": []},
        "verdict": {v: [] for v in VERDICTS},
    }

    def add(dim: str, state: str, name: str) -> None:
        if state in cov[dim] and name not in cov[dim][state]:
            cov[dim][state].append(name)

    for r in recs:
        for c in r.cancels:
            phase = c.get("phase_at_cancel")
            ev = c.get("evidence") or {}
            if phase in ("queued", "prefill", "decode", "executing"):
                add("phase", phase, r.name)
            elif phase and phase != "completed":  # e.g. in_flight: a non-streaming client cannot tell
                cov["phase"].setdefault(phase, [])
                add("phase", phase, r.name)
            if phase == "completed" or c.get("terminal_state") == "completed" or ev.get("race"):
                add("phase", "race/completion", r.name)
            add("verdict", c.get("verdict"), r.name)
        if r.builtin and r.builtin.get("trigger") == "near_completion_tokens" and r.cancels:
            add("phase", "race/completion", r.name)
        if not (r.cancels or r.stops):
            continue
        for m in r.mode_values:
            add("client method", m, r.name)
        if r.api and "API" in cov:
            add("API", r.api, r.name)
        if any(n > 1 for n in r.n_values) and "n>1" in cov:
            add("n>1", "n>1", r.name)
        if (r.per_repeat_targets or 0) > 1:
            add("burst", "burst (K of M)", r.name)
    return cov


def _coverage_section(recs: list[ScenarioRecord], doc: Mapping) -> list[str]:
    cov = coverage(recs, doc)
    lines = ["## 7. Not covered by this run", ""]
    missing = []
    labels = {"phase": "Phase at cancel", "client method": "Client method", "API": "API", "n>1": "n>1",
              "burst": "Burst", "verdict": "Verdict kinds not seen"}
    for dim, states in cov.items():
        gone = [s for s, by in states.items() if not by]
        if gone:
            missing.append(f"- **{labels[dim]}**: {', '.join(gone)}")
    unknown_api = [r.name for r in recs if (r.cancels or r.stops) and r.api is None]
    lines += missing or ["- Every phase, client method, API, n>1 and burst state was exercised."]
    if unknown_api:
        lines.append(f"- The API of {', '.join(unknown_api)} is not recorded by the run (no builtin definition "
                     "of that name agrees with it): it counts for neither completions nor chat above.")
    if doc.get("family") == TRITON:
        lines.append("- **Engines**: vLLM is not covered: this run drove Triton Inference Server over gRPC and HTTP; "
                     "no Triton run says anything about vLLM.")
    else:
        lines.append("- **Engines**: Triton Inference Server is not covered: this run drove vLLM's OpenAI server "
                     "(and AsyncLLM in process, through the relay app); no vLLM run says anything about Triton.")
    lines += ["", "What the run did cover:", ""]
    rows = [[dim, state, ", ".join(by) or "**not covered**"] for dim, states in cov.items() if dim != "verdict"
            for state, by in states.items()]
    lines += _table(["dimension", "state", "covered by"], rows)
    lines += ["", ("Race/completion counts as covered where a cancel met a request that completed first, or a "
                   "scenario aimed its cancel at the last tokens (trigger near completion)."), ""]
    return lines


# ------------------------------------------------------------------------------------------ the document
def protocol_markdown(run: Run, doc: Mapping, builtin: Mapping[str, Mapping] | None = None) -> str:
    """The acceptance protocol of `run` as Markdown; `doc` is its `report_document`, `builtin` the
    builtin scenario definitions by name (fields of collectors.cancels.scenarios.Scenario), or None."""
    facts = run_facts(run)
    recs = scenario_records(run, doc, builtin)
    cancels = list(doc.get("cancels", []))
    counts = Counter(c.get("verdict") for c in cancels)
    title = f"# Acceptance protocol: run {run.id}" + (f" ({facts['name']})" if facts["name"] else "")
    duration = f"{facts['duration_s']:.1f} s" if facts["duration_s"] else "still recording"
    if not cancels:
        result = "**not accepted**: no cancel was recorded"
    elif accepted(doc):
        result = f"**accepted**: {_accepted_counts(cancels)}, every neighbour completed, no silent resubmit"
    else:
        parts = ", ".join(f"{counts[v]} {v.replace('_', ' ')}" for v in VERDICTS if counts[v])
        result = f"**not accepted**: {parts} of {_plural(len(cancels), 'cancel')}" + \
            ("" if doc.get("neighbours_ok") else "; not every neighbour completed")
        if not any(c["verdict"] == "released" or is_expected(c) for c in cancels) and all(map(is_race, cancels)):
            result += ("; every one a race the completion won, which shows nothing of cancels reaching the engine: "
                       "record scenarios that cancel well before the end")
    lines = [title, "",
             (f"Run status: {facts['status']} · started {facts['started_utc']} UTC · duration {duration} · "
              f"{_plural(len(recs), 'scenario')}, {_plural(len(cancels), 'cancel')}."), "",
             f"Result: {result}.", ""]
    lines += _system_section(run, facts)
    lines += _concurrency_section(run, recs)
    lines += _scenario_section(recs, triton=doc.get("family") == TRITON)
    lines += _delay_section(run, doc, facts)
    lines += _measurement_section(run, recs, doc)
    lines += _outcome_section(doc, recs)
    lines += _coverage_section(recs, doc)
    return "\n".join(lines).rstrip() + "\n"
