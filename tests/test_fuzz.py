"""Fuzzing with hypothesis: what comes from outside either parses into its documented shape or is
rejected with the project's own error in one line; nothing else escapes.

Targets: the Prometheus text parsers (vLLM, Triton, the generic line parser on every recorded fixture,
DCGM exporter's included) on mutations of the recorded bodies and on random ones; scenario TOML files;
the dashboard's URL parameters and the store text they feed; the run store reader on truncated and
corrupted store files (and the CLI on a few of those).

The example count comes from a settings profile: "ci" (default; bounded and derandomized, so a run is
reproducible and takes seconds) or "fuzz" (`make fuzz`, or CANCELWATCH_FUZZ=1 / HYPOTHESIS_PROFILE=fuzz:
thousands of random examples a test).
"""

from __future__ import annotations

import atexit
import math
import os
import re
import shutil
import sqlite3
import tempfile
from dataclasses import fields
from pathlib import Path

import pandas as pd
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from cancelwatch.collectors.cancels.scenarios import APIS, MODES, TRIGGERS, Scenario, ScenarioError, load_file
from cancelwatch.collectors.sources.base import ParseError
from cancelwatch.collectors.sources.prom_text import LineMemo, parse_lines
from cancelwatch.collectors.sources.triton import parse_triton_metrics
from cancelwatch.collectors.sources.vllm import parse_vllm_metrics
from cancelwatch.dashboard.params import MAX_RUN_ID, read_url_params
from cancelwatch.runstore.compact import compact
from cancelwatch.runstore.errors import StoreError
from cancelwatch.runstore.paths import store_in_dir
from cancelwatch.runstore.reader import list_runs, load_run, resolve_run_id
from cancelwatch.runstore.records import Sample
from tests.conftest import FIXTURES, cli
from tests.test_runstore import recorded_run

