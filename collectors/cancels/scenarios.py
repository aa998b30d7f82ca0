"""Scripted cancels: what to send, when to cancel, and what each scenario proves.

Built-ins cover the phases a cancel can hit; users add their own in TOML files:

    [[scenario]]
    name = "long_decode"
    prompt_tokens = 800
    max_tokens = 1500
    trigger = "after_tokens"     # after_ms | after_tokens | while_queued | before_first_token | near_completion_tokens
    trigger_value = 50
    repeats = 2

A bad file is rejected before any request is sent, with the key named.
"""

from __future__ import annotations

import math
import re
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path

TRIGGERS = ("after_ms", "after_tokens", "while_queued", "before_first_token", "near_completion_tokens")
# task cancel | close the stream | non-streaming client timeout | POST /cancel to the relay app
MODES = ("cancel", "disconnect", "timeout", "explicit")
APIS = ("completions", "chat")


NEIGHBOUR_PROMPT_TOKENS = 200  # the neighbour's prompt: short, so that its stream starts at once


class ScenarioError(Exception):
    """A scenario definition that cannot run; the message names the key and the fix."""


@dataclass(frozen=True)
class Scenario:
    name: str
    proves: str = ""
    trigger: str = "after_tokens"
    trigger_value: float = 20
    mode: str = "cancel"
    api: str = "completions"
    stream: bool = True
    prompt_tokens: int = 600
    max_tokens: int = 1500
    n: int = 1
    concurrency: int = 1  # target requests sent together
    cancel_count: int = 1  # how many of them are cancelled
    fillers: int = 0  # requests that occupy the batch before the targets are sent
    filler_max_tokens: int = 200
    neighbour_max_tokens: int = 250
    probe_max_tokens: int = 8
    resubmit: bool = False  # the probe resends the cancelled prompt (prefix-cache reuse)
    share_prefix: bool = False  # the targets' prompts begin with the neighbour's whole prompt (prefix cache)
    repeats: int = 1
    timeout_s: float = 1.0  # client timeout of mode = "timeout"
    via_relay: bool = False  # sent to the relay app (in-process AsyncLLM) instead of the target


BUILTIN: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario("queued", "a waiting request is cancelled: waiting drops, running and KV usage do not",
                 trigger="while_queued", trigger_value=0, fillers=3, filler_max_tokens=400, neighbour_max_tokens=500,
                 prompt_tokens=300, max_tokens=200),
        Scenario("prefill", "cancelled before its first token: the long prompt's blocks are freed",
                 trigger="before_first_token", trigger_value=250, prompt_tokens=3000, max_tokens=200),
        Scenario("decode", "cancelled after streamed tokens: KV usage drops",
                 trigger="after_tokens", trigger_value=20, prompt_tokens=1200, max_tokens=1500),
        Scenario("race", "cancelled within the last tokens: exactly one terminal state wins",
                 trigger="near_completion_tokens", trigger_value=2, prompt_tokens=200, max_tokens=40),
        Scenario("disconnect", "the client closes the stream, no cancel call: the server still aborts",
                 mode="disconnect", trigger="after_tokens", trigger_value=20, prompt_tokens=1200, max_tokens=1500),
        # 2.5 s, not 1 s: a machine that holds the recorder up past the deadline before the request left it
        # (CI, two cores: 1.2 s) times the request out before any hop or the engine saw it. 1500 tokens
        # still run well past 2.5 s on the engines this drives
        Scenario("nonstream_timeout", "a non-streaming request whose client times out is aborted",
                 mode="timeout", stream=False, trigger="after_ms", trigger_value=2500, timeout_s=2.5,
                 prompt_tokens=1200, max_tokens=1500),
        Scenario("chat", "a chat completion cancelled mid-stream leaves like a completion",
                 api="chat", trigger="after_tokens", trigger_value=20, prompt_tokens=1200, max_tokens=1500),
        Scenario("n2", "a completion with n=2: both sequences leave",
                 n=2, trigger="after_tokens", trigger_value=20, prompt_tokens=1000, max_tokens=1500),
        Scenario("burst", "K of M concurrent requests cancelled at once; the others go on",
                 concurrency=3, cancel_count=2, trigger="after_tokens", trigger_value=15, prompt_tokens=800,
                 max_tokens=1500),
        Scenario("resubmit", "cancel, then the same prompt again: prefix-cache hits rise (KV reuse after cancel)",
                 resubmit=True, trigger="after_tokens", trigger_value=20, prompt_tokens=1024, max_tokens=1500),
        Scenario("inproc", "in-process AsyncLLM: an explicit cancel through the relay awaits abort(request_id)",
                 mode="explicit", via_relay=True, trigger="after_tokens", trigger_value=20, prompt_tokens=1200,
                 max_tokens=1500),
    )
}

