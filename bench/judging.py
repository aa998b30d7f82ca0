"""How fast a run is judged, this tree beside another revision, in one run: the dashboard opening an hour's run
(200 cancels, read whole and judged), an hour at 20 Hz with 1000 cancels judged whole, and the live judge (each
cancel judged on its own window, as a watch judges it as its grace ends: the window's read from the store and the
judging, apart).

    .venv/bin/python bench/judging.py                      # against BASE_REV
    .venv/bin/python bench/judging.py --against HEAD~3     # any revision git knows
    .venv/bin/python bench/judging.py --against none       # this tree alone

Both trees judge the same synthetic stores (bench/synthetic.py, written once by this tree), each with its own
code: the other revision is unpacked from git (`git archive`) into a temporary folder and measured in a process
of its own, on the same rows with the samples indexed as its own schema indexes them. Targets: the page <= 2 s,
the 1000 cancels <= 5 s, the live judge <= 10 ms a cancel. Printed, not
asserted: machines are noisy.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASE_REV = "118dc21"  # the last revision before the vLLM rules read the ledger as arrays (analysis/verdicts/requests.py)
ROWS = (("page_s", "dashboard opens the hour's run (200 cancels), s", 2.0),
        ("whole_s", "1000 cancels in an hour judged whole, s", 5.0),
        ("whole_load_s", "  reading that run (not judging), s", None),
        ("live_ms", "live judge, ms a cancel (read + judge)", 10.0),
        ("live_judge_ms", "  judging its window, ms a cancel", None),
        ("live_read_ms", "  reading its window from the store, ms", None))


def measure(tree: Path, page_store: Path, whole_store: Path, repeats: int) -> dict:
    """The figures of the code in `tree`, on the two stores (run id 1 each)."""
    sys.path.insert(0, str(tree))
    import importlib
    import inspect

    import pandas as pd

    from bench.dashboard import open_page

    # a tree from before one namespace imports its parts by their bare names (analysis, runstore)
    home = "cancelwatch." if "__path__" in (tree / "cancelwatch" / "__init__.py").read_text() else ""

    def part(name: str):
        return importlib.import_module(home + name)

    VIEW_METRICS, long_run_verdicts = part("analysis.facts").VIEW_METRICS, part("analysis.long_runs").long_run_verdicts
    judge_run, LOOKBACK_S = part("analysis.verdicts").judge_run, part("analysis.watching").LOOKBACK_S
    reader = part("runstore.reader")
    load_overview, load_run, load_window = reader.load_overview, reader.load_run, reader.load_window

    out = {"page_s": min(open_page(page_store, 1, None)[4][-2] for _ in range(repeats))}  # its total
    best = None
    for _ in range(repeats):
        t = time.perf_counter()
        run = load_run(whole_store, 1, metrics=VIEW_METRICS)
        t1 = time.perf_counter()
        n = len(judge_run(run))
        took = (t1 - t, time.perf_counter() - t1)
        best = took if best is None or sum(took) < sum(best) else best
    out["whole_load_s"], out["whole_s"], out["whole_cancels"] = best[0], best[1], n
    del run  # the whole run's frames, not kept alive (and walked by the collector) while the live judge is timed
    # the live judge reads only the series the verdicts read, where this tree's reader can (the view's, in a tree
    # from before the verdicts' were named apart)
    judged = getattr(part("analysis.facts"), "VERDICT_METRICS", VIEW_METRICS)
    narrow = {"metrics": judged} if "metrics" in inspect.signature(load_window).parameters else {}
    read = [0.0]
    # on one connection, as the live judge reads its windows, where this tree's reader can
    one = getattr(reader, "WindowReader", None)
    one = one(page_store) if one is not None else None

    def window(lo: float, hi: float):
        t = time.perf_counter()
        w = one(1, lo, hi, lookback_s=LOOKBACK_S, **narrow) if one is not None else \
            load_window(page_store, 1, lo, hi, lookback_s=LOOKBACK_S, **narrow)
        read[0] += time.perf_counter() - t
        return w

    overview = load_overview(page_store, 1, metrics=VIEW_METRICS)
    best = None
    for _ in range(repeats):  # the best pass, as above: a watch's judge has judged before (its imports, its caches)
        read[0] = 0.0
        t = time.perf_counter()
        verdicts = long_run_verdicts(overview, pd.DataFrame(columns=["request_id", "judged_by", "body"]), window)
        took, n = time.perf_counter() - t, max(len(verdicts), 1)
        best = (took, read[0], n) if best is None or took < best[0] else best
    took, read_s, n = best
    out.update(live_ms=1000 * took / n, live_read_ms=1000 * read_s / n, live_judge_ms=1000 * (took - read_s) / n)
    return out


def unpack(rev: str, into: Path) -> Path:
    """The tree of `rev`, from git, in a folder of its own."""
    tar = into / "tree.tar"
    subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", "-o", str(tar), rev], check=True)
    tree = into / "tree"
    with tarfile.open(tar) as t:
        t.extractall(tree, filter="data")
    return tree


def figures_of(tree: Path, page_store: Path, whole_store: Path, repeats: int) -> dict:
    """measure(), in a process of its own (a tree's modules do not mix with another's), on the stores as that
    tree's recorder would have indexed them."""
    from cancelwatch.runstore.writer import samples_indexed_as

    ddl = (tree / "runstore" / "schema.py").read_text()
    folder = page_store.parent / f"indexed-as-{abs(hash(str(tree)))}"
    page_store, whole_store = (samples_indexed_as(s, ddl, folder) for s in (page_store, whole_store))
    got = subprocess.run([sys.executable, __file__, "--measure", str(tree), str(page_store), str(whole_store),
                          "--repeats", str(repeats)], capture_output=True, text=True, cwd=tree)
    if got.returncode:
        sys.exit(f"bench/judging.py: measuring {tree} failed: {got.stderr.strip().splitlines()[-1:]}")
    return json.loads(got.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", default=BASE_REV, help="a git revision to measure beside this tree ('none': none)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--measure", nargs=3, metavar=("TREE", "PAGE_STORE", "WHOLE_STORE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.measure:
        tree, page, whole = (Path(p) for p in args.measure)
        print(json.dumps(measure(tree, page, whole, args.repeats)))
        return
    sys.path.insert(0, str(ROOT))
    from bench.synthetic import write_synthetic_run

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        page, whole = tmp / "hour_200.db", tmp / "hour_1000.db"
        t = time.perf_counter()
        write_synthetic_run(page, duration_s=3600.0, cancels=200)
        write_synthetic_run(whole, duration_s=3600.0, cancels=1000, filler_series=10)
        print(f"synthetic runs: an hour at 20 Hz with 200 cancels (55 filler series) and with 1000 (10), written "
              f"in {time.perf_counter() - t:.0f} s")
        trees = [("this tree", ROOT)]
        if args.against.lower() != "none":
            trees.insert(0, (args.against, unpack(args.against, tmp)))
        got = [figures_of(tree, page, whole, args.repeats) for _, tree in trees]
        names = [name for name, _ in trees]
        print(f"{'':46}" + "".join(f"{n[:14]:>15}" for n in names) + f"{'target':>9}")
        for key, label, target in ROWS:
            print(f"{label:46}" + "".join(f"{g[key]:>15.2f}" for g in got) + (f"{target:>9g}" if target else ""))
        if len(got) == 2:
            ratios = ", ".join(f"{key.split('_')[0]} {got[0][key] / got[1][key]:.1f}x"
                               for key in ("page_s", "whole_s", "live_ms"))
            print(f"faster than {names[0]}: {ratios}")


if __name__ == "__main__":
    main()