_COMMON = dict(deadline=None, database=None, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
settings.register_profile("ci", max_examples=100, derandomize=True, **_COMMON)
settings.register_profile("fuzz", max_examples=3000, **_COMMON)
PROFILE = settings.get_profile(
    os.environ.get("HYPOTHESIS_PROFILE") or ("fuzz" if os.environ.get("CANCELWATCH_FUZZ") else "ci"))


# files the examples are written to (one at a time), made at import: the strategies need the seeds
WORK = Path(tempfile.mkdtemp(prefix="cw-fuzz-"))
atexit.register(shutil.rmtree, WORK, True)
for _sub in ("scenarios", "root", "store"):
    (WORK / _sub).mkdir()


def fuzz(scale: float = 1.0):
    """The active profile, with `scale` times its examples (the store tests cost more per example)."""
    return settings(PROFILE, max_examples=max(10, int(PROFILE.max_examples * scale)))


def assert_one_line(exc: BaseException) -> str:
    """A rejection says what is wrong in one non-empty line (no line break of any kind)."""
    msg = str(exc)
    assert msg.strip(), f"empty message from {type(exc).__name__}"
    assert len(msg.splitlines()) == 1, f"{type(exc).__name__} message is not one line: {msg!r}"
    return msg


# ---------------------------------------------------------------------------------------------------------
# Prometheus text: vLLM, Triton, the generic line parser

BODIES = {p.relative_to(FIXTURES).as_posix(): p.read_text()
          for p in [*sorted((FIXTURES / "vllm").rglob("*.txt")), *sorted((FIXTURES / "triton").glob("metrics_*.txt")),
                    FIXTURES / "dcgm" / "exporter.txt"]}
VLLM_BODIES = sorted(k for k in BODIES if k.startswith("vllm/"))
TRITON_BODIES = sorted(k for k in BODIES if k.startswith("triton/"))
SAMPLE_LINE = re.compile(r"^(?:vllm:|nv_|cancelwatch_model_|DCGM_)")

HOSTILE_VALUES = ["NaN", "+Inf", "-Inf", "nan", "inf", "Infinity", "1e308", "1e309", "-1e-400", "1e99999", "0x10",
                  "1_000", "", " ", "1.0.0", "\u0661", "\U0001d7d9", "True", "--1", "+", "e5", "9" * 400, "-0",
                  "0.1e-3", "1 2", "1\t2", "\x00", "\u00a0" + "1", "1\x0b", "1\x1c"]
NASTY_CHARS = list('{}",=\\ #:_aZ09.+-eE\t\r\n\x00\x0b\x0c\x1c\x1e\x85\u2028\u2029\u00e9\U0001f600\ufeff')
nasty_text = st.text(alphabet=st.sampled_from(NASTY_CHARS) | st.characters(), max_size=30)
value_token = st.sampled_from(HOSTILE_VALUES) | st.floats().map(repr) | st.integers().map(str) | nasty_text


@st.composite
def mutated_body(draw, names: list[str]) -> str:
    """A recorded body with a few mutations, most of them on the sample lines the parsers keep."""
    lines = BODIES[draw(st.sampled_from(names))].split("\n")
    for _ in range(draw(st.integers(1, 4))):
        kept = [i for i, line in enumerate(lines) if SAMPLE_LINE.match(line) and "_bucket" not in line]
        i = draw(st.sampled_from(kept)) if kept and draw(st.integers(0, 9)) else draw(st.integers(0, len(lines) - 1))
        line = lines[i]
        kind = draw(st.sampled_from(["flip", "insert", "value", "label", "delete", "dup", "swap", "truncate"]))
        pos = draw(st.integers(0, len(line)))
        if kind == "flip":
            lines[i] = line[:pos] + draw(st.sampled_from(NASTY_CHARS) | st.characters()) + line[pos + 1:]
        elif kind == "insert":
            lines[i] = line[:pos] + draw(nasty_text | st.sampled_from(HOSTILE_VALUES)) + line[pos:]
        elif kind == "value":
            head = line.rsplit(" ", 1)[0] if " " in line else line
            lines[i] = head + " " + draw(value_token)
        elif kind == "label" and '="' in line:
            start = line.index('="') + 2
            end = line.find('"', start)
            lines[i] = line[:start] + draw(nasty_text) + (line[end:] if end >= 0 else "")
        elif kind == "delete":
            del lines[i]
        elif kind == "dup":
            lines.insert(i, line)
        elif kind == "swap":
            j = draw(st.integers(0, len(lines) - 1))
            lines[i], lines[j] = lines[j], line
        elif kind == "truncate":
            lines[i] = line[:pos]
            if draw(st.booleans()):
                del lines[i + 1:]  # the body cut short here (maybe without its final newline)
        if not lines:
            lines = [""]
    return "\n".join(lines)


METRIC_NAMES = ["vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc",
                "vllm:cache_config_info", "vllm:x_bucket", "vllm:e2e_request_latency_seconds_sum",
                "nv_inference_count", "nv_inference_pending_request_count", "cancelwatch_model_active_requests",
                "nv_gpu_memory_used_bytes", "DCGM_FI_DEV_FB_USED"]
label_name = st.sampled_from(["engine", "model_name", "model", "le", "quantile", "gpu", "reason"]) | nasty_text
label_value = nasty_text.map(lambda s: s.replace("\\", "\\\\").replace('"', '\\"')) | nasty_text


@st.composite
def random_line(draw) -> str:
    kind = draw(st.integers(0, 9))
    if kind == 0:
        return draw(nasty_text)
    if kind == 1:
        return f"# {draw(st.sampled_from(['TYPE', 'HELP', 'EOF', 'UNIT']))} {draw(st.sampled_from(METRIC_NAMES))} " \
               f"{draw(st.sampled_from(['gauge', 'counter', 'histogram', 'summary', 'info', 'stateset', 'x']))}"
    name = draw(st.sampled_from(METRIC_NAMES))
    if not draw(st.integers(0, 4)):
        name += draw(nasty_text)
    labels = draw(st.lists(st.tuples(label_name, label_value), max_size=3))
    series = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels) + draw(st.sampled_from(["}", "", ",}"])) + "}"
                     if labels or draw(st.booleans()) else "")
    ts = draw(st.sampled_from(["", " 1700000000000", " -1", " x", " 1e3"]))
    return f"{series}{draw(st.sampled_from([' ', '  ', chr(9)]))}{draw(value_token)}{ts}"


random_body = st.lists(random_line(), max_size=12).map(lambda ls: "\n".join(ls)).flatmap(
    lambda body: st.sampled_from([body, body + "\n"]))


