"""Recording against the real embedded vLLM engine (CPU build), its faults, and its clean shutdown."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sqlite3
import time

import httpx
import pandas as pd
import pytest

from cancelwatch.analysis.series import series_frame
from cancelwatch.collectors.cancels.load import StreamResult, _one, run_streams
from cancelwatch.collectors.engines import lifecycle
from cancelwatch.runstore.reader import load_run
from tests.conftest import cli, cli_popen, free_port, wait_gone, wait_recording
from tests.metrics_proxy import MetricsProxy


def rate(df: pd.DataFrame) -> float:
    span = df["t_s"].max() - df["t_s"].min()
    return (len(df) - 1) / span if span > 0 else 0.0


def stored_sample_count(store, run_id) -> int:
    with sqlite3.connect(store) as con:
        return con.execute("SELECT count(*) FROM samples WHERE run_id = ?", (run_id,)).fetchone()[0]


def assert_taken_equals_written(store, run):
    stats = run.info["stats"]
    assert stats["samples_taken"] > 0
    assert stats["samples_taken"] == stats["samples_written"] == stored_sample_count(store, run.id)


LOAD = {"streams": 6, "prompt_tokens": 1450, "max_tokens": 50}


async def unsampled_load(url: str, model: str) -> list[StreamResult]:
    """The test's load with prompts of their own (ids and prompts from index 100 on): the same work for the
    engine, none of it left in the prefix cache for the sampled load's prompts."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0)) as client:
        return list(await asyncio.gather(*(_one(client, url, model, 100 + i, LOAD["prompt_tokens"], LOAD["max_tokens"])
                                           for i in range(LOAD["streams"]))))


@pytest.mark.slow
def test_sample_under_load_sees_queueing_kv_and_memory(engine, engine_home, tmp_path):
    # how long this load takes this engine, unsampled: the sampling run outlasts the load by a margin
    # measured here, not by a duration tuned where the engine was fast (10 s there: the load took 3.5 s;
    # an engine five times slower took 17-30 s)
    t0 = time.monotonic()
    warm = asyncio.run(unsampled_load(engine.url, engine.served_model_name))
    measured_s = time.monotonic() - t0
    assert all(r.error is None and r.chunks == LOAD["max_tokens"] for r in warm), warm
    duration_s = max(10.0, 2.0 + 1.5 * measured_s + 3.0)  # lead-in, the load with room to be slower, the tail
    store = tmp_path / "cw.db"
    proc = cli_popen("sample", "--target", engine.url, "--duration", f"{duration_s:.1f}", "--store", str(store),
                     home=engine_home)
    wait_recording(store, ok_scrapes=1)
    t_load_ns = time.monotonic_ns()
    results = asyncio.run(run_streams(engine.url, engine.served_model_name, **LOAD))
    load_s = (time.monotonic_ns() - t_load_ns) / 1e9
    stdout, stderr = proc.communicate(timeout=duration_s + 60)
    assert proc.returncode == 0, stderr
    assert all(r.error is None and r.chunks == LOAD["max_tokens"] for r in results), results
    run = load_run(store, "latest")
    load_at_s = (t_load_ns - run.info["started_mono_ns"]) / 1e9
    assert load_at_s + load_s < duration_s - 1.0, (
        f"the load ended {load_at_s + load_s:.1f} s into a {duration_s:.1f} s run (it started {load_at_s:.1f} s in "
        f"and took {load_s:.1f} s, against {measured_s:.1f} s unsampled): the run would not see it end")
    print(f"the load: {measured_s:.1f} s unsampled, {load_s:.1f} s sampled, from {load_at_s:.1f} s into a "
          f"{duration_s:.1f} s run")

    assert run.info["status"] == "completed"
    assert run.info["cache"]["t0"]["num_gpu_blocks"] == "64"
    running = series_frame(run, "requests_running")
    waiting = series_frame(run, "requests_waiting")
    kv = series_frame(run, "kv_cache_usage_ratio")
    rss = series_frame(run, "engine_rss_bytes")
    for name, df in (("running", running), ("waiting", waiting), ("kv", kv), ("engine memory", rss)):
        assert rate(df) >= 18.0, f"{name}: {rate(df):.1f} samples/s"
    assert waiting["value"].max() > 0
    assert kv["value"].max() > 0.5
    assert running["value"].max() == 4
    # the streams end well before the run does: the tail of the run shows the engine empty again
    tail = running[running["t_s"] > load_at_s + load_s + 0.5]
    assert len(tail) >= 5 and (tail["value"] == 0).all()
    assert rss["value"].min() > 256 * 2**20  # at least the KV pool
    assert_taken_equals_written(store, run)
    assert f"run {run.id} completed" in stdout


