"""Untrusted text stays text: a run whose run name, model name, scenario names and target label carry
HTML and script is shown inert by the HTML report, the dashboard (in a real browser) and the rendered
notebooks. The run is the shipped sample recording, copied through the run store's writer with those
strings replaced, so every record has the shape a real recording gives it."""

from __future__ import annotations

import json
import time
from html.parser import HTMLParser
from pathlib import Path

import pytest

from cancelwatch.analysis.facts import VIEW_METRICS, run_facts
from cancelwatch.analysis.verdicts import judge_run
from cancelwatch.runstore.reader import load_run
from cancelwatch.runstore.records import EventRecord, GapRecord, LedgerRecord, Sample, ScrapeRecord
from cancelwatch.runstore.writer import LEDGER_COLUMNS, StoreWriter, create_run, finish_run, open_store, set_run_json
from tests import test_dashboard_browser as real_browser
from tests.conftest import cli
from tests.test_dashboard_browser import TABLE_ROWS

# the real-browser fixtures of the dashboard's browser tests: Debian's Chromium, `streamlit run` on 127.0.0.1
browser = real_browser.browser
served = real_browser.served

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "dashboard" / "sample" / "sample.db"

SCRIPT = "<script>window.__pwned=1</script>"
IMG = '<img src=x onerror="window.__pwned=2">'
RUN_NAME = f"evil run {SCRIPT}"
MODEL = f"tiny{IMG}"
LABEL = f"t0{IMG}"


def scenario_name(name: str) -> str:
    return f"{name}{SCRIPT}{IMG}"


def _relabel(value, table: dict):
    """Every key and string value found in `table` replaced, through nested JSON."""
    if isinstance(value, dict):
        return {table.get(k, k): _relabel(v, table) for k, v in value.items()}
    if isinstance(value, list):
        return [_relabel(v, table) for v in value]
    return table.get(value, value) if isinstance(value, str) else value


def write_hostile_run(path: str | Path) -> int:
    """Copy the sample run into the store at `path` with hostile run, model, scenario and target names."""
    src = load_run(SAMPLE, "latest")
    info = src.info
    scenarios = sorted({*src.ledger["scenario"].dropna()})
    names = {s: scenario_name(s) for s in scenarios}
    table = {"t0": LABEL, "tiny": MODEL}
    settings = _relabel(info["settings"], table)
    settings["name"] = RUN_NAME
    settings["extra"]["scenarios"] = [names.get(s, s) for s in settings["extra"]["scenarios"]]
    engine = _relabel(info["engine"], table)
    for e in engine.get("targets", {}).values():
        e["model"] = MODEL
    con = open_store(path)
    rid = create_run(con, name=RUN_NAME, targets=_relabel(info["targets"], table), engine=engine,
                     settings=settings, wall_ns=int(info["started_wall_ns"]),
                     mono_ns=int(info["started_mono_ns"]))
    set_run_json(con, rid, "cache", _relabel(info["cache"], table))
    con.commit()
    writer = StoreWriter(con, rid)
    by_scrape = {k: g for k, g in src.samples.groupby("scrape_id", sort=False)}
    for sc in src.scrapes.itertuples(index=False):
        rows = by_scrape.get(sc.id)
        samples = [] if rows is None else [
            Sample(r.source, r.metric, r.value,
                   tuple(sorted((k, table.get(v, v) if k == "model_name" else v)
                                for k, v in json.loads(r.labels).items())),
                   int(r.wall_ns), int(r.mono_ns))
            for r in rows.itertuples(index=False)]
        writer.put(ScrapeRecord(sc.source, table.get(sc.target, sc.target), int(sc.tick), int(sc.wall_ns),
                                int(sc.mono_ns), int(sc.duration_ns), bool(sc.ok), samples))
    for g in src.gaps.itertuples(index=False):
        writer.put(GapRecord(g.source, table.get(g.target, g.target), g.kind, int(g.start_wall_ns),
                             int(g.start_mono_ns), int(g.end_mono_ns), int(g.ticks), g.detail))
    for e in src.events.itertuples(index=False):
        data = _relabel(json.loads(e.data), table)
        if "scenario" in data:
            data["scenario"] = names.get(data["scenario"], data["scenario"])
        writer.put(EventRecord(e.kind, int(e.wall_ns), int(e.mono_ns), e.request_id, data))
    for row in src.ledger.to_dict("records"):
        fields = {c: (None if row[c] != row[c] else row[c]) for c in LEDGER_COLUMNS}  # NaN -> None
        for c in ("sent_mono_ns", "first_token_mono_ns", "cancel_mono_ns", "closed_mono_ns"):
            fields[c] = None if fields[c] is None else int(fields[c])
        fields["scenario"] = names.get(fields["scenario"], fields["scenario"])
        writer.put(LedgerRecord(**fields))
    writer.close()
    finish_run(con, rid, info["status"], _relabel(info["stats"], table), int(info["ended_wall_ns"]))
    con.close()
    return rid


