"""The commands the READMEs give, as a reader copies them, and what the tests do with each.

tests/test_readme_commands.py checks that every command of the READMEs is in exactly one of the tables
below and that none of the tables names a command the READMEs no longer give; the tests named in RUN read
the command's text from here and run it as written (ports and store paths may be overridden, nothing else).
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the README, the folders' READMEs and the docs site's pages that give commands (docs/, mkdocs.yml)
READMES = (ROOT / "README.md", ROOT / "dashboard" / "README.md", ROOT / "notebooks" / "README.md",
           *(ROOT / "docs" / page for page in ("engines.md", "fleet.md", "cli.md", "dashboard.md", "cancels.md",
                                               "hops.md", "run-format.md", "development.md", "benchmarks.md")))

# aimed at 127.0.0.1 or the embedded engines: run as written by the test named (file::function)
RUN = {
    "make demo": "test_readme_commands_engine.py::test_make_demo_ends_in_the_page_with_its_runs",
    "make demo-triton": "test_readme_commands_engine.py::test_make_demo_triton_ends_in_the_page_with_its_run",
    "make dashboard": "test_readme_commands.py::test_make_dashboard_serves_the_page",
    "make docs": "test_docs.py::test_the_docs_build_strict_and_list_every_page",
    "streamlit run dashboard/app.py": "test_readme_commands.py::test_the_console_script_serves_the_page_from_the_root",
    "streamlit run /path/to/dashboard/app.py":
        "test_readme_commands.py::test_the_page_started_from_another_folder_works_the_same",
    "cancelwatch sample --target a=http://127.0.0.1:8000 --target b=http://127.0.0.1:8001":
        "test_readme_commands_engine.py::test_two_labelled_replicas_sampled_as_written",
    "cancelwatch notebook capacity_review --run latest --html capacity.html":
        "test_readme_commands_engine.py::test_the_notebook_commands_as_written",
    "cancelwatch notebook capacity_review --run 1 --run 2 --html review.html":
        "test_readme_commands_engine.py::test_the_notebook_commands_as_written",
    "cancelwatch notebook vram_plateau --run latest --html plateau.html":
        "test_readme_commands_engine.py::test_the_notebook_commands_as_written",
    "cancelwatch notebook capacity_review --store runs/cancelwatch.db --run 1 --run 2 -p context_len=4096 "
    "--html review.html": "test_readme_commands_engine.py::test_the_notebook_commands_as_written",
    "cancelwatch notebook resolution --run latest -p prom_store=runs/imported.db --html resolution.html":
        "test_prometheus_import.py::test_the_resolution_notebook_commands_as_written",
    "cancelwatch engine up --engine triton --port 8100":
        "test_readme_commands_engine.py::test_the_triton_commands_as_written",
    "cancelwatch record --target grpc://127.0.0.1:8101 --scenario triton --store runs/triton.db":
        "test_readme_commands_engine.py::test_the_triton_commands_as_written",
    "cancelwatch engine down --port 8100": "test_readme_commands_engine.py::test_the_triton_commands_as_written",
    "cancelwatch engine status": "test_readme_commands_engine.py::test_the_triton_commands_as_written",
    "cancelwatch engine up --relay --port 8100": "test_readme_commands_engine.py::test_the_relay_engine_as_written",
    "python -m cancelwatch": "conftest.py::cli",
    "make lab": "test_notebooks.py::test_make_lab_serves_the_notebooks_on_loopback_behind_a_token",
    "cancelwatch record --target http://127.0.0.1:9001 --metrics-url http://127.0.0.1:8000 --scenario disconnect "
    "--hop nginx=127.0.0.1:9001,http://127.0.0.1:8080 --hop vllm=127.0.0.1:9002,http://127.0.0.1:8000":
        "test_gateways_engine.py::test_the_readme_hop_command_as_written",
}

# aimed at other hosts or a GPU: parsed by the real command line, with the values each option must get
# (test_readme_commands.py::test_remote_and_gpu_commands_parse_as_meant), never run
COMMAND_LINE_ONLY = {
    "cancelwatch sample --target http://10.0.0.5:8000 --pid 12345 --nvml on --duration 60":
        {"target": ["http://10.0.0.5:8000"], "pid": [12345], "nvml": "on", "duration": 60.0},
    "cancelwatch engine up --gpu --engine-python /opt/vllm/bin/python --model /models/Llama-3.1-8B --port 8000":
        {"gpu": True, "engine_python": "/opt/vllm/bin/python", "model": "/models/Llama-3.1-8B", "port": 8000},
    "cancelwatch record --target grpc://10.0.0.7:8001 --metrics-url http://10.0.0.7:8002 "
    "--http-url http://10.0.0.7:8000 --engine-log /var/log/triton.log --scenario triton_executing":
        {"target": "grpc://10.0.0.7:8001", "metrics_url": "http://10.0.0.7:8002",
         "http_url": "http://10.0.0.7:8000", "scenario": "triton_executing"},
    "cancelwatch import prometheus --url http://prometheus:9090 --start now-7d --step 1m --match '{job=\"vllm\"}'":
        {"url": "http://prometheus:9090", "start": "now-7d", "step": "1m", "match": '{job="vllm"}'},
    "cancelwatch canary --target http://vllm-gateway:8000 --every 10m --scenario decode,disconnect "
    "--listen 127.0.0.1:9464":
        {"target": "http://vllm-gateway:8000", "every": "10m", "scenario": "decode,disconnect",
         "listen": "127.0.0.1:9464"},
    "cancelwatch watch --listen 127.0.0.1:9000 --upstream http://vllm-gateway:8000 --metrics-url http://vllm:8000 "
    "--metrics-listen 127.0.0.1:9465":
        {"listen": "127.0.0.1:9000", "upstream": "http://vllm-gateway:8000", "metrics_url": "http://vllm:8000",
         "metrics_listen": "127.0.0.1:9465"},
    "cancelwatch watch --listen 127.0.0.1:9000 --upstream http://127.0.0.1:8080 --upstream-name nginx "
    "--hop app=127.0.0.1:9001,http://127.0.0.1:8300 --hop vllm=127.0.0.1:9002,http://127.0.0.1:8000":
        {"listen": "127.0.0.1:9000", "upstream": "http://127.0.0.1:8080", "upstream_name": "nginx",
         "hop": ["app=127.0.0.1:9001,http://127.0.0.1:8300", "vllm=127.0.0.1:9002,http://127.0.0.1:8000"]},
}

# given, but not run by a test, and why
NOT_RUN = {
    "make test": "the suite itself (CI runs it from a fresh clone)",
    "CANCELWATCH_ENGINE_CPUS=0.3 make test": "the suite itself on a slowed engine: run by hand, its time is in the "
                                             "notes of the change that set the 60-minute budget",
    "make test-fast": "a subset of this suite: run from a test it would run that test again; `make test` runs "
                      "every test it selects, and the marks are strict",
    ".venv/bin/python -m pytest -m \"not engine and not browser and not triton and not prometheus\" tests":
        "what `make test-fast` runs (see there)",
    "make fuzz": "tests/test_fuzz.py and tests/test_verdict_properties.py with thousands of examples a test; the "
                 "suite runs the same tests bounded",
    "make test-slow": "the tests marked slow, one at a time: a suite target beside `make test`, run by hand",
    "make test-aiperf": "the AIPerf tests (tests/test_watch_aiperf.py) with a 1.2 GB venv of their own: a suite "
        "target beside `make test`, run by hand",
    "make corpus": "re-records the corpus from real servers (45 minutes); `make test` judges what it recorded "
                   "(tests/test_corpus.py)",
    "python -m tests.corpus.check --bless": "writes the manifest once a person has read the table of what moved; "
                                            "tests/test_corpus.py runs the check it blesses",
    "python -m cancelwatch.analysis.verdicts.reference > docs/rules.md": "writes docs/rules.md; tests/test_rule_reference.py "
                                                             "checks that file is what it writes",
    "make prometheus": "an install step that `make test` runs first",
    "make sample-run": "re-records the shipped sample run; the engine tests record the same scenarios",
    "make bench": "a benchmark: prints figures for minutes, read by a person, not asserted",
    "make matrix": "writes the matrix into the repository's docs/: it runs `cancelwatch matrix --out docs`, which "
                   "test_gateways_engine.py runs for nginx and HAProxy into a folder of its own",
    "python bench/dashboard.py": "a benchmark (see make bench)",
    "python bench/judging.py": "a benchmark (see make bench): this tree beside an older revision",
    "python bench/import.py": "a benchmark (see make bench)",
    "python bench/observer.py": "a benchmark (see make bench)",
    "python bench/burst.py": "a benchmark (see make bench)",
    "python bench/soak.py": "a benchmark of ~20 minutes (see make bench)",
    "python bench/slow_engine.py": "a benchmark (see make bench)",
    "python bench/other_traffic.py": "a benchmark of ~8 minutes on the embedded engine",
    "python bench/tap.py": "a benchmark (see make bench)",
    "python bench/watch.py": "a benchmark of a few minutes on the embedded engine: prints figures, read by a person",
    "python bench/window.py": "a benchmark of ~3 minutes writing synthetic runs: prints figures, read by a person",
    "python bench/watch_soak.py": "a benchmark of ~20 minutes: the watch against a fixture engine, prints figures",
    "python bench/record_soak.py": "a benchmark of ~40 minutes: record against a fixture engine, prints figures",
    "python bench/engine_nice.py": "a benchmark of ~3 minutes on the embedded engine: prints figures, read by a person",
}

_ENV = r"(?:[A-Z][A-Z0-9_]*=\S+ )*"  # VAR=value words before a command
_INLINE = re.compile(r"`(" + _ENV + r"(?:cancelwatch|make|streamlit|python|\.venv/bin/\S+) [^`]+|make|make \S+)`")
# a synopsis, not a command: options in brackets, alternatives, or a word in capitals standing for a value
_PLACEHOLDER = re.compile(r"[\[\]|]|(?<![\w-])[A-Z][A-Z_]*(?:=[A-Z_]+)?(?![\w-])|\.\.\.")


def _join(lines: list[str]) -> list[str]:
    cmds, current = [], ""
    for line in lines:
        text = line.split("  #")[0].rstrip() if not line.lstrip().startswith("#") else ""
        if not text.strip():
            continue
        current += (" " if current else "") + text.strip().rstrip("\\").strip()
        if not text.endswith("\\"):
            cmds.append(current)
            current = ""
    return cmds


def readme_commands() -> dict[str, list[str]]:
    """Every command of the READMEs -> the READMEs it stands in. Left out: synopses (see synopses()) and
    inline names of a command ("`cancelwatch record` drives...") that begin a longer command given."""
    found: dict[str, list[str]] = {}
    inline: dict[str, list[str]] = {}
    for path in READMES:
        text = path.read_text()
        for block in re.findall(r"^```[a-z]*\n(.*?)^```", text, flags=re.M | re.S):
            for cmd in _join(block.splitlines()):
                if _is_command(cmd) and not _PLACEHOLDER.search(_bare(cmd)):
                    found.setdefault(cmd, []).append(path.name)
        for m in _INLINE.finditer(text):
            cmd = " ".join(m.group(1).split())
            if _is_command(cmd) and not _PLACEHOLDER.search(_bare(cmd)) and len(cmd.split()) > 1:
                inline.setdefault(cmd, []).append(path.name)
    longer = [*found, *inline, *synopses()]
    for cmd, where in inline.items():
        named = len(cmd.split()) <= 3 and not any(w.startswith("-") for w in cmd.split())
        if not (named and any(other != cmd and other.startswith(cmd + " ") for other in longer)):
            found.setdefault(cmd, []).extend(where)
    return found


def _bare(cmd: str) -> str:
    """The command without the VAR=value words before it."""
    return re.sub("^" + _ENV, "", cmd)


def _is_command(cmd: str) -> bool:
    first = _bare(cmd).split()[0]
    return first in ("cancelwatch", "make", "streamlit", "python") or first.startswith(".venv/")


def synopses() -> list[str]:
    """The usage lines of the command reference and the examples with options in brackets."""
    out = []
    for path in READMES:
        text = path.read_text()
        for m in _INLINE.finditer(text):
            cmd = " ".join(m.group(1).split())
            if cmd.startswith("cancelwatch ") and _PLACEHOLDER.search(cmd):
                out.append(cmd)
        for block in re.findall(r"^```[a-z]*\n(.*?)^```", text, flags=re.M | re.S):
            out += [c for c in _join(block.splitlines()) if c.startswith("cancelwatch ") and _PLACEHOLDER.search(c)]
    return out


def words(cmd: str, ports: dict[int, int] | None = None) -> list[str]:
    """The command's words as a shell splits them, with the README's ports swapped for the test's."""
    text = cmd
    for old, new in (ports or {}).items():
        text = re.sub(rf"(?<=[:= ]){old}(?!\d)", str(new), text)
    return shlex.split(text)