def test_run_store_can_be_read_while_being_written(engine, engine_home, tmp_path):
    store = tmp_path / "cw.db"
    proc = cli_popen("sample", "--target", engine.url, "--duration", "5", "--store", str(store), home=engine_home)
    try:
        deadline = time.monotonic() + 30
        partial = None
        while time.monotonic() < deadline:
            time.sleep(0.5)
            if store.exists():
                try:
                    partial = load_run(store, "latest")
                except Exception:  # noqa: BLE001 - the run row may not exist yet
                    continue
                if len(partial.samples) > 0:
                    break
        seen = "no run" if partial is None else f"{partial.info['status']} with {len(partial.samples)} samples"
        assert partial is not None and partial.info["status"] == "running", f"the run as last read: {seen}"
        assert len(partial.samples) > 0, f"the run as last read: {seen}"
    finally:
        proc.communicate(timeout=60)
    final = load_run(store, partial.id)
    assert final.info["status"] == "completed"
    assert len(final.samples) > len(partial.samples)


def test_ctrl_c_keeps_everything_and_marks_interrupted(engine, engine_home, tmp_path):
    store = tmp_path / "cw.db"
    proc = cli_popen("sample", "--target", engine.url, "--duration", "0", "--store", str(store), home=engine_home)
    wait_recording(store, ok_scrapes=25)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 130, stderr
    run = load_run(store, "latest")
    assert run.info["status"] == "interrupted"
    assert len(run.scrapes) > 20
    assert_taken_equals_written(store, run)


def test_metrics_500_garbage_and_truncated_are_counted_and_sampling_goes_on(engine, engine_home, tmp_path):
    faults = {}
    for i in range(5, 80, 10):
        faults[i], faults[i + 3], faults[i + 6] = "500", "garbage", "truncated"
    proxy = MetricsProxy(engine.url, free_port(), faults)
    proxy.up()
    try:
        store = tmp_path / "cw.db"
        res = cli("sample", "--target", proxy.url, "--duration", "4", "--store", str(store), "--nvml", "off",
                  home=engine_home)
    finally:
        proxy.close()
    assert res.returncode == 0, res.stderr
    run = load_run(store, "latest")
    stats = {s["source"]: s for s in run.info["stats"]["sources"]}["vllm"]
    served = proxy.served
    assert served["garbage"] > 0 and served["truncated"] > 0 and served["500"] > 0
    assert stats["parse_errors"] == served["garbage"] + served["truncated"]  # each one counted
    assert stats["scrape_errors"] == served["500"]
    kinds = set(run.gaps["kind"])
    assert {"error", "parse_error"} <= kinds
    # failed scrapes stored no values; good ones kept coming
    failed = run.scrapes[run.scrapes["ok"] == 0]
    assert (failed["n_samples"] == 0).all()
    assert not run.samples["scrape_id"].isin(failed["id"]).any()
    assert (run.scrapes["ok"] == 1).sum() >= 40
    assert_taken_equals_written(store, run)