def check_samples(samples, source: str) -> None:
    """The documented shape of a parse: Samples of this source and scrape, float values (Prometheus's NaN
    and +-Inf included: the store keeps NaN as NULL), labels as sorted (str, str) pairs, one per name."""
    assert isinstance(samples, list) and samples
    for s in samples:
        assert type(s) is Sample, s
        assert (s.source, s.wall_ns, s.mono_ns) == (source, 11, 22)
        assert isinstance(s.metric, str) and s.metric
        assert type(s.value) is float, s
        assert isinstance(s.labels, tuple) and list(s.labels) == sorted(s.labels)
        assert all(isinstance(k, str) and isinstance(v, str) for k, v in s.labels)
        assert len({k for k, _ in s.labels}) == len(s.labels)


def outcome(parse, text: str, memo: LineMemo | None = None):
    """The samples (as comparable keys), or the ParseError's one line; any other exception escapes."""
    try:
        samples = parse(text, 11, 22, memo=memo)
    except ParseError as exc:
        return ("rejected", assert_one_line(exc))
    # values compared as numbers (NaN equal to NaN; -0 equal to 0: the parser reads '-0' as int 0, float() as -0.0)
    return ("parsed", sorted((s.metric, s.labels, math.isnan(s.value), 0.0 if math.isnan(s.value) else s.value)
                             for s in samples), samples)


def check_parser(parse, source: str, seed_body: str, text: str) -> None:
    fresh = outcome(parse, text)
    event(fresh[0])
    if fresh[0] == "parsed":
        check_samples(fresh[2], source)
    # a memo warmed on the recorded body must give the same answer: it only saves work
    memo = LineMemo()
    parse(seed_body, 0, 0, memo=memo)
    warmed = outcome(parse, text, memo)
    assert warmed[:2] == fresh[:2] if fresh[0] == "parsed" else warmed[0] == "rejected", (fresh[:2], warmed[:2])


@fuzz()
@given(name=st.sampled_from(VLLM_BODIES), data=st.data())
def test_vllm_parser_on_mutated_recorded_bodies(name, data):
    text = data.draw(mutated_body([name]))
    check_parser(parse_vllm_metrics, "vllm", BODIES[name], text)


@fuzz()
@given(text=random_body)
@example('vllm:num_requests_running{engine="0"} 1e309\n')
@example('vllm:num_requests_running{engine="0",engine="1"} 1\n')
@example('vllm:num_requests_running{engine="0"} 1\x0b\n')
@example('vllm:num_requests_running{engine="0"} ' + "9" * 400 + "\n")
@example('vllm:num_requests_running{engine="0"} 1_000\n')
def test_vllm_parser_on_random_bodies(text):
    check_parser(parse_vllm_metrics, "vllm", BODIES["vllm/0.32/loaded.txt"], text)


@fuzz()
@given(name=st.sampled_from(TRITON_BODIES), data=st.data())
def test_triton_parser_on_mutated_recorded_bodies(name, data):
    text = data.draw(mutated_body([name]))
    check_parser(parse_triton_metrics, "triton", BODIES[name], text)


@fuzz()
@given(text=random_body)
@example('nv_inference_count{model="slow",version="1"} 4\nnv_cpu_memory_total_bytes\x0b25276514304\n')
def test_triton_parser_on_random_bodies(text):
    check_parser(parse_triton_metrics, "triton", BODIES["triton/metrics_loaded.txt"], text)


def generic(text: str, wall_ns: int, mono_ns: int, memo: LineMemo | None = None) -> list[Sample]:
    """prom_text's line parser as a parse function: every sample line of any exporter (DCGM's too)."""
    lines = [line for line in text.split("\n") if line.strip() and not line.startswith("#")]
    parsed = memo.parse(lines) if memo is not None else parse_lines(lines)
    return [Sample("any", name, value, labels, wall_ns, mono_ns) for name, labels, value in parsed]


@fuzz()
@given(name=st.sampled_from(sorted(k for k in BODIES if not k.startswith("vllm/0.32"))), data=st.data())
def test_generic_line_parser_on_every_recorded_exporter(name, data):
    text = data.draw(mutated_body([name]) | random_body)
    fresh = outcome(generic, text)
    event(fresh[0])
    if fresh[0] == "parsed" and fresh[2]:
        check_samples(fresh[2], "any")
    memo = LineMemo()
    generic(BODIES[name], 0, 0, memo=memo)
    warmed = outcome(generic, text, memo)
    assert warmed[:2] == fresh[:2] if fresh[0] == "parsed" else warmed[0] == "rejected", (fresh[:2], warmed[:2])


