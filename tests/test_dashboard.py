"""The dashboard, through Streamlit's AppTest: every section on the shipped sample run and on runs the
tests record from the real engine; the store-folder guard; live follow; compare."""

from __future__ import annotations

import base64
import json
import os
import shutil
import sqlite3
from pathlib import Path

import numpy as np
import pytest
from streamlit.testing.v1 import AppTest

from cancelwatch.analysis.anatomy import cancel_summary
from cancelwatch.analysis.cancel_table import cancel_window
from cancelwatch.analysis.explain import memory_story, pick_story_cancel
from cancelwatch.analysis.facts import VIEW_METRICS
from cancelwatch.analysis.verdicts import judge_run
from cancelwatch.dashboard import recording
from cancelwatch.runstore.reader import load_run
from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[1]
APP = str(ROOT / "dashboard" / "app.py")
SAMPLE = ROOT / "dashboard" / "sample" / "sample.db"
SECTIONS = ["Timeline", "Why is GPU memory still high?", "Capacity", "Export"]


def app(store_dir: Path, monkeypatch, **params) -> AppTest:
    monkeypatch.setenv("CANCELWATCH_STORE_DIR", str(store_dir))
    monkeypatch.chdir(ROOT)
    at = AppTest.from_file(APP, default_timeout=180)
    for k, v in params.items():
        at.query_params[k] = v
    return at.run()


SUMMARY, TIMELINE, STORY, CAPACITY = range(4)  # the page's charts, top to bottom


def figure(at: AppTest, i: int = TIMELINE) -> dict:
    return json.loads(at.get("plotly_chart")[i].proto.spec)


def full_name(trace: dict) -> str | None:
    """A timeline trace's full name (analysis/timeline.py trace_name): its legend entry names only its kind."""
    return (trace.get("meta") or {}).get("name", trace.get("name"))


def values(arr):
    """A trace's x or y as plotly's JSON has it: a list, or a typed array ({"dtype", "bdata"})."""


    if isinstance(arr, dict):
        return np.frombuffer(base64.b64decode(arr["bdata"]), dtype=np.dtype(arr["dtype"])).astype(float)
    return np.array([np.nan if x is None else x for x in arr], dtype=float)


def per_scrape(run, metric: str) -> dict:
    """A metric's samples summed over label sets per scrape, by target: what the page plots."""
    df = run.series(metric)
    out = {}
    for target, g in df.groupby("target", observed=True):
        out[str(target)] = g.groupby("scrape_id", as_index=False).agg(t_s=("t_s", "first"), value=("value", "sum"))
    return out


def assert_every_section(at: AppTest, store: Path, run_id: str | int = "latest") -> None:
    """Every section of the page, holding the numbers of the run it shows (read here from the store)."""


    run = load_run(store, run_id, metrics=VIEW_METRICS)
    verdicts = judge_run(run)
    assert verdicts, "these runs all hold cancels"
    assert not at.exception, at.exception
    heads = [s.value for s in at.subheader]
    for section in SECTIONS:
        assert section in heads, heads
    assert f"Cancels ({len(verdicts)})" in heads
    # the summary bars, the timeline, the zoomed figure beside the story, the capacity drawing
    assert len(at.get("plotly_chart")) == 4
    # the five-second picture on top: the sentence of the run's own numbers and the before/after bars
    story = pick_story_cancel(verdicts)
    summary = cancel_summary(run, story)
    assert summary["sentence"][0].upper() + summary["sentence"][1:] in heads
    bars = {t["name"] for t in figure(at, SUMMARY)["data"]}
    assert {"KV pool: used", "KV pool: free", "total (measured)"} <= bars, bars
    # the memory anatomy in the timeline: the parts stacked under the measured total
    stacked = {full_name(t) for t in figure(at)["data"] if t.get("stackgroup")}
    assert {n.split(" ", 1)[1] for n in stacked} >= {"KV pool: used", "KV pool: free", "other"}, stacked
    cap = {t["name"] for t in figure(at, CAPACITY)["data"]}
    assert cap == {"used at p95", "peak above p95", "free at peak"}
    # the verdict table: one row per cancel, in order, with its verdict and stop time
    table = next(d.value for d in at.dataframe if "verdict" in d.value.columns)
    assert list(table["request_id"]) == [v.request_id for v in verdicts]
    assert list(table["verdict"]) == [v.verdict for v in verdicts]
    assert list(table["stop_s"]) == pytest.approx([v.timepoints["user_stop"] for v in verdicts], abs=1e-3)
    # the timeline: one marker trace per verdict through every cancel's timepoints, at the run's times
    data = figure(at)["data"]
    marks = {t["name"]: values(t["x"]) for t in data if (t.get("name") or "").startswith("cancel: ")}
    assert set(marks) == {f"cancel: {v.verdict}" for v in verdicts}, set(marks)
    for v in verdicts:
        for point, t_s in v.timepoints.items():
            if t_s is not None:
                assert np.isclose(marks[f"cancel: {v.verdict}"], t_s).any(), (v.request_id, point, t_s)
    # KV usage (in %) and running requests per target: their peaks are the run's own
    for metric, name, scale in (("kv_cache_usage_ratio", "KV usage", 100), ("requests_running", "running", 1)):
        frames = per_scrape(run, metric)
        assert frames, metric
        for target, g in frames.items():
            (trace,) = [t for t in data if full_name(t) == f"{name} {target}"]
            assert np.nanmax(values(trace["y"])) == pytest.approx(scale * g["value"].max()), (metric, target)
    # the story beside it: the sentences for the chosen cancel, and its figure zoomed to that cancel
    story = pick_story_cancel(verdicts)
    shown = [m.value for m in at.markdown]
    sentences = memory_story(run, verdicts, story)
    assert len(sentences) >= 2 and all(s in shown for s in sentences), (sentences, shown)
    assert story.request_id in " ".join(shown)
    assert figure(at, STORY)["layout"]["xaxis"]["range"] == pytest.approx(list(cancel_window(story)))


