"""A scoring request's columns (`user_id`, and optional `recent_items`, `recent_timestamps` and `k`), checked by the
rules of `schema.py` without pandas: the lean server reads them from JSON, the pyfunc from a DataFrame."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from common.serving.pyfunc import BadInput
from .schema import BadField, checked_id, checked_k, checked_timestamp, missing, refused_as, shown

LIST_TYPES = (list, tuple, np.ndarray)


@dataclass(frozen=True)
class UserRequest:
    """One row: the user id and their recent item ids, oldest first."""

    user_id: str | int
    recent_items: tuple = ()


@refused_as(BadInput)
def parse_rows(columns: Mapping[str, Sequence], n_rows: int) -> list[UserRequest]:
    """The request's rows, or `BadInput` naming the column and row that cannot be read."""
    if "user_id" not in columns:
        raise BadField(f"input is missing column 'user_id' (got {', '.join(map(str, columns)) or 'no columns'})")
    recent, stamps = columns.get("recent_items"), columns.get("recent_timestamps")
    if stamps is not None and recent is None:
        raise BadField("recent_timestamps needs the column recent_items (one timestamp per recent item)")
    rows = []
    for row, user in enumerate(columns["user_id"]):
        user_id = checked_id(user, f"user_id row {row}")
        items = _item_list(recent[row], row) if recent is not None else ()
        if stamps is not None and not missing(stamps[row]):
            times = _timestamps(stamps[row], row, len(items))  # oldest first; equal times keep the given order
            items = tuple(items[index] for index in sorted(range(len(items)), key=times.__getitem__))
        rows.append(UserRequest(user_id, items))
    if len(rows) != n_rows:
        raise BadField(f"input columns differ in length: user_id has {len(rows)} rows, expected {n_rows}")
    return rows


@refused_as(BadInput)
def requested_k(columns: Mapping[str, Sequence], params: Mapping | None, default: int) -> int:
    """`k` from the first row of the `k` column that gives one, else MLflow's params, else `default`."""
    given = [checked_k(value, f"k row {row}") for row, value in enumerate(columns.get("k", ())) if not missing(value)]
    param = params.get("k") if params else None
    if param is not None:
        param = checked_k(param, "param k")
    return given[0] if given else param if param is not None else default


def _item_list(value, row: int) -> tuple:
    if missing(value):
        return ()
    if not isinstance(value, LIST_TYPES) or (isinstance(value, np.ndarray) and value.ndim != 1):
        raise BadField(f"recent_items row {row} must be a list of item ids (newest last), got {shown(value)}")
    return tuple(checked_id(item, f"recent_items row {row} item {position}") for position, item in enumerate(value))


def _timestamps(value, row: int, count: int) -> list[int]:
    if not isinstance(value, LIST_TYPES) or (isinstance(value, np.ndarray) and value.ndim != 1) or len(value) != count:
        raise BadField(f"recent_timestamps row {row} must be a list of {count} timestamps (one per recent item), got "
                       f"{shown(value)}")
    return [checked_timestamp(stamp, f"recent_timestamps row {row} item {position}")
            for position, stamp in enumerate(value)]
