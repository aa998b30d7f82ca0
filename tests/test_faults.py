"""Faults that must not lose what was recorded (no engine: recorded /metrics bodies on a real socket).

- The store's disk fills up (a file-size limit on the recorder): one line naming the store's path, the
  run ends early as failed, and every sample written before the failure is intact and readable.
- Two recorders write one store at once while the dashboard reads it: both complete, nobody sees
  "database is locked".
The engine-side faults (SIGSTOP, SIGKILL, Ctrl-C during `record`) are in test_faults_engine.py.
"""

from __future__ import annotations

import resource
import signal
import sqlite3
import subprocess
import sys
import threading
import time

from cancelwatch.runstore.reader import load_run
from tests.conftest import FIXTURES, ROOT, wait_recording
from tests.fixture_server import MetricsFixtureServer
from tests.test_dashboard import app

LOADED = FIXTURES / "vllm" / "0.32" / "loaded.txt"


def sample_cmd(url: str, store, duration: float, hz: float = 20, name: str | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "cancelwatch", "sample", "--target", url, "--duration", str(duration),
           "--hz", str(hz), "--nvml", "off", "--store", str(store)]
    return cmd + (["--name", name] if name else [])


def file_size_limit(nbytes: int):
    def apply():
        # a write past the limit then fails with EFBIG (as on a full disk) instead of killing the process
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))
    return apply


def test_a_full_disk_ends_the_run_with_one_line_and_keeps_what_was_written(tmp_path):
    store = tmp_path / "cw.db"
    with MetricsFixtureServer(LOADED) as server:
        started = time.monotonic()
        res = subprocess.run(sample_cmd(server.url, store, duration=60), capture_output=True, text=True, cwd=ROOT,
                             timeout=120, preexec_fn=file_size_limit(1_500_000))
        took = time.monotonic() - started
    assert res.returncode == 1, res.stdout[-2000:] + res.stderr[-2000:]
    line = res.stderr.strip()
    assert line.count("\n") == 0 and str(store) in line and "free space or choose another --store" in line, line
    assert took < 45, f"the run went on for {took:.0f} s after its store was full"  # it stopped, not 60 s
    # what was written before the failure is intact: the store is consistent and the run readable
    with sqlite3.connect(store) as db:
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        (n,) = db.execute("select count(*) from samples").fetchone()
    assert n > 0, "nothing was written before the limit: raise it so the test shows earlier writes kept"
    run = load_run(store, "latest")
    assert run.info["status"] == "failed"
    assert f"{n} samples written" in line, (n, line)
    assert len(run.scrapes) > 0 and (run.scrapes["ok"] == 1).all()


def test_ctrl_c_ends_the_run_even_when_the_recorder_was_started_with_sigint_ignored(tmp_path):
    """`cmd &` in a script starts a command with SIGINT ignored (a test suite run that way did); Python then never
    raises KeyboardInterrupt, and `kill -INT` or the dashboard's Stop was lost: the run went on."""
    store = tmp_path / "cw.db"

    def ignore_sigint():
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    with MetricsFixtureServer(LOADED) as server:
        proc = subprocess.Popen(sample_cmd(server.url, store, duration=0), cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, preexec_fn=ignore_sigint)
        try:
            wait_recording(store, ok_scrapes=10)
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate(timeout=30)
    assert proc.returncode == 130, out[-2000:] + err[-2000:]
    run = load_run(store, "latest")
    assert run.info["status"] == "interrupted" and len(run.scrapes) >= 10


def test_two_recorders_and_the_dashboard_share_one_store(tmp_path, monkeypatch):
    store = tmp_path / "cw.db"
    with MetricsFixtureServer(LOADED) as a, MetricsFixtureServer(LOADED) as b:
        procs = [subprocess.Popen(sample_cmd(s.url, store, duration=12, hz=50, name=f"rec-{i}"), cwd=ROOT,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for i, s in enumerate((a, b))]
        reads, errors = [], []
        stop = threading.Event()

        def read_loop():  # a reader outside the page too, as fast as it can
            while not stop.is_set():
                try:
                    if store.exists():
                        reads.append(len(load_run(store, "latest").scrapes))
                except Exception as exc:  # noqa: BLE001 - any failure to read is what this test looks for
                    # read before the first recorder made its run: the truth, not a failure
                    if reads or "holds no runs yet" not in str(exc):
                        errors.append(f"{type(exc).__name__}: {exc}")
                time.sleep(0.05)

        reader = threading.Thread(target=read_loop, daemon=True)
        reader.start()
        pages = 0
        try:
            time.sleep(2)
            deadline = time.monotonic() + 9
            while time.monotonic() < deadline and all(p.poll() is None for p in procs):
                at = app(tmp_path, monkeypatch, store="cw.db", run="latest")  # the dashboard, reading
                assert not at.exception, [e.value for e in at.exception]
                pages += 1
            outs = [p.communicate(timeout=60) for p in procs]
        finally:
            stop.set()
            reader.join(10)
            for p in procs:
                if p.poll() is None:
                    p.kill()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, out[-2000:] + err[-2000:]
        assert "locked" not in (out + err).lower()
    assert not errors, errors[:5]
    assert pages >= 1 and len(reads) >= 10
    with sqlite3.connect(store) as db:
        rows = db.execute("select name, status from runs order by id").fetchall()
    assert sorted(rows) == [("rec-0", "completed"), ("rec-1", "completed")]
    for run_id in (1, 2):
        run = load_run(store, run_id)
        assert (run.scrapes["ok"] == 1).sum() > 100  # each sampled its own server all along


def test_a_run_read_while_it_grows_holds_only_samples_of_scrapes_it_read(tmp_path):
    """The reader takes scrapes, series and samples in separate reads: rows written in between must
    not come back attached to the wrong scrape (or fail on an empty table)."""
    import cancelwatch.runstore.reader as reader
    from cancelwatch.runstore.records import Sample, ScrapeRecord
    from cancelwatch.runstore.writer import StoreWriter, create_run, open_store

    store = tmp_path / "cw.db"
    con = open_store(store)
    rid = create_run(con, name="growing", targets=[{"label": "t0", "url": "http://127.0.0.1:9"}], engine={},
                     settings={"hz": 20}, wall_ns=time.time_ns(), mono_ns=time.monotonic_ns())
    writer = StoreWriter(con, rid, flush_s=0.01)

    def scrape(i: int) -> ScrapeRecord:
        now = time.monotonic_ns()
        return ScrapeRecord("vllm", "t0", i, time.time_ns(), now, 1000, True,
                            [Sample("vllm", "requests_running", float(i), (), time.time_ns(), now)])

    real = reader._load_scrapes
    written_between = []

    def scrapes_then_more(con_, path, rid_, within=None, only=None, **kw):
        out = real(con_, path, rid_, within, only, **kw)
        for i in range(len(out), len(out) + 3):  # the recorder writes on while the reader is between reads
            writer.put(scrape(i))
        time.sleep(0.3)
        written_between.append(3)
        return out

    writer.put(scrape(0))
    time.sleep(0.3)
    reader._load_scrapes = scrapes_then_more
    try:
        run = load_run(store, "latest")
    finally:
        reader._load_scrapes = real
        writer.close()
        con.close()
    assert written_between and len(run.scrapes) == 1
    assert run.samples["value"].tolist() == [0.0]  # not the later scrapes' values under scrape 0's time
    assert len(load_run(store, "latest").samples) == 4  # the next read has them all
