"""Accelerated soak of `cancelwatch watch` (issue 21 point 3): a day's worth of 20 Hz ticks, and cancels, through
the real watch in as little wall time as this machine allows, while this script reads the watch's RSS.

The upstream is a fixture engine in a process of its own (not counted): a recorded vLLM 0.32 /metrics
(tests/fixtures/vllm/0.32/loaded.txt, the filtered scrape served as vLLM serves it) and a streaming
/v1/completions that sends a chunk every 20 ms. The watch samples it at --hz (far above 20: that is the
acceleration) and its live judge judges each cancel on its own window, as on a real engine. Clients, bounded in
count and time: --cancels streams broken off after two chunks, each beside one completed request.

Prints: ticks written and the hours of 20 Hz ticks they stand for; the watch's RSS when it had written an hour's
ticks (72,000) and at the end, and the growth between; RSS along the way; its CPU; cancels judged; the store's size.
A day's 1.73 M ticks at --hz 800 take about 40 minutes on two cores (the fixture answers in about a millisecond).

Usage: python bench/watch_soak.py [--minutes 20] [--hz 400] [--cancels 1000] [--keep]
"""

from __future__ import annotations

import argparse
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cancelwatch.collectors.sources.vllm import FAMILY, SOURCE_NAME  # noqa: E402
from cancelwatch.runstore.reader import load_overview, load_verdicts, resolve_run_id  # noqa: E402

BODY = ROOT / "tests" / "fixtures" / FAMILY / "0.32" / "loaded.txt"
TICKS_PER_HOUR = 20 * 3600
CHUNKS, CHUNK_S = 40, 0.02
CAP_HZ = 200.0
KV_PER_STREAM = 0.05  # --live: the KV usage each stream holds
# `watch --hz` stops at 200 Hz to spare a real engine its scrapes. The fixture is ours, and a day's 1.73 M ticks at
# 200 Hz take 2.4 hours: above the cap the soak runs the same CLI with the cap raised (RecordSettings.max_hz).
UNCAPPED = """
import dataclasses, cancelwatch.collectors.recording.session as s
@dataclasses.dataclass
class Uncapped(s.RecordSettings):
    max_hz: float = 5000.0
s.RecordSettings = Uncapped
from cancelwatch.cli import main
main()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_fixture(port: int, live: bool = False) -> subprocess.Popen:
    """The fixture engine in a process of its own (its CPU is not the measured command's), once it answers."""
    proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--serve", str(port),
                             *(["--live"] if live else [])], cwd=ROOT)
    for _ in range(100):
        try:
            httpx.get(f"http://127.0.0.1:{port}/version", timeout=1.0)
            break
        except httpx.HTTPError:
            time.sleep(0.1)
    return proc


def cli_argv(hz: float) -> list[str]:
    """`cancelwatch` as a command line, with the rate cap raised above CAP_HZ (UNCAPPED)."""
    return [sys.executable, "-c", UNCAPPED if hz > CAP_HZ else "from cancelwatch.cli import main; main()"]


