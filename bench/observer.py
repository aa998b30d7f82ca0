"""Observer effect: what sampling costs the engine.

A fixed workload (200 streamed completions, 6 at a time) runs on the embedded engine with no
sampling and with `cancelwatch sample` at 20, 50 and 100 Hz in a process of its own (as an operator
runs it), the conditions interleaved and repeated so that drift on a shared machine falls on all of
them. Prints, per condition, the engine's tokens/s and TTFT p50 (median over repeats) and their
ratio to no sampling. Target: <= 2 % loss at 20 Hz.

Usage: python bench/observer.py [--target URL] [--completions 200] [--concurrency 6] [--repeats 3]
       [--rates 20,50,100] [--max-tokens 32] [--prompt-tokens 200]
Without --target it starts an embedded engine in a temp home and stops it at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cancelwatch.collectors.cancels.load import make_prompt, served_model  # noqa: E402
from cancelwatch.collectors.engines import lifecycle  # noqa: E402
from cancelwatch.collectors.engines import vllm_server as engine_mod  # noqa: E402
from cancelwatch.runstore.errors import StoreError  # noqa: E402
from cancelwatch.runstore.reader import load_run  # noqa: E402

REQUEST_TIMEOUT_S = 120.0


async def one(client: httpx.AsyncClient, url: str, model: str, i: int, prompt_tokens: int, max_tokens: int):
    body = {"model": model, "prompt": make_prompt(prompt_tokens, seed=i + 1), "max_tokens": max_tokens,
            "stream": True, "ignore_eos": True}
    t0 = time.monotonic()
    first, chunks = None, 0
    async with client.stream("POST", url + "/v1/completions", json=body, headers={"X-Request-Id": f"obs-{i}"}) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks += 1
                first = first if first is not None else time.monotonic() - t0
    return first, chunks


async def workload(url: str, model: str, completions: int, concurrency: int, prompt_tokens: int,
                   max_tokens: int) -> dict:
    """`completions` requests, `concurrency` in flight at a time; bounded in count and time."""
    queue = list(range(completions))
    ttfts, tokens = [], 0
    limits = httpx.Limits(max_connections=concurrency + 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(REQUEST_TIMEOUT_S), limits=limits) as client:
        async def worker():
            nonlocal tokens
            while queue:
                i = queue.pop()
                first, chunks = await one(client, url, model, i, prompt_tokens, max_tokens)
                ttfts.append(first)
                tokens += chunks

        t0 = time.monotonic()
        await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(concurrency))), 1800)
        wall = time.monotonic() - t0
    return {"tokens_per_s": tokens / wall, "ttft_p50_ms": float(np.median(ttfts)) * 1000, "wall_s": wall}


def start_sampler(url: str, hz: float, store: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "cancelwatch", "sample", "--target", url, "--hz", str(hz),
                             "--duration", "3600", "--nvml", "off", "--store", str(store)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # sampling has begun: the first scrapes are in the store
        if proc.poll() is not None:
            raise SystemExit(f"sampler exited: {proc.stderr.read()[-500:]}")
        try:
            if store.exists() and len(load_run(store, "latest").scrapes) > 5:
                return proc
        except StoreError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("the sampler did not start sampling within 60 s")


def stop_sampler(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target")
    ap.add_argument("--completions", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rates", default="20,50,100")
    ap.add_argument("--prompt-tokens", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    conditions = [0.0, *rates]
    tmp = Path(tempfile.mkdtemp(prefix="cw-observer-"))
    state = None
    url = args.target
    if url is None:
        state = engine_mod.start(tmp / "home", port=lifecycle.free_port())
        url = state.url
    url = url.rstrip("/")
    try:
        model = served_model(url)
        # one warm-up round, not counted: the first requests pay for compiling and caches
        asyncio.run(workload(url, model, args.concurrency * 2, args.concurrency, args.prompt_tokens, args.max_tokens))
        results: dict[float, list[dict]] = {c: [] for c in conditions}
        for rep in range(args.repeats):
            order = conditions[rep % len(conditions):] + conditions[:rep % len(conditions)]  # rotated
            for hz in order:
                proc = start_sampler(url, hz, tmp / f"obs-{rep}-{hz:g}.db") if hz else None
                try:
                    res = asyncio.run(workload(url, model, args.completions, args.concurrency,
                                               args.prompt_tokens, args.max_tokens))
                finally:
                    if proc is not None:
                        stop_sampler(proc)
                results[hz].append(res)
                label = f"{hz:g} Hz" if hz else "none"
                print(f"  repeat {rep + 1} {label:>7}: {res['tokens_per_s']:7.1f} tok/s  TTFT p50 "
                      f"{res['ttft_p50_ms']:6.1f} ms  ({res['wall_s']:.1f} s)", flush=True)
        base_tps = float(np.median([r["tokens_per_s"] for r in results[0.0]]))
        base_ttft = float(np.median([r["ttft_p50_ms"] for r in results[0.0]]))
        print(f"\nobserver effect: {args.completions} completions x {args.max_tokens} tokens, {args.concurrency} "
              f"concurrent, prompt {args.prompt_tokens} tokens, {args.repeats} repeats (medians)")
        print(f"{'sampling':>9} {'tok/s':>8} {'ratio':>7} {'loss':>7} {'TTFT p50 ms':>12} {'ratio':>7}")
        for hz in conditions:
            tps = float(np.median([r["tokens_per_s"] for r in results[hz]]))
            ttft = float(np.median([r["ttft_p50_ms"] for r in results[hz]]))
            # each repeat runs every condition within minutes: its own ratio to its own no-sampling
            # round is less exposed to the machine's drift than the ratio of medians
            ratios = [r["tokens_per_s"] / b["tokens_per_s"] for r, b in zip(results[hz], results[0.0])]
            label = f"{hz:g} Hz" if hz else "none"
            print(f"{label:>9} {tps:8.1f} {tps / base_tps:7.3f} {100 * (1 - tps / base_tps):6.1f}% "
                  f"{ttft:12.1f} {ttft / base_ttft:7.3f}   per-repeat tok/s ratio median "
                  f"{np.median(ratios):.3f}, range {min(ratios):.3f}-{max(ratios):.3f}")
        noise = [r["tokens_per_s"] for r in results[0.0]]
        print(f"no-sampling rounds alone vary by {100 * (max(noise) - min(noise)) / np.median(noise):.1f} % "
              f"(max-min over median): a loss smaller than that is below this machine's noise")
    finally:
        if state is not None:
            lifecycle.stop(tmp / "home", state.port)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
