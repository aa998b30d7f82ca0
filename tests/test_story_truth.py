"""The story tells the truth per verdict (issue: verdicts on users' stacks, point 12): no "the request's
space went back to the pool" beside a cancel that was not released; a leak whose abort the engine logged
is not blamed on a proxy or app that does not pass the cancel on; a late abort is not called lost. Each
case is the rule table's own hand-built run (tests/test_verdict_rules.py)."""

from __future__ import annotations

import pytest

from cancelwatch.analysis.explain import memory_story
from cancelwatch.analysis.verdicts import judge_run
from tests.test_verdict_rules import VLLM_RUNS


def story(rule: str) -> tuple[str, str]:
    run = VLLM_RUNS[rule]()
    (v,) = judge_run(run)
    assert v.evidence.rule == rule
    return v.verdict, " ".join(memory_story(run, [v], v))


@pytest.mark.parametrize("rule", sorted(r for r in VLLM_RUNS if r != "released"))
def test_only_a_release_gives_the_space_back_in_the_story(rule):
    # a release beside other traffic too: the share it reads is everyone's, never "went back" on its own
    verdict, text = story(rule)
    assert "went back to the pool" not in text, text
    assert verdict != "released" or rule == "released_beside_traffic", (rule, verdict)


def test_a_release_gives_it_back():
    assert "went back to the pool" in story("released")[1]


@pytest.mark.parametrize("rule, says, never", [
    ("no_abort_ran_to_end", "lost on the way", None),
    ("no_abort_still_there", "lost on the way", None),
    ("abort_after_grace", "not lost but late", "lost on the way"),
    ("abort_logged_still_generating", "The cancel reached the engine; the engine did not let the request go",
     "does not pass it on"),
    ("resubmitted_after_stop", "the copy sent after it is what kept the engine busy", "lost on the way"),
    ("app_lost_cancel", "the app lost the cancel", "cannot tell whether"),
    ("still_counted_generating", "cannot tell whether the cancel was lost on the way or reached an engine",
     "(a proxy or app that does not pass it on)"),
])
def test_a_leak_is_blamed_where_the_evidence_puts_it(rule, says, never):
    verdict, text = story(rule)
    assert verdict == "leaked" and says in text, text
    assert never is None or never not in text, text