# ---------------------------------------------------------------------------------------------------------
# Scenario TOML files

_TYPES = {f.name: f.type for f in fields(Scenario)}
INT_KEYS = [k for k, t in _TYPES.items() if t == "int"]
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def toml_string(s: str) -> str:
    out = []
    for ch in s:
        out.append(f"\\u{ord(ch):04x}" if ch in '"\\' or ord(ch) < 0x20 or ord(ch) == 0x7F else ch)
    return '"' + "".join(out) + '"'


def toml_float(x: float) -> str:
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return repr(x)


scalar = st.one_of(
    st.integers(-(2**63), 2**63 - 1).map(str), st.integers(-3, 40).map(str), st.floats().map(toml_float),
    st.booleans().map(lambda b: "true" if b else "false"), st.text(max_size=12).map(toml_string),
    st.sampled_from([*TRIGGERS, *MODES, *APIS]).map(toml_string), st.just("1979-05-27T07:32:00Z"),
    st.just("07:32:00"))
toml_value = st.recursive(scalar, lambda inner: st.lists(inner, max_size=3).map(lambda v: "[" + ", ".join(v) + "]")
                          | st.dictionaries(st.sampled_from(["name", "a"]), inner, max_size=2).map(
                              lambda d: "{" + ", ".join(f"{k} = {v}" for k, v in d.items()) + "}"), max_leaves=4)


def plausible(key: str):
    """Mostly values of the right type and range, so that documents reach the checks after the types."""
    t = _TYPES[key]
    if key == "name":
        return st.from_regex(NAME, fullmatch=True).map(toml_string) | st.text(max_size=10).map(toml_string)
    if key == "trigger":
        return st.sampled_from(TRIGGERS).map(toml_string)
    if key == "mode":
        return st.sampled_from(MODES).map(toml_string)
    if key == "api":
        return st.sampled_from(APIS).map(toml_string)
    if t == "int":
        return st.integers(-2, 30).map(str) | st.integers().map(str)
    if t == "float":
        return st.floats(-10, 5000).map(toml_float) | st.floats().map(toml_float) | st.integers(0, 100).map(str)
    if t == "bool":
        return st.booleans().map(lambda b: "true" if b else "false")
    return st.text(max_size=10).map(toml_string)


@st.composite
def scenario_table(draw) -> str:
    keys = draw(st.lists(st.sampled_from(list(_TYPES)), unique=True, max_size=8))
    if draw(st.integers(0, 9)):
        keys = ["name", *[k for k in keys if k != "name"]]
    rows = [f"{k} = {draw(plausible(k) if draw(st.integers(0, 4)) else toml_value)}" for k in keys]
    if not draw(st.integers(0, 9)):
        rows.append(f"{toml_string(draw(nasty_text))} = {draw(toml_value)}")  # an unknown (maybe unprintable) key
    return "[[scenario]]\n" + "".join(r + "\n" for r in rows)


@st.composite
def scenario_document(draw) -> bytes:
    kind = draw(st.integers(0, 9))
    if kind <= 5:
        text = "".join(draw(st.lists(scenario_table(), min_size=1, max_size=3)))
    elif kind == 6:
        text = f"{draw(st.sampled_from(['scenario', 'scenarios', 'x']))} = {draw(toml_value)}\n"
    elif kind == 7:
        text = draw(st.text(max_size=60))
    elif kind == 8:
        n = draw(st.integers(1, 3000))
        text = "[[scenario]]\nname = \"x\"\nrepeats = " + "[" * n + "]" * n + "\n"  # deep nesting
    else:
        return draw(st.binary(max_size=60))  # maybe not UTF-8 at all
    data = text.encode("utf-8", "surrogatepass")  # a lone surrogate drawn into a string: bytes no UTF-8 reader takes
    if draw(st.integers(0, 4)) == 0 and data:  # a byte flipped or the file cut short
        i = draw(st.integers(0, len(data) - 1))
        data = data[:i] + bytes([draw(st.integers(0, 255))]) + data[i + 1:] if draw(st.booleans()) else data[:i]
    return data


