"""What a reader copies is what a test runs: every command of the READMEs is run as written, checked for
its command line (remote hosts, a GPU), or said why not (tests/readme_commands.py holds the tables).

This file: the accounting, the command lines, and the dashboard started the ways the README and the
Makefile give, seen in a real browser (no engine: the shipped sample run). The commands that need the
embedded engines are in tests/test_readme_commands_engine.py.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
from typer.main import get_command

from cancelwatch.analysis.anatomy import cancel_summary
from cancelwatch.analysis.explain import pick_story_cancel
from cancelwatch.analysis.facts import VIEW_METRICS
from cancelwatch.analysis.verdicts import judge_run
from cancelwatch.cli import app
from cancelwatch.collectors.engines.lifecycle import free_port
from cancelwatch.runstore.reader import load_run
from tests.processes import listening_ips
from tests.readme_commands import COMMAND_LINE_ONLY, NOT_RUN, ROOT, RUN, readme_commands, synopses, words
from tests.test_dashboard_browser import TABLE_ROWS, TIMELINE, browser  # noqa: F401 - a fixture

VENV_BIN = Path(sys.executable).parent  # the venv's console scripts: `cancelwatch`, `streamlit`
SAMPLE = ROOT / "dashboard" / "sample" / "sample.db"
MAKEFILE_TARGETS = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), flags=re.M))


# --- the accounting -------------------------------------------------------------------------------------

def test_every_readme_command_is_run_checked_or_said_why():
    given = readme_commands()
    tables = [RUN, COMMAND_LINE_ONLY, NOT_RUN]
    unaccounted = [c for c in given if sum(c in t for t in tables) != 1]
    assert not unaccounted, f"README commands in none (or several) of tests/readme_commands.py's tables: {unaccounted}"
    # a table names nothing the READMEs (or, for make, the Makefile) no longer give
    stale = [c for t in tables for c in t if c not in given and not (
        c.startswith("make ") and c.split()[1] in MAKEFILE_TARGETS)]
    assert not stale, f"tests/readme_commands.py names commands the READMEs do not give: {stale}"
    # every test named in RUN exists
    for cmd, where in RUN.items():
        file, func = where.split("::")
        tree = ast.parse((ROOT / "tests" / file).read_text())
        names = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        assert func in names, f"{cmd!r}: no {func} in tests/{file}"


def test_the_accounting_sees_a_new_command(tmp_path, monkeypatch):
    """The check above can fail: a README with a command the tables do not know, in a block and inline."""
    from tests import readme_commands as rc

    readme = tmp_path / "README.md"
    readme.write_text("Run it:\n\n```sh\ncancelwatch summary latest   # the last run\ncancelwatch runs \\\n"
                      "  --store runs/x.db\n```\n\nor `cancelwatch export 3 --parquet out` and "
                      "`cancelwatch report [RUN] --json` (a synopsis).\n")
    monkeypatch.setattr(rc, "READMES", (readme,))
    found = rc.readme_commands()
    assert set(found) == {"cancelwatch summary latest", "cancelwatch runs --store runs/x.db",
                          "cancelwatch export 3 --parquet out"}, found
    assert rc.synopses() == ["cancelwatch report [RUN] --json"]
    assert not set(found) & {*RUN, *COMMAND_LINE_ONLY, *NOT_RUN}


def _command(argv: list[str]):
    """The (typer's own click) command the words name after `cancelwatch`, and the words left for its options."""
    cmd = get_command(app)
    rest = list(argv)
    while hasattr(cmd, "commands") and rest and rest[0] in cmd.commands:
        cmd = cmd.commands[rest.pop(0)]
    return cmd, rest


@pytest.mark.parametrize("cmd", sorted(COMMAND_LINE_ONLY))
def test_remote_and_gpu_commands_parse_as_meant(cmd):
    command, rest = _command(words(cmd)[1:])
    ctx = command.make_context(words(cmd)[0], rest)  # the real parser: a flag that is gone fails here
    for name, value in COMMAND_LINE_ONLY[cmd].items():
        assert ctx.params[name] == value, (name, ctx.params[name])


@pytest.mark.parametrize("synopsis", sorted(set(synopses())))
def test_every_option_of_a_synopsis_exists(synopsis):
    command, rest = _command(words(synopsis.replace("\\|", "|"))[1:])
    options = {o for p in command.params for o in (*p.opts, *p.secondary_opts)}
    named = {w.strip("[]").split("=")[0] for w in rest if w.strip("[").startswith("-") and w.strip("[]") != "--"}
    missing = named - options
    assert not missing, f"{synopsis}: `cancelwatch {command.name}` has no {sorted(missing)}"


# --- the dashboard, started the README's ways, in a real browser -----------------------------------------

def start_page(args: list[str], cwd: Path, env: dict[str, str], port: int, what: str) -> subprocess.Popen:
    """Start the page with `args`; return once it answers /_stcore/health, listening on 127.0.0.1 only."""
    proc = subprocess.Popen(args, cwd=cwd, env={**os.environ, **env}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/_stcore/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.3)
    else:
        stop_page(proc)
        pytest.fail(f"{what} did not serve {url} within 120 s (exit {proc.returncode}): "
                    f"{proc.stdout.read().decode(errors='replace')[-2000:]}")
    listening = listening_ips(proc.pid)
    # dashboard/.streamlit/config.toml binds it to loopback (the same file keeps tracebacks out of the page)
    assert listening == {"127.0.0.1"}, (what, listening)
    return proc


def stop_page(proc: subprocess.Popen) -> str:
    """Ctrl-C the page (its whole process group) and return what it printed."""
    try:
        os.killpg(proc.pid, signal.SIGINT)
    except ProcessLookupError:
        pass
    try:
        out, _ = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=10)
    return out.decode(errors="replace")


