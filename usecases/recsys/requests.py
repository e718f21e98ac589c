"""A scoring request's columns, checked, without pandas: the lean server reads them from JSON, the pyfunc from a
DataFrame, and both get the same rows and the same one-line refusals.

Columns: `user_id` (required), `recent_items` (optional: per row a list of item ids, newest last, or null),
`recent_timestamps` (optional: per row a list of numbers, one per recent item, which orders them) and `k` (optional:
the first row's value). K is otherwise MLflow's `k` param: a column wins over it, because MLflow hands the logged
default to every call that gives no params.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from common.serving.pyfunc import BadInput

MAX_K = 1000
LIST_TYPES = (list, tuple, np.ndarray)


@dataclass(frozen=True)
class UserRequest:
    """One row: the raw user id and their recent item ids, oldest first."""

    user_id: object
    recent_items: tuple = ()


def parse_rows(columns: Mapping[str, Sequence], n_rows: int) -> list[UserRequest]:
    """The request's rows, or `BadInput` naming the column and row that cannot be read."""
    if "user_id" not in columns:
        raise BadInput(f"input is missing column 'user_id' (got {', '.join(map(str, columns)) or 'no columns'})")
    recent = columns.get("recent_items")
    stamps = columns.get("recent_timestamps")
    if stamps is not None and recent is None:
        raise BadInput("recent_timestamps needs the column recent_items (one timestamp per recent item)")
    rows = []
    for row, user in enumerate(columns["user_id"]):
        if _missing(user):
            raise BadInput(f"user_id row {row}: expected a user id, got null")
        items = _item_list(recent[row], row) if recent is not None else ()
        if stamps is not None and items:
            items = _ordered(items, _timestamps(stamps[row], row, len(items)))
        rows.append(UserRequest(user, items))
    if len(rows) != n_rows:
        raise BadInput(f"input columns differ in length: user_id has {len(rows)} rows, expected {n_rows}")
    return rows


def requested_k(columns: Mapping[str, Sequence], params: Mapping | None, default: int) -> int:
    """`k` from the first row of a `k` column, else MLflow's params, else `default`; 1..MAX_K."""
    if "k" in columns and len(columns["k"]):
        raw, where = columns["k"][0], "k row 0"
    elif params and params.get("k") is not None:
        raw, where = params["k"], "param k"
    else:
        return default
    try:
        k = int(raw)
    except (TypeError, ValueError):
        raise BadInput(f"{where}: expected an integer between 1 and {MAX_K}, got {_shown(raw)}") from None
    if k != raw and not (isinstance(raw, str) and raw.strip().lstrip("+").isdigit()):
        raise BadInput(f"{where}: expected an integer between 1 and {MAX_K}, got {_shown(raw)}")
    if not 1 <= k <= MAX_K:
        raise BadInput(f"{where}: k must be between 1 and {MAX_K}, got {k}")
    return k


def _item_list(value, row: int) -> tuple:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ()
    if not isinstance(value, LIST_TYPES) or (isinstance(value, np.ndarray) and value.ndim != 1):
        raise BadInput(f"recent_items row {row}: expected a list of item ids (newest last), got {_shown(value)}")
    for position, item in enumerate(value):
        if _missing(item) or isinstance(item, (*LIST_TYPES, dict, bool)):
            raise BadInput(f"recent_items row {row} item {position}: expected an item id (a string or an integer), "
                           f"got {_shown(item)}")
    return tuple(value)


def _timestamps(value, row: int, count: int) -> list[float]:
    if not isinstance(value, LIST_TYPES) or len(value) != count:
        raise BadInput(f"recent_timestamps row {row}: expected a list of {count} numbers (one per recent item), got "
                       f"{_shown(value)}")
    stamps = []
    for position, stamp in enumerate(value):
        if isinstance(stamp, bool) or not isinstance(stamp, (int, float, np.number)) or not math.isfinite(stamp):
            raise BadInput(f"recent_timestamps row {row} item {position}: expected a number, got {_shown(stamp)}")
        stamps.append(float(stamp))
    return stamps


def _ordered(items: tuple, stamps: list[float]) -> tuple:
    """Oldest first; equal timestamps keep the order they were given in."""
    return tuple(items[index] for index in sorted(range(len(items)), key=stamps.__getitem__))


def _missing(value) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def _shown(value) -> str:
    text = repr(value.tolist() if isinstance(value, np.ndarray) else value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"
