"""Races are counted apart (issue: verdicts on users' stacks, point 5): the acceptance and the protocol's
headline say "N released, M completions won the race", never "all released" when some were races; a
cancel is a race only where its rule concluded one, not where a race flag was noted on the way down the
ladder; a run of races alone is not accepted. Judged on the shipped sample, its verdicts changed in the
report document as each case would have them."""

from __future__ import annotations

import copy

from cancelwatch.analysis.protocol import accepted, protocol_markdown
from cancelwatch.analysis.verdicts import RACE_RULES, report_document
from cancelwatch.runstore.reader import load_run
from tests.conftest import ROOT

SAMPLE = ROOT / "dashboard" / "sample" / "sample.db"


def sample_doc():
    run = load_run(SAMPLE, "latest")
    return run, report_document(run)


def as_rule(c: dict, verdict: str, rule: str, race: str | None = None) -> None:
    c["verdict"] = verdict
    c["evidence"] = {**c["evidence"], "rule": rule, "race": race}


def headline(run, doc) -> str:
    return next(line for line in protocol_markdown(run, doc).splitlines() if line.startswith("Result:"))


def test_the_race_rules_are_the_ones_that_conclude_a_race():
    assert RACE_RULES == {"completion_won_race", "ran_out_its_last_tokens", "natural_end_with_stop",
                          "due_to_end_with_stop"}


def test_all_released_says_all():
    run, doc = sample_doc()
    assert accepted(doc) and "all 6 cancels released" in headline(run, doc)


def test_races_are_counted_apart_from_releases():
    run, doc = sample_doc()
    as_rule(doc["cancels"][0], "inconclusive", "completion_won_race", "completed before the cancel took effect")
    as_rule(doc["cancels"][1], "inconclusive", "ran_out_its_last_tokens", "the stop came 2 token(s) before the end")
    assert accepted(doc)
    line = headline(run, doc)
    assert "4 of 6 cancels released, 2 completions won the race" in line and "all" not in line


def test_a_race_flag_without_a_race_rule_is_not_a_race():
    """note_race() marks a cancel near its end before the evidence is weighed; the rule that then decided
    (the log never named the request) concluded no race, and the cancel is not waved through."""
    run, doc = sample_doc()
    as_rule(doc["cancels"][0], "inconclusive", "never_added", "the stop came 2 token(s) before the end")
    assert not accepted(doc) and "**not accepted**" in headline(run, doc)


def test_a_run_of_races_alone_is_not_accepted():
    run, doc = sample_doc()
    races = copy.deepcopy(doc)
    for c in races["cancels"]:
        as_rule(c, "inconclusive", "ran_out_its_last_tokens", "the stop came 2 token(s) before the end")
    assert not accepted(races)
    line = headline(run, races)
    assert "**not accepted**" in line and "every one a race the completion won" in line