def test_fresh_clone_shows_the_sample_labelled(tmp_path, monkeypatch):
    at = app(tmp_path, monkeypatch)  # an empty store folder: nothing recorded yet
    assert any("No run store" in i.value and "make demo" in i.value for i in at.info)
    assert any("SAMPLE RUN" in w.value for w in at.warning)
    assert_every_section(at, SAMPLE)
    facts = {m.label: m.value for m in at.metric}
    # the KV pool: 64 blocks x 128 tokens x 32 KiB
    assert facts["KV pool (tokens)"] == "8192" and facts["KV pool (MiB)"] == "256", facts


def test_sample_story_uses_the_runs_own_numbers(tmp_path, monkeypatch):
    """The story's figures, worked out here from the run's samples and timepoints, are on the page."""


    at = app(tmp_path, monkeypatch)
    text = " ".join(m.value for m in at.markdown)
    run = load_run(SAMPLE, "latest", metrics=VIEW_METRICS)
    story = pick_story_cancel(judge_run(run))
    tp = story.timepoints
    assert story.verdict == "released" and tp["reusable"] is not None
    # the engine's memory (no GPU in the sample: RSS of the engine's process tree) in the 2 s before the stop
    rss = per_scrape(run, "engine_rss_bytes")
    before = sum(float(np.median(g[(g["t_s"] >= tp["user_stop"] - 2.0) & (g["t_s"] < tp["user_stop"])]["value"]))
                 for g in rss.values())
    assert f"the engine's memory was {before / 1024**3:.2f} GiB" in text, text
    assert f"When the user pressed Stop at {tp['user_stop']:.1f} s" in text, text
    assert f"({story.scenario}, {story.request_id}) left the engine" in text, text
    assert f"a new request got in {1000 * (tp['reusable'] - tp['user_stop']):.0f} ms after the Stop" in text, text