def test_a_target_that_goes_away_is_picked_up_again(engine, engine_home, tmp_path):
    proxy = MetricsProxy(engine.url, free_port())
    proxy.up()
    store = tmp_path / "cw.db"
    proc = cli_popen("sample", "--target", proxy.url, "--duration", "6", "--store", str(store), "--nvml", "off",
                     home=engine_home)
    try:
        wait_recording(store, ok_scrapes=20)
        down_ns = time.time_ns()
        proxy.down()
        gone_ns = time.time_ns()  # down() returns once the server has stopped serving
        time.sleep(1.5)
        proxy.up()
        _, stderr = proc.communicate(timeout=60)
    finally:
        proxy.close()
    assert proc.returncode == 0, stderr
    run = load_run(store, "latest")
    err = run.gaps[(run.gaps["kind"] == "error") & (run.gaps["source"] == "vllm")]
    assert len(err) == 1
    gap_start_wall_ns = err["start_wall_ns"].iloc[0]
    # the gap starts with the first read after the server went: between down() and a few ticks after it returned
    assert down_ns - 0.1e9 <= gap_start_wall_ns <= gone_ns + 0.5e9, (gap_start_wall_ns - down_ns, gone_ns - down_ns)
    gap_end = err["end_t_s"].iloc[0]
    assert gap_end - err["t_s"].iloc[0] >= 1.0
    ok = run.scrapes[(run.scrapes["source"] == "vllm") & (run.scrapes["ok"] == 1)]
    assert (ok["t_s"] >= gap_end).sum() >= 20  # sampling resumed at full rate after it came back
    assert_taken_equals_written(store, run)


def test_unreachable_target_creates_no_run(tmp_path):
    store = tmp_path / "cw.db"
    res = cli("sample", "--target", f"http://127.0.0.1:{free_port()}", "--store", str(store), home=tmp_path)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "unreachable" in lines[0] and "engine up" in lines[0]
    assert not store.exists()