def assert_page_shows_the_run(browser, url: str, store: Path, run_id: int, shot: Path) -> None:
    """The page at `url` shows the run's summary, its timeline with every cancel's timepoints, and its verdict
    table row for row; no error, no traceback."""
    run = load_run(store, run_id, metrics=VIEW_METRICS)
    verdicts = judge_run(run)
    assert verdicts, f"run {run_id} of {store} has no cancels to show"
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(url, timeout=120_000)
    # a figure, or the page's own error (then said at once below, not after the figure's deadline)
    page.wait_for_function("() => document.querySelector('.js-plotly-plot .main-svg') || "
                           "document.body.innerText.includes('This app has encountered an error') || "
                           "document.querySelector('[data-testid=\"stException\"]')", timeout=180_000)
    text = page.inner_text("body")
    assert "This app has encountered an error" not in text and "Traceback" not in text, text[:3000]
    page.wait_for_function(f"() => document.querySelectorAll('.js-plotly-plot').length > {TIMELINE} && "
                           f"document.querySelectorAll('.js-plotly-plot')[{TIMELINE}]"
                           ".querySelectorAll('g.trace.scatter path.point').length > 0", timeout=120_000)
    page.wait_for_function(f"() => ({TABLE_ROWS})().length > 1", timeout=120_000)
    page.screenshot(path=str(shot), full_page=True)
    text = page.inner_text("body")
    for bad in ("This app has encountered an error", "Traceback", "ModuleNotFoundError", "Error:"):
        assert bad not in text, (bad, text[:3000])
    # the summary: the story cancel's sentence with the run's own numbers
    summary = cancel_summary(run, pick_story_cancel(verdicts))
    assert summary["sentence"][0].upper() + summary["sentence"][1:] in text, text[:2000]
    # the timeline: a marker for every timepoint of every cancel
    points = page.evaluate(f"() => document.querySelectorAll('.js-plotly-plot')[{TIMELINE}]"
                           ".querySelectorAll('g.trace.scatter path.point').length")
    assert points >= sum(t is not None for v in verdicts for t in v.timepoints.values())
    # the verdict table: the run's cancels, row for row
    rows = page.evaluate(TABLE_ROWS)
    head = rows[0]
    shown = [(r[head.index("request_id")], r[head.index("verdict")]) for r in rows[1:]]
    assert shown == [(v.request_id, v.verdict) for v in verdicts], rows
    page.close()


