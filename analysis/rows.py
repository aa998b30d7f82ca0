"""A frame's rows as named tuples, without pandas' per-row cost: DataFrame.itertuples reads each column through
its indexer and builds a tuple class on every call, about a millisecond a call on the run's few-row frames (its
events, stops, ledger), and a watch judges every cancel on a window of its own."""

from __future__ import annotations

from collections import namedtuple
from functools import lru_cache

import pandas as pd


@lru_cache(maxsize=128)
def _row_type(columns: tuple[str, ...]):
    return namedtuple("Row", columns, rename=True)


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
