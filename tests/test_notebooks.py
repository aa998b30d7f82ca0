"""The notebooks, executed by papermill through `cancelwatch notebook` on the sample run and on runs the
tests record, rendered to HTML without code cells and with plotly embedded."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import httpx
import nbformat
import papermill as pm
import psutil
import pytest

from cancelwatch.analysis import review
from cancelwatch.runstore.reader import StoreError
from tests.conftest import cli, free_port
from tests.processes import listening_ips

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "dashboard" / "sample" / "sample.db"
NOTEBOOKS = ["capacity_review", "vram_plateau"]
ALL_NOTEBOOKS = ["capacity_review", "explore", "resolution", "vram_plateau"]
# the notebooks that need nothing but a run (resolution also needs an import from Prometheus)
ON_A_RUN = ["capacity_review", "explore", "vram_plateau"]


def render(tmp_path: Path, name: str, *args: str, timeout: float = 300):
    html = tmp_path / f"{name}.html"
    ipynb = tmp_path / f"{name}.ipynb"
    res = cli("notebook", name, *args, "--html", str(html), "--ipynb", str(ipynb), timeout=timeout)
    nb = nbformat.read(str(ipynb), as_version=4) if ipynb.exists() else None
    return res, html.read_text() if html.exists() else "", nb


def error_outputs(nb) -> list:
    return [o for c in nb.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]


def assert_offline_without_code(html: str, nb) -> None:
    assert not re.search(r"<script[^>]+src=", html), "the report must not fetch scripts"
    # no code cells: no input area, and none of the code's own text
    assert 'class="highlight hl-ipython3"' not in html
    for c in nb.cells:
        if c.cell_type == "code":
            for line in c.source.splitlines():
                if len(line.strip()) > 25:
                    assert line.strip() not in html, line
    assert "Plotly.newPlot" in html
    # plotly.js itself is inside the file, once
    assert html.count("plotly.js v") >= 1 or html.count("window.Plotly") >= 1
    # the figures' data is in the HTML: every trace name the notebook plotted
    shown = [o["data"]["text/html"] for c in nb.cells for o in c.get("outputs", [])
             if o.get("output_type") == "display_data" and "Plotly.newPlot" in o.get("data", {}).get("text/html", "")]
    assert shown
    for fragment in shown:
        for name in re.findall(r'"name":"([^"]+)"', fragment):
            assert f'"name":"{name}"' in html


@pytest.mark.parametrize("name", ALL_NOTEBOOKS)
def test_committed_notebooks_are_stripped_and_parameterised(name):
    nb = nbformat.read(str(ROOT / "notebooks" / f"{name}.ipynb"), as_version=4)
    nbformat.validate(nb)
    assert all(not c.get("outputs") and c.get("execution_count") is None for c in nb.cells if c.cell_type == "code")
    tagged = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1 and "store" in tagged[0].source


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_on_the_sample_run(tmp_path, name):
    res, html, nb = render(tmp_path, name, "--store", str(SAMPLE))
    assert res.returncode == 0, res.stderr
    assert not error_outputs(nb)
    assert_offline_without_code(html, nb)
    if name == "capacity_review":
        for key in ("KV pool", "max concurrency at 2048 tokens", "peak KV usage", "time with requests waiting",
                    "p95 (ms)", "within 500 ms", "released"):
            assert key in html, key
        for name in ("used at p95", "peak above p95", "free at peak"):  # the pool, drawn
            assert f'"name":"{name}"' in html, name
    else:
        assert "Memory stays flat" in html and "GiB" in html and "left the engine" in html
        # the summary on top: the sentence of numbers, then the before/after bars and the anatomy
        assert re.search(r"Memory \d\.\d\d GiB before and after; the KV pool", html)
        for name in ("KV pool: used", "KV pool: free", "total (measured)", "engine KV pool: used"):
            assert f'"name":"{name}"' in html, name


def test_capacity_review_of_two_recorded_runs_compares_them(tmp_path, proxy_and_direct_runs):
    store, *_ = proxy_and_direct_runs
    res, html, nb = render(tmp_path, "capacity_review", "--store", str(store), "--run", "1", "--run", "2",
                           "-p", "context_len=1024", "-p", "latency_slo_ms=250")
    assert res.returncode == 0, res.stderr
    assert not error_outputs(nb)
    assert_offline_without_code(html, nb)
    assert "max concurrency at 1024 tokens" in html and "within 250 ms" in html
    # the comparison table: one column per run
    tables = [o["data"]["text/html"] for c in nb.cells for o in c.get("outputs", [])
              if "text/html" in o.get("data", {}) and "verdict: leaked" in o["data"]["text/html"]]
    assert tables, "no comparison table"
    head = re.search(r"<thead>(.*?)</thead>", tables[-1], re.S).group(1)
    columns = [c for c in re.findall(r"<th>([^<]*)</th>", head) if c]
    assert columns == ["run 1 (through-leaky-proxy)", "run 2 (direct)"], columns


def test_vram_plateau_on_a_recorded_run(tmp_path, proxy_and_direct_runs):
    store, *_ = proxy_and_direct_runs
    res, html, nb = render(tmp_path, "vram_plateau", "--store", str(store), "--run", "1")
    assert res.returncode == 0, res.stderr
    assert not error_outputs(nb)
    assert "NOT released" in html  # run 1 went through the leaky proxy: its story is the leak
    # its cancel as a card a stakeholder reads: each thing in words, a dash where the path has nothing, the evidence
    # whole; no index, no NaN
    card = next(o["data"]["text/html"] for c in nb.cells for o in c.get("outputs", [])
                if "what it rests on" in o.get("data", {}).get("text/html", ""))
    cells = [re.sub(r"<[^>]+>", "", c).strip() for c in re.findall(r"<td[^>]*>(.*?)</td>", card, re.S)]
    labels = cells[0::2]
    assert labels[:4] == ["request", "scenario", "where it was when stopped", "verdict"], labels
    assert not re.search(r"<th[ >]", card) and not any(c in ("NaN", "nan", "None") for c in cells), cells
    rests_on = cells[labels.index("what it rests on") * 2 + 1]
    assert "—" in cells and "rule: " in rests_on and "\nengine abort: " in rests_on, cells


@pytest.mark.parametrize("args, says", [
    (["--run", "99"], "no run 99"),
    (["--store", "/nonexistent/cw.db"], "no run store at /nonexistent/cw.db"),
])
def test_a_bad_parameter_ends_in_one_readable_error_cell(tmp_path, args, says):
    store_args = [] if "--store" in args else ["--store", str(SAMPLE)]
    res, html, nb = render(tmp_path, "vram_plateau", *store_args, *args)
    assert res.returncode == 1
    assert says in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    errors = error_outputs(nb)
    assert len(errors) == 1 and errors[0]["ename"] == "StoreError" and says in errors[0]["evalue"]
    # Minimal exception mode: one line, not a wall of traceback
    assert len(errors[0]["traceback"]) <= 2, errors[0]["traceback"]
    assert says in html and "Traceback" not in html


def test_bad_command_lines_are_usage_errors(tmp_path):
    res = cli("notebook", "nope", "--html", str(tmp_path / "x.html"))
    assert res.returncode == 2 and "capacity_review, explore, resolution, vram_plateau" in res.stderr
    res = cli("notebook", "capacity_review", "-p", "colour=blue", "--html", str(tmp_path / "x.html"))
    assert res.returncode == 2 and "no such parameter" in res.stderr
    res = cli("notebook", "capacity_review", "-p", "context_len", "--html", str(tmp_path / "x.html"))
    assert res.returncode == 2 and "KEY=VALUE" in res.stderr
    res = cli("notebook", "vram_plateau", "--run", "1", "--run", "2", "--html", str(tmp_path / "x.html"))
    assert res.returncode == 2 and "one run" in res.stderr
    assert not (tmp_path / "x.html").exists()


def test_review_helpers():
    assert review.parse_run_ids("1, 2") == ["1", "2"] and review.parse_run_ids(3) == ["3"]
    assert review.parse_run_ids(None) == ["latest"] and review.parse_run_ids([1, "latest"]) == ["1", "latest"]
    with pytest.raises(StoreError):
        review.parse_run_ids(" , ")
    runs = review.open_runs(str(SAMPLE), "latest")
    lat = review.release_latency_summary(runs, 100.0)
    released = [v.evidence.release_ms for v in runs[0].verdicts if v.verdict == "released"]
    assert lat.iloc[0]["released"] == len(released) and lat.iloc[0]["max (ms)"] == max(released)
    assert lat.iloc[0]["within 100 ms"] == f"{sum(x <= 100 for x in released)} of {len(runs[0].verdicts)}"
    assert lat.iloc[0]["engine abort from"] == f"engine log {len(runs[0].verdicts)}"  # every cancel on the engine log
    with pytest.raises(StoreError):
        review.open_runs(str(SAMPLE), "1,1")
    walk = review.plateau_walkthrough(runs[0])
    assert walk["cancel"] is not None and len(walk["story"]) == 3 and len(walk["row"]) == 1
    card = dict(zip(walk["card"][""], walk["card"]["value"]))
    assert card["request"] == walk["cancel"].request_id and card["user stop → app received (ms)"] == "—", card
    with pytest.raises(StoreError):
        review.plateau_walkthrough(runs[0], "cw-not-there")
    assert json.loads(review.latency_histogram(runs).to_json())["data"][0]["name"] == runs[0].label


def test_explore_on_the_sample_run(tmp_path):
    """The ad-hoc notebook: the runs, a run's series, its verdicts and the timeline, rendered offline."""
    res, html, nb = render(tmp_path, "explore", "--store", str(SAMPLE))
    assert res.returncode == 0, res.stderr
    assert not error_outputs(nb)
    assert_offline_without_code(html, nb)
    assert "SAMPLE RUN" in html  # the store named is the shipped sample
    for key in ("81,174 samples", "KV-cache usage: ", "The first cancel", "released"):
        assert key in html, key


