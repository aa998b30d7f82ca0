"""The acceptance protocol (`report --protocol`, analysis/protocol.py) on runs written through the run
store's writer: no engine. Every value the protocol shows is checked against the run it was built from."""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import asdict

import numpy as np
import pytest

from cancelwatch.analysis.protocol import accepted, coverage, protocol_markdown, scenario_records
from cancelwatch.analysis.verdicts import report_document, run_grace_s
from cancelwatch.collectors.cancels.scenarios import BUILTIN
from cancelwatch.runstore.reader import Run, load_run
from cancelwatch.runstore.records import EventRecord, LedgerRecord
from cancelwatch.runstore.writer import (
    create_run,
    finish_run,
    open_store,
    set_run_json,
    write_events,
    write_ledger,
    write_scrape_block,
)
from tests.conftest import cli

T0 = 20_000_000_000  # monotonic start, ns
W0 = 1_790_000_000_000_000_000  # wall clock at the start, ns
HZ = 20.0
PERIOD_S = 15.0  # one scenario a stretch of 15 s
MODEL = "/models/tiny-llama-protocol"
SERVED = "tiny-proto"
GRACE_S = 1.5
SECTIONS = ("## 1. System under test", "## 2. Concurrency", "## 3. Scenarios: client method and cancel scope",
            "## 4. Allowed observation delay", "## 5. How release was measured", "## 6. Outcome",
            "## 7. Not covered by this run")
BUILTINS = {name: asdict(s) for name, s in BUILTIN.items()}

# name, client mode, phase at cancel, n, targets sent together, of them cancelled, leaks, proves recorded
NO_QUEUED = [
    {"name": "decode", "mode": "cancel", "phase": "decode",
     "proves": "cancelled after streamed tokens: KV usage drops"},
    {"name": "disconnect", "mode": "disconnect", "phase": "decode", "leak": True,
     "proves": "the client closes the stream, no cancel call: the server still aborts"},
    {"name": "burst", "mode": "cancel", "phase": "decode", "targets": 3, "cancels": 2,
     "proves": "K of M concurrent requests cancelled at once; the others go on"},
    {"name": "n2", "mode": "cancel", "phase": "decode", "n": 2, "proves": "a completion with n=2: both sequences leave"},
    {"name": "chat", "mode": "cancel", "phase": "decode", "proves": None},  # proves taken from the builtin
    {"name": "my_custom", "mode": "cancel", "phase": "prefill", "proves": "a scenario of the user's own file"},
]
WITH_QUEUED = [{"name": "queued", "mode": "cancel", "phase": "queued",
                "proves": "a waiting request is cancelled: waiting drops, running and KV usage do not"},
               *NO_QUEUED[:1]]


