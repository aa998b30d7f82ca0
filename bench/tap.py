"""What a tap (collectors/sources/tap.py, `record --hop`) costs a stream, side by side with the same load
direct, in one run: the latency it adds to each SSE chunk (p50, p99), the throughput of a bulk transfer
through it, and the tap's own CPU time per 1000 chunks.

The upstream (an SSE server stamping each chunk with its send time) and the clients run in a child process,
the tap in this one on its own thread, as in `record`: the child's clock and this one are the machine's
monotonic clock. Figures, not assertions: these machines are shared and noisy.

    .venv/bin/python bench/tap.py [--streams 4] [--chunks 2000] [--interval-ms 2] [--bulk-mb 200]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import socket
import sys
import time
from pathlib import Path

import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cancelwatch.collectors.sources.tap import TapSource, parse_hop  # noqa: E402

PAD = b"x" * 120  # an SSE event of a token is ~150 bytes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _upstream(port: int, chunks: int, interval_s: float, bulk: int) -> asyncio.AbstractServer:
    async def handle(reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        if b"/bulk" in head.split(b"\r\n", 1)[0]:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % bulk)
            block = b"y" * 65536
            for _ in range(bulk // len(block)):
                writer.write(block)
                await writer.drain()
        else:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
            for _ in range(chunks):
                event = b"data: %d %s\n\n" % (time.monotonic_ns(), PAD)
                writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                await writer.drain()
                await asyncio.sleep(interval_s)
            writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", port)


async def _stream(port: int) -> list[int]:
    """One SSE stream read to its end: each chunk's lateness, ns from its send to its read."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Request-Id: bench\r\nContent-Length: 0\r\n\r\n")
    late = []
    while True:
        line = await reader.readline()
        if not line or line == b"0\r\n":
            break
        if line.startswith(b"data: "):
            late.append(time.monotonic_ns() - int(line.split()[1]))
    writer.close()
    return late


async def _bulk(port: int) -> float:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    t = time.monotonic()
    writer.write(b"GET /bulk HTTP/1.1\r\nHost: x\r\n\r\n")
    got = 0
    while chunk := await reader.read(1 << 20):
        got += len(chunk)
    writer.close()
    return got / (time.monotonic() - t) / 1e6


def child(up_port: int, conn, args) -> None:
    """The upstream and the clients: reads the port to talk to from `conn`, answers with the figures."""
    async def main():
        server = await _upstream(up_port, args.chunks, args.interval_ms / 1000, args.bulk_mb << 20)
        conn.send("ready")
        while (ask := conn.recv()) is not None:
            what, port = ask
            if what == "streams":
                late = await asyncio.gather(*(_stream(port) for _ in range(args.streams)))
                conn.send(np.concatenate([np.array(x, dtype=float) for x in late]))
            else:
                conn.send(await _bulk(port))
        server.close()

    asyncio.run(main())


def tap_cpu_s(tap: TapSource) -> float:
    ident = tap._thread.native_id
    return next((t.user_time + t.system_time for t in psutil.Process().threads() if t.id == ident), float("nan"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--chunks", type=int, default=2000)
    ap.add_argument("--interval-ms", type=float, default=2.0)
    ap.add_argument("--bulk-mb", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    up_port = free_port()
    parent, conn = mp.Pipe()
    proc = mp.get_context("spawn").Process(target=child, args=(up_port, conn, args), daemon=True)
    proc.start()
    assert parent.recv() == "ready"
    tap = TapSource(parse_hop(f"bench=127.0.0.1:{free_port()},http://127.0.0.1:{up_port}")).start()
    rows = {"direct": [], "tap": []}
    cpu = []
    try:
        for _ in range(args.repeats):  # interleaved: the machine's noise falls on both alike
            for name, port in (("direct", up_port), ("tap", tap.hop.listen_port)):
                before = tap_cpu_s(tap)
                parent.send(("streams", port))
                late = parent.recv()
                if name == "tap":
                    cpu.append((tap_cpu_s(tap) - before) / len(late) * 1e6)  # ms per 1000 chunks
                parent.send(("bulk", port))
                rows[name].append((late, parent.recv()))
        parent.send(None)
    finally:
        tap.close()
        proc.join(10)
    print(f"{args.streams} SSE streams x {args.chunks} chunks every {args.interval_ms:g} ms, and a "
          f"{args.bulk_mb} MiB bulk transfer; {args.repeats} interleaved repeats")
    print(f"{'':8} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'bulk MB/s':>10}")
    for name, got in rows.items():
        late = np.concatenate([x for x, _ in got]) / 1e6
        mbps = np.median([m for _, m in got])
        print(f"{name:8} {np.percentile(late, 50):8.3f} {np.percentile(late, 99):8.3f} {late.max():8.2f} {mbps:10.0f}")
    d = np.concatenate([x for x, _ in rows["direct"]]) / 1e6
    t = np.concatenate([x for x, _ in rows["tap"]]) / 1e6
    print(f"added by the tap: p50 {np.percentile(t, 50) - np.percentile(d, 50):+.3f} ms, "
          f"p99 {np.percentile(t, 99) - np.percentile(d, 99):+.3f} ms; bulk "
          f"{np.median([m for _, m in rows['tap']]) / np.median([m for _, m in rows['direct']]):.2f}x direct")
    print(f"tap CPU per 1000 chunks: {np.median(cpu):.1f} ms (runs: "
          + ", ".join(f"{c:.1f}" for c in cpu) + ")")


if __name__ == "__main__":
    main()
