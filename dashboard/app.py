"""cancelwatch dashboard: `streamlit run dashboard/app.py`.

Layout, widgets and caching only; every number and figure comes from analysis/. URL parameters:
`?store=runs/cancelwatch.db&run=latest` (the store must lie in the store folder, $CANCELWATCH_STORE_DIR
or ./runs).
"""

from pathlib import Path

import streamlit as st

from cancelwatch.analysis.cancel_table import VERDICT_COLOURS, cancel_table, cancel_window
from cancelwatch.analysis.capacity import capacity, capacity_figure, capacity_frame
from cancelwatch.analysis.anatomy import cancel_summary, summary_figure
from cancelwatch.analysis.compare import compare_runs
from cancelwatch.analysis.explain import memory_story, pick_story_cancel
from cancelwatch.analysis.facts import VIEW_METRICS, run_facts
from cancelwatch.analysis.ghosts import GHOST_CAPTION, ghost_headline, ghost_view
from cancelwatch.analysis.html_report import facts_frame, report_html
from cancelwatch.analysis.judged import judged_run
from cancelwatch.analysis.long_runs import OVERVIEW_NOTE
from cancelwatch.analysis.timeline import timeline_figure
from cancelwatch.analysis.verdicts import ghosts_of
from cancelwatch.dashboard import recording
from cancelwatch.dashboard.params import read_url_params
from cancelwatch.runstore.paths import DEFAULT_STORE, store_dir, store_in_dir, stores_in_dir
from cancelwatch.analysis.watching import LOOKBACK_S
from cancelwatch.runstore.reader import StoreError, list_runs, load_window, resolve_run_id

SAMPLE_STORE = Path(__file__).resolve().parent / "sample" / "sample.db"
LIVE_EVERY_S = 2.0
WHOLE_RUN = "whole run"

st.set_page_config(page_title="cancelwatch", page_icon=":material/stop_circle:", layout="wide")


def store_version(path: Path) -> tuple:
    """Changes whenever the recorder commits: the key under which a live run is reloaded."""
    out = []
    for p in (path, Path(str(path) + "-wal")):
        try:
            s = p.stat()
            out.append((s.st_mtime_ns, s.st_size))
        except OSError:
            out.append(None)
    return tuple(out)


@st.cache_resource(max_entries=6, show_spinner="Loading the run...")
def load_view(path: str, run_id: int, version: tuple):
    """(run, verdicts), shared read-only between sessions; a new `version` means the store grew. A long run
    (a day's watch) is its overview and its stored verdicts (analysis/long_runs.py): its millions of samples
    are not read, and a zoom reads its own stretch (detail)."""
    running = is_running(Path(path), run_id)
    got = judged_run(path, run_id, metrics=VIEW_METRICS, wait_for_windows=True,
                     window=lambda lo, hi, log_offsets_s=(): window(path, run_id, lo, hi, version if running else None,
                                                                    log_offsets_s))
    return got.run, got.verdicts


@st.cache_resource(max_entries=24, show_spinner=False)
def window(path: str, run_id: int, lo: float, hi: float, version: tuple | None, log_offsets_s: tuple = ()):
    """A stretch of a run at full resolution, with the ledger and log lines it is judged by; `version`: the
    store's, for a run still recorded (its stretch may fill in), else None (it will not change);
    `log_offsets_s`: where an engine log's lines are, its clock off the run's (load_window)."""
    return load_window(path, run_id, lo, hi, lookback_s=LOOKBACK_S, metrics=VIEW_METRICS, log_offsets_s=log_offsets_s)


def detail(path: Path, run, x_range: tuple[float, float] | None):
    """What a figure of `x_range` draws from: the run itself, or for a long run read from its overview, that
    stretch at full resolution."""
    if x_range is None or "overview" not in run.info:
        return run
    growing = store_version(path) if run.info["status"] == "running" else None
    return window(str(path), run.id, *x_range, growing)


@st.cache_data(max_entries=12, show_spinner=False)
def runs_table(path: str, version: tuple):
    return list_runs(path)


def is_running(path: Path, run_id: int) -> bool:
    runs = runs_table(str(path), store_version(path))
    return bool((runs.loc[runs["id"] == run_id, "status"] == "running").any())


def cancel_label(i: int, v) -> str:
    return f"#{i + 1} {v.scenario} · {v.verdict} · {v.request_id}"