def write_run(path, scenarios: list[dict], *, name: str = "protocol-test", engine_log: dict | None = None) -> int:
    """A recorded-shape run, one scenario a 15 s stretch: a neighbour from 1 s, the targets from 1.5 s,
    the stop at 5 s; a cancelled target leaves the scheduler at 5.05 s (at 9 s when it leaks), the
    others run to 8 s; the probe runs 5.3-7 s. Scheduler gauges at 20 Hz, the ledger and the trace."""
    con = open_store(path)
    targets = [{"label": "t0", "url": "http://127.0.0.1:8123"}]
    engine = {"targets": {"t0": {"embedded": True, "pid": 4242, "model": MODEL, "kv_bytes_per_token": 32768,
                                 "shape": {"max_num_seqs": 6, "num_gpu_blocks": 64, "block_size": 128,
                                           "dtype": "float32"},
                                 "command": ["python", "-m", "vllm.entrypoints.openai.api_server", "--model", MODEL]}},
              "pids": [4242], "nvml": "off",
              "engine_log": engine_log or {"t0": {"off": "no engine log: not followed in this test"}}}
    settings = {"hz": HZ, "extra": {"driven_target": targets[0]["url"], "scenarios": [s["name"] for s in scenarios],
                                    "grace_s": GRACE_S, "model": SERVED, "relay_url": None}}
    rid = create_run(con, name=name, targets=targets, engine=engine, settings=settings, wall_ns=W0, mono_ns=T0)
    set_run_json(con, rid, "cache", {"t0": {"num_gpu_blocks": "64", "block_size": "128",
                                            "kv_cache_size_tokens": "8192", "kv_cache_max_concurrency": "2.0",
                                            "model_names": [SERVED]}})
    t = np.arange(int(PERIOD_S * len(scenarios) * HZ)) / HZ
    running, waiting, kv = np.zeros(len(t)), np.zeros(len(t)), np.zeros(len(t))
    ended = np.zeros(len(t))  # vllm:request_success_total{finished_reason="length"}: the engine's own ends
    events: list[EventRecord] = []
    ledger: list[LedgerRecord] = []

    def ns(s: float) -> int:
        return T0 + round(s * 1e9)

    def event(kind, at, request_id=None, **data):
        events.append(EventRecord(kind, W0 + ns(at) - T0, ns(at), request_id, {**data, "metrics_target": "t0"}))

    for i, s in enumerate(scenarios):
        c, n, m, k = i * PERIOD_S, s.get("n", 1), s.get("targets", 1), s.get("cancels", 1)
        u = t - c
        nb = (u >= 1.0) & (u < 10.0)
        running += nb
        ended += (u >= 10.0) + (u >= 7.0)  # the neighbour's end and the probe's
        kv += 0.02 * nb * (u - 1.0)
        probe = (u >= 5.3) & (u < 7.0)
        running += probe
        kv += 0.03 * probe
        event("scenario_start", c + 0.9, scenario=s["name"], repeat=0,
              **({"proves": s["proves"]} if s.get("proves") else {}))
        tag = f"{i:02d}"
        ledger.append(LedgerRecord(f"cw-{s['name']}-neighbour-nb{tag}", s["name"], "neighbour", 1, 200, 250,
                                   ns(c + 0.9), ns(c + 1.05), 250, 0, None, ns(c + 10.0), "completed", "length"))
        for j in range(m):
            rid_t = f"cw-{s['name']}-target-{tag}{j:02d}ab{i}{j}"[-28:]
            cancelled = j < k
            end = (s.get("leak_end", 9.0) if s.get("leak") else 5.05) if cancelled else 8.0
            live = (u >= 1.5) & (u < end)
            if not cancelled or s.get("leak"):
                ended += n * (u >= end)  # run to its end (a leaked one too): cancelled ones end in no reason of these
            if s["phase"] == "queued" and cancelled:
                waiting += live
            else:
                running += n * live
                kv += 0.04 * n * live * (u - 1.5)
            if cancelled:
                cid = f"c{tag}{j}"
                event("user_stop", c + 5.0, rid_t, scenario=s["name"], phase=s["phase"], cancel_id=cid,
                      mode=s["mode"], tokens_at_cancel=0 if s["phase"] in ("queued", "prefill") else 20)
                event("app_received", c + 5.0005, rid_t, cancel_id=cid)
                event("engine_abort", c + 5.001, rid_t, cancel_id=cid)
                ledger.append(LedgerRecord(rid_t, s["name"], "target", n, 600, 1500, ns(c + 1.4),
                                           None if s["phase"] in ("queued", "prefill") else ns(c + 1.6), 20, 0,
                                           ns(c + 5.0), ns(c + 5.001), "cancelled", "task cancelled"))
            else:
                ledger.append(LedgerRecord(rid_t, s["name"], "target", n, 600, 1500, ns(c + 1.4), ns(c + 1.6), 1500,
                                           0, None, ns(c + 8.0), "completed", "length"))
        event("probe_sent", c + 5.25, f"cw-{s['name']}-probe-pr{tag}", scenario=s["name"])
        ledger.append(LedgerRecord(f"cw-{s['name']}-probe-pr{tag}", s["name"], "probe", 1, 100, 8, ns(c + 5.25),
                                   ns(c + 5.35), 8, 0, None, ns(c + 7.0), "completed", "length"))
        event("scenario_end", c + 12.0, scenario=s["name"], repeat=0)
    gen = np.cumsum(running)
    labels = (("engine", "0"), ("model_name", SERVED))
    mono = T0 + (t * 1e9).astype(np.int64)
    with con:
        write_scrape_block(con, rid, "vllm", "t0", ticks=np.arange(len(t)), wall_ns=mono - T0 + W0, mono_ns=mono,
                           duration_ns=3_000_000,
                           series={("requests_running", labels): running, ("requests_waiting", labels): waiting,
                                   ("kv_cache_usage_ratio", labels): np.clip(kv, 0, 1),
                                   ("generation_tokens_total", labels): gen,
                                   ("requests_finished_total", (*labels, ("finished_reason", "length"))): ended})
        write_events(con, rid, events)
        write_ledger(con, rid, ledger)
    finish_run(con, rid, "completed", {"test": True}, ended_wall_ns=W0 + int(t[-1] * 1e9))
    con.close()
    return rid


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = tmp_path_factory.mktemp("protocol") / "cw.db"
    write_run(path, NO_QUEUED)
    return path


