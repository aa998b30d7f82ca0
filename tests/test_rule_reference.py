"""docs/rules.md is the table of rules as it stands: every code once, with its verdict, sentence and fields."""

from __future__ import annotations

from pathlib import Path

from cancelwatch.analysis.verdicts import RULES
from cancelwatch.analysis.verdicts.reference import reference_markdown, sentence_fields

DOC = Path(__file__).resolve().parents[1] / "docs" / "rules.md"


def test_the_rule_reference_is_current():
    assert DOC.read_text() == reference_markdown(), \
        "docs/rules.md is out of date: python -m cancelwatch.analysis.verdicts.reference > docs/rules.md"


def test_every_rule_is_in_the_reference_once_under_its_verdict():
    text = reference_markdown()
    for code, rule in RULES.items():
        assert text.count(f"| `{code}`") == 1, code
        section = text.split(f"## {rule.verdict} (", 1)[1].split("\n## ", 1)[0]
        assert f"| `{code}`" in section, (code, rule.verdict)


def test_the_fields_a_sentence_is_filled_with():
    assert sentence_fields("kept {kept_ms:.0f} ms, {others} others, {kept_ms}") == ["kept_ms", "others"]