SUITES = {"default": list(BUILTIN)}

_TYPES = {f.name: f.type for f in fields(Scenario)}
_PY_TYPES = {"str": str, "float": (int, float), "int": int, "bool": bool}
_INT_KEYS = [name for name, t in _TYPES.items() if t == "int"]
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
MAX_INT = 1_000_000  # tokens, requests: far beyond any context, well within SQLite's integers


def _check(s: Scenario, where: str) -> Scenario:
    def bad(key: str, why: str) -> ScenarioError:
        return ScenarioError(f"{where}: key '{key}' {why}")

    if s.trigger not in TRIGGERS:
        raise bad("trigger", f"is {s.trigger!r}; use one of {', '.join(TRIGGERS)}")
    if s.mode not in MODES:
        raise bad("mode", f"is {s.mode!r}; use one of {', '.join(MODES)}")
    if s.api not in APIS:
        raise bad("api", f"is {s.api!r}; use one of {', '.join(APIS)}")
    for key in ("prompt_tokens", "max_tokens", "n", "concurrency", "repeats"):
        if getattr(s, key) < 1:
            raise bad(key, "must be >= 1")
    for key in ("cancel_count", "fillers"):
        if getattr(s, key) < 0:
            raise bad(key, "must be >= 0")
    if s.cancel_count > s.concurrency:
        raise bad("cancel_count", f"({s.cancel_count}) is more than concurrency ({s.concurrency})")
    if s.trigger_value < 0:
        raise bad("trigger_value", "must be >= 0")
    if (s.mode == "explicit") != s.via_relay:
        raise bad("mode", "\"explicit\" goes with via_relay = true (only the relay app takes POST /cancel)")
    if s.mode == "timeout" and s.stream:
        raise bad("stream", "must be false with mode = \"timeout\" (a streaming client does not time out)")
    if not s.stream and s.trigger in ("after_tokens", "near_completion_tokens", "before_first_token"):
        raise bad("trigger", f"{s.trigger!r} needs stream = true")
    if s.share_prefix and s.prompt_tokens <= NEIGHBOUR_PROMPT_TOKENS:
        raise bad("prompt_tokens", f"must be more than the neighbour's {NEIGHBOUR_PROMPT_TOKENS} with share_prefix = true "
                  "(the target's prompt is the neighbour's and more)")
    if s.repeats > 20 or s.concurrency > 16 or s.fillers > 16:
        raise bad("repeats", "/ concurrency / fillers are bounded (20 / 16 / 16) to keep a run short")
    # what tests/test_fuzz.py found a file could still carry past the checks above:
    # a name goes into every request's X-Request-Id header and the ledger ("a\nb" broke the header mid-run)
    if not _NAME.fullmatch(s.name):
        raise bad("name", f"is {s.name!r}; use 1-64 letters, digits, '_', '.' or '-', starting with a letter or digit")
    # NaN passed every comparison above; inf never fires
    if not math.isfinite(s.trigger_value):
        raise bad("trigger_value", "must be a finite number")
    if not (math.isfinite(s.timeout_s) and s.timeout_s > 0):
        raise bad("timeout_s", "must be a finite number of seconds > 0")
    for key in ("filler_max_tokens", "neighbour_max_tokens", "probe_max_tokens"):
        if getattr(s, key) < 1:
            raise bad(key, "must be >= 1")
    # the ledger stores these in SQLite (64-bit integers) and the driver builds prompts this long
    for key in _INT_KEYS:
        if getattr(s, key) > MAX_INT:
            raise bad(key, f"must be <= {MAX_INT}")
    return s


