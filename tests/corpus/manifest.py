"""The corpus's manifest (tests/corpus/manifest.json): per recorded run, how it was recorded and, per cancel,
the truth its set-up makes certain and the verdict the rules were last blessed with.

    {"runs": {NAME: {"file": "runs/NAME.db.gz", "what": one line, "recorded": {how},
                     "runs": {RUN_ID: {"name": ..., "truth": {REQUEST_ID: {"truth": T, "why": ...}}}},
                     "expected": {RUN_ID: {REQUEST_ID: {"verdict": V, "rule": R, "basis": B, "why": ...}}}}}}

A truth T is one of TRUTHS; the basis B of an expected verdict is `construction` where the run's truth names
the cancel, else `reviewed` (read from the evidence; `why` says what it rests on)."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

CORPUS = Path(__file__).resolve().parent
RUNS_DIR = CORPUS / "runs"
MANIFEST = CORPUS / "manifest.json"

# what a set-up makes certain of one request, and the verdicts that contradict it
TRUTHS = {
    "released": ("leaked",),  # the cancel surely reached the engine, which let the request go
    "leaked": ("released",),  # the cancel surely never reached the engine, which ran on past the grace
    "no_lost_cancel": ("leaked",),  # the request ran to its end before its client left: nothing was lost
    "no_cancel": ("released", "leaked", "stale_gauge", "inconclusive"),  # read to its end: no cancel at all
}
CONSTRUCTION, REVIEWED = "construction", "reviewed"


def load_manifest(path: Path = MANIFEST) -> dict:
    if not path.exists():
        return {"runs": {}}
    return json.loads(path.read_text())


def save_manifest(doc: dict, path: Path = MANIFEST) -> None:
    doc["runs"] = dict(sorted(doc["runs"].items()))
    path.write_text(json.dumps(doc, indent=1, sort_keys=False) + "\n")


def unpack(entry: dict, folder: Path) -> Path:
    """The entry's store, ungzipped into `folder` (once)."""
    src = CORPUS / entry["file"]
    dest = folder / src.name.removesuffix(".gz")
    if not dest.exists():
        with gzip.open(src, "rb") as fin, open(dest, "wb") as fout:
            shutil.copyfileobj(fin, fout)
    return dest