@pytest.fixture(scope="module")
def run_doc(store):
    run = load_run(store, "latest")
    return run, report_document(run)


def section(text: str, heading: str) -> str:
    """The body of one `## ` section."""
    start = text.index(heading) + len(heading)
    end = text.find("\n## ", start)
    return text[start:] if end < 0 else text[start:end]


def not_covered(text: str, label: str) -> list[str]:
    """The states listed under `label` in the not-covered section; [] when the label is not there."""
    found = re.search(rf"^- \*\*{re.escape(label)}\*\*: (.+)$", section(text, SECTIONS[6]), re.MULTILINE)
    return [s.strip() for s in found.group(1).split(",")] if found else []


def verdict_row(text: str, scenario: str) -> list[str]:
    """The outcome table's row of one scenario, its cells as text."""
    body = section(text, SECTIONS[5])
    line = next(ln for ln in body.splitlines() if ln.startswith(f"| {scenario} |"))
    return [c.strip() for c in line.strip("|").split("|")]


# ------------------------------------------------------------------------------------------ the pure function
def test_the_protocol_holds_every_section_and_the_runs_own_values(run_doc):
    run, doc = run_doc
    text = protocol_markdown(run, doc, BUILTINS)
    positions = [text.index(h) for h in SECTIONS]
    assert positions == sorted(positions), "sections out of order"
    assert text.startswith(f"# Acceptance protocol: run {run.id} (protocol-test)")
    system = section(text, SECTIONS[0])
    assert MODEL in system and SERVED in system and "http://127.0.0.1:8123" in system
    assert "Engine version | not recorded" in system  # the run stores none: never made up
    assert "max_num_seqs" in section(text, SECTIONS[1]) and "6 (engine shape)" in section(text, SECTIONS[1])
    assert "Grace window: 1.5 s" in section(text, SECTIONS[3]) and run_grace_s(run) == GRACE_S
    assert "20 Hz asked (one sample every 50 ms)" in section(text, SECTIONS[3])
    # the verdict counts per scenario are those of the report document
    assert doc["cancels"], "the test run must have cancels"
    for s in NO_QUEUED:
        mine = [c for c in doc["cancels"] if c["scenario"] == s["name"]]
        counts = Counter(c["verdict"] for c in mine)
        row = verdict_row(text, s["name"])
        assert row[1:] == [str(len(mine)), *(str(counts[v]) for v in ("released", "leaked", "stale_gauge",
                                                                          "inconclusive"))], (s["name"], row)
    total = Counter(c["verdict"] for c in doc["cancels"])
    assert verdict_row(text, "**all**")[1:3] == [str(len(doc["cancels"])), str(total["released"])]
    # every cancel is listed by its short id, with its phase
    outcome = section(text, SECTIONS[5])
    for c in doc["cancels"]:
        short = c["request_id"].rsplit("-", 1)[-1][-8:]
        assert re.search(rf"\| `{re.escape(short)}` \| {c['phase_at_cancel']} \|", outcome), c["request_id"]
    # the result line follows the acceptance rule
    assert ("**accepted**" in text) == accepted(doc)