def test_recorded_runs_every_section_and_compare(proxy_and_direct_runs, monkeypatch):
    store, *_ = proxy_and_direct_runs
    for run_id in (1, 2):
        at = app(store.parent, monkeypatch, store=store.name, run=str(run_id))
        assert not at.error and not any("SAMPLE" in w.value for w in at.warning)
        assert_every_section(at, store, run_id)
    table = next(d.value for d in at.dataframe if "verdict" in d.value.columns)
    assert list(table["verdict"]) == ["released", "released"]
    assert not any(s.value.startswith("Ghosts") for s in at.subheader)  # nothing leaked, nothing listed
    # run 1 went through the leaky proxy: its verdicts are red, and compare puts both runs side by side
    at = app(store.parent, monkeypatch, store=store.name, run="1")
    assert list(next(d.value for d in at.dataframe if "verdict" in d.value.columns)["verdict"]) == ["leaked", "leaked"]
    # each leaked request ran on to its end for nobody (the recording waits for the engine to go idle): no ghost left
    assert "Ghosts: 0 of 2 leaked request(s) still in the engine" in [s.value for s in at.subheader]
    ghosts = next(d.value for d in at.dataframe if "in the engine" in d.value.columns)
    assert list(ghosts["in the engine"]) == ["left", "left"] and (ghosts["ran for nobody (s)"] > 0).all(), ghosts
    at.selectbox(key="compare_id").set_value(2).run()
    assert not at.exception
    assert "Compare run 1 with run 2" in [s.value for s in at.subheader]
    cmp = next(d.value for d in at.dataframe if list(d.value.columns) == ["run 1", "run 2"])
    assert cmp.loc["verdict: leaked", "run 1"] == "2" and cmp.loc["verdict: released", "run 2"] == "2"
    assert len(at.get("plotly_chart")) == 6  # and the two compared runs' own figures


def test_choosing_a_cancel_zooms_the_timeline(tmp_path, monkeypatch):

    at = app(tmp_path, monkeypatch)
    assert "range" not in figure(at)["layout"]["xaxis"]
    opts = at.selectbox(key="zoom").options
    at.selectbox(key="zoom").set_value(opts[2]).run()
    assert not at.exception
    lo, hi = figure(at)["layout"]["xaxis"]["range"]
    run = load_run(SAMPLE, "latest", metrics=VIEW_METRICS)
    verdicts = judge_run(run)
    chosen = verdicts[1]
    assert chosen.request_id in opts[2]
    # the timeline shows that cancel's window, from before its stop to after its grace
    assert [lo, hi] == pytest.approx(list(cancel_window(chosen)))
    assert lo < chosen.timepoints["user_stop"] < hi and hi - lo < 30
    # and the story beside it is now that cancel's, with its figure on the same window
    shown = [m.value for m in at.markdown]
    assert all(s in shown for s in memory_story(run, verdicts, chosen)), shown
    assert figure(at, STORY)["layout"]["xaxis"]["range"] == pytest.approx([lo, hi])
    # and the summary on top follows the chosen cancel
    summary = cancel_summary(run, chosen)
    assert summary["sentence"][0].upper() + summary["sentence"][1:] in [h.value for h in at.subheader]
    # (choosing a row of the table drives the same zoom: tests/test_dashboard_browser.py clicks one)


def test_a_long_run_opens_from_its_overview_and_stored_verdicts_and_zooms_at_full_resolution(tmp_path, monkeypatch):
    """Issue 21 point 3, with the page's bound lowered to 5 minutes for a 15-minute run: the page never reads
    the run whole (load_run refuses here) nor judges a cancel (the live judge's verdicts are stored), draws the
    whole run from the overview with its peaks, and a chosen cancel's stretch from every sample in it."""
    import cancelwatch.analysis.long_runs as long_runs
    import cancelwatch.runstore.reader as reader
    from cancelwatch.analysis.verdicts.stored import judged_by, stored
    from bench.synthetic import write_synthetic_run
    from cancelwatch.runstore.writer import open_store, write_verdicts

    store = tmp_path / "day.db"
    rid = write_synthetic_run(store, duration_s=900, cancels=30, leak_every=5, filler_series=3)
    whole = load_run(store, rid, metrics=VIEW_METRICS)
    verdicts = judge_run(whole)
    con = open_store(store)
    with con:
        write_verdicts(con, rid, judged_by(), [(v.request_id, stored(v)) for v in verdicts])
    con.close()
    monkeypatch.setattr(long_runs, "LONG_RUN_S", 300.0)

    def refused(*args, **kwargs):
        raise AssertionError("a long run is never read whole by the page")

    monkeypatch.setattr(reader, "load_run", refused)
    monkeypatch.setattr("cancelwatch.analysis.verdicts.families.FAMILIES", {})  # judging anything would raise KeyError
    at = app(tmp_path, monkeypatch, store="day.db")
    assert not at.exception and not at.error, (at.exception, [e.value for e in at.error])
    assert f"Cancels ({len(verdicts)})" in [h.value for h in at.subheader]
    assert any("drawn from the run's overview" in c.value for c in at.caption)
    table = next(d.value for d in at.dataframe if "verdict" in d.value.columns)
    assert list(table["verdict"]) == [v.verdict for v in verdicts]
    (trace,) = [t for t in figure(at)["data"] if full_name(t) == "running t0"]
    running = whole.series("requests_running")
    assert len(values(trace["y"])) < len(running) / 50  # two points per 10 s, not 20 a second
    assert np.nanmax(values(trace["y"])) == running["value"].max()
    # a cancel chosen: its stretch at full resolution, every sample in it
    opts = at.selectbox(key="zoom").options
    at.selectbox(key="zoom").set_value(opts[5]).run()
    assert not at.exception and not at.error, (at.exception, [e.value for e in at.error])
    lo, hi = cancel_window(verdicts[4])
    (trace,) = [t for t in figure(at)["data"] if full_name(t) == "running t0"]
    inside = running[(running["t_s"] >= lo) & (running["t_s"] <= hi)]
    assert len(values(trace["y"])) == len(inside) > 100


