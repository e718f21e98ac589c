"""From a raw log to encoded positives: rating threshold and de-duplication, the iterative k-core, id encoding.

Written against the pandas API, so that cuDF can run it on a GPU.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from common.errors import UserError
from .config import Data


def filter_interactions(frame: pd.DataFrame, data: Data, source: str = "the log") -> pd.DataFrame:
    """Positives for implicit feedback: ratings at or above the threshold, each (user, item) pair once at its
    earliest time, then the k-core. The result is in time order (ties in log order) with a fresh index."""
    threshold = data.rating_threshold
    if threshold is not None:
        if frame["rating"].isna().all():
            raise UserError(f"{source}: data.rating_threshold={threshold} needs ratings but there are none "
                            "(data.columns.rating names the column); set data.rating_threshold=null")
        highest = frame["rating"].max()
        frame = frame[frame["rating"] >= threshold]
        if frame.empty:
            raise UserError(f"{source}: nothing left after data.rating_threshold={threshold}: the highest rating is "
                            f"{highest:g}; lower it, or set data.rating_threshold=null to keep every rating")
    frame = frame.sort_values("timestamp", kind="stable").drop_duplicates(["user", "item"], keep="first")
    cored = k_core(frame, data.min_user_interactions, data.min_item_interactions)
    if cored.empty:
        filters = [f"data.rating_threshold={threshold}"] if threshold is not None else []
        filters.append(f"the k-core filter (data.min_user_interactions={data.min_user_interactions}, "
                       f"data.min_item_interactions={data.min_item_interactions})")
        raise UserError(f"{source}: nothing left after {' and '.join(filters)}; relax the filters ({_before(frame)})")
    return cored.reset_index(drop=True)


def _before(frame: pd.DataFrame) -> str:
    """How many users and items the k-core started from, and the most interactions of each, to relax it by."""
    users, items = frame.groupby("user").size(), frame.groupby("item").size()
    return (f"before it: {len(users)} users with at most {users.max()} interactions each, {len(items)} items with "
            f"at most {items.max()} users each")


def k_core(frame: pd.DataFrame, min_user: int, min_item: int) -> pd.DataFrame:
    """Drop users and items with fewer interactions than asked until none is left: dropping an item can take a
    user below its minimum, and the other way round (0 turns a side off)."""
    while not frame.empty:
        keep = pd.Series(True, index=frame.index)
        if min_user:
            keep &= frame.groupby("user")["item"].transform("size") >= min_user
        if min_item:
            keep &= frame.groupby("item")["user"].transform("size") >= min_item
        if keep.all():
            break
        frame = frame[keep]
    return frame


def encode(frame: pd.DataFrame, titles: pd.Series | None = None
           ) -> tuple[pd.DataFrame, np.ndarray, np.ndarray, np.ndarray | None]:
    """Codes 1..n in the order of the sorted raw ids (0 stays `ranking.UNKNOWN`); the raw ids and titles by code."""
    user_codes, users = pd.factorize(frame["user"], sort=True)
    item_codes, items = pd.factorize(frame["item"], sort=True)
    encoded = pd.DataFrame({"user": user_codes.astype(np.int64) + 1, "item": item_codes.astype(np.int64) + 1,
                            "timestamp": frame["timestamp"].to_numpy(np.int64),
                            "rating": frame["rating"].to_numpy(np.float64)})
    aligned = None
    if titles is not None:
        titles = titles[~titles.index.duplicated()]
        aligned = np.concatenate([[""], titles.reindex(items).fillna("").astype(str).to_numpy(object)]).astype(object)
    return encoded, _with_placeholder(users), _with_placeholder(items), aligned


def _with_placeholder(ids: pd.Index) -> np.ndarray:
    if pd.api.types.is_integer_dtype(ids):
        return np.concatenate([[-1], ids.to_numpy(np.int64)])
    return np.concatenate([[None], ids.to_numpy(object)]).astype(object)