def test_unwritable_store_names_the_path(engine, engine_home, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    store = blocker / "cw.db"
    res = cli("sample", "--target", engine.url, "--store", str(store), "--duration", "1", home=engine_home)
    assert res.returncode == 2
    assert len(res.stderr.strip().splitlines()) == 1 and str(store) in res.stderr


def test_bad_flags_are_one_line_errors(tmp_path):
    for args, needle in (
        (["--target", "localhost:8000"], "not an http(s) URL"),
        (["--target", "http://127.0.0.1:1", "--hz", "0"], "--hz"),
        (["--target", "a=http://127.0.0.1:1", "--target", "a=http://127.0.0.1:2"], "unique"),
    ):
        res = cli("sample", *args, "--store", str(tmp_path / "x.db"), home=tmp_path)
        assert res.returncode == 2 and needle in res.stderr, (args, res.stderr)
        assert len(res.stderr.strip().splitlines()) == 1


def test_two_targets_are_labelled(engine, engine_home, tmp_path):
    store = tmp_path / "cw.db"
    proxy = MetricsProxy(engine.url, free_port())
    proxy.up()
    try:
        res = cli("sample", "--target", f"direct={engine.url}", "--target", f"proxied={proxy.url}",
                  "--duration", "2", "--store", str(store), home=engine_home)
    finally:
        proxy.close()
    assert res.returncode == 0, res.stderr
    run = load_run(store, "latest")
    vllm = run.samples[run.samples["source"] == "vllm"]
    assert set(vllm["target"]) == {"direct", "proxied"}
    assert [t["label"] for t in run.info["targets"]] == ["direct", "proxied"]
    assert set(run.info["cache"]) == {"direct", "proxied"}


def test_runs_and_parquet_export(engine, engine_home, tmp_path):
    store = tmp_path / "cw.db"
    assert cli("sample", "--target", engine.url, "--duration", "1", "--store", str(store), "--name", "x",
               home=engine_home).returncode == 0
    listing = cli("runs", "--store", str(store))
    assert listing.returncode == 0 and "completed" in listing.stdout and " x " in listing.stdout
    res = cli("export", "latest", "--parquet", str(tmp_path / "pq"), "--store", str(store))
    assert res.returncode == 0, res.stderr
    run = load_run(store, "latest")
    back = pd.read_parquet(tmp_path / "pq" / f"run{run.id}_samples.parquet")
    assert len(back) == len(run.samples) > 0
    assert set(back["metric"]) == set(run.samples["metric"])
    missing = cli("export", "99", "--parquet", str(tmp_path / "pq"), "--store", str(store))
    assert missing.returncode == 2 and "no run 99" in missing.stderr


def test_engine_status_and_busy_port(engine, engine_home, tmp_path):
    status = cli("engine", "status", home=engine_home)
    assert status.returncode == 0 and engine.url in status.stdout and "healthy" in status.stdout
    again = cli("engine", "up", "--port", str(engine.port), home=engine_home)
    assert again.returncode == 2 and "already runs" in again.stderr
    elsewhere = cli("engine", "up", "--port", str(engine.port), home=tmp_path)  # another home, same port
    assert elsewhere.returncode == 2 and "busy" in elsewhere.stderr
    nothing = cli("engine", "status", home=tmp_path)
    assert nothing.returncode == 1 and "no embedded engine" in nothing.stdout


@pytest.mark.slow
def test_engine_killed_mid_run_ends_target_lost_then_engine_down_cleans_up(private_engine, tmp_path):
    home, state = private_engine
    store = tmp_path / "cw.db"
    proc = cli_popen("sample", "--target", state.url, "--duration", "60", "--lost-after", "3", "--store", str(store),
                     home=home)
    wait_recording(store, ok_scrapes=30)
    tree = lifecycle.engine_pids(state)
    assert len(tree) >= 2  # API server + engine core (+ workers)
    os.kill(state.pid, signal.SIGKILL)  # the API server dies; what it leaves is for engine down
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 3, stderr
    run = load_run(store, "latest")
    assert run.info["status"] == "target_lost"
    assert "lost" in set(run.gaps["kind"]) and "error" in set(run.gaps["kind"])
    assert (run.scrapes["ok"] == 1).sum() >= 30  # what was sampled before the kill is all there
    assert_taken_equals_written(store, run)
    down = cli("engine", "down", "--port", str(state.port), home=home)
    assert down.returncode == 0, down.stderr
    left = wait_gone(tree)
    assert not left, f"processes left after engine down: {left}"
    assert json.loads(json.dumps(lifecycle.all_states(home), default=str)) == []


def test_filtered_scrapes_give_the_analysis_series_of_full_bodies(engine):
    """After one full body the source asks /metrics/ for just the series the analysis reads (ALIASES):
    the same series, with the same labels, as in the full body; every other series waits for the next
    full body."""
    from cancelwatch.collectors.sources.vllm import ALIASES, VllmMetricsSource

    src = VllmMetricsSource(engine.url, "t0")
    full = src.sample(1, 2)
    assert src.endpoint._filtered_path is not None and "name%5B%5D=vllm%3Anum_requests_running" in src.endpoint._filtered_path
    filtered_body = src.endpoint.fetch(src.endpoint._filtered_path)
    assert len(filtered_body) < len(src.endpoint.fetch()) / 4
    again = src.sample(3, 4)
    ours = {name for name, _ in ALIASES.values()}
    want = sorted((s.metric, s.labels) for s in full if s.metric in ours)
    assert {"requests_running", "requests_waiting", "kv_cache_usage_ratio"} <= {m for m, _ in want}
    assert sorted((s.metric, s.labels) for s in again) == want
    src.close()


def test_a_store_of_another_schema_is_refused_before_recording(engine, engine_home, tmp_path):
    store = tmp_path / "old.db"
    with sqlite3.connect(store) as con:
        con.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
        con.execute("INSERT INTO meta VALUES ('schema_version', '1')")
    res = cli("sample", "--target", engine.url, "--duration", "1", "--store", str(store), home=engine_home)
    assert res.returncode == 2
    assert len(res.stderr.strip().splitlines()) == 1 and "schema 1" in res.stderr and "--store" in res.stderr
    with sqlite3.connect(store) as con:  # left exactly as it was
        assert [r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")] == ["meta"]