def test_scenarios_take_the_recorded_facts_first_and_say_what_came_from_a_builtin(run_doc):
    run, doc = run_doc
    recs = {r.name: r for r in scenario_records(run, doc, BUILTINS)}
    assert list(recs) == [s["name"] for s in NO_QUEUED]
    assert recs["burst"].per_repeat_targets == 3 and recs["burst"].per_repeat_cancels == 2
    assert recs["n2"].n_values == [2] and recs["disconnect"].modes == ["disconnect"]
    assert recs["chat"].api == "chat" and recs["chat"].proves_from == "builtin"
    assert recs["decode"].proves_from == "run" and recs["my_custom"].api is None
    text = protocol_markdown(run, doc, BUILTINS)
    scen = section(text, SECTIONS[2])
    assert "burst: 2 of 3 concurrent requests cancelled at once" in scen
    assert "n=2: every one of its 2 child sequences" in scen
    assert "disconnect: the client closes the stream" in scen
    assert "what it proves from the builtin definition `chat`" in scen
    assert "no builtin of this name" in scen.split("| my_custom |")[1].splitlines()[0]
    # without builtins nothing is filled in: the API is not recorded by the run
    bare = section(protocol_markdown(run, doc, None), SECTIONS[2])
    chat_row = bare.split("| chat |")[1].splitlines()[0]
    assert "| not recorded |" in chat_row and "chat" not in chat_row.replace("| not recorded |", "")


def test_a_builtin_that_disagrees_with_the_record_is_not_used(run_doc):
    run, doc = run_doc
    wrong = {**BUILTINS, "decode": {**BUILTINS["decode"], "mode": "disconnect", "api": "chat"}}
    (rec,) = [r for r in scenario_records(run, doc, wrong) if r.name == "decode"]
    assert rec.builtin is None and rec.builtin_differs and rec.api is None and rec.modes == ["cancel"]
    assert "differs from the builtin of that name" in protocol_markdown(run, doc, wrong)


def test_a_run_without_queued_lists_it_as_not_covered(run_doc, tmp_path):
    run, doc = run_doc
    text = protocol_markdown(run, doc, BUILTINS)
    assert "queued" in not_covered(text, "Phase at cancel")
    assert "race/completion" in not_covered(text, "Phase at cancel")
    assert "decode" not in not_covered(text, "Phase at cancel") and "prefill" not in not_covered(text, "Phase at cancel")
    assert set(not_covered(text, "Client method")) == {"timeout", "explicit"}
    assert not_covered(text, "API") == [] and not_covered(text, "n>1") == [] and not_covered(text, "Burst") == []
    seen = {c["verdict"] for c in doc["cancels"]}
    assert set(not_covered(text, "Verdict kinds not seen")) == {"released", "leaked", "stale_gauge",
                                                                  "inconclusive"} - seen
    assert "Triton Inference Server is not covered" in text
    assert "The API of my_custom is not recorded" in text

    # the same protocol over a run that did cancel a queued request no longer lists it
    path = tmp_path / "queued.db"
    write_run(path, WITH_QUEUED)
    qrun = load_run(path, "latest")
    qtext = protocol_markdown(qrun, report_document(qrun), BUILTINS)
    assert "queued" not in not_covered(qtext, "Phase at cancel")
    assert "chat" in not_covered(qtext, "API") and not_covered(qtext, "n>1") == ["n>1"]
    assert coverage(scenario_records(qrun, report_document(qrun), BUILTINS), {})["phase"]["queued"] == ["queued"]