def load_file(path: str | Path) -> list[Scenario]:
    p = Path(path)
    try:
        doc = tomllib.loads(p.read_text())
    except OSError as exc:
        raise ScenarioError(f"cannot read scenario file {p}: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:  # a ValueError, not an OSError (found by tests/test_fuzz.py)
        raise ScenarioError(f"{p}: not UTF-8 text (byte {exc.start}); save the file as UTF-8") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ScenarioError(f"{p}: not valid TOML ({exc})") from exc
    except RecursionError as exc:  # tomllib recurses once per nested array (found by tests/test_fuzz.py)
        raise ScenarioError(f"{p}: not valid TOML (nested too deeply)") from exc
    entries = doc.get("scenario")
    extra = set(doc) - {"scenario", "hop"}
    if extra:
        raise ScenarioError(f"{p}: key {_key(sorted(extra)[0])} is unknown; put scenarios under [[scenario]] "
                            "(and taps under [[hop]])")
    _hops(doc, p)
    if not isinstance(entries, list) or not entries:
        raise ScenarioError(f"{p}: key 'scenario' is missing; add at least one [[scenario]] table")
    out = []
    for i, entry in enumerate(entries):
        where = f"{p} scenario #{i + 1}"
        if not isinstance(entry, dict):  # `scenario = [1, "x"]` (found by tests/test_fuzz.py)
            raise ScenarioError(f"{where}: key 'scenario' must hold tables ([[scenario]]), not {type(entry).__name__}")
        if "name" not in entry:
            raise ScenarioError(f"{where}: key 'name' is missing")
        for key, value in entry.items():
            if key not in _TYPES:
                raise ScenarioError(f"{where}: key {_key(key)} is unknown; known keys: {', '.join(_TYPES)}")
            want = _PY_TYPES[_TYPES[key]]
            if not isinstance(value, want) or (want is int and isinstance(value, bool)):
                raise ScenarioError(f"{where}: key '{key}' must be {_TYPES[key]}, not {type(value).__name__}")
        # repr: a name may hold a line break until _check refuses it, and the message must stay one line
        out.append(_check(Scenario(**entry), f"{p} scenario {entry['name']!r}"))
    return out


HOP_KEYS = ("name", "listen", "upstream")


def _hops(doc: dict, p: Path) -> list[str]:
    """The file's [[hop]] tables (name, listen, upstream: the taps of --hop, in order from the client) as
    `NAME=LISTEN,UPSTREAM` strings; ScenarioError for a table that is not one."""
    entries = doc.get("hop", [])
    if not isinstance(entries, list):
        raise ScenarioError(f"{p}: key 'hop' must hold tables ([[hop]]), not {type(entries).__name__}")
    out = []
    for i, entry in enumerate(entries):
        where = f"{p} hop #{i + 1}"
        if not isinstance(entry, dict) or set(entry) != set(HOP_KEYS) \
                or not all(isinstance(entry[k], str | int) and not isinstance(entry[k], bool) for k in HOP_KEYS):
            raise ScenarioError(f"{where}: a [[hop]] holds exactly name, listen and upstream, e.g. name = \"nginx\", "
                                "listen = \"127.0.0.1:9001\", upstream = \"http://127.0.0.1:8080\"")
        out.append(f"{entry['name']}={entry['listen']},{entry['upstream']}")
    return out


def load_hops(spec: str) -> list[str]:
    """The [[hop]] tables of the scenario files named in `spec`, as `NAME=LISTEN,UPSTREAM` strings (none for a
    suite or built-in)."""
    out = []
    for part in (x.strip() for x in spec.split(",")):
        if part and part not in SUITES and part not in BUILTIN and (part.endswith(".toml") or Path(part).exists()):
            try:
                doc = tomllib.loads(Path(part).read_text())
            except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError, RecursionError):
                continue  # load_file says why, in its own words
            out += _hops(doc, Path(part))
    return out


def _key(key: str) -> str:
    """A key as a one-line message shows it: 'name', or escaped when TOML's quoted key held a line break."""
    return f"'{key}'" if key.isprintable() else repr(key)


def resolve(spec: str) -> list[Scenario]:
    """A suite name, a built-in scenario name, a TOML file, or a comma-separated list of those."""
    if "," in spec:
        return [s for part in spec.split(",") if part.strip() for s in resolve(part.strip())]
    if spec in SUITES:
        return [BUILTIN[n] for n in SUITES[spec]]
    if spec in BUILTIN:
        return [BUILTIN[spec]]
    if spec.endswith(".toml") or Path(spec).exists():
        return load_file(spec)
    known = ", ".join([*SUITES, *BUILTIN])
    raise ScenarioError(f"--scenario {spec!r} is neither a suite, a built-in ({known}) nor a .toml file")