def test_explore_reads_a_long_run_from_its_overview_with_the_verdicts_read_whole(tmp_path):
    """A day's watch opens from its overview and its cancels' windows (judged_run), not read whole: the same
    verdicts. `long_run_s` brings the threshold (3 h) down to a run a test writes in a second."""
    from bench.synthetic import write_synthetic_run
    from cancelwatch.analysis.judged import judged_run

    store = tmp_path / "long.db"
    write_synthetic_run(store, duration_s=150.0, cancels=5, name="long")
    whole = judged_run(store, "latest")
    assert not whole.long and len(whole.verdicts) == 5
    res, html, nb = render(tmp_path, "explore", "--store", str(store), "-p", "long_run_s=60")
    assert res.returncode == 0, res.stderr
    assert not error_outputs(nb)
    assert "A long run: read from its overview" in html
    # the cancel table's rows: request_id, scenario, phase, verdict
    shown = re.findall(r"<td>(cw-[\w-]+)</td>\s*<td>[^<]*</td>\s*<td>[^<]*</td>\s*<td>(\w+)</td>", html)
    assert sorted(set(shown)) == sorted((v.request_id, v.verdict) for v in whole.verdicts), shown


# ---------------------------------------------------------------------------------------------------------
# JupyterLab: `make lab`, and the notebooks as it runs them (kernel in notebooks/, no parameters)

