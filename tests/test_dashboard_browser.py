"""The served dashboard in a real browser: Debian's headless Chromium driven by Playwright."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from PIL import Image

from cancelwatch.analysis.anatomy import cancel_summary
from cancelwatch.analysis.cancel_table import VERDICT_COLOURS
from cancelwatch.analysis.explain import pick_story_cancel
from cancelwatch.analysis.facts import VIEW_METRICS
from cancelwatch.analysis.verdicts import judge_run
from cancelwatch.dashboard import recording
from cancelwatch.collectors.engines.lifecycle import free_port
from cancelwatch.runstore.reader import load_run
from tests.conftest import cli_popen, wait_recording
from tests.processes import listening_ips

ROOT = Path(__file__).resolve().parents[1]
# every test here drives Chromium; the ones that record from the engine are marked `engine` as well
# (tests/conftest.py marks them by the engine fixtures they use)
pytestmark = pytest.mark.browser

CHROMIUM = "/usr/bin/chromium"
# the machine has no internet: without these Chromium keeps trying to reach Google's hosts
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture
def served(tmp_path):
    """Start `streamlit run dashboard/app.py` on a free port with the store folder in tmp_path."""
    procs = []

    def start(store_dir: Path, **extra_env: str) -> str:
        port = free_port()
        env = {**os.environ, "CANCELWATCH_STORE_DIR": str(store_dir), **extra_env}
        # the README's way: the venv's `streamlit` console script, from the root (not `python -m streamlit`,
        # which puts the working directory on sys.path and hid a page that could not import itself)
        proc = subprocess.Popen([str(Path(sys.executable).with_name("streamlit")), "run", "dashboard/app.py",
                                 "--server.port", str(port)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT)
        procs.append(proc)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/_stcore/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        else:
            proc.kill()
            pytest.fail(f"streamlit did not come up: {proc.stdout.read().decode(errors='replace')[-2000:]}")
        # dashboard/.streamlit/config.toml binds the server to loopback only
        listening = listening_ips(proc.pid)
        assert listening and listening <= {"127.0.0.1"}, listening
        return url

    yield start
    for proc in procs:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture
def browser(tmp_path):
    if not Path(CHROMIUM).exists():
        pytest.fail("no /usr/bin/chromium: `make test` installs Debian's chromium (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        try:
            yield b
        finally:
            b.close()


# per trace of the first figure, what plotly drew in its SVG: marker points and the length of the line path
# the page's figures, top to bottom: the summary bars, the timeline, the story's zoom, the capacity drawing
TIMELINE = 1
DRAWN = """() => Array.from(document.querySelectorAll('.js-plotly-plot')[1].querySelectorAll('g.trace.scatter'))
    .map(g => ({name: (g.__data__[0].trace.meta || {}).name || g.__data__[0].trace.name, points: g.querySelectorAll('path.point').length,
                line: Array.from(g.querySelectorAll('path.js-line'))
                           .reduce((n, p) => n + (p.getAttribute('d') || '').length, 0)}))"""
# the verdict table's cells as text: the grid paints a canvas and keeps an accessible table beside it.
# The page holds several data frames (run facts, capacity, ...) that render in their own time: pick the
# one whose header names the request and the verdict, or none yet
TABLE_ROWS = """() => { for (const e of document.querySelectorAll('[data-testid="stDataFrame"]')) {
        const t = e.querySelector('table');
        if (!t || e.offsetParent === null) continue;
        const rows = Array.from(t.querySelectorAll('tr')).map(r => Array.from(r.querySelectorAll('th,td'))
                                                                       .map(c => c.innerText.trim()));
        if (rows.length > 1 && rows[0].includes('request_id') && rows[0].includes('verdict')) return rows;
    } return []; }"""


def pixels(png: Path, colour: str) -> int:
    """How many pixels of a screenshot have exactly this #rrggbb colour."""

    rgb = tuple(int(colour[i:i + 2], 16) for i in (1, 3, 5))
    with Image.open(png) as im:
        return dict((c, n) for n, c in im.convert("RGB").getcolors(maxcolors=1 << 24)).get(rgb, 0)


