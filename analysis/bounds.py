"""The tolerances the verdicts' model of the engine assumes, in one table: each lag, slack, margin and hold, with
why it is what it is. A verdict that rests on one of them can only be as right as its assumption; change one here
and the corpus check (tests/corpus/) says what moved.

Seconds unless named otherwise; instants are on the run's clock (s since it started)."""

from __future__ import annotations

# ------------------------------------------------------------------------------------------ the run's reading
# the counts the rules compare (the engine's gauges and own ends, the ledger's requests and sequences, their stays'
# sums) are whole requests: one is above another when it is more by over half a request, and equal within half of one
# (a float's rounding, a sum of weights, never a fraction of a request)
WHOLE = 0.5
GRACE_S = 2.0  # how long after the abort (else the stop) a release is looked for, unless the run says otherwise
MIN_SAMPLES = 5  # fewer scheduler samples in a run than this: nothing is judged on them
# how far past the abort a request that did not leave in the grace is followed (its tokens made for nobody, where
# it left); a cancel's stretch of the run ends here
HORIZON_S = 60.0
# a cancel's stretch of the run starts this long before its stop: the engine as the user pressed stop (the count, the
# ledger's count and KV usage the rules read the release against), and where the checks of its evidence start (a
# restart, a hole in the engine log, a preemption, requests the log names and the ledger does not)
BASELINE_S = 1.0
# a stop this close to the end (tokens) is a race the completion may win: neither outcome is a lost cancel
RACE_TOKENS = 8

# ------------------------------------------------------------------------------------------ the engine's log
# an engine log line is stamped to the millisecond, then mapped onto the run's clock: an abort may read a hair
# before the stop that caused it
LOG_SLACK_S = 0.05
# a line stamped to the millisecond on the recorder's host lands within a few ms of where it was written; the
# windows a renamed request's line is matched in are not widened by LOG_SLACK_S: a request sent 5 ms after its
# neighbour's first token would then share its window with the neighbour's line, and neither be matched. A line
# that lands outside its window is left unknown (other traffic, inconclusive), never matched wrong
MATCH_SLACK_S = 0.005

# ------------------------------------------------------------------------------------------ who is in the engine
# an end the engine made reaches its client this much later through a hop, at the most assumed (and a request, or
# the disconnect that cancels it, sent reaches the engine this much later)
LAG_S = 0.25
# a request is counted by the gauges within this long of its Added line (the engine's next step), at the most
# assumed: on a starved host a step took over half a second
ENTER_S = 1.0
# how long the engine's count must hold fewer lost requests than the ledger before the oldest are taken out
# (_gone_by_surplus): the ledger's other requests run ahead of the gauges for up to a request's entry (its Added
# line's doubt and the next step) and a lagging client's close; a review built releases read as leaks from a
# shortfall of just over a second (a whole-second Added stamp; a neighbour's reader a second behind). Longer, the
# last lost requests of an AIPerf run were never taken out: the engine went idle 2.85 s after the shortfall began
SURPLUS_HOLD_S = 2.0
# no sequence runs faster than the fastest one went alone in the window, this many times over: a request cannot
# have made its tokens sooner (a step's timing wobbles; two cores, a busy recorder beside the engine)
PACE_MARGIN = 1.25
# the engine's own ends and the clients' closes that read them are paired from this long before a cancel's look-back
# (VllmCase.ends_unread): a close just inside it reads its own end, counted just before it, and not another's. Four
# times LAG_S: a close LAG_S into the look-back may read an end LAG_S before it, and so on
READ_BACK_S = 1.0
# a request seen waiting shows the engine full where it stayed waiting while the engine made tokens in this many
# sample intervals after it entered: the scheduler ran a whole step after it came, and did not let it in (a watch's
# `reusable`: analysis/verdicts/reuse.py)
FULL_STEPS = 2
# passes of judge_vllm at the most: each ends the ledger's no-abort requests where their verdicts saw them leave
JUDGE_PASSES = 3

# ------------------------------------------------------------------------------------------ a slow reader
# the server counting fewer than the ledger for this long (and at least this many sample periods) after a fall is
# no lag of a scrape or a close: the engine was done with a request its client was still reading
PERSIST_S = 1.0
PERSIST_PERIODS = 4
# the next request the engine would finish this close after the ones that left could be one of them: nothing
# is moved
AMBIGUOUS_S = 1.0

# ------------------------------------------------------------------------------------------ Triton
# a natural end this close after the stop is a race the end may have won, not a lost cancel
RACE_S = 0.1
# without a log, a ledger request is counted as the server's from this long after its send to this long before
# its client's close (a recorded probe was taken up 12 ms after its send)
LEDGER_LAG_S = 0.1
# a natural end known to within this is the request's end: counted up to it and gone then, it ran to it. A request
# taken up at once is shown so by a reading LEDGER_LAG_S after its send (it may not have reached the server before)
# and the one after it (20 Hz). Known only more widely (the core may have queued it), a fall inside that span may
# be its end or a cancel's
NATURAL_END_SPREAD_S = 0.15

# ------------------------------------------------------------------------------------------ a window's judging
# the window starts this long before the stop: the baseline the rules read (BASELINE_S), and before it the hold over
# which the count's surplus says which lost requests (stopped, no abort known) the engine still holds
# (SURPLUS_HOLD_S): a window that starts later keeps them all at the baseline, where the whole run has let them go
BEFORE_S = 4.0
SETTLE_S = 2.0  # a cancel is judged this long after its grace ends: the store's commit, the log's last lines
# a cancel whose request the engine log does not name by its window's end (never_added) is judged again on a
# window this much longer: a hop holding the request, or a starved API server (CI: over 5 s after the watch saw
# it sent), gets it to the engine after its stop, and its Added line then makes it a leak (entered_after_stop)
ENTRY_WAIT_S = 10.0
# how long the engine's count must hold fewer than the watch's ghosts before the oldest are taken to have left:
# a request on its way is in the watch's flight before the engine counts it (its next step; seconds behind a
# hop), and a finished one leaves the count before its client closes it (a lagging reader, a buffering proxy).
# Either makes the surplus dip for a moment, and a ghost once dropped is never taken back
GHOST_HOLD_S = 1.0