def run_as_lab_does(name: str, out: Path) -> nbformat.NotebookNode:
    """Execute notebooks/NAME.ipynb top to bottom as opened in JupyterLab: no parameters, the kernel in
    notebooks/."""
    pm.execute_notebook(str(ROOT / "notebooks" / f"{name}.ipynb"), str(out), cwd=str(ROOT / "notebooks"),
                        kernel_name="python3", progress_bar=False, log_output=False, execution_timeout=300)
    return nbformat.read(str(out), as_version=4)


def output_text(nb) -> str:
    parts = []
    for c in nb.cells:
        for o in c.get("outputs", []):
            data = o.get("data", {})
            parts.append(str(data.get("text/markdown") or data.get("text/html") or data.get("text/plain") or ""))
    return "\n".join(parts)


@pytest.mark.parametrize("name", ON_A_RUN)
def test_with_no_store_yet_the_notebooks_open_on_the_sample_run(tmp_path, monkeypatch, name):
    empty = tmp_path / "runs"
    empty.mkdir()
    monkeypatch.setenv("CANCELWATCH_STORE_DIR", str(empty))  # a fresh clone: no runs/cancelwatch.db
    nb = run_as_lab_does(name, tmp_path / f"{name}.ipynb")
    assert not error_outputs(nb)
    text = output_text(nb)
    assert "SAMPLE RUN" in text and "sample run shipped with cancelwatch" in text
    assert "run 1 (sample)" in text or "**sample**" in text  # the sample's own run, named