def test_the_served_dashboard_shows_the_timeline_and_the_verdict_table(proxy_and_direct_runs, served, browser,
                                                                        tmp_path):

    # the recordings come first (fixture order): a browser idling beside them takes CPU from the engine
    store, *_ = proxy_and_direct_runs
    run = load_run(store, 1, metrics=VIEW_METRICS)
    verdicts = judge_run(run)
    assert [v.verdict for v in verdicts] == ["leaked", "leaked"]
    url = served(store.parent)
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(f"{url}/?store={store.name}&run=1", timeout=60_000)
    page.wait_for_selector(".js-plotly-plot .main-svg", timeout=90_000)
    # the verdict table (the first data frame sits in the collapsed "Run facts" expander)
    page.wait_for_function("() => Array.from(document.querySelectorAll('[data-testid=\"stDataFrame\"]'))"
                           ".some(e => e.offsetParent !== null)", timeout=60_000)
    text = page.inner_text("body")
    assert "Why is GPU memory still high?" in text and f"Cancels ({len(verdicts)})" in text
    assert "Traceback" not in text
    # the summary bars, the timeline, the story's zoomed figure, the capacity drawing
    page.wait_for_function("() => document.querySelectorAll('.js-plotly-plot').length == 4", timeout=60_000)
    # the five-second summary with the run's own numbers, above everything else
    summary = cancel_summary(run, pick_story_cancel(verdicts))
    headline = summary["sentence"][0].upper() + summary["sentence"][1:]
    assert headline in text and text.index(headline) < text.index("Why is GPU memory still high?"), text[:2000]
    # the timeline as drawn: a marker at every timepoint of every cancel, in its verdict's trace, and
    # the KV usage and running lines of the target
    page.wait_for_function(f"() => document.querySelectorAll('.js-plotly-plot')[{TIMELINE}]"
                           ".querySelectorAll('g.trace.scatter path.point').length > 0", timeout=30_000)
    drawn = {d["name"]: d for d in page.evaluate(DRAWN)}
    # the memory anatomy, drawn: the KV pool's used and free parts and the rest under the measured total
    for name in ("engine KV pool: used", "engine KV pool: free", "engine other", "engine process memory"):
        assert drawn[name]["line"] > 0, (name, sorted(drawn))
    for verdict in {v.verdict for v in verdicts}:
        n = sum(t is not None for v in verdicts if v.verdict == verdict for t in v.timepoints.values())
        assert drawn[f"cancel: {verdict}"]["points"] == n, drawn
    assert drawn["KV usage t0"]["line"] > 0 and drawn["running t0"]["line"] > 0, drawn
    # the verdict table: one row per cancel, with its request id and verdict
    page.wait_for_function(f"() => ({TABLE_ROWS})().length > 1", timeout=60_000)
    rows = page.evaluate(TABLE_ROWS)
    head = rows[0]
    shown = [(r[head.index("request_id")], r[head.index("verdict")]) for r in rows[1:]]
    assert shown == [(v.request_id, v.verdict) for v in verdicts], rows
    # a cell with nothing in it is blank or a dash, never a word for nothing
    assert not [c for r in rows[1:] for c in r if c.lower() in ("none", "nan", "null", "<na>")], rows
    # and as a person sees it: the KV usage line in its colour on the page, and each verdict cell of the
    # table filled with the verdict's colour (a blank or failed page has none of either)
    page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)  # the summary on top
    shot = tmp_path / "timeline.png"
    timeline = page.locator(".js-plotly-plot").nth(TIMELINE)
    timeline.scroll_into_view_if_needed()
    timeline.screenshot(path=str(shot))
    assert pixels(shot, "#e45756") > 100, "no KV usage line in the screenshot"
    grid = page.locator('[data-testid="stDataFrame"]').filter(has_text="request_id").first
    grid.scroll_into_view_if_needed()
    grid.screenshot(path=str(tmp_path / "verdicts.png"))
    assert pixels(tmp_path / "verdicts.png", VERDICT_COLOURS["leaked"]) > 500 * len(verdicts)


@pytest.mark.slow
def test_a_live_run_is_followed_until_it_completes(served, browser, engine, engine_home, tmp_path):
    folder = tmp_path / "runs"
    folder.mkdir()
    store = folder / "live.db"
    url = served(folder)  # before the recording starts: a slow start of the page must not outlast the run
    # the page at the live store's address before there is one (it shows the sample run, drawn): how long this
    # machine takes to draw it is what the run must outlast, with room, once the live page is opened
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    t0 = time.monotonic()
    page.goto(f"{url}/?store=live.db", timeout=60_000)
    page.wait_for_selector(".js-plotly-plot .main-svg", timeout=90_000)
    page_s = time.monotonic() - t0
    duration_s = max(30.0, 10.0 + 3 * page_s)
    proc = cli_popen("sample", "--target", engine.url, "--duration", f"{duration_s:.0f}", "--store", str(store),
                     "--name", "live", home=engine_home)
    try:
        wait_recording(store, ok_scrapes=1)
        t1 = time.monotonic()
        page.goto(f"{url}/?store=live.db", timeout=60_000)
        page.wait_for_selector(".js-plotly-plot .main-svg", timeout=90_000)
        text = page.inner_text("body")
        assert "still being recorded" in text, (f"the live page drew in {time.monotonic() - t1:.1f} s (the page "
                                                f"before it in {page_s:.1f} s), the run lasts {duration_s:.0f} s",
                                                text[:2000])
        # the fragment reloads every 2 s; when the recorder finishes, the page shows it without a reload
        page.wait_for_function("() => document.body.innerText.includes('completed') && "
                               "!document.body.innerText.includes('still being recorded')",
                               timeout=(duration_s + 60) * 1000)
        page.screenshot(path=str(tmp_path / "live.png"), full_page=True)
    finally:
        out, err = proc.communicate(timeout=duration_s + 60)
    assert proc.returncode == 0, err


