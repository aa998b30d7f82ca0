"""Soak: many cancels with neighbours over a long run, against the embedded engine.

One `cancelwatch record` run drives a soak suite (decode cancels three at a time and client
disconnects two at a time, each with a streaming neighbour and a probe) until at least --cancels
cancels are made, while this script watches the recorder's RSS. Prints:
- harmed neighbours (a neighbour that did not complete; must be 0);
- samples taken vs written (must be equal);
- the recorder's RSS after its first minute and at the end (growth must stay < 10 %);
- store bytes per hour of recording;
- verdict counts, and how many of the cancels record's live judge kept agree with `report`'s whole-run judgement.

Usage: python bench/soak.py [--target URL] [--cancels 500] [--minutes 25]
Without --target it starts an embedded engine in a temp home and stops it at the end.
"""

from __future__ import annotations

import argparse
import json
import os
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

from cancelwatch.collectors.engines import lifecycle  # noqa: E402
from cancelwatch.collectors.engines import vllm_server as engine_mod  # noqa: E402
from cancelwatch.analysis.verdicts.stored import usable  # noqa: E402
from cancelwatch.runstore.reader import load_run, load_verdicts  # noqa: E402

SUITE = """
[[scenario]]
name = "soak_decode_{i}"
trigger = "after_tokens"
trigger_value = 20
prompt_tokens = 300
max_tokens = 1200
concurrency = 3
cancel_count = 3
neighbour_max_tokens = 150
repeats = {repeats}

[[scenario]]
name = "soak_disconnect_{i}"
mode = "disconnect"
trigger = "after_tokens"
trigger_value = 10
prompt_tokens = 300
max_tokens = 1200
concurrency = 2
cancel_count = 2
neighbour_max_tokens = 150
repeats = {repeats}
"""


def tree_rss(pid: int) -> int:
    try:
        return psutil.Process(pid).memory_info().rss
    except psutil.Error:
        return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target")
    ap.add_argument("--cancels", type=int, default=500)
    ap.add_argument("--minutes", type=float, default=25.0, help="upper bound: the run is interrupted then")
    ap.add_argument("--hz", default="20")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="cw-soak-"))
    home = tmp / "home"
    # 3 + 2 cancels per pair of scenarios; a scenario repeats at most 20 times, so the suite holds as
    # many numbered pairs as the total needs (they alternate: decode, disconnect, decode, ...)
    pairs = -(-args.cancels // 5)
    blocks, left = [], pairs
    for i in range(-(-pairs // 20)):
        blocks.append(SUITE.format(i=i, repeats=min(20, left)))
        left -= 20
    scen = tmp / "soak.toml"
    scen.write_text("".join(blocks))
    store = tmp / "soak.db"
    state, url = None, args.target
    if url is None:
        state = engine_mod.start(home, port=lifecycle.free_port())
        url = state.url
    try:
        env = {**os.environ, "CANCELWATCH_HOME": str(home)}
        # the soak suite interleaves: decode, disconnect, decode, ... is what `repeats` gives per scenario;
        # the driver runs a scenario's repeats back to back, which is as much of a soak
        t0 = time.monotonic()
        # record's report (500 rows) goes to a file: a pipe nobody reads while it runs would fill and block it
        report_out = (tmp / "record-stdout.txt").open("w")
        proc = subprocess.Popen([sys.executable, "-m", "cancelwatch", "record", "--target", url, "--scenario",
                                 str(scen), "--store", str(store), "--nvml", "off", "--hz", args.hz,
                                 "--name", "soak"], cwd=ROOT, env=env, stdout=report_out,
                                stderr=subprocess.PIPE, text=True)
        rss_samples: list[tuple[float, int, int]] = []  # (s since start, wall ns, RSS bytes)
        deadline = t0 + args.minutes * 60
        while proc.poll() is None and time.monotonic() < deadline:
            rss_samples.append((time.monotonic() - t0, time.time_ns(), tree_rss(proc.pid)))
            time.sleep(5)
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # bounded: the partial run is kept and judged
        _, err = proc.communicate(timeout=600)
        report_out.close()
        wall = time.monotonic() - t0
        if not store.exists():
            raise SystemExit(f"record recorded nothing (exit {proc.returncode}): {err.strip()[-800:]}")
        rep = subprocess.run([sys.executable, "-m", "cancelwatch", "report", "latest", "--json", "--store", str(store)],
                             cwd=ROOT, capture_output=True, text=True, timeout=600)
        doc = json.loads(rep.stdout)
        run = load_run(store, "latest")
        stats = run.info["stats"]
        ledger = run.ledger
        neighbours = ledger[ledger["role"] == "neighbour"]
        harmed = neighbours[neighbours["terminal_state"] != "completed"]
        verdicts = Counter(c["verdict"] for c in doc["cancels"])
        run_s = (run.info["ended_wall_ns"] - run.info["started_wall_ns"]) / 1e9
        size = sum(p.stat().st_size for p in tmp.glob("soak.db*"))
        # the recorder while it records: from its first minute to the run's end (after it, `record` reports:
        # past analysis.long_runs.RECORDED_LONG_S from the overview and the verdicts judged live, which is not
        # the recorder's growth)
        recording = [(t, r) for t, w, r in rss_samples if w <= run.info["ended_wall_ns"]]
        warm = [r for t, r in recording if t >= 60] or [r for _, r in recording]
        rss_start, rss_end = warm[0], warm[-1]
        report_peak = max((r for _, w, r in rss_samples if w > run.info["ended_wall_ns"]), default=None)
        print(f"soak: {len(doc['cancels'])} cancels in {run_s / 60:.1f} min ({wall / 60:.1f} min wall), record exit "
              f"{proc.returncode}, run {run.info['status']}")
        print(f"  harmed neighbours:   {len(harmed)} of {len(neighbours)}"
              + (f"  ({', '.join(sorted(set(harmed['terminal_state'].astype(str))))})" if len(harmed) else ""))
        print(f"  samples taken:       {stats.get('samples_taken')}")
        print(f"  samples written:     {stats.get('samples_written')}"
              f"  ({'equal' if stats.get('samples_taken') == stats.get('samples_written') else 'NOT equal'})")
        print(f"  recorder RSS:        {rss_start / 2**20:.1f} MiB at 1 min -> {rss_end / 2**20:.1f} MiB at the end "
              f"({100 * (rss_end - rss_start) / rss_start:+.1f} %) of the recording; its report at its end: "
              + (f"{report_peak / 2**20:.1f} MiB at most" if report_peak else "not sampled"))
        trend = [f"{t / 60:.0f} min {r / 2**20:.0f}" for t, r in recording[12::24]]
        print(f"  recorder RSS (MiB):  {', '.join(trend)}")
        print(f"  store:               {size / 2**20:.1f} MiB, {size / 2**20 / (run_s / 3600):.1f} MiB per hour")
        print(f"  verdicts:            {dict(verdicts)}")
        # record's live judge (each cancel on its own window, kept with the run) against `report`, which reads a
        # run shorter than 3 hours whole and judges it
        live = usable(load_verdicts(store, run.id))
        same = sum(1 for c in doc["cancels"] if (v := live.get(c["request_id"])) is not None
                   and (v.verdict, v.rule) == (c["verdict"], c["evidence"].get("rule")))
        print(f"  judged live:         {len(live)} kept with the run; {same} of them as the whole run's report says")
        if err.strip():
            print(f"  record stderr: {err.strip()[-500:]}")
    finally:
        if state is not None:
            lifecycle.stop(home, state.port)


if __name__ == "__main__":
    main()
