"""Burst sampling: how precisely a cancel's release is located, and at what cost.

Records the same cancels (a decode cancel with a streaming neighbour, repeated) on the embedded
engine at 20 Hz flat, 100 Hz flat and 20 Hz with 100 Hz bursts around each stop (`--burst-hz 100`),
the modes interleaved and repeated. Prints, per mode:
- where `left_scheduler` (the first sample showing the request gone) falls after the engine's own
  abort line: p50/p90/max in ms, against one engine step (the neighbour's median inter-token time);
- the scheduler source's average scrape rate over the run (what the engine serves);
- the recorder process's CPU (one core = 100 %; the driver's share is the same in every mode);
- the engine's CPU seconds per 1000 generated tokens (its observer effect: higher = sampling took
  from the engine).

Usage: python bench/burst.py [--target URL --engine-log PATH] [--cancels 8] [--repeats 2]
Without --target it starts an embedded engine in a temp home and stops it at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cancelwatch.analysis.series import series_frame  # noqa: E402
from cancelwatch.collectors.engines import lifecycle  # noqa: E402
from cancelwatch.collectors.engines import vllm_server as engine_mod  # noqa: E402
from cancelwatch.collectors.sources.vllm import SOURCE_NAME as VLLM_SOURCE  # noqa: E402
from cancelwatch.runstore.reader import load_run  # noqa: E402

MODES = [("20 Hz flat", ["--hz", "20"]), ("100 Hz flat", ["--hz", "100"]),
         ("20 + 100 burst", ["--hz", "20", "--burst-hz", "100", "--burst-window", "2s"])]
SCENARIO = """
[[scenario]]
name = "burst_decode"
trigger = "after_tokens"
trigger_value = 20
prompt_tokens = 600
max_tokens = 1200
neighbour_max_tokens = 400
repeats = {repeats}
"""


def engine_cpu_s(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
        except psutil.Error:
            pass
    return total


def pct(values, q) -> float:
    return float(np.percentile(values, q)) if len(values) else float("nan")


def one_mode(url: str, home: Path, args_: list[str], scen: Path, store: Path, engine_pids: list[int],
             extra: list[str]) -> dict:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu0, t0 = engine_cpu_s(engine_pids), time.monotonic()
    env = {**os.environ, "CANCELWATCH_HOME": str(home)}
    res = subprocess.run([sys.executable, "-m", "cancelwatch", "record", "--target", url, "--scenario", str(scen),
                          "--store", str(store), "--nvml", "off", *args_, *extra], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=1800)
    wall = time.monotonic() - t0
    engine_cpu = engine_cpu_s(engine_pids) - cpu0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if res.returncode not in (0, 1):
        raise SystemExit(f"record failed ({res.returncode}): {res.stderr[-800:]}")
    rec_cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    run = load_run(store, "latest")
    doc = json.loads(subprocess.run([sys.executable, "-m", "cancelwatch", "report", "latest", "--json", "--store",
                                     str(store)], cwd=ROOT, capture_output=True, text=True).stdout)
    deltas = [1000 * (c["timepoints"]["left_scheduler"] - c["timepoints"]["engine_abort"]) for c in doc["cancels"]
              if c["timepoints"]["left_scheduler"] is not None and c["timepoints"]["engine_abort"] is not None
              and c["timepoint_sources"]["engine_abort"]["source"] == "engine_log"]
    led = run.ledger[run.ledger["role"] == "neighbour"]
    steps = [(r.closed_mono_ns - r.first_token_mono_ns) / 1e6 / max(1, r.chunks - 1) for r in led.itertuples()
             if r.first_token_mono_ns and r.closed_mono_ns and r.chunks > 1]
    sc = run.scrapes[(run.scrapes["source"] == VLLM_SOURCE) & (run.scrapes["ok"] == 1)]
    span = (sc["t_s"].max() - sc["t_s"].min()) if len(sc) > 1 else float("nan")
    gen = series_frame(run, "generation_tokens_total")
    tokens = float(gen["value"].max() - gen["value"].min()) if len(gen) else float("nan")
    return {"deltas": deltas, "step_ms": float(np.median(steps)) if steps else float("nan"),
            "scrape_hz": len(sc) / span if span else float("nan"), "recorder_cpu": 100 * rec_cpu / wall,
            "engine_cpu_per_1k": 1000 * engine_cpu / tokens if tokens else float("nan"),
            "released": sum(c["verdict"] == "released" for c in doc["cancels"]), "cancels": len(doc["cancels"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target")
    ap.add_argument("--engine-log")
    ap.add_argument("--cancels", type=int, default=8, help="cancels per mode and repeat")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="cw-burst-"))
    home = tmp / "home"
    scen = tmp / "burst.toml"
    scen.write_text(SCENARIO.format(repeats=args.cancels))
    state, url, extra = None, args.target, []
    if url is None:
        state = engine_mod.start(home, port=lifecycle.free_port())
        url = state.url
        pids = lifecycle.engine_pids(state)
    else:
        pids = []
        if args.engine_log:
            extra = ["--engine-log", args.engine_log]
    try:
        results: dict[str, list[dict]] = {m: [] for m, _ in MODES}
        for rep in range(args.repeats):
            order = MODES[rep % len(MODES):] + MODES[:rep % len(MODES)]
            for name, margs in order:
                r = one_mode(url, home, margs, scen, tmp / f"{rep}-{name.split()[0]}-{len(margs)}.db", pids, extra)
                results[name].append(r)
                print(f"  repeat {rep + 1} {name:>15}: left-abort p50 {pct(r['deltas'], 50):6.1f} ms, "
                      f"{r['scrape_hz']:5.1f} scrapes/s, recorder {r['recorder_cpu']:4.1f}% CPU, "
                      f"{r['released']}/{r['cancels']} released", flush=True)
        print(f"\nburst sampling: {args.cancels} decode cancels x {args.repeats} repeats per mode")
        print(f"{'mode':>15} {'n':>4} {'p50 ms':>7} {'p90 ms':>7} {'max ms':>7} {'step ms':>8} {'p50/step':>8} "
              f"{'scrapes/s':>9} {'recorder CPU':>12} {'engine CPU s/1k tok':>19}")
        for name, _ in MODES:
            rs = results[name]
            d = [x for r in rs for x in r["deltas"]]
            step = float(np.median([r["step_ms"] for r in rs]))
            print(f"{name:>15} {len(d):4d} {pct(d, 50):7.1f} {pct(d, 90):7.1f} {max(d) if d else float('nan'):7.1f} "
                  f"{step:8.1f} {pct(d, 50) / step:8.2f} {np.mean([r['scrape_hz'] for r in rs]):9.1f} "
                  f"{np.mean([r['recorder_cpu'] for r in rs]):11.1f}% "
                  f"{np.mean([r['engine_cpu_per_1k'] for r in rs]):19.2f}")
    finally:
        if state is not None:
            lifecycle.stop(home, state.port)


if __name__ == "__main__":
    main()