def test_clicking_a_row_of_the_verdict_table_zooms_the_timeline(served, browser, tmp_path):
    folder = tmp_path / "runs"
    folder.mkdir()
    shutil.copy(ROOT / "dashboard" / "sample" / "sample.db", folder / "cw.db")
    url = served(folder)
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(f"{url}/?store=cw.db", timeout=60_000)
    page.wait_for_selector(".js-plotly-plot .main-svg", timeout=90_000)
    x_range = f"() => document.querySelectorAll('.js-plotly-plot')[{TIMELINE}].layout.xaxis.range"
    whole = page.evaluate(x_range)
    grid = page.locator('[data-testid="stDataFrame"]').nth(1)
    grid.scroll_into_view_if_needed()
    box = grid.bounding_box()
    # the grid is a canvas: the first data row sits below the header, the selection box at the left
    page.mouse.click(box["x"] + 14, box["y"] + 35 + 17)
    page.wait_for_function(f"() => {{ const r = ({x_range})(); return r && r[1] - r[0] < 40; }}", timeout=60_000)
    lo, hi = page.evaluate(x_range)
    assert hi - lo < 40 and (whole is None or (whole[1] - whole[0]) > hi - lo)
    # the zoom box names the first cancel: read once the page has drawn the rerun (the timeline's range can be
    # drawn before the box shows its new value)
    zoom_box = page.locator('[data-testid="stSelectbox"]').filter(has_text="Zoom the timeline to")
    deadline = time.monotonic() + 30
    while not zoom_box.locator("input").input_value().startswith("#1 ") and time.monotonic() < deadline:
        page.wait_for_timeout(100)
    assert zoom_box.locator("input").input_value().startswith("#1 ")


@pytest.mark.slow
def test_a_recording_started_from_the_form_ends_in_its_verdict_table(served, browser, engine, engine_home,
                                                                      tmp_path):
    """The sidebar form starts the real `cancelwatch record` against the embedded engine; the page follows
    the run while it records and shows its verdict table when it ends."""
    folder = tmp_path / "runs"
    folder.mkdir()
    url = served(folder, CANCELWATCH_HOME=str(engine_home))
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(url, timeout=60_000)
    page.wait_for_selector("text=Record from this page", timeout=90_000)
    page.get_by_label("Target URL").fill(engine.url)
    page.get_by_label("Scenarios (built-in names or a suite, comma-separated)").fill("decode")
    page.get_by_role("button", name="Start recording").click()
    # the run appears in the store and the page follows it to its end
    page.wait_for_function("() => document.body.innerText.includes('from the page')", timeout=60_000)
    page.screenshot(path=str(tmp_path / "recording-started.png"), full_page=True)
    page.wait_for_function(f"() => ({TABLE_ROWS})().length > 1", timeout=180_000)
    page.wait_for_function("() => document.body.innerText.includes('completed') && "
                           "!document.body.innerText.includes('still being recorded')", timeout=180_000)
    page.wait_for_function(f"() => ({TABLE_ROWS})().some(r => r.includes('released'))", timeout=60_000)
    page.screenshot(path=str(tmp_path / "recorded-from-the-page.png"), full_page=True)
    run = load_run(folder / "cancelwatch.db", "latest")
    assert run.info["status"] == "completed" and run.info["name"] == "from the page"
    rows = page.evaluate(TABLE_ROWS)
    head = rows[0]
    shown = [(r[head.index("request_id")], r[head.index("verdict")]) for r in rows[1:]]
    assert shown == [(v.request_id, v.verdict) for v in judge_run(run)] and shown[0][1] == "released", rows
    # one at a time: the next one may start once `record` has exited. The page shows the run's final state
    # from the store as soon as its status is written; the process still prints its report after that
    deadline = time.monotonic() + 60
    while recording.current(folder) is not None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert recording.current(folder) is None, f"still recording 60 s after the page showed the run's end: " \
                                              f"{recording.current(folder)}"
