"""Verdicts beside other traffic: how many of the default suite's cancels get a verdict while streams
the tool does not know arrive at random, and how many of those verdicts are wrong.

Records the default suite on the embedded engine twice, once direct (every cancel reaches the engine:
a `leaked` or `stale_gauge` is wrong) and once through tests/proxies.py with every target's disconnect
lost (`released` is wrong for the cancels it kept; one through the relay app never passes it), each beside short streams (X-Request-Id `foreign-<n>`, 8 to 24 tokens)
arriving as a Poisson process, one a second on average. Each recording is judged twice, side by side:
as before per-request evidence was weighed (any request the ledger does not know in a cancel's window
makes it `inconclusive`), and as now (analysis/verdicts/vllm.py: beside_traffic).

Usage: python bench/other_traffic.py [--rate 1.0] [--seed 7]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cancelwatch.analysis.verdicts import judge_run  # noqa: E402
from cancelwatch.analysis.verdicts.vllm_case import VllmCase  # noqa: E402
from cancelwatch.collectors.cancels.load import make_prompt  # noqa: E402
from cancelwatch.collectors.engines import lifecycle  # noqa: E402
from cancelwatch.collectors.engines import vllm_server as engine_mod  # noqa: E402
from cancelwatch.runstore.reader import load_run  # noqa: E402
from tests.proxies import ProxyBehaviour  # noqa: E402

MAX_STREAMS = 900  # bounded: at one a second, a quarter of an hour
WRONG_IF_REACHED = {"leaked", "stale_gauge"}


class Traffic:
    """Short streams straight to the engine at random (exponential gaps), until stopped or MAX_STREAMS."""

    def __init__(self, url: str, model: str, rate: float, seed: int):
        self.url, self.model, self.rate = url, model, rate
        self.rng = random.Random(seed)
        self.stop = threading.Event()
        self.sent = self.failed = 0
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _one(self, client: httpx.AsyncClient, i: int) -> None:
        body = {"model": self.model, "prompt": make_prompt(self.rng.randint(20, 80), seed=5000 + i),
                "max_tokens": self.rng.randint(8, 24), "stream": True, "ignore_eos": True}
        try:
            async with client.stream("POST", self.url + "/v1/completions", json=body,
                                     headers={"X-Request-Id": f"foreign-{i}"}) as resp:
                async for _ in resp.aiter_lines():
                    pass
        except httpx.HTTPError:
            self.failed += 1

    async def _run(self) -> None:
        async with httpx.AsyncClient(timeout=httpx.Timeout(60.0)) as client:
            tasks = []
            for i in range(MAX_STREAMS):
                await asyncio.sleep(self.rng.expovariate(self.rate))
                if self.stop.is_set():
                    break
                tasks.append(asyncio.create_task(self._one(client, i)))
                self.sent += 1
            await asyncio.gather(*tasks, return_exceptions=True)


def record(url: str, home: Path, store: Path, engine_log: str) -> None:
    env = {**os.environ, "CANCELWATCH_HOME": str(home)}
    res = subprocess.run([sys.executable, "-m", "cancelwatch", "record", "--target", url, "--store", str(store),
                          "--nvml", "off", "--engine-log", engine_log], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=1800)
    if res.returncode not in (0, 1):
        raise SystemExit(f"record failed ({res.returncode}): {res.stderr[-800:]}")


def judged(store: Path, weigh_traffic: bool) -> list:
    run = load_run(store, "latest")
    if weigh_traffic:
        return judge_run(run)
    saved = VllmCase.judged_beside_traffic
    VllmCase.judged_beside_traffic = lambda self: False  # as before: other traffic in the window decides nothing
    try:
        return judge_run(run)
    finally:
        VllmCase.judged_beside_traffic = saved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=1.0, help="streams of other traffic a second, on average")
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="cw-traffic-"))
    home = tmp / "home"
    state = engine_mod.start(home, port=lifecycle.free_port())
    rows = []
    try:
        for mode in ("direct", "leaky proxy"):
            proxy = ProxyBehaviour(state.url, lifecycle.free_port(), leak=True).start() if mode != "direct" else None
            traffic = Traffic(state.url, state.served_model_name, args.rate, args.seed)
            store = tmp / f"{mode.split()[0]}.db"
            t0 = time.monotonic()
            traffic.thread.start()
            try:
                record(proxy.url if proxy else state.url, home, store, state.log_path)
            finally:
                traffic.stop.set()
                traffic.thread.join(timeout=90)
                if proxy is not None:
                    proxy.stop()
            wall = time.monotonic() - t0
            for weigh in (False, True):
                vs = judged(store, weigh)
                verdicts = Counter(v.verdict for v in vs)
                # the truth: direct, every cancel reached the engine; through the proxy, those whose
                # disconnect it kept (a cancel through the relay app never passes it)
                lost = set(proxy.leaked) if proxy is not None else set()
                wrong = sum((v.verdict == "released") if v.request_id in lost else (v.verdict in WRONG_IF_REACHED)
                            for v in vs)
                foreign = sum(1 for v in vs if v.evidence.foreign_requests)
                rows.append((mode, "now" if weigh else "before", len(vs), foreign, verdicts, wrong,
                             Counter(v.rule for v in vs if v.evidence.foreign_requests)))
            print(f"  {mode}: {len(vs)} cancels in {wall:.0f} s beside {traffic.sent} streams of other traffic "
                  f"({traffic.failed} failed)", flush=True)
    finally:
        lifecycle.stop(home, state.port)
    print(f"\nthe default suite beside other traffic (~{args.rate:g} short streams a second)")
    print(f"{'path':>12} {'judged':>7} {'cancels':>7} {'w/ traffic':>10} {'released':>8} {'leaked':>6} "
          f"{'stale':>5} {'inconcl.':>8} {'decided':>7} {'wrong':>5}")
    for mode, when, n, foreign, verdicts, wrong, _ in rows:
        decided = n - verdicts["inconclusive"]
        print(f"{mode:>12} {when:>7} {n:7d} {foreign:10d} {verdicts['released']:8d} {verdicts['leaked']:6d} "
              f"{verdicts['stale_gauge']:5d} {verdicts['inconclusive']:8d} {decided / n if n else 0:7.0%} {wrong:5d}")
    print("\nrules of the cancels with other traffic in their window:")
    for mode, when, *_, rules in rows:
        print(f"{mode:>12} {when:>7}: " + json.dumps(dict(rules.most_common())))


if __name__ == "__main__":
    main()
