"""Accelerated soak of `cancelwatch record` (issue 21 point 3): a long record's memory, and its live judge, over a
day's worth of 20 Hz ticks in as little wall time as this machine allows, while this script reads the recorder's
RSS.

The target is bench/watch_soak.py's fixture engine in a process of its own (not counted), with its scheduler gauges
counting the streams it sends (`--serve PORT --live`): `record`'s scenarios wait for the count to agree with the
client and for an idle engine as on a real one. The recorder samples it at --hz (far above 20: that is the
acceleration; above 200 Hz with the cap raised, as watch_soak.py does) and drives a scripted suite (decode cancels
three at a time, each scenario with its neighbour and probe) until --cancels are made or --minutes pass (then
Ctrl-C: the partial run is kept and judged). Its live judge (cancelwatch/live_judge.py) judges each cancel on its
own window as the run goes, and keeps the verdict with the run; its end reports from the run's overview and those
verdicts (a run past analysis.long_runs.RECORDED_LONG_S), never reading the run whole.

Prints: ticks written and the hours of 20 Hz ticks they stand for; the recorder's RSS after an hour's ticks and at
the end of the recording, and the growth between; RSS along the way; its peak while it reported (its tail); its
CPU; cancels made, judged live and kept, and the verdict counts of its report; the store's size.

Usage: python bench/record_soak.py [--minutes 40] [--hz 800] [--cancels 1000] [--keep]
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.watch_soak import TICKS_PER_HOUR, cli_argv, free_port, print_memory, start_fixture, tidy  # noqa: E402
from cancelwatch.collectors.sources.vllm import SOURCE_NAME  # noqa: E402
from cancelwatch.runstore.reader import load_overview, load_verdicts, resolve_run_id  # noqa: E402

# the fixture sends 40 chunks a stream, one every 20 ms: the trigger and the neighbour fit inside it
SUITE = """
[[scenario]]
name = "soak_decode_{i}"
trigger = "after_tokens"
trigger_value = 10
prompt_tokens = 20
max_tokens = 40
concurrency = 3
cancel_count = 3
neighbour_max_tokens = 40
repeats = {repeats}
"""
PER_SCENARIO = 3  # cancels a scenario makes
MAX_REPEATS = 20  # a scenario repeats at most this often (collectors/cancels/scenarios.py)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=40.0, help="upper bound: the run is interrupted then")
    ap.add_argument("--hz", type=float, default=800.0)
    ap.add_argument("--cancels", type=int, default=1000)
    ap.add_argument("--keep", action="store_true", help="keep the run's store (removed by default)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="cw-record-soak-"))
    store = tmp / "soak.db"
    runs = -(-args.cancels // PER_SCENARIO)
    blocks, left = [], runs
    for i in range(-(-runs // MAX_REPEATS)):
        blocks.append(SUITE.format(i=i, repeats=min(MAX_REPEATS, left)))
        left -= MAX_REPEATS
    scen = tmp / "soak.toml"
    scen.write_text("".join(blocks))
    port = free_port()
    engine = start_fixture(port, live=True)
    proc, err = None, ""
    try:
        out, said_err = tmp / "record-stdout.txt", tmp / "record-stderr.txt"
        report_out, err_out = out.open("w"), said_err.open("w")  # a pipe nobody reads while it runs would fill
        proc = subprocess.Popen(
            [*cli_argv(args.hz), "record", "--target", f"http://127.0.0.1:{port}", "--scenario", str(scen),
             "--store", str(store), "--nvml", "off", "--hz", str(args.hz), "--grace", "1", "--name", "record soak"],
            cwd=ROOT, stdout=report_out, stderr=err_out)
        t0 = time.monotonic()
        ps = psutil.Process(proc.pid)
        rss: list[tuple[float, int, int, float]] = []  # (s since start, wall ns, RSS bytes, CPU s)
        stop_at, hard = t0 + args.minutes * 60, t0 + args.minutes * 60 + 600  # its report at the end, still read
        while proc.poll() is None and time.monotonic() < hard:
            if time.monotonic() >= stop_at:
                proc.send_signal(signal.SIGINT)  # bounded: the partial run is kept and judged
                stop_at = float("inf")
            try:
                rss.append((time.monotonic() - t0, time.time_ns(), ps.memory_info().rss, sum(ps.cpu_times()[:2])))
            except psutil.Error:
                break
            time.sleep(2.0)
        proc.wait(60)
        report_out.close()
        err_out.close()
        err = said_err.read_text()
        wall = time.monotonic() - t0
        if not store.exists():
            raise SystemExit(f"record recorded nothing (exit {proc.returncode}): {err.strip()[-800:]}")
        rid = resolve_run_id(store, "latest")
        over = load_overview(store, rid, metrics=())  # the counts of its scrapes, not its samples
        info = over.info
        ticks = sum(s["scrapes_ok"] for s in info["overview"]["sampling"] if s["source"] == SOURCE_NAME)
        stats = info["stats"]
        kept = len(load_verdicts(store, rid))
        stops = over.events[over.events["kind"] == "user_stop"]["request_id"].nunique() if not over.events.empty else 0
        run_s = (info["ended_wall_ns"] - info["started_wall_ns"]) / 1e9
        rate = ticks / run_s
        # the recording, then its report: the recorder's own growth is the first's
        recording = [(t, r) for t, w, r, _ in rss if w <= info["ended_wall_ns"]]
        cpu = max((c for _, w, _, c in rss if w <= info["ended_wall_ns"]), default=0.0)
        tail = max((r for _, w, r, _ in rss if w > info["ended_wall_ns"]), default=None)
        lines = out.read_text().splitlines()
        said = Counter(line.split()[3] for line in lines if line.startswith("record: cancel "))
        table = Counter(w for line in lines for w in ("released", "leaked", "stale_gauge", "inconclusive")
                        if line.startswith("│") and f" {w} " in line)
        print(f"record soak: {ticks:,} scrapes of the engine in {run_s / 60:.1f} min ({rate:.0f} Hz): "
              f"{ticks / TICKS_PER_HOUR:.1f} h of 20 Hz ticks; record exit {proc.returncode}, run {info['status']}, "
              f"{wall / 60:.1f} min with its report")
        print(f"  cancels made {stops}: judged live {sum(said.values())} ({dict(said)}), kept with the run at its end "
              f"{kept}; its report's table {dict(table)}; samples taken {stats.get('samples_taken')}, written "
              f"{stats.get('samples_written')}")
        print_memory("recorder", recording, rate, ticks, cpu, run_s, "at the end of the recording",
                     "; its report at its end: " + (f"{tail / 2**20:.1f} MiB at most" if tail else "not sampled"))
    finally:
        tidy([proc, engine], tmp, store, args.keep, err, "record")


if __name__ == "__main__":
    main()