@pytest.mark.parametrize("store", ["../../etc/passwd", "/etc/passwd", "../outside.db", "sub/../../outside.db", "cw.txt"])
def test_a_store_from_the_url_cannot_leave_the_store_folder(tmp_path, monkeypatch, store):
    folder = tmp_path / "runs"
    folder.mkdir()
    shutil.copy(SAMPLE, tmp_path / "outside.db")
    at = app(folder, monkeypatch, store=store)
    assert not at.exception
    assert at.error, [i.value for i in at.info]
    assert "outside the store folder" in at.error[0].value or "not a .db" in at.error[0].value
    assert not at.dataframe and not at.get("plotly_chart")


def test_a_link_inside_the_folder_pointing_out_is_refused(tmp_path, monkeypatch):
    folder = tmp_path / "runs"
    folder.mkdir()
    shutil.copy(SAMPLE, tmp_path / "secret.db")
    os.symlink(tmp_path / "secret.db", folder / "link.db")
    at = app(folder, monkeypatch, store="link.db")
    assert at.error and "outside the store folder" in at.error[0].value
    assert not at.dataframe


def test_a_bad_run_id_falls_back_to_the_latest_with_a_warning(tmp_path, monkeypatch):
    shutil.copy(SAMPLE, tmp_path / "cw.db")
    at = app(tmp_path, monkeypatch, store="cw.db", run="1 OR 1=1")
    assert not at.exception
    assert any("integer id or 'latest'" in w.value for w in at.warning)
    assert at.title[0].value.startswith("Run 1")


def test_not_a_store_and_an_empty_store_explain(tmp_path, monkeypatch):
    (tmp_path / "junk.db").write_bytes(b"not sqlite at all" * 100)
    at = app(tmp_path, monkeypatch, store="junk.db")
    assert not at.exception and at.error and "not a cancelwatch run store" in at.error[0].value
    con = sqlite3.connect(tmp_path / "empty.db")
    con.executescript((ROOT / "runstore" / "schema.py").read_text().split('DDL = """')[1].split('"""')[0])
    con.close()
    at = app(tmp_path, monkeypatch, store="empty.db")
    assert not at.exception and any("holds no runs yet" in i.value for i in at.info)
    # a store a recorder is creating this instant: the file, no table yet
    sqlite3.connect(tmp_path / "new.db").execute("PRAGMA journal_mode=WAL").close()
    at = app(tmp_path, monkeypatch, store="new.db")
    assert not at.exception and not at.error and any("holds no runs yet" in i.value for i in at.info)


def test_a_run_still_recording_is_followed_live(tmp_path, monkeypatch):
    store = tmp_path / "cw.db"
    shutil.copy(SAMPLE, store)
    con = sqlite3.connect(store)
    con.execute("UPDATE runs SET status = 'running', ended_wall_ns = NULL")
    con.commit()
    con.close()
    at = app(tmp_path, monkeypatch, store="cw.db")
    assert not at.exception
    assert at.toggle(key="follow").value is True
    assert any("still being recorded" in c.value for c in at.caption)
    at.toggle(key="follow").set_value(False).run()
    assert not at.exception and at.toggle(key="follow").value is False


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000", "http://localhost:8000/", "http://[::1]:8000"])
def test_the_page_records_loopback_targets(url):
    assert recording.check_target(url) == url