def test_timepoint_sources_are_summarised_and_their_absence_said(run_doc):
    run, doc = run_doc
    sourced = json.loads(json.dumps(doc))
    for c in sourced["cancels"]:
        c["timepoint_sources"] = {
            "user_stop": {"source": "client", "reason": None},
            "app_received": {"source": None, "reason": "no app on this path"},
            "engine_abort": {"source": "engine_log", "reason": None},
            "left_scheduler": {"source": "samples", "reason": None},
            "reusable": {"source": "client", "reason": None},
        }
    body = section(protocol_markdown(run, sourced, BUILTINS), SECTIONS[4])
    assert "| burst | client ×2 | none ×2 | engine log ×2 | scheduler samples ×2 | client ×2 |" in body
    assert re.search(r"- app received: no app on this path \(decode, disconnect, burst, n2, chat, my_custom\)", body)
    assert "no engine log: not followed in this test" in body  # the run's own engine-log facts

    bare = json.loads(json.dumps(doc))
    for c in bare["cancels"]:
        c.pop("timepoint_sources", None)
    body = section(protocol_markdown(run, bare, BUILTINS), SECTIONS[4])
    assert "not recorded for this run's cancels" in body and "| decode | not recorded ×1 |" in body

    # an old run without engine-log facts says so; one with a followed log names its path
    info = {**run.info, "engine": {k: v for k, v in run.info["engine"].items() if k != "engine_log"}}
    old = Run(id=run.id, info=info, samples=run.samples, scrapes=run.scrapes, gaps=run.gaps, events=run.events,
              ledger=run.ledger)
    assert "Engine log: not recorded" in protocol_markdown(old, doc, BUILTINS)
    info = {**run.info, "engine": {**run.info["engine"], "engine_log": {"t0": {"path": "/logs/engine-8123.log"}}}}
    followed = Run(id=run.id, info=info, samples=run.samples, scrapes=run.scrapes, gaps=run.gaps, events=run.events,
                   ledger=run.ledger)
    body = section(protocol_markdown(followed, doc, BUILTINS), SECTIONS[4])
    assert "| t0 | followed | /logs/engine-8123.log |" in body and "0 added, 0 aborted" in body


def test_a_run_without_cancels_still_gets_a_protocol_saying_so(tmp_path):
    path = tmp_path / "empty.db"
    con = open_store(path)
    rid = create_run(con, name=None, targets=[{"label": "t0", "url": "http://x:1"}], engine={"nvml": "off"},
                     settings={"hz": 10.0}, wall_ns=W0, mono_ns=T0)
    finish_run(con, rid, "completed", {})
    con.close()
    run = load_run(path, "latest")
    text = protocol_markdown(run, report_document(run), BUILTINS)
    assert all(h in text for h in SECTIONS)
    assert "**not accepted**: no cancel was recorded" in text and "No scenario ran" in text
    assert set(not_covered(text, "Phase at cancel")) == {"queued", "prefill", "decode", "race/completion"}
    assert "Model | not recorded" in text and "Grace window: 2 s** (the default" in text


# ------------------------------------------------------------------------------------------ the command line
def test_report_protocol_writes_the_file_beside_the_table_and_the_json(store, run_doc, tmp_path):
    run, doc = run_doc
    want = 0 if accepted(doc) else 1
    out = tmp_path / "protocol.md"
    res = cli("report", "latest", "--store", str(store), "--protocol", str(out))
    assert res.returncode == want, res.stderr
    assert "cancels" in res.stdout and f"wrote {out}" in res.stderr  # the table still printed
    text = out.read_text()
    assert text == protocol_markdown(run, doc, BUILTINS)  # the CLI passes the builtins, nothing else
    assert all(h in text for h in SECTIONS) and SERVED in text and "Grace window: 1.5 s" in text

    out2 = tmp_path / "protocol2.md"
    res = cli("report", "latest", "--store", str(store), "--json", "--protocol", str(out2), "--grace", "3")
    assert res.returncode in (0, 1), res.stderr
    printed = json.loads(res.stdout)  # stdout stays pure JSON
    assert len(printed["cancels"]) == len(doc["cancels"])
    assert "Grace window: 3 s**, given to the report with `--grace`; the run's own is 1.5 s" in out2.read_text()


def test_an_unwritable_protocol_path_is_a_one_line_error_and_loses_nothing_else(store, tmp_path):
    html = tmp_path / "r.html"
    missing = tmp_path / "nope" / "p.md"
    res = cli("report", "latest", "--store", str(store), "--json", "--html", str(html), "--protocol", str(missing))
    assert res.returncode == 2
    err = [ln for ln in res.stderr.strip().splitlines() if not ln.startswith("wrote ")]
    assert len(err) == 1 and str(missing) in err[0] and "does not exist" in err[0], res.stderr
    assert json.loads(res.stdout)["cancels"] and html.is_file() and not missing.exists()

    res = cli("report", "latest", "--store", str(store), "--protocol", str(tmp_path))  # a folder, not a file
    assert res.returncode == 2 and "cancels" in res.stdout
    (line,) = res.stderr.strip().splitlines()
    assert f"cannot write {tmp_path}" in line and "choose a writable path for --protocol" in line