def check_scenario(s: Scenario) -> None:
    """What a loaded scenario may be: every field of its type, every value one the driver can send."""
    assert type(s) is Scenario
    for f in fields(Scenario):
        v = getattr(s, f.name)
        want = {"str": (str,), "int": (int,), "float": (int, float), "bool": (bool,)}[f.type]
        assert isinstance(v, want) and (f.type == "bool" or not isinstance(v, bool)), (f.name, v)
    assert NAME.fullmatch(s.name), s.name  # it goes into X-Request-Id headers and the ledger
    assert s.trigger in TRIGGERS and s.mode in MODES and s.api in APIS
    assert math.isfinite(s.trigger_value) and s.trigger_value >= 0
    assert math.isfinite(s.timeout_s) and 0 < s.timeout_s
    for key in INT_KEYS:  # the ledger stores them in SQLite (64-bit) and the driver builds prompts this long
        assert getattr(s, key) <= 1_000_000, key
    for key in ("prompt_tokens", "max_tokens", "n", "concurrency", "repeats", "filler_max_tokens",
                "neighbour_max_tokens", "probe_max_tokens"):
        assert getattr(s, key) >= 1, key
    assert 0 <= s.cancel_count <= s.concurrency and s.fillers >= 0
    assert s.repeats <= 20 and s.concurrency <= 16 and s.fillers <= 16
    assert (s.mode == "explicit") == s.via_relay and not (s.mode == "timeout" and s.stream)


SCEN_DIR = WORK / "scenarios"


@fuzz()
@given(data=scenario_document())
@example(data=b'[[scenario]]\nname = "x"\ntrigger_value = nan\n')
@example(data=b'scenario = [1, "x"]\n')
@example(data=b'[[scenario]]\nname = "a\\nb"\n')
@example(data=b'\xff\xfe[[scenario]]\n')
def test_scenario_files_load_or_are_rejected_in_one_line(data):
    path = SCEN_DIR / "s.toml"
    path.write_bytes(data)
    try:
        loaded = load_file(path)
    except ScenarioError as exc:
        msg = assert_one_line(exc)
        assert str(path) in msg
        event("rejected: " + msg.split(": ", 1)[1].split(" ")[0:2][-1])
        return
    event("loaded")
    assert loaded
    for s in loaded:
        check_scenario(s)


# ---------------------------------------------------------------------------------------------------------
# The dashboard's URL parameters

url_text = st.text(max_size=40) | st.sampled_from(
    ["latest", "1", "0", "-1", "1 OR 1=1", "99999999999999999999", str(MAX_RUN_ID), str(MAX_RUN_ID + 1), "1_0",
     "\u0663", "+1", " 2 ", "9" * 5000, "cw.db", "runs/cw.db", "../x.db", "/etc/passwd", "~nosuchuser/x.db",
     "a" * 300 + ".db", "x/" * 2100 + "a.db", "cw.db\n", "\x00", "~", "runs/../runs/cw.db"])
url_params = st.dictionaries(st.sampled_from(["store", "run", "cancel", "compare", "x"]), url_text, max_size=4)


@fuzz()
@given(params=url_params)
def test_url_parameters_give_a_selection_or_one_line(params):
    sel = read_url_params(params)
    assert isinstance(sel.store, str) and isinstance(sel.run, str)
    assert sel.run == "latest" or (sel.run.isdigit() and 1 <= int(sel.run) <= MAX_RUN_ID)
    if sel.message is not None:
        assert_one_line(ValueError(sel.message))
        assert "run" in params and sel.run == "latest"
    elif "run" in params:
        assert sel.run == params["run"].strip() or sel.run == str(int(params["run"].strip()))


STORE_ROOT = WORK / "root"
(STORE_ROOT / "cw.db").write_bytes(b"")


@fuzz()
@given(params=url_params)
def test_the_store_a_url_names_is_inside_the_folder_or_refused_in_one_line(params):
    text = read_url_params(params).store
    try:
        path = store_in_dir(text, STORE_ROOT)
    except StoreError as exc:
        assert_one_line(exc)
        return
    assert path.is_relative_to(STORE_ROOT) and path.suffix == ".db"
    path.is_file()  # what the page does next: must not raise either