def choose_store() -> tuple[Path | None, bool]:
    """(store path, is the shipped sample). Shows why when neither the chosen store nor a sample is there."""
    st.sidebar.header("Run store")
    root = store_dir()
    found = stores_in_dir(root)
    default = read_url_params(st.query_params).store
    # a value set by the record form's callback wins over the URL's (no second default for the widget)
    initial = {} if "store_text" in st.session_state else {"value": default}
    text = st.sidebar.text_input("Store file (inside the store folder)", key="store_text", **initial,
                                 help=f"Store folder: {root}. Set CANCELWATCH_STORE_DIR to read another folder.")
    if found:
        st.sidebar.caption("Stores here: " + ", ".join(p.name for p in found))
    use_sample = st.sidebar.toggle("Show the sample run", value=False, key="use_sample",
                                   help="A short run recorded from the embedded engine, shipped with cancelwatch.")
    if use_sample:
        return SAMPLE_STORE, True
    try:
        path = store_in_dir(text, root)
    except StoreError as exc:
        st.error(str(exc))
        return None, False
    if not path.is_file():
        st.info(f"No run store at `{text}` yet. Record a run with `make demo`, or with "
                "`cancelwatch record --target http://127.0.0.1:8000 --scenario default`. "
                "Meanwhile, here is the sample run shipped with cancelwatch.")
        return SAMPLE_STORE, True
    return path, False


def choose_run(path: Path, sample: bool):
    try:
        runs = runs_table(str(path), store_version(path))
    except StoreError as exc:
        st.error(str(exc))
        return None, None
    if runs.empty:  # a new store, or one a recorder is creating this instant
        st.info(f"{path.name} holds no runs yet. Record one with `make demo` or `cancelwatch record --target URL`.")
        return None, None
    labels = {int(r.id): f"{r.id} · {r.name or ''} · {r.status} · {r.started:%Y-%m-%d %H:%M}" for r in runs.itertuples()}
    ids = list(labels)[::-1]
    url = read_url_params(st.query_params)
    if url.message and not sample:
        st.warning(url.message)
    wanted = url.run if not sample else "latest"
    try:
        want_id = resolve_run_id(path, wanted)
    except StoreError as exc:
        st.warning(f"{exc}; showing the latest run")
        want_id = ids[0]
    st.sidebar.header("Run")
    run_id = st.sidebar.selectbox("Run", ids, index=ids.index(want_id), format_func=labels.get, key="run_id")
    other = st.sidebar.selectbox("Compare with", [None, *[i for i in ids if i != run_id]],
                                 format_func=lambda i: "nothing" if i is None else labels[i], key="compare_id")
    return run_id, other


def show_facts(facts: dict) -> None:
    pool = facts["kv_pools"][0] if facts["kv_pools"] else {}
    st.caption(f"{facts['status']} · started {facts['started_utc']} UTC · {facts['engine']} · "
               f"memory shown: {'GPU (NVML)' if facts['memory_source'] == 'nvml' else 'engine process (no GPU)'}")
    cols = st.columns(5)
    cols[0].metric("duration (s)", f"{facts['duration_s']:.0f}" if facts["duration_s"] else "recording")
    cols[1].metric("model", facts["served_model"] or "n/a")
    cols[2].metric("KV pool (tokens)", pool.get("tokens") or "n/a",
                   f"{pool['blocks']} blocks × {pool['block_size']}" if pool.get("blocks") else None, delta_color="off",
                   delta_arrow="off")
    cols[3].metric("KV pool (MiB)", f"{pool['bytes'] / 1024**2:.0f}" if pool.get("bytes") else "n/a")
    cols[4].metric("sampling (Hz)", facts["hz"], f"{facts['gap_ticks']} gap ticks", delta_color="off", delta_arrow="off")
    with st.expander("Run facts and sampling"):
        st.dataframe(facts_frame(facts), hide_index=True, width="stretch")


def show_ghosts(run, verdicts) -> None:
    """The leaked requests: which the engine still holds for nobody (ghosts), how long each has run since its
    client left, and the tokens it cost."""
    table = ghosts_of(run, verdicts)
    if table.empty:
        return
    st.subheader(ghost_headline(table))
    st.caption(GHOST_CAPTION)
    if "overview" in run.info:
        st.caption(f"Where a verdict did not see its request leave, its age is read from the run's "
                   f"{run.info['overview']['bucket_s']} s overview: to within that.")
    st.dataframe(ghost_view(table), hide_index=True, width="stretch", key="ghost_table")


