"""Benchmark: import a fleet's week of history from a real Prometheus, then render the capacity review on it.

A synthetic 7-day history of 8 vLLM replicas (running, waiting, KV usage, token and prefix-cache
counters, preemptions, cache config) and their GPUs (DCGM exporter framebuffer series, MiB) at a 15 s
step is written as OpenMetrics, backfilled with `promtool tsdb create-blocks-from openmetrics` into a
fresh TSDB, and served by Debian's `prometheus` on 127.0.0.1. Then `cancelwatch import prometheus`
and `cancelwatch notebook capacity_review` run as subprocesses; their wall time and peak RSS are
printed (targets: <= 30 s and <= 1 GB each).

    python bench/import.py [--days 7] [--replicas 8] [--step 15]
"""

from __future__ import annotations

import argparse
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
MiB = 1024**2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_openmetrics(path: Path, start: int, days: float, replicas: int, step: int) -> int:
    """The history as OpenMetrics text, family by family; returns the number of samples."""
    t = start + np.arange(int(days * 86400 / step)) * step
    rng = np.random.default_rng(11)
    hour = (t % 86400) / 3600.0
    load = 0.5 + 0.45 * np.sin((hour - 8) / 24 * 2 * np.pi)  # a daily cycle
    n = 0
    with path.open("w") as f:
        def family(name: str, rows: list[tuple[str, np.ndarray]]) -> None:
            nonlocal n
            f.write(f"# TYPE {name} gauge\n")
            for labels, values in rows:
                f.write("".join(f"{name}{{{labels}}} {v:.6g} {ts}\n" for v, ts in zip(values, t)))
                n += len(values)

        reps = [f'instance="replica-{i}:8000",job="vllm",model_name="llama-70b",engine="0"' for i in range(replicas)]
        running = [np.clip(np.round(load * 48 + rng.normal(0, 3, len(t))), 0, 64) for _ in reps]
        waiting = [np.clip(np.round((r - 40) * 0.5), 0, None) for r in running]
        family("vllm:num_requests_running", list(zip(reps, running)))
        family("vllm:num_requests_waiting", list(zip(reps, waiting)))
        family("vllm:kv_cache_usage_perc", [(lab, np.clip(r / 64 + rng.normal(0, 0.02, len(t)), 0, 1))
                                            for lab, r in zip(reps, running)])
        family("vllm:generation_tokens_total", [(lab, np.cumsum(r * 30 * step)) for lab, r in zip(reps, running)])
        family("vllm:prefix_cache_queries_total", [(lab, np.cumsum(r * 500 * step)) for lab, r in zip(reps, running)])
        family("vllm:prefix_cache_hits_total", [(lab, np.cumsum(r * 200 * step)) for lab, r in zip(reps, running)])
        family("vllm:num_preemptions_total", [(lab, np.cumsum(w > 8)) for lab, w in zip(reps, waiting)])
        family("vllm:cache_config_info", [(lab + ',num_gpu_blocks="9000",block_size="16"', np.ones(len(t)))
                                          for lab in reps])
        gpus = [f'gpu="{i % 8}",UUID="GPU-{i:08d}",Hostname="gpu-node-{i // 8}"' for i in range(replicas)]
        used = [np.full(len(t), 72706.0) for _ in gpus]
        family("DCGM_FI_DEV_FB_USED", list(zip(gpus, used)))
        family("DCGM_FI_DEV_FB_FREE", [(g, np.full(len(t), 8204.0)) for g in gpus])
        family("DCGM_FI_DEV_FB_RESERVED", [(g, np.full(len(t), 597.0)) for g in gpus])
        f.write("# EOF\n")
    return n


def timed(cmd: list[str], cwd: Path = ROOT) -> tuple[float, float, subprocess.CompletedProcess]:
    """(wall s, peak RSS MiB of the child, result); children are waited for one at a time."""
    t0 = time.monotonic()
    res = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    wall = time.monotonic() - t0
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return wall, peak_kib / 1024.0, res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--days", type=float, default=7.0)
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--step", type=int, default=15)
    args = ap.parse_args()
    prom_bin, promtool = shutil.which("prometheus"), shutil.which("promtool")
    if not prom_bin or not promtool:
        print("error: no prometheus/promtool: `make prometheus` installs Debian's package", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="cw-import-bench-"))
    try:
        end = int(time.time()) // 3600 * 3600 - 3 * 3600  # clear of Prometheus's head block
        start = end - int(args.days * 86400)
        om = work / "history.om"
        t0 = time.monotonic()
        samples = write_openmetrics(om, start, args.days, args.replicas, args.step)
        print(f"history: {args.days:g} days, {args.replicas} replicas, {args.step} s step: {samples:,} samples, "
              f"{om.stat().st_size / MiB:.0f} MiB of OpenMetrics, written in {time.monotonic() - t0:.1f} s")
        t0 = time.monotonic()
        subprocess.run([promtool, "tsdb", "create-blocks-from", "openmetrics", str(om), str(work / "data")],
                       check=True, capture_output=True)
        print(f"backfill (promtool tsdb create-blocks-from openmetrics): {time.monotonic() - t0:.1f} s")
        om.unlink()
        port = free_port()
        (work / "prometheus.yml").write_text("global:\n  scrape_interval: 15s\nscrape_configs: []\n")
        log = open(work / "prometheus.log", "w")  # noqa: SIM115 - closed below
        prom = subprocess.Popen([prom_bin, f"--config.file={work / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={work / 'data'}", "--storage.tsdb.retention.time=60d",
                                 f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
        try:
            import httpx

            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/-/ready", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.3)
            store = work / "imported.db"
            cw = [sys.executable, "-m", "cancelwatch"]
            wall, rss, res = timed([*cw, "import", "prometheus", "--url", f"http://127.0.0.1:{port}",
                                    "--start", str(start), "--end", str(end - args.step), "--step", f"{args.step}s",
                                    "--store", str(store)])
            if res.returncode != 0:
                print(res.stdout + res.stderr, file=sys.stderr)
                return 1
            print(res.stdout.strip())
            print(f"import: {wall:.1f} s wall, peak RSS {rss:.0f} MiB (targets <= 30 s, <= 1024 MiB); "
                  f"store {store.stat().st_size / MiB:.0f} MiB")
            wall, rss2, res = timed([*cw, "notebook", "capacity_review", "--run", "latest", "--store", str(store),
                                     "--html", str(work / "capacity.html")])
            if res.returncode != 0:
                print(res.stdout + res.stderr, file=sys.stderr)
                return 1
            print(f"capacity review on it: {wall:.1f} s wall, peak RSS of the largest child so far {max(rss, rss2):.0f} "
                  f"MiB; html {(work / 'capacity.html').stat().st_size / MiB:.1f} MiB")
        finally:
            prom.terminate()
            prom.wait(20)
            log.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