@pytest.mark.parametrize("run", ["99999999999999999999", "\u0663"])
def test_hostile_url_parameters_on_the_page(tmp_path, monkeypatch, run):
    """The page itself (AppTest) with a hostile run id: a one-line warning, the latest run, no exception."""
    from streamlit.testing.v1 import AppTest

    recorded_run(tmp_path / "cw.db")
    monkeypatch.setenv("CANCELWATCH_STORE_DIR", str(tmp_path))
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    at = AppTest.from_file(str(Path(__file__).resolve().parents[1] / "dashboard" / "app.py"), default_timeout=120)
    at.query_params["store"] = "cw.db"
    at.query_params["run"] = run
    at.run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    assert at.warning and all(len(w.value.splitlines()) == 1 for w in at.warning)
    assert at.title[0].value.startswith("Run 1")


# ---------------------------------------------------------------------------------------------------------
# The run store reader on truncated and corrupted files

STORE_DIR = WORK / "store"
recorded_run(STORE_DIR / "wal.db")  # as a recording leaves it (WAL mode, checkpointed on close)
compact(STORE_DIR / "wal.db", STORE_DIR / "plain.db")  # as the sample run is shipped
SEEDS = {name: (STORE_DIR / f"{name}.db").read_bytes() for name in ("wal", "plain")}
PAGE = 4096
# SQL-level damage: what a crash, a bad tool or a hand edit can leave in a store that still opens
DAMAGE = [
    "UPDATE runs SET targets = '{not json'", "UPDATE runs SET engine = '[1, 2]'", "UPDATE runs SET settings = '\"s\"'",
    "UPDATE runs SET stats = 'null'", "UPDATE runs SET cache = '7'", "UPDATE runs SET targets = '{}'",
    "UPDATE runs SET started_mono_ns = 'abc'", "UPDATE runs SET started_mono_ns = ''",
    "UPDATE runs SET started_wall_ns = 'x'", "UPDATE runs SET started_wall_ns = 99e99",
    "UPDATE samples SET value = 'text'", "UPDATE series SET labels = '{bad'", "UPDATE series SET metric = NULL",
    "UPDATE scrapes SET mono_ns = 'x'", "UPDATE scrapes SET wall_ns = NULL", "UPDATE events SET data = '{bad'",
    "UPDATE events SET mono_ns = 'x'", "UPDATE gaps SET end_mono_ns = 'x'", "DELETE FROM scrapes",
    "DROP TABLE samples", "DROP TABLE ledger", "ALTER TABLE gaps DROP COLUMN detail", "DELETE FROM series",
    "UPDATE runs SET id = 9223372036854775807", "UPDATE ledger SET prompt_tokens = 'many'",
]