def show_run(path: Path, run_id: int, other_id, sample: bool) -> None:
    run, verdicts = load_view(str(path), run_id, store_version(path))
    facts = run_facts(run)
    title = f"Run {run_id} · {facts['name'] or ''}"
    st.title(title)
    if sample:
        st.warning("SAMPLE RUN: recorded from the embedded engine and shipped with cancelwatch. "
                   "Record your own with `make demo`.", icon=":material/inventory_2:")
    if facts["status"] == "running":
        st.caption("This run is still being recorded.")
    show_facts(facts)

    table = cancel_table(run, verdicts)
    options = [WHOLE_RUN, *[cancel_label(i, v) for i, v in enumerate(verdicts)]]
    if st.session_state.get("zoom") not in options:
        st.session_state["zoom"] = WHOLE_RUN
    chosen_now = st.session_state["zoom"]
    summary_cancel = (verdicts[options.index(chosen_now) - 1] if chosen_now != WHOLE_RUN
                      else pick_story_cancel(verdicts))
    summary = (cancel_summary(detail(path, run, cancel_window(summary_cancel)), summary_cancel)
               if summary_cancel is not None else None)
    if summary is not None:
        # the five-second picture: one cancel, memory before and after, in the run's own numbers
        st.subheader(summary["sentence"][0].upper() + summary["sentence"][1:])
        st.caption(f"{summary_cancel.scenario} · {summary_cancel.request_id} · {summary_cancel.verdict}")
        st.plotly_chart(summary_figure(summary), key="summary_figure", width="stretch")
    zoom = st.selectbox("Zoom the timeline to", options, key="zoom")
    chosen = verdicts[options.index(zoom) - 1] if zoom != WHOLE_RUN else None
    x_range = cancel_window(chosen) if chosen is not None else None

    st.subheader("Timeline")
    st.caption("Memory stays flat while KV usage and running requests fall at each cancel: reserved is not used.")
    if "overview" in run.info and x_range is None:
        st.caption("This run is " + OVERVIEW_NOTE.format(**run.info["overview"]) + ".")
    st.plotly_chart(timeline_figure(detail(path, run, x_range), verdicts, x_range=x_range,
                                    highlight=chosen.request_id if chosen else None),
                    key="timeline", width="stretch")

    st.subheader(f"Cancels ({len(table)})")
    if table.empty:
        st.info("No cancels in this run: `cancelwatch record --scenario default` records some.")
    else:
        def on_pick():
            rows = st.session_state["cancel_table"].selection.rows
            st.session_state["zoom"] = options[rows[0] + 1] if rows else WHOLE_RUN

        styled = table.style.map(lambda v: f"background-color: {VERDICT_COLOURS.get(v, '')}; color: white",
                                 subset=["verdict"]).format(precision=1, na_rep="–")
        st.dataframe(styled, hide_index=True, width="stretch", on_select=on_pick, selection_mode="single-row",
                     key="cancel_table")
        st.caption("Choose a row to zoom the timeline to that cancel.")

    show_ghosts(run, verdicts)

    st.subheader("Why is GPU memory still high?")
    story = chosen or pick_story_cancel(verdicts)
    around = detail(path, run, cancel_window(story)) if story is not None else run
    left, right = st.columns([2, 3])
    with left:
        for sentence in memory_story(around, verdicts, story):
            st.markdown(sentence)
    with right:
        if story is not None:
            st.plotly_chart(timeline_figure(around, verdicts, x_range=cancel_window(story), highlight=story.request_id,
                                            height=620), key="story_figure", width="stretch")

    st.subheader("Capacity")
    ctx = st.number_input("Context length (tokens)", min_value=16, max_value=1_000_000, value=2048, step=256,
                          key="context_len")
    cap = capacity(run, int(ctx))
    cols = st.columns(5)
    cols[0].metric("KV pool", f"{cap['pool_tokens'] or 'n/a'} tokens")
    cols[1].metric(f"max concurrency at {int(ctx)}", cap["max_concurrency"] if cap["max_concurrency"] is not None else "n/a")
    cols[2].metric("peak / p95 KV usage", "n/a" if cap["peak_kv"] is None else
                   f"{100 * cap['peak_kv']:.0f} % / " + ("n/a" if cap["p95_kv"] is None else f"{100 * cap['p95_kv']:.0f} %"))
    cols[3].metric("headroom at peak", "n/a" if cap["headroom_tokens"] is None else f"{cap['headroom_tokens']} tokens")
    cols[4].metric("time with requests waiting", "n/a" if cap["waiting_share"] is None else
                   f"{100 * cap['waiting_share']:.1f} %")
    if "overview" in run.info:
        st.caption(f"This run is read from its {run.info['overview']['bucket_s']} s overview (each bucket's lowest "
                   "and highest value): the peaks are the run's (of one engine's or GPU's series; a sum over several "
                   "is at most that), the p95 and the time with requests waiting are not known from it.")
    st.plotly_chart(capacity_figure([(f"run {run_id}", cap)]), key="capacity_figure", width="stretch")
    st.dataframe(capacity_frame(cap), hide_index=True)

    if other_id is not None:
        st.subheader(f"Compare run {run_id} with run {other_id}")
        orun, overdicts = load_view(str(path), int(other_id), store_version(path))
        st.dataframe(compare_runs([(f"run {run_id}", run, verdicts), (f"run {other_id}", orun, overdicts)],
                                  int(ctx)).astype(str), width="stretch")
        a, b = st.columns(2)
        a.plotly_chart(timeline_figure(run, verdicts, height=700), key="compare_a", width="stretch")
        b.plotly_chart(timeline_figure(orun, overdicts, height=700), key="compare_b", width="stretch")

    st.subheader("Export")
    st.download_button("Download this run as an offline HTML report",
                       data=lambda: report_html(run, verdicts, int(ctx), sample=sample),
                       file_name=f"cancelwatch-run-{run_id}.html", mime="text/html", key="export_html")
    st.caption(f"The same report from a terminal: `cancelwatch report {run_id} --store {path} --html report.html`")