def print_memory(who: str, rss: list[tuple[float, int]], rate: float, ticks: int, cpu: float, span_s: float,
                 end_note: str = "at the end", after: str = "") -> None:
    """The measured command's RSS after an hour's ticks (rss: (s since its start, bytes)) and at its end, the
    growth between, its CPU and its RSS along the way."""
    hour_at = TICKS_PER_HOUR / rate  # s into the soak when an hour of 20 Hz ticks was written
    after_hour = [r for t, r in rss if t >= hour_at]
    at_hour, end = (after_hour[0] if after_hour else None), rss[-1][1]
    if at_hour:
        print(f"  {who} RSS: {at_hour / 2**20:.1f} MiB after an hour's ticks -> {end / 2**20:.1f} MiB {end_note} "
              f"({100 * (end - at_hour) / at_hour:+.1f} %){after}")
    else:
        print(f"  {who} RSS: {end / 2**20:.1f} MiB {end_note} (an hour's ticks not reached){after}")
    print(f"  {who} CPU: {cpu:.0f} s user+system, {cpu / span_s:.2f} cores; "
          f"{cpu / max(ticks / TICKS_PER_HOUR, 1e-9):.0f} s for each hour of 20 Hz ticks")
    step = max(1, len(rss) // 12)
    print("  RSS along the way (h of 20 Hz ticks: MiB): "
          + ", ".join(f"{t * rate / TICKS_PER_HOUR:.1f}: {r / 2**20:.0f}" for t, r in rss[::step]))


def tidy(procs: list, tmp: Path, store: Path, keep: bool, err: str, who: str) -> None:
    """The store's size and the command's last words; then every process stopped, the store removed unless kept."""
    for p in procs:
        if p is not None and p.poll() is None:
            p.kill()
            p.wait(10)
    if store.exists():
        print(f"  store: {sum(p.stat().st_size for p in tmp.glob(store.name + '*')) / 2**20:.0f} MiB")
    if err.strip():
        print(f"  {who} stderr (last lines): {' | '.join(err.strip().splitlines()[-3:])[:400]}")
    if keep:
        print(f"  the run is kept in {store}")
    else:
        shutil.rmtree(tmp, ignore_errors=True)  # a day's run is over a gigabyte


def serve(port: int, live: bool = False) -> None:
    """The fixture engine (run as `--serve PORT [--live]` in its own process). `live`: its scheduler gauges count
    the streams it is sending (running; none waiting; KV usage KV_PER_STREAM each), as an engine's do, for `record`'s scripted scenarios,
    which wait for the count to agree with the client and for an idle engine (bench/record_soak.py)."""
    import re

    from tests.fixture_server import filter_body

    recorded = BODY.read_text()
    streams = [0]
    lock = threading.Lock()

    def current() -> str:
        if not live:
            return recorded
        text = re.sub(r"^(vllm:num_requests_running\{[^}]*\}) \S+$", lambda m: f"{m.group(1)} {streams[0]:.1f}",
                      recorded, flags=re.M)
        text = re.sub(r"^(vllm:kv_cache_usage_perc\{[^}]*\}) \S+$",
                      lambda m: f"{m.group(1)} {min(1.0, KV_PER_STREAM * streams[0])}", text, flags=re.M)
        return re.sub(r"^(vllm:num_requests_waiting(?:_by_reason)?\{[^}]*\}) \S+$", lambda m: f"{m.group(1)} 0.0",
                      text, flags=re.M)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        # http.server sends the head and the body in two writes: with Nagle on, the body waits for the
        # client's delayed ACK (40 ms on loopback), which held every scrape at ~45 ms. uvicorn (vLLM's
        # server) sets TCP_NODELAY too.
        disable_nagle_algorithm = True

        def _send(self, status: int, text: str, ctype: str = "text/plain; version=0.0.4") -> None:
            data = text.encode()
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):  # noqa: N802 - http.server's name
            parts = urlsplit(self.path)
            if parts.path == "/metrics":
                self._send(200, current())
            elif parts.path == "/metrics/":
                self._send(200, filter_body(current(), set(parse_qs(parts.query).get("name[]", []))))
            elif parts.path == "/version":
                self._send(200, '{"version": "0.32.0"}', "application/json")
            elif parts.path == "/v1/models":
                self._send(200, '{"object": "list", "data": [{"id": "fixture", "object": "model"}]}',
                           "application/json")
            else:
                self._send(404, "not found\n")

        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            with lock:
                streams[0] += 1
            try:
                for i in range(CHUNKS):
                    finish = '"length"' if i == CHUNKS - 1 else "null"  # the last one says why, as vLLM's does
                    event = 'data: {"choices": [{"index": 0, "text": "tok%d", "finish_reason": %s}]}\n\n' % (i, finish)
                    self.wfile.write(f"{len(event):x}\r\n{event}\r\n".encode())
                    self.wfile.flush()
                    time.sleep(CHUNK_S)
                self.wfile.write(b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")
            except OSError:  # the client (through the watch) went: as an engine's stream does, stop
                self.close_connection = True
            finally:
                with lock:
                    streams[0] -= 1

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    httpd.daemon_threads = True
    httpd.serve_forever()


def clients(url: str, cancels: int, seconds: float, stop: threading.Event) -> int:
    """Bounded: `cancels` streams broken off after two chunks, each after one completed request, spread over
    `seconds`. Returns how many were broken off."""
    done = 0
    gap = seconds / max(cancels, 1)
    start = time.monotonic()
    with httpx.Client(timeout=10.0) as client:
        for i in range(cancels):
            if stop.is_set() or time.monotonic() - start > seconds:
                break
            body = {"model": "fixture", "prompt": "hello", "max_tokens": CHUNKS, "stream": True}
            try:
                client.post(f"{url}/v1/completions", json=body).read()
                with client.stream("POST", f"{url}/v1/completions", json=body) as r:
                    for k, _ in enumerate(r.iter_raw()):
                        if k >= 1:
                            break  # the user pressed Stop: the response is closed with the stream unread
                done += 1
            except httpx.HTTPError:
                pass
            wait = start + (i + 1) * gap - time.monotonic()
            if wait > 0:
                stop.wait(wait)
    return done


def main() -> None:
    if len(sys.argv) in (3, 4) and sys.argv[1] == "--serve":
        serve(int(sys.argv[2]), live=sys.argv[3:] == ["--live"])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=20.0)
    ap.add_argument("--hz", type=float, default=400.0)
    ap.add_argument("--cancels", type=int, default=1000)
    ap.add_argument("--keep", action="store_true", help="keep the run's store (removed by default)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="cw-watch-soak-"))
    store = tmp / "soak.db"
    up_port, port = free_port(), free_port()
    upstream = start_fixture(up_port)
    watch, err = None, ""
    try:
        seconds = args.minutes * 60
        watch = subprocess.Popen(
            [*cli_argv(args.hz), "watch", "--listen", f"127.0.0.1:{port}",
             "--upstream", f"http://127.0.0.1:{up_port}", "--store", str(store), "--hz", str(args.hz),
             "--nvml", "off", "--duration", f"{seconds + 30:.0f}s", "--grace", "1", "--name", "watch soak"],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for _ in range(300):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                time.sleep(0.1)
        stop = threading.Event()
        made = [0]
        loop = threading.Thread(target=lambda: made.__setitem__(0, clients(f"http://127.0.0.1:{port}", args.cancels,
                                                                            seconds, stop)), daemon=True)
        t0 = time.monotonic()
        loop.start()
        rss: list[tuple[float, int]] = []
        proc = psutil.Process(watch.pid)
        cpu = 0.0
        while watch.poll() is None and time.monotonic() - t0 < seconds:
            rss.append((time.monotonic() - t0, proc.memory_info().rss))
            cpu = sum(proc.cpu_times()[:2])
            time.sleep(2.0)
        stop.set()
        loop.join(30)
        watch.send_signal(signal.SIGTERM)  # ends the run completed, every open row written
        _, err = watch.communicate(timeout=180)
        wall = time.monotonic() - t0
        if not store.exists():
            raise SystemExit(f"the watch recorded nothing (exit {watch.returncode}): {err.strip()[-800:]}")
        rid = resolve_run_id(store, "latest")
        over = load_overview(store, rid, metrics=())  # the counts of its scrapes, not its samples
        ticks = sum(s["scrapes_ok"] for s in over.info["overview"]["sampling"] if s["source"] == SOURCE_NAME)
        stats = over.info["stats"]
        judged = len(load_verdicts(store, rid))
        rate = ticks / wall
        print(f"watch soak: {ticks:,} scrapes of the engine in {wall / 60:.1f} min ({rate:.0f} Hz): "
              f"{ticks / TICKS_PER_HOUR:.1f} h of 20 Hz ticks; watch exit {watch.returncode}")
        print(f"  cancels made {made[0]}, judged live and stored {judged}; samples taken {stats.get('samples_taken')}, "
              f"written {stats.get('samples_written')}")
        print_memory("watch", rss, rate, ticks, cpu, wall)
    finally:
        tidy([watch, upstream], tmp, store, args.keep, err, "watch")


if __name__ == "__main__":
    main()
