"""The leaked cancels of a stored run as ghosts (analysis/ghosts.py): which the engine still held at the last
sample read, and each one's age. It weighs the engine's count against the ledger's requests in the engine as
the run's family reads them (Family.in_engine): families.ghosts_of passes the family's reading in."""

from __future__ import annotations

import pandas as pd

from cancelwatch.analysis.ghosts import GHOST_COLUMNS, GHOST_UNKNOWN, IN_ENGINE, LEFT, UNKNOWN, Ghosts
from cancelwatch.analysis.verdicts.core import LEFT_BY_RULES


def ghost_table(run, verdicts, in_engine) -> pd.DataFrame:
    """Every leaked cancel of `run`, oldest first: when its client left (s since the run started), whether the
    engine still holds it, and its age: up to the last sample read while the engine holds it (a ghost), up to
    when it left otherwise (the time it ran for nobody). Where the verdict's own stretch saw it leave, or its
    abort came after the grace, that is when. Where it was still there then, the engine's count after its
    grace is replayed as the watch does live (Ghosts), against the ledger's requests in the engine: at most as
    many ghosts as the count holds beyond them, the oldest taken to have gone first. `in_engine(run, target)`:
    that reading (analysis.ghosts.EngineReading), None where the family's gauges count no requests."""
    rows, joining, left_by = {}, [], {}
    for v in verdicts:
        if v.verdict != "leaked":
            continue
        stop, left = v.client_left_s(), v.timepoints.get("left_scheduler")
        by = None
        if v.rule in LEFT_BY_RULES:  # when it had left by: which of the lost requests left first, the count says
            left, by = None, left
        abort = v.timepoints.get("engine_abort")
        if left is None and abort is not None and abort > stop + v.evidence.grace_s:
            left = abort  # the abort came late (abort_after_grace): it ended the request then
        rows[v.request_id] = {
            "request_id": v.request_id, "scenario": v.scenario, "rule": v.rule, "client_left_s": stop,
            "in_engine": LEFT if left is not None else UNKNOWN, "left_engine_s": left,
            "age_s": None if left is None else left - stop, "unknown_why": None,
            "tokens_after_client_left": v.evidence.tokens_after_client_left,
            "tokens_are": v.evidence.tokens_after_client_left_is}
        if left is None:
            joining.append((stop, v.evidence.grace_s, v.request_id))
            if by is not None:
                left_by[v.request_id] = by
    if joining:
        _replay(run, joining, rows, in_engine)
    for rid, by in left_by.items():  # the count kept it a ghost past when its verdict says it had left by
        if rows[rid]["in_engine"] != LEFT or rows[rid]["left_engine_s"] > by:
            rows[rid].update(in_engine=LEFT, left_engine_s=by, age_s=by - rows[rid]["client_left_s"], unknown_why=None)
    frame = pd.DataFrame(list(rows.values()), columns=GHOST_COLUMNS)
    return frame.sort_values("client_left_s", kind="stable").reset_index(drop=True)


def _replay(run, joins: list[tuple[float, float, str]], rows: dict, in_engine) -> None:
    """The engine's count from each of `joins` (its client's close, its grace, request id): each joins the ghosts
    at its close, or from when the engine counted it at the latest if later (a request a hop sent on late), as
    the ledger's requests in the engine let it go there; it leaves them where the count no longer holds it beyond
    those, never before its grace's end (its verdict saw it there). Joined only at its grace's end, a leaked one
    in its grace sat in the count's surplus as nothing: under steady leaking there always was one, and no older
    ghost's end showed (analysis.ghosts.WatchGhosts, the watch's live reading)."""
    targets = run.info.get("targets") or []
    times = counts = flying = reading = None
    if len(targets) > 1:
        why = "targets"
    else:
        reading = in_engine(run, targets[0]["label"] if targets else None)
        if reading is not None:
            ok = ~pd.isna(reading.count)
            times, counts, flying = reading.t_s[ok], reading.count[ok], reading.in_flight[ok]
        why = None if times is not None and len(times) else "no_count"
    if why:
        for *_, rid in joins:
            rows[rid]["unknown_why"] = GHOST_UNKNOWN[why]
        return
    joins = sorted((max(t, reading.counted_from.get(rid, t)), t + grace, rid) for t, grace, rid in joins)
    ghosts, k = Ghosts(), 0
    for t, count, n in zip(times, counts, flying):
        while k < len(joins) and joins[k][0] <= t:
            at, until, rid = joins[k]
            ghosts.leaked(rid, rows[rid]["client_left_s"], seen_at_s=at, seen_until_s=max(at, until))
            k += 1
        for rid, by in ghosts.update(count, n, float(t)):
            rows[rid].update(in_engine=LEFT, left_engine_s=by, age_s=by - rows[rid]["client_left_s"])
    last = float(times[-1])
    # the grace of the last ones ends past the last sample: the verdict saw them there, and nothing since
    for *_, rid in joins[k:]:
        ghosts.leaked(rid, rows[rid]["client_left_s"])
    # a fall in the last second read has not held long enough to say who left: the oldest it may be
    short = ghosts.short_by(counts[-1], flying[-1])
    for i, rid in enumerate(sorted(ghosts.left_at, key=ghosts.left_at.get)):
        rows[rid].update(in_engine=IN_ENGINE, age_s=last - rows[rid]["client_left_s"])
        if i < short:
            rows[rid].update(in_engine=UNKNOWN, unknown_why=GHOST_UNKNOWN["last_second"])