def test_a_store_in_the_store_folder_is_read_and_not_labelled_sample(tmp_path, monkeypatch):
    folder = tmp_path / "runs"
    folder.mkdir()
    shutil.copy(SAMPLE, folder / "cancelwatch.db")
    monkeypatch.setenv("CANCELWATCH_STORE_DIR", str(folder))
    nb = run_as_lab_does("explore", tmp_path / "explore.ipynb")
    assert not error_outputs(nb)
    assert "SAMPLE RUN" not in output_text(nb)


def test_make_lab_serves_the_notebooks_on_loopback_behind_a_token(tmp_path):
    if shutil.which("make") is None:
        pytest.skip("no make")
    port = free_port()
    log = tmp_path / "lab.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(["make", "--no-print-directory", "lab", f"LAB_PORT={port}"], cwd=ROOT, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime")})
    procs: list[psutil.Process] = [psutil.Process(proc.pid)]
    base = f"http://127.0.0.1:{port}"
    try:
        token, deadline = None, time.monotonic() + 180
        while token is None and time.monotonic() < deadline:
            m = re.search(rf"{re.escape(base)}/lab\?token=([0-9a-f]+)", log.read_text(errors="replace"))
            if m:
                token = m.group(1)
            elif proc.poll() is not None:
                pytest.fail(f"make lab exited {proc.returncode}: {log.read_text()[-3000:]}")
            else:
                time.sleep(0.5)
        assert token, f"no URL with a token printed: {log.read_text()[-3000:]}"
        procs += psutil.Process(proc.pid).children(recursive=True)
        # JupyterLab listens on loopback only
        listening = listening_ips(proc.pid)
        assert listening == {"127.0.0.1"}, listening
        assert httpx.get(f"{base}/api/status", timeout=10).status_code == 403  # no token: refused
        assert httpx.get(f"{base}/api/contents", params={"token": "wrong"}, timeout=10).status_code == 403
        auth = {"Authorization": f"token {token}"}
        status = httpx.get(f"{base}/api/status", headers=auth, timeout=10)
        assert status.status_code == 200, status.text
        listing = httpx.get(f"{base}/api/contents", headers=auth, timeout=10).json()
        names = {c["name"] for c in listing["content"]}
        # the server's root is notebooks/: the notebooks, not the project's files
        assert {"capacity_review.ipynb", "vram_plateau.ipynb", "explore.ipynb"} <= names, names
        assert "Makefile" not in names
    finally:
        # SIGTERM to make and the server it started (their own session): the server shuts down and make ends
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass  # already gone
        _, alive = psutil.wait_procs(procs, timeout=30)
        for p in alive:
            p.kill()
        proc.wait(10)
    assert not alive, f"make lab left processes behind after SIGTERM: {[p.pid for p in alive]}"
