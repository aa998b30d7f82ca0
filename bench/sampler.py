"""Sampler benchmark against the embedded engine under load.

Prints, per source and rate: achieved Hz, interval error p50/p99 (|interval - period|), scrape
duration p50/p99, and the sampler process's CPU share of one core (all its threads, the store
writer included). The load runs in a separate process so its CPU is not counted.

Usage: python bench/sampler.py [--target URL] [--seconds 15] [--rates 20,50]
Without --target it starts an embedded engine in a temp home and stops it at the end.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cancelwatch.collectors.engines import lifecycle  # noqa: E402
from cancelwatch.collectors.engines import vllm_server as engine_mod  # noqa: E402
from cancelwatch.collectors.recording.sampler import Sampler  # noqa: E402
from cancelwatch.collectors.sources.process_memory import ProcessMemorySource  # noqa: E402
from cancelwatch.collectors.sources.vllm import VllmMetricsSource  # noqa: E402
from cancelwatch.runstore.writer import StoreWriter, create_run, finish_run, open_store  # noqa: E402


def start_load(url: str, seconds: float) -> subprocess.Popen:
    """Bursts of 6 streams, back to back, for about `seconds` (bounded: at most 20 bursts)."""
    script = (
        "import asyncio, sys, time\n"
        "from cancelwatch.collectors.cancels.load import run_streams, served_model\n"
        f"url = {url!r}; end = time.monotonic() + {seconds}\n"
        "model = served_model(url)\n"
        "for _ in range(20):\n"
        "    if time.monotonic() > end: break\n"
        "    asyncio.run(run_streams(url, model, streams=6, prompt_tokens=1450, max_tokens=50))\n"
    )
    return subprocess.Popen([sys.executable, "-c", script], cwd=ROOT)


def pct(values, q) -> float:
    return float(np.percentile(values, q)) if len(values) else float("nan")


def bench_rate(url: str, pids: list[int], hz: float, seconds: float, store: Path) -> list[dict]:
    sources = [VllmMetricsSource(url, "t0"), ProcessMemorySource(pids)]
    con = open_store(store)
    run_id = create_run(con, name=f"bench-{hz:g}hz", targets=[{"label": "t0", "url": url}], engine={},
                        settings={"hz": hz}, wall_ns=time.time_ns(), mono_ns=time.monotonic_ns())
    writer = StoreWriter(con, run_id)
    sampler = Sampler(sources, writer.put, hz=hz)
    load = start_load(url, seconds)
    time.sleep(1.0)  # let the load reach the engine
    cpu0, wall0 = time.process_time(), time.monotonic()
    sampler.start()
    time.sleep(seconds)
    sampler.stop()
    writer.close()
    cpu_share = (time.process_time() - cpu0) / (time.monotonic() - wall0)
    load.wait(timeout=120)
    finish_run(con, run_id, "completed", {})
    con.close()
    period_ms = 1000.0 / hz
    rows = []
    for st in sampler.stats.values():
        intervals = np.array(st.intervals_ns) / 1e6
        err = np.abs(intervals - period_ms)
        durations = np.array(st.durations_ns) / 1e6
        span = ((st.last_ok_mono_ns or 0) - (st.first_ok_mono_ns or 0)) / 1e9
        rows.append({
            "hz": hz, "source": st.source, "achieved_hz": (st.scrapes_ok - 1) / span if span else float("nan"),
            "interval_err_p50_ms": pct(err, 50), "interval_err_p99_ms": pct(err, 99),
            "scrape_p50_ms": pct(durations, 50), "scrape_p99_ms": pct(durations, 99),
            "missed_ticks": st.missed_ticks, "errors": st.scrape_errors + st.parse_errors,
            "cpu_share_of_core": cpu_share,
        })
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", help="a running vLLM; default: start the embedded engine")
    ap.add_argument("--pid", type=int, action="append", default=[], help="engine pid(s) with --target")
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--rates", default="20,50")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="cw-bench-"))
    state = None
    if args.target:
        url, pids = args.target, args.pid
    else:
        print("starting the embedded engine ...", flush=True)
        state = engine_mod.start(tmp / "home", port=int(os.environ.get("BENCH_PORT", "8123")))
        url, pids = state.url, [state.pid]
    try:
        rows = []
        for hz in (float(r) for r in args.rates.split(",")):
            rows += bench_rate(url, pids, hz, args.seconds, tmp / "bench.db")
    finally:
        if state is not None:
            lifecycle.stop(tmp / "home", state.port)
    cols = ["hz", "source", "achieved_hz", "interval_err_p50_ms", "interval_err_p99_ms", "scrape_p50_ms",
            "scrape_p99_ms", "missed_ticks", "errors", "cpu_share_of_core"]
    print(" ".join(f"{c:>20}" for c in cols))
    for r in rows:
        print(" ".join(f"{r[c]:>20.3f}" if isinstance(r[c], float) else f"{r[c]:>20}" for c in cols))
    print("targets: 20 Hz sustained, p99 interval error <= 10 ms, CPU share <= 0.05 of one core")
    return 0


if __name__ == "__main__":
    sys.exit(main())
