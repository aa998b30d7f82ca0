"""A frame's rows as named tuples, without pandas' per-row cost: DataFrame.itertuples reads each column through
its indexer and builds a tuple class on every call, about a millisecond a call on the run's few-row frames (its
events, stops, ledger), and a watch judges every cancel on a window of its own."""

from __future__ import annotations

from collections import namedtuple
from functools import lru_cache

import pandas as pd

from cancelwatch.runstore.reader import Run


@lru_cache(maxsize=128)
def _row_type(columns: tuple[str, ...]):
    return namedtuple("Row", columns, rename=True)


def event_rows(run: Run, *kinds: str) -> list:
    """frame_rows(run.events_of(*kinds)) (every event without kinds), made once an events frame (Run.memo): a cancel's
    rules read the same few kinds' rows a dozen times. Shared: a caller does not change the list."""
    def make() -> list:
        every = run.memo("events", ("rows",), lambda: frame_rows(run.events))
        return every if not kinds else [every[i] for i in run.event_positions(*kinds).tolist()]
    return run.memo("events", ("rows", *kinds), make)


def ledger_rows(run: Run) -> list:
    """frame_rows(run.ledger), made once a ledger frame (Run.memo). Shared: a caller does not change the list."""
    return run.memo("ledger", ("rows",), lambda: frame_rows(run.ledger))


def ledger_dicts(run: Run, request_ids) -> dict[str, dict]:
    """Request id -> its ledger row as a dict by column name (frame_dicts), of `request_ids` only (the last row of an
    id, as a dict of every row keeps it)."""
    names = run.memo("ledger", ("names",), lambda: [str(c) for c in run.ledger.columns])
    wanted = set(request_ids)
    return {row.request_id: dict(zip(names, row)) for row in ledger_rows(run) if row.request_id in wanted}


def frame_rows(df: pd.DataFrame) -> list:
    """df.itertuples(index=False), as a list: each value a Python object (a float column's NaN stays NaN; a
    missing value of a nullable column is None or pd.NA, both pd.isna)."""
    if not len(df):
        return []
    row = _row_type(tuple(str(c) for c in df.columns))
    # the frame as one object array: a column read through the frame costs tens of microseconds each
    return list(map(row._make, df.to_numpy(dtype=object).tolist()))


def frame_dicts(df: pd.DataFrame) -> list[dict]:
    """df.to_dict("records") with frame_rows' values: a tenth of its cost on a ledger's few rows of twenty columns."""
    if not len(df):
        return []
    names = [str(c) for c in df.columns]
    return [dict(zip(names, values)) for values in df.to_numpy(dtype=object).tolist()]
