"""The leaked cancels of a stored run as ghosts (analysis/ghosts.py): which the engine still held at the last
sample read, and each one's age. It weighs the engine's count against the ledger's requests in the engine as
the run's family reads them: families.ghosts_of passes the family's reading in."""

from __future__ import annotations

import pandas as pd

from analysis.ghosts import GHOST_COLUMNS, GHOST_UNKNOWN, IN_ENGINE, LEFT, UNKNOWN, Ghosts
from analysis.series import scheduler_frame


def ghost_table(run, verdicts, in_engine) -> pd.DataFrame:
    """Every leaked cancel of `run`, oldest first: when its client left (s since the run started), whether the
    engine still holds it, and its age: up to the last sample read while the engine holds it (a ghost), up to
    when it left otherwise (the time it ran for nobody). Where the verdict's own stretch saw it leave, that is
    when. Where it was still there then, the engine's count after its grace is replayed as the watch does
    live (Ghosts), against the ledger's requests in the engine (from their Added lines): at most as many ghosts
    as the count holds beyond them, the oldest taken to have gone first. `in_engine(run, target, times)`: the
    ledger's requests in the engine at each of `times`, None where the family's gauges count none."""
    rows, joining = {}, []
    for v in verdicts:
        if v.verdict != "leaked":
            continue
        stop, left = v.timepoints["user_stop"], v.timepoints.get("left_scheduler")
        rows[v.request_id] = {
            "request_id": v.request_id, "scenario": v.scenario, "rule": v.rule, "client_left_s": stop,
            "in_engine": LEFT if left is not None else UNKNOWN, "left_engine_s": left,
            "age_s": None if left is None else left - stop, "unknown_why": None,
            "tokens_after_client_left": v.evidence.tokens_after_client_left,
            "tokens_are": v.evidence.tokens_after_client_left_is}
        if left is None:
            joining.append((stop + v.evidence.grace_s, v.request_id))
    if joining:
        _replay(run, sorted(joining), rows, in_engine)
    frame = pd.DataFrame(list(rows.values()), columns=GHOST_COLUMNS)
    return frame.sort_values("client_left_s", kind="stable").reset_index(drop=True)


def _replay(run, joins: list[tuple[float, str]], rows: dict, in_engine) -> None:
    """The engine's count from the first grace end of `joins` (instant, request id) on: each request joins
    the ghosts at its grace's end (its verdict saw it there then), and leaves them where the count no longer
    holds it beyond the ledger's requests in the engine."""
    targets = run.info.get("targets") or []
    sched = scheduler_frame(run)
    sched = sched[sched["count"].notna() & (sched["t_s"] >= joins[0][0])] if not sched.empty else sched
    times = sched["t_s"].to_numpy(dtype=float)
    in_flight = in_engine(run, targets[0]["label"] if targets else None, times) \
        if len(targets) <= 1 and len(times) and not run.ledger.empty else None
    why = "targets" if len(targets) > 1 else "no_count" if in_flight is None else None
    if why:
        for _, rid in joins:
            rows[rid]["unknown_why"] = GHOST_UNKNOWN[why]
        return
    ghosts, k = Ghosts(), 0
    for t, count, flying in zip(times, sched["count"].to_numpy(dtype=float), in_flight):
        while k < len(joins) and joins[k][0] <= t:
            ghosts.leaked(joins[k][1], rows[joins[k][1]]["client_left_s"])
            k += 1
        for rid, by in ghosts.update(count, flying, float(t)):
            rows[rid].update(in_engine=LEFT, left_engine_s=by, age_s=by - rows[rid]["client_left_s"])
    for rid in ghosts.left_at:
        rows[rid].update(in_engine=IN_ENGINE, age_s=float(times[-1]) - rows[rid]["client_left_s"])
