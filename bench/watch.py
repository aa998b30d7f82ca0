"""What `cancelwatch watch` costs real traffic, side by side with the same load direct, in one run: tokens/s
and time to first token (p50, p99) of the same streams to the embedded engine direct and through a watch,
rounds interleaved (direct, watched, direct, watched, ...) so that a noisy machine weighs on both; and the
watch's own CPU time and memory, per hour of watching.

    .venv/bin/python bench/watch.py [--rounds 3] [--streams 4] [--max-tokens 200] [--prompt-tokens 200]

Figures, not assertions: these machines are shared and noisy. Starts the embedded engine on a free port
and stops it (and the watch) at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cancelwatch.collectors.cancels.load import run_streams, served_model  # noqa: E402
from cancelwatch.collectors.engines import lifecycle  # noqa: E402
from cancelwatch.collectors.engines.lifecycle import free_port  # noqa: E402
from cancelwatch.collectors.engines import vllm_server  # noqa: E402


def wait_listening(port: int, limit_s: float = 120.0) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise SystemExit(f"the watch did not listen on {port} within {limit_s:.0f} s")


def one_round(url: str, model: str, streams: int, prompt_tokens: int, max_tokens: int) -> tuple[float, list[float]]:
    """(tokens/s over the round's wall time, each stream's time to first token)."""
    t = time.monotonic()
    res = asyncio.run(run_streams(url, model, streams=streams, prompt_tokens=prompt_tokens, max_tokens=max_tokens))
    wall = time.monotonic() - t
    bad = [r.error for r in res if r.error]
    if bad:
        raise SystemExit(f"a stream failed: {bad[0]}")
    return sum(r.chunks for r in res) / wall, [r.first_chunk_s for r in res if r.first_chunk_s is not None]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--prompt-tokens", type=int, default=200)
    args = ap.parse_args()
    home = Path(tempfile.mkdtemp(prefix="cw-bench-watch-"))
    port, listen, mport = free_port(), free_port(), free_port()
    state = vllm_server.start(home, port=port, timeout_s=600)
    engine = f"http://127.0.0.1:{port}"
    watch = None
    try:
        env = {**os.environ, "CANCELWATCH_HOME": str(home)}
        watch = subprocess.Popen([sys.executable, "-m", "cancelwatch", "watch", "--listen", f"127.0.0.1:{listen}",
                                  "--upstream", engine, "--metrics-listen", f"127.0.0.1:{mport}",
                                  "--store", str(home / "watch.db")], cwd=ROOT, env=env,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        wait_listening(listen)
        proc = psutil.Process(watch.pid)
        model = served_model(engine)
        one_round(engine, model, args.streams, args.prompt_tokens, 20)  # warm the engine up
        cpu0, t0 = sum(proc.cpu_times()[:2]), time.monotonic()
        rss0 = proc.memory_info().rss
        got: dict[str, tuple[list[float], list[float]]] = {"direct": ([], []), "watched": ([], [])}
        for _ in range(args.rounds):
            for name, url in (("direct", engine), ("watched", f"http://127.0.0.1:{listen}")):
                rate, ttft = one_round(url, model, args.streams, args.prompt_tokens, args.max_tokens)
                got[name][0].append(rate)
                got[name][1].extend(ttft)
        cpu_s, wall_s = sum(proc.cpu_times()[:2]) - cpu0, time.monotonic() - t0
        rss = proc.memory_info().rss
        print(f"{args.rounds} rounds of {args.streams} streams x {args.max_tokens} tokens, direct and through the "
              "watch interleaved")
        print(f"{'':10} {'tokens/s (median)':>18} {'TTFT p50 (ms)':>14} {'TTFT p99 (ms)':>14}")
        for name, (rates, ttft) in got.items():
            print(f"{name:10} {np.median(rates):18.1f} {np.percentile(ttft, 50) * 1000:14.1f} "
                  f"{np.percentile(ttft, 99) * 1000:14.1f}")
        ratio = np.median(got["watched"][0]) / np.median(got["direct"][0])
        print(f"watched / direct tokens/s: {ratio:.3f}")
        print(f"the watch: {cpu_s:.2f} CPU s over {wall_s:.0f} s = {cpu_s / wall_s * 3600:.0f} CPU s per hour "
              f"at this load; RSS {rss0 / 2**20:.0f} MiB at the start, {rss / 2**20:.0f} MiB at the end")
    finally:
        if watch is not None and watch.poll() is None:
            watch.send_signal(signal.SIGTERM)
            try:
                watch.wait(60)
            except subprocess.TimeoutExpired:
                watch.kill()
        lifecycle.stop(home, state.port)


if __name__ == "__main__":
    main()
