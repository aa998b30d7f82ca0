"""Dashboard benchmark: a synthetic run (20 Hz, a cancel every period) in a temp store; prints the time to open
the page's view of it (read, verdicts, the figures and tables the page builds first) and the figure payload the
browser receives.

    .venv/bin/python bench/dashboard.py [--repeats 3] [--duration 3600] [--cancels 200] [--filler-series 55]
    .venv/bin/python bench/dashboard.py --duration 86400 --cancels 1000 --filler-series 10   # a day

The run is read and judged as the page reads it (analysis/judged.py). A run longer than
analysis.long_runs.LONG_RUN_S opens from its overview and the verdicts its live judge stored (written here as a
watch does: each cancel judged on its own window, timed too), and the story cancel's stretch at full resolution;
a shorter one is read whole and judged. `--whole-too` also times
reading the long run whole (load_run of the page's series, no judging) beside it, for scale.

Targets (issues 4 and 21): <= 2 s, payload <= 5 MB. Printed, not asserted: machines are noisy.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cancelwatch.analysis.cancel_table import cancel_table, cancel_window  # noqa: E402
from cancelwatch.analysis.capacity import capacity  # noqa: E402
from cancelwatch.analysis.explain import memory_story, pick_story_cancel  # noqa: E402
from cancelwatch.analysis.facts import VIEW_METRICS, run_facts  # noqa: E402
from cancelwatch.analysis.anatomy import cancel_summary  # noqa: E402
from cancelwatch.analysis.judged import judged_run  # noqa: E402
from cancelwatch.analysis.long_runs import is_long, long_run_verdicts  # noqa: E402
from cancelwatch.analysis.timeline import timeline_figure  # noqa: E402
from cancelwatch.analysis.verdicts import ghosts_of  # noqa: E402
from cancelwatch.analysis.verdicts.stored import judged_by, stored  # noqa: E402
from cancelwatch.analysis.watching import LOOKBACK_S  # noqa: E402
from bench.synthetic import write_synthetic_run  # noqa: E402
from cancelwatch.runstore.reader import load_overview, load_run, load_window, overview_span_s  # noqa: E402
from cancelwatch.runstore.writer import open_store, write_verdicts  # noqa: E402


def open_page(path: Path, rid: int, long_after: float | None):
    """What the dashboard's load_view and first screen do (dashboard/app.py), with their times."""
    t0 = time.perf_counter()
    long, run, verdicts = _judged(path, rid, long_after)
    t1 = time.perf_counter()
    story = pick_story_cancel(verdicts)
    around = load_window(path, rid, *cancel_window(story), lookback_s=LOOKBACK_S, metrics=VIEW_METRICS) if long \
        else run
    whole = timeline_figure(run, verdicts)
    zoom = timeline_figure(around, verdicts, x_range=cancel_window(story), highlight=story.request_id)
    cancel_summary(around, story)
    memory_story(around, verdicts, story)
    cancel_table(run, verdicts)
    capacity(run)
    run_facts(run)
    ghosts_of(run, verdicts)
    t2 = time.perf_counter()
    return long, run, verdicts, whole, (t1 - t0, t2 - t1, t2 - t0, len(whole.to_json()) + len(zoom.to_json()))


def _judged(path: Path, rid: int, long_after: float | None):
    got = judged_run(path, rid, metrics=VIEW_METRICS, long_run_s=long_after, wait_for_windows=True)
    return got.long, got.run, got.verdicts


def store_live_verdicts(path: Path, rid: int) -> tuple[int, float]:
    """Judge every cancel on its own window, as the watch's live judge does, and store the verdicts."""
    t = time.perf_counter()
    run = load_overview(path, rid, metrics=VIEW_METRICS)
    verdicts = long_run_verdicts(run, pd.DataFrame(columns=["request_id", "judged_by", "body"]),
                                 lambda lo, hi: load_window(path, rid, lo, hi, lookback_s=LOOKBACK_S,
                                                            metrics=VIEW_METRICS))
    con = open_store(path)
    with con:
        write_verdicts(con, rid, judged_by(), [(v.request_id, stored(v)) for v in verdicts])
    con.close()
    return len(verdicts), time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--duration", type=float, default=3600.0)
    ap.add_argument("--cancels", type=int, default=200)
    ap.add_argument("--filler-series", type=int, default=55,
                    help="vllm: series a scrape carries beyond those the page reads (a real scrape: about 55)")
    ap.add_argument("--long-after", type=float, default=None,
                    help="open runs longer than this (s) from their overview (default: the page's, LONG_RUN_S)")
    ap.add_argument("--whole-too", action="store_true", help="also time reading a long run whole, for scale")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench.db"
        t = time.perf_counter()
        rid = write_synthetic_run(path, duration_s=args.duration, cancels=args.cancels,
                                  filler_series=args.filler_series)
        print(f"synthetic run: {args.duration:.0f} s at 20 Hz, {args.cancels} cancels, {args.filler_series} filler "
              f"series, {path.stat().st_size / 1e6:.0f} MB store, written in {time.perf_counter() - t:.1f} s")
        if is_long(overview_span_s(path, rid), args.long_after):
            n, took = store_live_verdicts(path, rid)
            print(f"live judge (written with the run, as a watch does): {n} cancels judged on their own windows "
                  f"in {took:.1f} s, {1000 * took / max(n, 1):.0f} ms a cancel")
        rows = []
        for _ in range(max(1, args.repeats)):
            long, run, verdicts, whole, row = open_page(path, rid, args.long_after)
            rows.append(row)
        how = "its overview and stored verdicts" if long else "read whole and judged"
        print(f"opened from {how}: samples read {len(run.samples):,}; cancels {len(verdicts)}; "
              f"points drawn in the whole-run figure: {sum(len(t.x) for t in whole.data if t.x is not None):,}")
        print(f"{'repeat':>6} {'read and judged s':>18} {'figures s':>10} {'total s':>8} {'payload MB':>11}")
        for i, (a, c, d, p) in enumerate(rows):
            print(f"{i:>6} {a:>18.2f} {c:>10.2f} {d:>8.2f} {p / 1e6:>11.2f}")
        best = min(r[2] for r in rows)
        print(f"best total {best:.2f} s (target <= 2 s); payload {rows[-1][3] / 1e6:.2f} MB (target <= 5 MB)")
        if long and args.whole_too:
            t = time.perf_counter()
            whole_run = load_run(path, rid, metrics=VIEW_METRICS)
            print(f"for scale: the same run read whole (load_run, no judging): {len(whole_run.samples):,} samples "
                  f"in {time.perf_counter() - t:.1f} s")


if __name__ == "__main__":
    main()
