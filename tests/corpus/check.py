"""Judge every corpus run and compare with the manifest (tests/test_corpus.py runs this in `make test`).

    python -m tests.corpus.check            # the table of what differs, by rule; exit 1 if anything does
    python -m tests.corpus.check --bless    # keep what the rules say now as expected (after reading the table)

A cancel whose truth the set-up makes certain, judged the other way (released for leaked, leaked for
released, any verdict for a stream read to its end), fails and cannot be blessed. Any other difference from
the blessed verdicts fails too, and is shown as one table by rule: before, after, how many, which runs.
The note of the change that re-blesses says what moved and why.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.corpus.manifest import CONSTRUCTION, REVIEWED, TRUTHS, load_manifest, save_manifest, unpack  # noqa: E402


# the evidence fields a blessed verdict keeps beside its verdict and rule: what the rule that read them named
# (which waiver, which lagging clients, which minted id, how many foreign requests, where a hop kept it)
KEY_FIELDS = ("kv_drop_waived", "lagging_clients", "log_named_as", "foreign_requests", "stopped_at", "app_answer")


@dataclass(frozen=True)
class Judged:
    corpus_run: str  # the manifest's name
    run_id: str
    request_id: str
    verdict: str
    rule: str | None
    why: str  # what the verdict rests on, in one line: the rule's sentence, else the count it read, else sources
    fields: tuple = ()  # (name, value) of the KEY_FIELDS the evidence set
    count_read: bool = False  # the evidence carries a count reading (Evidence.count_reading)

    def said(self) -> str:
        return said(self.verdict, self.rule, dict(self.fields))


def said(verdict: str, rule: str | None, fields: dict) -> str:
    """A verdict as the table shows it: `released (released)`, with its key fields where it set any."""
    extra = ", ".join(f"{k}={fields[k]}" for k in KEY_FIELDS if fields.get(k) is not None)
    return f"{verdict} ({rule})" + (f" [{extra}]" if extra else "")


def corpus_stores(folder: Path, manifest: dict | None = None) -> list[tuple[str, Path, dict]]:
    """(name, store, manifest entry) of every corpus run, its store unpacked into `folder`."""
    manifest = load_manifest() if manifest is None else manifest
    return [(name, unpack(entry, folder), entry) for name, entry in manifest["runs"].items()]


def judge_store(name: str, store: Path, entry: dict, judge=None, metrics=None) -> list[Judged]:
    """Each cancel of the corpus run's store judged (`metrics`: the run read with those series alone)."""
    from cancelwatch.analysis.evidence import count_reading_text
    from cancelwatch.analysis.verdicts import judge_run
    from cancelwatch.runstore.reader import load_run

    judge = judge or judge_run
    out = []
    for run_id in entry["runs"]:
        for v in judge(load_run(store, int(run_id), metrics=metrics)):
            fields = tuple((k, getattr(v.evidence, k)) for k in KEY_FIELDS if getattr(v.evidence, k) not in (None, 0, []))
            rests_on = v.evidence.why or count_reading_text(v.evidence.count_reading) or v.sources_text()
            out.append(Judged(name, run_id, v.request_id, v.verdict, v.rule, rests_on, fields,
                              v.evidence.count_reading is not None))
    return out


def judge_corpus(folder: Path, manifest: dict | None = None, metrics=None) -> list[Judged]:
    out: list[Judged] = []
    for name, store, entry in corpus_stores(folder, manifest):
        out += judge_store(name, store, entry, metrics=metrics)
    return out


@dataclass
class Outcome:
    wrong: list[str]  # construction truths contradicted: never blessed
    moved: dict  # (before, after) -> [how many, runs]
    judged: int
    expected: int

    @property
    def ok(self) -> bool:
        return not self.wrong and not self.moved


