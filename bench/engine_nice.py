"""What the embedded engine's nice (collectors/engines/lifecycle.py: ENGINE_NICE) buys the recorder beside it,
side by side in one run: one stream read to its end through a `cancelwatch watch` in front of the embedded
engine, rounds interleaved with the engine's session (its autogroup) and processes at nice 0 and at
ENGINE_NICE. Per round: how long the stream took (the engine's pace) and how long the watch's threads waited
for a CPU against how long they ran (/proc/PID/task/*/schedstat), and the longest hole between the watch's
scrapes of the engine's /metrics (its samples, as a run stores them).

    .venv/bin/python bench/engine_nice.py [--rounds 2] [--max-tokens 2000]

Figures, not assertions: these machines are shared and noisy. Starts the embedded engine on a free port and
stops it (and the watches) at the end. Needs a Linux with /proc; the autogroup is set where the kernel has
them.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.watch import wait_listening  # noqa: E402
from cancelwatch.collectors.cancels.load import served_model  # noqa: E402
from cancelwatch.collectors.engines import lifecycle, vllm_server  # noqa: E402
from cancelwatch.collectors.engines.lifecycle import free_port  # noqa: E402
from cancelwatch.collectors.families import family_for_target  # noqa: E402
from cancelwatch.runstore.reader import load_run  # noqa: E402


def schedstat(pid: int) -> tuple[float, float]:
    """(s run, s waited for a CPU) summed over the threads of `pid` now."""
    run = wait = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            r, w, _ = map(int, (task / "schedstat").read_text().split())
        except (OSError, ValueError):
            continue
        run, wait = run + r, wait + w
    return run / 1e9, wait / 1e9


def set_nice(engine_pid: int, nice: int) -> None:
    for pid in [engine_pid, *(c.pid for c in psutil.Process(engine_pid).children(recursive=True))]:
        try:
            os.setpriority(os.PRIO_PROCESS, pid, nice)
        except OSError:
            pass
    lifecycle.yield_cpu(engine_pid, nice)


def one_round(home: Path, engine: str, model: str, max_tokens: int, n: int) -> tuple[float, float, float, float]:
    """(s the stream took, s the watch's threads ran, s they waited for a CPU, longest hole between its scrapes)."""
    listen, store = free_port(), home / f"watch-{n}.db"
    env = {**os.environ, "CANCELWATCH_HOME": str(home)}
    watch = subprocess.Popen([sys.executable, "-m", "cancelwatch", "watch", "--listen", f"127.0.0.1:{listen}",
                              "--upstream", engine, "--store", str(store)], cwd=ROOT, env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_listening(listen)
        time.sleep(3)  # the watch's start-up done
        run0, wait0 = schedstat(watch.pid)
        body = {"model": model, "prompt": "The sea", "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
        t0 = time.monotonic()
        with httpx.stream("POST", f"http://127.0.0.1:{listen}/v1/completions", json=body, timeout=300) as r:
            for _ in r.iter_lines():
                pass
        took = time.monotonic() - t0
        run1, wait1 = schedstat(watch.pid)
    finally:
        watch.send_signal(signal.SIGTERM)
        try:
            watch.wait(60)
        except subprocess.TimeoutExpired:
            watch.kill()
    scrapes = load_run(store, "latest").scrapes
    scheduler = scrapes[scrapes["source"] == family_for_target(engine).scheduler_source]
    times = np.sort(scheduler["mono_ns"].to_numpy(float)) / 1e9
    hole = float(np.max(np.diff(times))) if len(times) > 1 else float("nan")
    return took, run1 - run0, wait1 - wait0, hole


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=2000)
    args = ap.parse_args()
    home = Path(tempfile.mkdtemp(prefix="cw-bench-nice-"))
    port = free_port()
    state = vllm_server.start(home, port=port, timeout_s=600)
    engine = f"http://127.0.0.1:{port}"
    try:
        model = served_model(engine)
        got: dict[int, list[tuple[float, float, float, float]]] = {0: [], lifecycle.ENGINE_NICE: []}
        n = 0
        for _ in range(args.rounds):
            for nice in got:
                set_nice(state.pid, nice)
                got[nice].append(one_round(home, engine, model, args.max_tokens, n))
                n += 1
        set_nice(state.pid, lifecycle.ENGINE_NICE)
        print(f"{args.rounds} rounds: one stream of {args.max_tokens} tokens through a watch, the engine at each nice")
        print(f"{'engine nice':>11} {'stream s':>9} {'watch ran s':>12} {'watch waited s':>15} {'waited/ran':>11} "
              f"{'longest scrape hole s':>22}")
        for nice, rows in got.items():
            took, ran, waited, hole = (float(np.median([r[i] for r in rows])) for i in range(4))
            print(f"{nice:11d} {took:9.2f} {ran:12.2f} {waited:15.2f} {waited / ran if ran else float('nan'):11.1f} "
                  f"{hole:22.2f}")
    finally:
        lifecycle.stop(home, state.port)


if __name__ == "__main__":
    main()
