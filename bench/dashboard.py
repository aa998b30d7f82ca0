"""Dashboard benchmark: a synthetic 1-hour 20 Hz run with 200 cancels in a temp store; prints the time
to load it and build the page's figures, and the figure payload the browser receives.

    .venv/bin/python bench/dashboard.py [--repeats 3] [--duration 3600] [--cancels 200]

Targets (issue 4): load + figures <= 2 s, payload <= 5 MB. Printed, not asserted: machines are noisy.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from analysis.cancel_table import cancel_table, cancel_window  # noqa: E402
from analysis.capacity import capacity  # noqa: E402
from analysis.explain import pick_story_cancel  # noqa: E402
from analysis.facts import VIEW_METRICS, run_facts  # noqa: E402
from analysis.timeline import timeline_figure  # noqa: E402
from analysis.verdicts import judge_run  # noqa: E402
from bench.synthetic import write_synthetic_run  # noqa: E402
from runstore.reader import load_run  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--duration", type=float, default=3600.0)
    ap.add_argument("--cancels", type=int, default=200)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench.db"
        t = time.perf_counter()
        write_synthetic_run(path, duration_s=args.duration, cancels=args.cancels)
        print(f"synthetic run: {args.duration:.0f} s at 20 Hz, {args.cancels} cancels, "
              f"{path.stat().st_size / 1e6:.0f} MB store, written in {time.perf_counter() - t:.1f} s")
        rows = []
        for _ in range(max(1, args.repeats)):
            t0 = time.perf_counter()
            run = load_run(path, "latest", metrics=VIEW_METRICS)
            t1 = time.perf_counter()
            verdicts = judge_run(run)
            t2 = time.perf_counter()
            whole = timeline_figure(run, verdicts)
            story = pick_story_cancel(verdicts)
            zoom = timeline_figure(run, verdicts, x_range=cancel_window(story), highlight=story.request_id)
            cancel_table(run, verdicts)
            capacity(run)
            run_facts(run)
            t3 = time.perf_counter()
            payload = len(whole.to_json()) + len(zoom.to_json())
            rows.append((t1 - t0, t2 - t1, t3 - t2, t3 - t0, payload))
        print(f"samples loaded: {len(run.samples):,}; cancels judged: {len(verdicts)}; "
              f"points drawn in the whole-run figure: {sum(len(t.x) for t in whole.data if t.x is not None):,}")
        print(f"{'repeat':>6} {'load s':>8} {'verdicts s':>11} {'figures s':>10} {'total s':>8} {'payload MB':>11}")
        for i, (a, b, c, d, p) in enumerate(rows):
            print(f"{i:>6} {a:>8.2f} {b:>11.2f} {c:>10.2f} {d:>8.2f} {p / 1e6:>11.2f}")
        best = min(r[3] for r in rows)
        print(f"best total {best:.2f} s (target <= 2 s); payload {rows[-1][4] / 1e6:.2f} MB (target <= 5 MB)")


if __name__ == "__main__":
    main()
