"""A cancel's window read from a long run: what a live judge (`cancelwatch watch`) pays per cancel.

For each run length, one synthetic run (bench/synthetic.py: 20 Hz, the scheduler's and NVML's series, a
cancel every period) is written, then the windows of --windows cancels spread over it are read with
`runstore.reader.load_window` (samples of [stop - 2 s, stop + grace + 2 s], events and ledger 60 s back),
on the store's own indexes (each series between its source's first and last scrape of the window, from the
covering series index) and, side by side in the same run, on a copy indexed as a store too big to migrate
keeps it (samples_run: the window's samples found by (run, scrape), each looked up in the table). A window's
read should not grow with the run. Prints, per run length: samples in the store, the window read's p50 and max
(ms) both ways, and the whole run's load_run for scale.

Usage: python bench/window.py [--hours 0.25,1,4] [--windows 20] [--filler-series 10]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cancelwatch.analysis.watching import LOOKBACK_S, window_of  # noqa: E402
from bench.synthetic import write_synthetic_run  # noqa: E402
from cancelwatch.runstore.reader import load_run, load_window  # noqa: E402
from cancelwatch.runstore.schema import NARROW_SAMPLE_INDEXES  # noqa: E402
from cancelwatch.runstore.writer import samples_indexed_as  # noqa: E402

GRACE_S = 2.0


def window_reads(store: Path, rid: int, duration_s: float, n: int) -> list[float]:
    """ms per window read, for `n` stops spread over the run."""
    out = []
    for i in range(n):
        stop = duration_s * (i + 0.5) / n
        lo, hi = window_of(stop, GRACE_S)
        t = time.perf_counter()
        w = load_window(store, rid, lo, hi, lookback_s=LOOKBACK_S)
        out.append((time.perf_counter() - t) * 1000)
        assert not w.samples.empty, f"no samples in the window at {stop:.0f} s"
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hours", default="0.25,1,4", help="run lengths, comma-separated")
    ap.add_argument("--windows", type=int, default=20)
    ap.add_argument("--filler-series", type=int, default=10, help="vLLM series beyond the judged ones")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="cw-window-") as tmp:
        for hours in (float(h) for h in args.hours.split(",")):
            store = Path(tmp) / f"run-{hours:g}h.db"
            t = time.perf_counter()
            rid = write_synthetic_run(store, duration_s=hours * 3600, cancels=max(10, int(hours * 1000 / 24)),
                                      filler_series=args.filler_series)
            wrote_s = time.perf_counter() - t
            indexed = window_reads(store, rid, hours * 3600, args.windows)
            narrow = samples_indexed_as(store, NARROW_SAMPLE_INDEXES, Path(tmp) / "narrow")
            by_scrape = window_reads(narrow, rid, hours * 3600, args.windows)
            narrow.unlink()
            t = time.perf_counter()
            samples = len(load_run(store, rid).samples)
            whole_s = time.perf_counter() - t
            rows.append((hours, samples, wrote_s, indexed, by_scrape, whole_s))
    print(f"{'run':>6} {'samples':>10} {'written s':>9} | {'window p50 ms':>13} {'max':>7} | "
          f"{'by scrape p50':>13} {'max':>7} | {'load_run s':>10}")
    for hours, samples, wrote_s, indexed, by_scrape, whole_s in rows:
        print(f"{hours:>5g}h {samples:>10,} {wrote_s:>9.1f} | {statistics.median(indexed):>13.1f} "
              f"{max(indexed):>7.1f} | {statistics.median(by_scrape):>13.1f} {max(by_scrape):>7.1f} | {whole_s:>10.2f}")


if __name__ == "__main__":
    main()