def compare(judged: list[Judged], manifest: dict) -> Outcome:
    wrong, moved = [], defaultdict(lambda: [0, set()])
    got = {(j.corpus_run, j.run_id, j.request_id): j for j in judged}
    expected_n = 0
    for name, entry in manifest["runs"].items():
        for run_id, run in entry["runs"].items():
            for rid, t in run.get("truth", {}).items():
                j = got.get((name, run_id, rid))
                if j is not None and j.verdict in TRUTHS[t["truth"]]:
                    wrong.append(f"{name} run {run_id} {rid}: known {t['truth']} by construction ({t['why']}), "
                                 f"judged {j.verdict} ({j.rule})")
            exp = entry.get("expected", {}).get(run_id, {})
            expected_n += len(exp)
            for rid, e in exp.items():
                j = got.pop((name, run_id, rid), None)
                before = said(e["verdict"], e["rule"], e.get("fields", {}))
                after = "not judged" if j is None else j.said()
                if before != after:
                    moved[(before, after)][0] += 1
                    moved[(before, after)][1].add(name)
    for (name, _, _), j in got.items():  # judged and never blessed
        moved[("not expected", j.said())][0] += 1
        moved[("not expected", j.said())][1].add(name)
    return Outcome(wrong, {k: (n, sorted(runs)) for k, (n, runs) in moved.items()}, len(judged), expected_n)


def table(outcome: Outcome) -> str:
    lines = []
    if outcome.wrong:
        lines.append(f"{len(outcome.wrong)} cancel(s) known by construction judged the other way:")
        lines += [f"  {w}" for w in outcome.wrong]
    if outcome.moved:
        rows = [("before (verdict, rule)", "after", "how many", "runs")]
        rows += [(b, a, str(n), ", ".join(runs)) for (b, a), (n, runs) in sorted(outcome.moved.items())]
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        lines.append("verdicts that differ from the manifest, by rule:")
        for r in rows:
            lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(r[:3], widths)) + "  " + r[3])
    return "\n".join(lines)


def bless(judged: list[Judged], manifest: dict) -> None:
    """Keep what the rules say now as each cancel's expected verdict; a reviewed line whose rule did not move
    keeps its words."""
    by_run: dict[tuple[str, str], dict] = defaultdict(dict)
    for j in judged:
        by_run[(j.corpus_run, j.run_id)][j.request_id] = j
    for name, entry in manifest["runs"].items():
        old = entry.get("expected", {})
        entry["expected"] = {}
        for run_id, run in entry["runs"].items():
            truth = run.get("truth", {})
            kept = {}
            for rid, j in sorted(by_run.get((name, run_id), {}).items()):
                was = old.get(run_id, {}).get(rid, {})
                if rid in truth:
                    basis, why = CONSTRUCTION, truth[rid]["why"]
                elif was.get("rule") == j.rule and was.get("why") and was.get("basis") == REVIEWED \
                        and not was["why"].startswith("rule "):
                    basis, why = REVIEWED, was["why"]
                else:
                    basis, why = REVIEWED, _first_line(j.why) or f"rule {j.rule}"
                kept[rid] = {"verdict": j.verdict, "rule": j.rule, "basis": basis, "why": why}
                if j.fields:
                    kept[rid]["fields"] = dict(j.fields)
            entry["expected"][run_id] = kept


def _first_line(text: str, limit: int = 240) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def counts(manifest: dict) -> Counter:
    c: Counter = Counter()
    for entry in manifest["runs"].values():
        for run in entry.get("expected", {}).values():
            for e in run.values():
                c[e["basis"]] += 1
        for run in entry["runs"].values():
            c["no_cancel"] += sum(1 for t in run.get("truth", {}).values() if t["truth"] == "no_cancel")
    return c


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bless", action="store_true", help="keep what the rules say now as expected")
    args = ap.parse_args(argv)
    manifest = load_manifest()
    with tempfile.TemporaryDirectory(prefix="cancelwatch-corpus-") as tmp:
        judged = judge_corpus(Path(tmp), manifest)
    outcome = compare(judged, manifest)
    text = table(outcome)
    if text:
        print(text)
    if args.bless:
        if outcome.wrong:
            print("check.py: cancels known by construction are judged the other way: mend the rules, they cannot "
                  "be blessed", file=sys.stderr)
            return 1
        bless(judged, manifest)
        save_manifest(manifest)
        c = counts(manifest)
        print(f"blessed {outcome.judged} cancels ({c[CONSTRUCTION]} by construction, {c[REVIEWED]} reviewed) "
              f"and {c['no_cancel']} streams read to their end")
        return 0
    print(f"{outcome.judged} cancels judged, {outcome.expected} expected: "
          + ("as the manifest says" if outcome.ok else "differences above"))
    return 0 if outcome.ok else 1


if __name__ == "__main__":
    sys.exit(main())