@st.composite
def corrupted_store(draw) -> tuple[str, list[str], list[tuple[str, int, bytes]]]:
    """(seed, SQL damage, byte damage): the seed file, some statements run on it, then bytes cut or
    overwritten. Mostly past the first page (the schema): a store whose first page is gone is refused at
    the door, while damage further in reaches the queries behind it."""
    seed = draw(st.sampled_from(sorted(SEEDS)))
    size = len(SEEDS[seed])
    sql = draw(st.lists(st.sampled_from(DAMAGE), min_size=1, max_size=2, unique=True)) if draw(st.booleans()) else []
    ops = []
    for _ in range(draw(st.integers(0 if sql else 1, 3))):
        kind = draw(st.sampled_from(["truncate", "bytes", "page", "page", "header"]))
        if kind == "truncate":
            at = draw(st.integers(2 * PAGE, size) if draw(st.integers(0, 4)) else st.integers(0, size))
        elif kind == "header":
            at = draw(st.integers(0, 99))
        elif kind == "page":  # a b-tree page's header and cell pointers, or its cells at the end
            page = draw(st.integers(1, size // PAGE - 1) if draw(st.integers(0, 9)) else st.just(0))
            at = page * PAGE + draw(st.sampled_from([0, 1, 3, 5, 7, 8, 12, 100, 108, PAGE // 2, PAGE - 64, PAGE - 8]))
        else:
            at = draw(st.integers(PAGE, size - 1) if draw(st.integers(0, 4)) else st.integers(0, size - 1))
        ops.append((kind, at, b"" if kind == "truncate" else draw(st.binary(min_size=1, max_size=64))))
    return seed, sql, ops


def write_store(seed: str, sql: list[str], ops: list[tuple[str, int, bytes]]) -> Path:
    path = STORE_DIR / "fuzzed.db"
    for p in (path, Path(f"{path}-wal"), Path(f"{path}-shm"), Path(f"{path}-journal")):
        p.unlink(missing_ok=True)
    path.write_bytes(SEEDS[seed])
    if sql:
        con = sqlite3.connect(path)
        try:
            for stmt in sql:
                try:
                    con.execute(stmt)
                except (sqlite3.IntegrityError, sqlite3.OperationalError):
                    pass  # the schema does not let this damage in (NOT NULL), or an earlier one dropped its table
            con.commit()
        finally:
            con.close()
    data = bytearray(path.read_bytes())
    for kind, at, junk in ops:
        if kind == "truncate":
            del data[at:]
        else:
            data[at:at + len(junk)] = junk
    path.write_bytes(bytes(data))
    return path


def check_read(path: Path, read) -> object | None:
    try:
        out = read()
    except StoreError as exc:
        msg = assert_one_line(exc)
        assert str(path) in msg, msg
        event("rejected: " + msg.split("(")[0].replace(str(path), "STORE")[:40])
        return None
    event("read")
    return out


@fuzz(0.6)
@given(damaged=corrupted_store())
@example(damaged=("plain", [], [("truncate", PAGE * 8, b"")]))
@example(damaged=("plain", ["UPDATE runs SET engine = '{not json'"], []))
@example(damaged=("plain", ["UPDATE runs SET engine = '[1, 2]'"], []))
def test_the_reader_returns_a_run_or_one_line_naming_the_store(damaged):
    path = write_store(*damaged)
    runs = check_read(path, lambda: list_runs(path))
    if runs is not None:
        assert isinstance(runs, pd.DataFrame)
    run = check_read(path, lambda: load_run(path, "latest"))
    if run is not None:
        assert isinstance(run.info["targets"], list) or run.info["targets"] == {}  # {}: the column left empty
        assert all(isinstance(run.info[k], dict) for k in ("engine", "cache", "settings", "stats"))
        for df in (run.samples, run.scrapes, run.gaps, run.events, run.ledger):
            assert isinstance(df, pd.DataFrame)
        check_read(path, lambda: load_run(path, run.id, metrics=["requests_running"]))


@fuzz(0.3)
@given(damaged=corrupted_store(), run=st.sampled_from(["latest", "1", "2", "0", "99999999999999999999"]))
@example(damaged=("plain", [], []), run="99999999999999999999")
def test_run_ids_on_damaged_stores(damaged, run):
    path = write_store(*damaged)
    try:
        rid = resolve_run_id(path, run)
    except StoreError as exc:
        msg = assert_one_line(exc)
        if damaged == ("plain", [], []):  # the store is whole: only the id can be wrong
            assert f"no run {run} in {path}" in msg
        return
    # an id of the store (damage SQLite does not notice, a zero byte in the runs page, can make it 0 or less)
    assert type(rid) is int and -MAX_RUN_ID - 1 <= rid <= MAX_RUN_ID


@pytest.mark.parametrize("damage", ["truncated", "header", "json", "not sqlite"])
def test_report_on_a_damaged_store_is_one_line_exit_2(tmp_path, damage):
    """The command line on a damaged store: exit 2 and one line on stderr that names the store."""
    path = tmp_path / "cw.db"
    data = SEEDS["plain"]
    if damage == "truncated":
        path.write_bytes(data[: len(data) // 3])
    elif damage == "header":
        path.write_bytes(data[:16] + b"\xff" * 84 + data[100:])
    elif damage == "json":
        shutil.copy(STORE_DIR / "plain.db", path)
        con = sqlite3.connect(path)
        con.execute("UPDATE runs SET settings = '{\"hz\": 20, '")
        con.commit()
        con.close()
    else:
        path.write_bytes(b"SQLite format 2\x00" + b"\x00" * 5000)
    res = cli("report", "latest", "--store", str(path), home=tmp_path, timeout=120)
    assert res.returncode == 2, (res.returncode, res.stdout[-500:], res.stderr[-2000:])
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and str(path) in lines[0], res.stderr[-2000:]


def test_the_fuzz_profile_is_the_bounded_one_unless_asked():
    """CI runs the bounded, reproducible profile; the long run is asked for by name."""
    if not (os.environ.get("HYPOTHESIS_PROFILE") or os.environ.get("CANCELWATCH_FUZZ")):
        assert PROFILE.max_examples <= 200 and PROFILE.derandomize
