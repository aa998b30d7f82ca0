"""The reference of every rule code (docs/rules.md), made from the table of rules (core.RULES): its verdict,
its sentence, and the fields it sets. `python -m cancelwatch.analysis.verdicts.reference > docs/rules.md` writes it;
tests/test_rule_reference.py keeps it current."""

from __future__ import annotations

import string
import sys

from cancelwatch.analysis.evidence import OPEN_REASONS
from cancelwatch.analysis.verdicts.core import ASSUMPTIONS, COUNT_READING_RULES, RULES, VERDICTS


def sentence_fields(sentence: str) -> list[str]:
    """The fields a rule's sentence is filled in with, in order, once each."""
    out: list[str] = []
    for _, name, _, _ in string.Formatter().parse(sentence):
        if name and name not in out:
            out.append(name)
    return out


def reference_markdown() -> str:
    lines = ["# Verdict rules", "",
             "Every verdict carries a `rule`: the code of the rung of the ladder that gave it (`cancelwatch report "
             "--json`, `evidence.rule`). This page is made from the table of rules (`analysis/verdicts/core.py`, "
             "`RULES`) by `python -m cancelwatch.analysis.verdicts.reference`; a test keeps it current.", "",
             "- **fields**: what the rule fills its sentence with (the evidence's `why`); the same values, by "
             "name, are the evidence's `rule_fields`.",
             "- **count_reading**: the rule read the scheduler's count at a deciding sample; `evidence.count_reading` "
             "holds that count, the fewest and the most other requests the engine could hold there, the bound the "
             "count was held to, and the requests that keep the two apart, each with its reason "
             f"({', '.join(f'`{code}`' for code in OPEN_REASONS)}: `analysis/evidence.py`, OPEN_REASONS). "
             "`app_lost_unconfirmed` carries one where a sample short of the ledger kept the loss open.",
             "- **race**: the evidence concluded a race the completion won; **quiet**: a plain release, `why` empty.", ""]
    for verdict in VERDICTS:
        codes = [c for c, r in RULES.items() if r.verdict == verdict]
        lines += [f"## {verdict} ({len(codes)} rules)", "", "| rule | sets | sentence |", "|---|---|---|"]
        for code in codes:
            rule = RULES[code]
            sets = [f"`{f}`" for f in sentence_fields(rule.sentence)]
            if code in COUNT_READING_RULES:
                sets.append("`count_reading`")
            marks = [m for m, on in (("race", rule.race), ("quiet", rule.quiet)) if on]
            sentence = rule.sentence.replace("|", "\\|")
            lines.append(f"| `{code}`{' (' + ', '.join(marks) + ')' if marks else ''} | {', '.join(sets) or '-'} "
                         f"| {sentence} |")
        lines.append("")
    lines += ["## Assumptions", "",
              "Where the evidence alone does not decide, a verdict names what it rests on besides it "
              "(`evidence.assumes`), and the report says where the run's own evidence contradicts one "
              "(`report --json`, `assumptions`).", "", "| assumption | what is assumed |", "|---|---|"]
    lines += [f"| `{code}` | {what} |" for code, what in ASSUMPTIONS.items()]
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(reference_markdown())