def _start_from_form(root: Path, store: Path) -> None:
    """The form's submit callback: runs before the page reruns, so it may point the page's widgets at
    the new run (store, run, follow live) instead of fighting their kept values."""
    ss = st.session_state
    scenarios = [c.strip() for c in ss.get("rec_scenarios", "").split(",") if c.strip()]
    try:
        recording.start(root, store, ss.get("rec_target", ""), ss.get("rec_metrics", ""), scenarios)
    except recording.RecordingRefused as exc:
        ss["rec_error"] = str(exc)
        return
    ss.pop("rec_error", None)
    st.query_params.update({"store": store.name, "run": "latest"})
    ss["store_text"], ss["use_sample"], ss["follow"] = store.name, False, True
    for key in ("run_id", "compare_id", "zoom"):
        ss.pop(key, None)


def record_form(path: Path | None, sample: bool) -> None:
    """Sidebar: start `cancelwatch record` in the background against a loopback target (others only
    when allowed by CANCELWATCH_ALLOWED_TARGETS); the page then follows the new run."""
    root = store_dir()
    st.sidebar.header("Record from this page")
    stopped = recording.enforce_limit(root)
    if stopped:
        st.sidebar.warning(stopped)
    if st.session_state.get("rec_error"):
        st.sidebar.error(st.session_state["rec_error"])
    running = recording.current(root)
    if running is not None:
        st.sidebar.info(f"Recording {', '.join(running['scenarios'])} against {running['target']} "
                        f"(pid {running['pid']}, at most {running['max_s']:.0f} s).")
        return
    store = path if path is not None and not sample else root / Path(DEFAULT_STORE).name
    with st.sidebar.form("record_form"):
        st.text_input("Target URL", value="http://127.0.0.1:8000", key="rec_target")
        st.text_input("Metrics URL (optional: default the target)", value="", key="rec_metrics")
        st.text_input("Scenarios (built-in names or a suite, comma-separated)", value="decode", key="rec_scenarios")
        st.form_submit_button("Start recording", on_click=_start_from_form, args=(root, store))
    st.sidebar.caption(f"Records into {store.name}; loopback targets only unless listed in "
                       f"{recording.ALLOW_ENV}; at most {recording.MAX_RECORDING_S:.0f} s.")


def main() -> None:
    path, sample = choose_store()
    record_form(path, sample)
    if path is None:
        return
    if sample and not path.is_file():
        st.info("The sample run is missing from this checkout (dashboard/sample/sample.db): `make sample-run` "
                "records it again.")
        return
    run_id, other_id = choose_run(path, sample)
    if run_id is None:
        return
    running = is_running(path, run_id)
    initial = {} if "follow" in st.session_state else {"value": running}
    follow = st.sidebar.toggle("Follow live", key="follow", **initial,
                               help="Reload the run every few seconds while it is being recorded.")

    @st.fragment(run_every=LIVE_EVERY_S if follow and running else None)
    def view():
        try:
            show_run(path, int(run_id), other_id, sample)
        except StoreError as exc:
            st.error(str(exc))
        if follow and running and not is_running(path, run_id):
            st.rerun()  # the run ended: a full rerun stops the timer and shows the final state

    view()


try:
    main()
except Exception as exc:  # the page explains in one line; the traceback goes to the server log only
    import logging

    logging.getLogger("cancelwatch.dashboard").exception("dashboard failed")
    st.error(f"The dashboard could not show this run: {type(exc).__name__}: {exc}")