@pytest.fixture
def store_folder(tmp_path) -> Path:
    """A store folder with the shipped sample run as runs/cancelwatch.db (the README's URL names it)."""
    folder = tmp_path / "runs"
    folder.mkdir()
    shutil.copy(SAMPLE, folder / "cancelwatch.db")
    return folder


@pytest.mark.browser
def test_the_console_script_serves_the_page_from_the_root(browser, store_folder, tmp_path):
    """`streamlit run dashboard/app.py` with the venv's console script, from the repository root: the
    console script puts only dashboard/ on sys.path, so the page's imports must come from the install."""
    cmd = next(c for c in RUN if c.startswith("streamlit "))
    port = free_port()
    argv = [str(VENV_BIN / "streamlit"), *words(cmd)[1:], "--server.port", str(port)]
    proc = start_page(argv, ROOT, {"CANCELWATCH_STORE_DIR": str(store_folder)}, port, cmd)
    try:
        assert_page_shows_the_run(browser, f"http://127.0.0.1:{port}/?store=cancelwatch.db&run=latest",
                                  store_folder / "cancelwatch.db", 1, tmp_path / "root.png")
    finally:
        log = stop_page(proc)
    assert "Traceback" not in log and "ModuleNotFoundError" not in log, log[-3000:]


@pytest.mark.browser
def test_the_page_started_from_another_folder_works_the_same(browser, store_folder, tmp_path):
    """From another working directory with the script's full path: the same page, on 127.0.0.1, and the
    docs' URL (docs/dashboard.md: `?store=runs/cancelwatch.db&run=latest`) read from that directory's runs/."""
    port = free_port()
    argv = [str(VENV_BIN / "streamlit"), "run", str(ROOT / "dashboard" / "app.py"), "--server.port", str(port)]
    # no store folder named: the page reads ./runs of the directory it was started in
    proc = start_page(argv, tmp_path, {"CANCELWATCH_STORE_DIR": ""}, port, "streamlit run /path/to/app.py")
    try:
        url = next(c for c in Path(ROOT / "docs" / "dashboard.md").read_text().splitlines()
                   if "?store=" in c and "8501" in c)
        url = url.lstrip("# ").replace("8501", str(port))
        assert url.endswith("/?store=runs/cancelwatch.db&run=latest"), url
        assert_page_shows_the_run(browser, url, store_folder / "cancelwatch.db", 1, tmp_path / "elsewhere.png")
    finally:
        log = stop_page(proc)
    assert "Traceback" not in log and "ModuleNotFoundError" not in log, log[-3000:]


@pytest.mark.browser
def test_make_dashboard_serves_the_page(browser, store_folder, tmp_path):
    port = free_port()
    proc = start_page(["make", "--no-print-directory", "dashboard", f"DASHBOARD_PORT={port}"], ROOT,
                      {"CANCELWATCH_STORE_DIR": str(store_folder)}, port, "make dashboard")
    try:
        assert_page_shows_the_run(browser, f"http://127.0.0.1:{port}/?store=cancelwatch.db&run=latest",
                                  store_folder / "cancelwatch.db", 1, tmp_path / "make-dashboard.png")
    finally:
        log = stop_page(proc)
    assert "Traceback" not in log, log[-3000:]
    assert not [p for p in psutil.process_iter(["cmdline"]) if str(port) in " ".join(p.info["cmdline"] or [])
                and "streamlit" in " ".join(p.info["cmdline"] or [])], "make dashboard left the page running"
