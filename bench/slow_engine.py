"""The slow-engine knob, measured: the embedded vLLM at the machine's speed and under CANCELWATCH_ENGINE_CPUS.

Starts the embedded engine once free and once with a CPU quota of --cores (the knob's value, default 0.3),
runs the reference load on each (six streams of 1450 prompt tokens and 50 generated tokens, the load of
the engine tests and `make demo`) --repeats times after one warm-up round, and prints per condition the
load's wall time (each round and the median), the first token p50 and the engine's start-up time, side by
side, with the ratio. The knob is meant to make that load take at least 16 s (a slow CI machine's).

Usage: python bench/slow_engine.py [--cores 0.3] [--repeats 3]
Needs root (the quota is a cgroup); the engines live in a temp home and are stopped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cancelwatch.collectors.cancels.load import run_streams  # noqa: E402
from cancelwatch.collectors.engines import lifecycle  # noqa: E402
from cancelwatch.collectors.engines import vllm_server as engine_mod  # noqa: E402

STREAMS, PROMPT_TOKENS, MAX_TOKENS = 6, 1450, 50


def measure(home: Path, cores: float | None, repeats: int) -> dict:
    t0 = time.monotonic()
    state = engine_mod.start(home, port=lifecycle.free_port(), cpu_cores=cores, timeout_s=1200)
    startup_s = time.monotonic() - t0
    try:
        rounds, firsts = [], []
        for i in range(repeats + 1):
            t = time.monotonic()
            res = asyncio.run(run_streams(state.url, state.served_model_name, STREAMS, PROMPT_TOKENS, MAX_TOKENS,
                                          timeout_s=600))
            wall = time.monotonic() - t
            bad = [r for r in res if r.error or r.chunks != MAX_TOKENS]
            if bad:
                raise SystemExit(f"a stream failed on the {'limited' if cores else 'free'} engine: {bad[0]}")
            label = "warm-up" if i == 0 else f"round {i}"
            print(f"  {'quota ' + format(cores, 'g') + ' cores' if cores else 'free':>16} {label:>8}: {wall:6.1f} s, "
                  f"first token p50 {statistics.median(r.first_chunk_s for r in res):.2f} s", flush=True)
            if i:
                rounds.append(wall)
                firsts.extend(r.first_chunk_s for r in res)
        return {"startup_s": startup_s, "rounds": rounds, "median_s": statistics.median(rounds),
                "first_p50_s": statistics.median(firsts)}
    finally:
        lifecycle.stop(home, state.port)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cores", type=float, default=0.3)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="cw-slow-engine-"))
    print(f"load: {STREAMS} streams x {PROMPT_TOKENS} prompt tokens, {MAX_TOKENS} generated; "
          f"{args.repeats} rounds after a warm-up", flush=True)
    free = measure(tmp / "free", None, args.repeats)
    slow = measure(tmp / "slow", args.cores, args.repeats)
    print()
    print("| engine | start-up | load wall (rounds) | load wall median | first token p50 |")
    print("|---|---|---|---|---|")
    for name, r in (("free", free), (f"CANCELWATCH_ENGINE_CPUS={args.cores:g}", slow)):
        print(f"| {name} | {r['startup_s']:.0f} s | {', '.join(f'{x:.1f}' for x in r['rounds'])} s | "
              f"{r['median_s']:.1f} s | {r['first_p50_s']:.2f} s |")
    print(f"\nslow / free: load {slow['median_s'] / free['median_s']:.1f}x, start-up "
          f"{slow['startup_s'] / free['startup_s']:.1f}x; the knob's target, load >= 16 s: "
          f"{'met' if min(slow['rounds']) >= 16 else 'NOT met'} (shortest round {min(slow['rounds']):.1f} s)")


if __name__ == "__main__":
    main()