# ---------------------------------------------------------------------------------------------------------
# what "inert" means, in the file and in the browser

class _Elements(HTMLParser):
    """Every element's attributes, and every script element's text."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.attrs: list[tuple[str, dict]] = []
        self.scripts: list[str] = []
        self._in_script = False

    def handle_starttag(self, tag, attrs):
        self.attrs.append((tag, dict(attrs)))
        if tag == "script":
            self._in_script = True
            self.scripts.append("")

    def handle_endtag(self, tag):
        if tag == "script":
            self._in_script = False

    def handle_data(self, data):
        if self._in_script:
            self.scripts[-1] += data


def assert_inert_html(html: str) -> None:
    """No script element and no event-handler attribute came from the data, and the text is there escaped."""
    assert "&lt;script&gt;window.__pwned=1&lt;/script&gt;" in html, "the hostile text should be shown, escaped"
    assert "<script>window.__pwned" not in html
    assert "<img src=x onerror" not in html
    doc = _Elements()
    doc.feed(html)
    live_handlers = [(tag, a) for tag, a in doc.attrs for k, v in a.items()
                     if k.startswith("on") and "__pwned" in (v or "")]
    assert not live_handlers, live_handlers[:3]
    assert not [s for s in doc.scripts if s.strip().startswith("window.__pwned")]


NOT_RUN = "() => typeof window.__pwned === 'undefined'"


# every image of the document has settled (loaded or broken), and a task later: a broken image's error event
# is queued as it breaks, so by then any onerror has run
IMAGES_SETTLED = """() => Array.from(document.images).every(i => i.complete)
    ? new Promise(r => setTimeout(() => r(true), 0)) : false"""


def assert_inert_page(page, *literals: str, timeout_s: float = 60) -> None:
    # the literals shown (the page has rendered what it is checked on), and then every image settled: the
    # onerror of an image made from the data fires once the request for `x` has failed, however long that
    # takes the machine (a fixed 1.5 s was all it had)
    deadline, text = time.monotonic() + timeout_s, ""
    while time.monotonic() < deadline:
        text = page.inner_text("body")
        if all(literal in text for literal in literals):
            break
        page.wait_for_timeout(100)
    for literal in literals:
        assert literal in text, (literal, f"not on the page within {timeout_s:.0f} s", text[:3000])
    # what renders just after (a component's iframe) has a moment to appear too: a negative check looks a while
    page.wait_for_timeout(1500)
    for frame in page.frames:  # the page and any iframe in it (a component's HTML runs in one)
        frame.wait_for_function(IMAGES_SETTLED, timeout=max(1.0, deadline - time.monotonic()) * 1000)
        assert frame.evaluate(NOT_RUN), f"the data's script ran in {frame.url}: window.__pwned = " \
                                        f"{frame.evaluate('window.__pwned')}"


@pytest.fixture(scope="module")
def hostile_store(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("hostile")
    store = folder / "evil.db"
    write_hostile_run(store)
    return store


def test_the_hostile_run_is_the_sample_run_under_other_names(hostile_store):
    """The copy keeps the recording: same cancels, same verdicts; only the names differ."""
    sample = load_run(SAMPLE, "latest", metrics=VIEW_METRICS)
    evil = load_run(hostile_store, "latest", metrics=VIEW_METRICS)
    assert evil.info["name"] == RUN_NAME and [t["label"] for t in evil.info["targets"]] == [LABEL]
    assert run_facts(evil)["served_model"] == MODEL
    ours, theirs = judge_run(evil), judge_run(sample)
    assert [(v.verdict, v.request_id) for v in ours] == [(v.verdict, v.request_id) for v in theirs]
    assert [v.scenario for v in ours] == [scenario_name(v.scenario) for v in theirs]
    assert len(evil.samples) == len(sample.samples)


def test_the_html_report_shows_the_text_inert(hostile_store, tmp_path):
    out = tmp_path / "report.html"
    res = cli("report", "1", "--store", str(hostile_store), "--html", str(out))
    assert res.returncode in (0, 1), res.stderr
    assert_inert_html(out.read_text())


@pytest.mark.browser
def test_the_html_report_in_the_browser(hostile_store, browser, tmp_path):
    out = tmp_path / "report.html"
    res = cli("report", "1", "--store", str(hostile_store), "--html", str(out))
    assert res.returncode in (0, 1), res.stderr
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(out.as_uri())
    page.wait_for_selector(".js-plotly-plot .main-svg", timeout=60_000)
    assert_inert_page(page, RUN_NAME, scenario_name("burst"), MODEL, LABEL)
    # plotly draws the names as SVG text, the tags as characters
    legend = page.evaluate("() => Array.from(document.querySelectorAll('g.legend')).map(g => g.textContent).join(' ')")
    assert f"KV usage {LABEL}" in legend, legend


@pytest.mark.browser
def test_the_dashboard_in_the_browser(hostile_store, served, browser):
    url = served(hostile_store.parent)
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(f"{url}/?store={hostile_store.name}&run=1", timeout=60_000)
    page.wait_for_function("() => document.querySelectorAll('.js-plotly-plot').length == 4", timeout=120_000)
    page.wait_for_function(f"() => ({TABLE_ROWS})().length > 1", timeout=60_000)
    page.get_by_text("Run facts and sampling").click()  # the expander with the target's label
    # the run's name in the title, the model in the facts, and the story's sentence (Markdown) naming the
    # scenario of the cancel it tells: each as the characters the run holds
    assert_inert_page(page, RUN_NAME, MODEL, f"The cancelled request ({scenario_name('burst')}, ")
    rows = page.evaluate(TABLE_ROWS)
    head = rows[0]
    assert {r[head.index("scenario")] for r in rows[1:]} >= {scenario_name("burst"), scenario_name("decode")}, rows
    legend = page.evaluate("() => Array.from(document.querySelectorAll('g.legend')).map(g => g.textContent).join(' ')")
    assert f"KV usage {LABEL}" in legend, legend


NOTEBOOKS = ["vram_plateau", "capacity_review"]


@pytest.fixture(scope="module")
def rendered_notebooks(hostile_store, tmp_path_factory) -> dict[str, Path]:
    """Each notebook run by papermill on the hostile run and rendered by nbconvert, as `cancelwatch notebook`."""
    folder = tmp_path_factory.mktemp("hostile-notebooks")
    out = {}
    for name in NOTEBOOKS:
        out[name] = folder / f"{name}.html"
        res = cli("notebook", name, "--store", str(hostile_store), "--html", str(out[name]), timeout=300)
        assert res.returncode == 0, res.stderr
    return out


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_the_rendered_notebooks_show_the_text_inert(rendered_notebooks, name):
    assert_inert_html(rendered_notebooks[name].read_text())


@pytest.mark.browser
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_the_rendered_notebooks_in_the_browser(rendered_notebooks, browser, name):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(rendered_notebooks[name].as_uri())
    page.wait_for_selector(".js-plotly-plot .main-svg", timeout=60_000)
    assert_inert_page(page, RUN_NAME)