def test_a_target_elsewhere_must_be_allowed_by_name(monkeypatch):
    monkeypatch.delenv(recording.ALLOW_ENV, raising=False)
    with pytest.raises(recording.RecordingRefused, match=f"{recording.ALLOW_ENV}=10.1.2.3"):
        recording.check_target("http://10.1.2.3:8000")
    with pytest.raises(recording.RecordingRefused, match="not an http"):
        recording.check_target("file:///etc/passwd")
    monkeypatch.setenv(recording.ALLOW_ENV, "gpu-box.internal:8000, 10.1.2.3")
    assert recording.check_target("http://10.1.2.3:9000") == "http://10.1.2.3:9000"
    assert recording.check_target("http://gpu-box.internal:8000")
    with pytest.raises(recording.RecordingRefused):
        recording.check_target("http://gpu-box.internal:9999")  # allowed on one port only


def form(at: AppTest, target: str, scenarios: str = "decode") -> AppTest:
    at.text_input(key="rec_target").set_value(target)
    at.text_input(key="rec_scenarios").set_value(scenarios)
    return next(b for b in at.button if b.label == "Start recording").click().run()


def test_the_form_refuses_a_target_elsewhere_without_starting_anything(tmp_path, monkeypatch):
    monkeypatch.delenv(recording.ALLOW_ENV, raising=False)
    at = form(app(tmp_path, monkeypatch), "http://10.1.2.3:8000")
    (err,) = [e.value for e in at.sidebar.error]
    assert "not on this machine" in err and recording.ALLOW_ENV in err and "\n" not in err
    assert not (tmp_path / recording.LOCK_NAME).exists() and not (tmp_path / "cancelwatch.db").exists()


def test_the_form_shows_the_command_lines_one_line_error_for_a_dead_target(tmp_path, monkeypatch):
    port = free_port()  # nothing listens there
    monkeypatch.setattr(recording, "EARLY_EXIT_S", 60.0)  # a loaded machine may take 8 s just to import record
    at = form(app(tmp_path, monkeypatch), f"http://127.0.0.1:{port}")
    (err,) = [e.value for e in at.sidebar.error]
    assert "cannot list models" in err and str(port) in err and "fix --target" in err and "\n" not in err, err
    assert recording.current(tmp_path) is None  # the command ended: the next recording may start


def test_the_ghosts_the_engine_still_holds_are_listed_with_their_ages(tmp_path, monkeypatch):
    """Issue 21 point 2: a leaked request the engine's count still holds is listed first with its age to the
    last sample; one the count showed leaving, with how long it ran for nobody; a released one not at all."""
    from cancelwatch.analysis.verdicts import ghosts_of
    from tests.test_protocol import NO_QUEUED, PERIOD_S, write_run

    decode, disconnect = NO_QUEUED[0], NO_QUEUED[1]  # released; leaked, in the engine until 9 s of its stretch
    store = tmp_path / "cw.db"
    write_run(store, [decode, disconnect, {**disconnect, "leak_end": 99.0}])
    run = load_run(store, "latest", metrics=VIEW_METRICS)
    verdicts = judge_run(run)
    assert [v.verdict for v in verdicts] == ["released", "leaked", "leaked"], verdicts
    at = app(tmp_path, monkeypatch, store="cw.db")
    assert not at.exception, at.exception
    assert "Ghosts: 1 of 2 leaked request(s) still in the engine" in [s.value for s in at.subheader]
    shown = next(d.value for d in at.dataframe if "in the engine" in d.value.columns)
    last = float(run.series("requests_running")["t_s"].max())
    held, gone = verdicts[2], verdicts[1]
    assert list(shown["request"]) == [held.request_id, gone.request_id]  # the ghost first
    assert list(shown["in the engine"]) == ["still there", "left"]
    stop_held, stop_gone = held.timepoints["user_stop"], gone.timepoints["user_stop"]
    # the ghost's age runs to the last sample; the other ran 4 s for nobody (its stop at 5 s, its end at 9 s)
    assert list(shown["ran for nobody (s)"]) == pytest.approx([round(last - stop_held, 1), 4.0], abs=0.06)
    assert shown["left the engine (s)"].iloc[1] == pytest.approx(stop_gone + 4.0, abs=0.06)
    assert stop_held == pytest.approx(2 * PERIOD_S + 5.0)
    assert len(ghosts_of(run, verdicts)) == 2
