"""From a raw log to split positives: rating threshold and de-duplication, the iterative k-core, id encoding (the
pandas API, so that cuDF can run it on a GPU); then train, val and test by the temporal, random (RecBole's
rounding) or leave-last-out split, less the val and test rows no model can rank."""

from __future__ import annotations

import logging

import numpy as np
import pandas as pd

from common.errors import UserError
from .config import Data

log = logging.getLogger(__name__)

TRAIN, VAL, TEST = 0, 1, 2


def filter_interactions(frame: pd.DataFrame, data: Data, source: str = "the log") -> pd.DataFrame:
    """Positives: ratings at or above the threshold, each pair once at its earliest time, then the k-core."""
    threshold = data.rating_threshold
    if threshold is not None:
        check_threshold(source, threshold, frame["rating"].notna().any(), frame["rating"].max())
        frame = frame[frame["rating"] >= threshold]
    frame = frame.sort_values("timestamp", kind="stable").drop_duplicates(["user", "item"], keep="first")
    cored = k_core(frame, data.min_user_interactions, data.min_item_interactions)
    if cored.empty:
        filters = [f"data.rating_threshold={threshold}"] if threshold is not None else []
        filters.append(f"the k-core filter (data.min_user_interactions={data.min_user_interactions}, "
                       f"data.min_item_interactions={data.min_item_interactions})")
        users, items = frame.groupby("user").size(), frame.groupby("item").size()
        raise UserError(f"{source}: nothing left after {' and '.join(filters)}; relax the filters (before it: "
                        f"{len(users)} users with at most {users.max()} interactions each, {len(items)} items with at "
                        f"most {items.max()} users each)")
    return cored.reset_index(drop=True)


def check_threshold(source: str, threshold: float, rated: bool, highest: float) -> None:
    """Refuse a rating threshold that would leave nothing (both engines)."""
    if not rated:
        raise UserError(f"{source}: data.rating_threshold={threshold} needs ratings but there are none "
                        "(data.columns.rating names the column); set data.rating_threshold=null")
    if highest < threshold:
        raise UserError(f"{source}: nothing left after data.rating_threshold={threshold}: the highest rating is "
                        f"{highest:g}; lower it, or set data.rating_threshold=null to keep every rating")


def check_variety(source: str, key: str, ids, others: int) -> None:
    """One user or item left is a log with nothing to learn, most often the wrong column named as the id."""
    if len(ids) == 1:
        other = "item" if key == "user" else "user"
        raise UserError(f"{source}: every interaction is of one {key} ('{ids[0]}'; {other} ids: {others}) after "
                        f"de-duplication and the data.* filters; a recommender needs several: is the {key} column "
                        f"the right one (data.columns.{key})?")


def k_core(frame: pd.DataFrame, min_user: int, min_item: int) -> pd.DataFrame:
    """Drop users and items with fewer interactions than asked until none is left (0 turns a side off)."""
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


def check_ratios(ratios: list[float]) -> list[float]:
    """Train, val and test fractions, normalised as RecBole does so that its rounding is reproduced exactly."""
    total = sum(ratios)
    if len(ratios) != 3 or not all(0 < ratio < 1 for ratio in ratios) or abs(total - 1) > 1e-6:
        raise UserError(f"split_ratios: expected three fractions (train, val, test), each between 0 and 1 (a model "
                        f"needs a validation and a test split), summing to 1, got {list(ratios)}")
    return [ratio / total for ratio in ratios]


def split(frame: pd.DataFrame, method: str, ratios: list[float], seed: int, cuts: list[int] | None = None
          ) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """Train, val and test by `method`; a temporal split at `cuts` where given (the Dask engine's)."""
    if method == "temporal":
        return split_temporal(frame, ratios) if cuts is None else split_at(frame, cuts)
    if method == "random":
        return split_random(frame, ratios, seed)
    if method == "leave_last_out":
        return split_leave_last_out(frame)
    raise UserError(f"split: unknown method '{method}' (expected temporal, random or leave_last_out)")


def _by_label(frame: pd.DataFrame, labels: np.ndarray) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    return tuple(frame[labels == label].reset_index(drop=True) for label in (TRAIN, VAL, TEST))


def split_temporal(frame: pd.DataFrame, ratios: list[float]) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """One global cut in time, so that no model trains on the future of what it is tested on."""
    ordered = frame["timestamp"].sort_values(ignore_index=True).to_numpy()
    count = len(ordered)
    cuts = [ordered[position] if position < count else ordered[-1] + 1 for position in cut_positions(count, ratios)]
    return split_at(frame, cuts)


def cut_positions(count: int, ratios: list[float]) -> list[int]:
    """Where in the time-sorted log the validation and the test split start."""
    return [int(np.floor(fraction * count + 1e-9)) for fraction in (ratios[0], ratios[0] + ratios[1])]


def split_at(frame: pd.DataFrame, cuts: list[int]) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    timestamps = frame["timestamp"].to_numpy()
    labels = (timestamps >= cuts[0]).astype(np.int8) + (timestamps >= cuts[1]).astype(np.int8)
    return _by_label(frame, labels)


def split_sizes(counts: np.ndarray, ratios: list[float]) -> np.ndarray:
    """Train, val and test sizes per user with RecBole's rounding (`Dataset._calcu_split_ids`)."""
    counts = np.asarray(counts, dtype=np.int64)
    exact = counts[:, None] * np.asarray(ratios, dtype=np.float64)[None, :]
    sizes = np.floor(exact).astype(np.int64)
    sizes[:, 0] = counts - sizes[:, 1:].sum(axis=1)
    for column in range(len(ratios) - 1, 0, -1):
        bump = (sizes[:, 0] > 1) & (exact[:, column] > 0) & (exact[:, column] < 1)
        sizes[bump, column] += 1
        sizes[bump, 0] -= 1
    return sizes


def split_random(frame: pd.DataFrame, ratios: list[float], seed: int
                 ) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """RecBole's `RS` by user, shuffled by a hash of (user, item): a user's split does not depend on the rest."""
    frame = frame.reset_index(drop=True)
    keys = shuffle_keys(frame["user"].to_numpy(), frame["item"].to_numpy(), seed)
    shuffled = pd.DataFrame({"user": frame["user"].to_numpy(), "key": keys})
    rank = shuffled.sort_values(["user", "key"], kind="stable").groupby("user").cumcount().sort_index().to_numpy()
    sizes = split_sizes(frame.groupby("user")["user"].transform("size").to_numpy(), ratios)
    labels = (rank >= sizes[:, 0]).astype(np.int8) + (rank >= sizes[:, 0] + sizes[:, 1]).astype(np.int8)
    return _by_label(frame, labels)


def shuffle_keys(users: np.ndarray, items: np.ndarray, seed: int) -> np.ndarray:
    """SplitMix64 of (seed, user, item): a random order of a user's (distinct) items, fixed by the seed."""
    with np.errstate(over="ignore"):
        mixed = (np.uint64(seed) * np.uint64(0x9E3779B97F4A7C15) + users.astype(np.uint64) * np.uint64(1_000_003)
                 + items.astype(np.uint64))
        mixed = (mixed ^ (mixed >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        mixed = (mixed ^ (mixed >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return mixed ^ (mixed >> np.uint64(31))


def split_leave_last_out(frame: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """Per user the latest interaction is test and the one before val; users of fewer than three keep theirs."""
    frame = frame.reset_index(drop=True)
    ordered = frame.assign(order=np.arange(len(frame))).sort_values(["user", "timestamp", "order"])
    from_end = ordered.groupby("user").cumcount(ascending=False).sort_index().to_numpy()
    counts = frame.groupby("user")["user"].transform("size").to_numpy()
    labels = np.where(counts >= 3, np.where(from_end == 0, TEST, np.where(from_end == 1, VAL, TRAIN)), TRAIN)
    return _by_label(frame, labels)


def check_evaluable(frame: pd.DataFrame, method: str, parts: tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame],
                    kept: tuple[pd.DataFrame, pd.DataFrame], source: str) -> None:
    """Refuse a split that leaves train, val or test (`kept`) empty: every metric would be 0."""
    if parts[TRAIN].empty:
        raise UserError(f"{source}: split={method} leaves no training interactions: the cut in time falls on the "
                        f"earliest timestamp ({frame['timestamp'].min()}), which most of the log shares, and ties go "
                        "to the later split; use split=random or split=leave_last_out")
    empty = [index for index, part in enumerate(kept) if part.empty]
    if not empty:
        return
    names = [("validation", "test")[index] for index in empty]
    what = f"split={method} leaves the {' and '.join(names)} split{'s' if len(names) > 1 else ''} empty"
    counts = frame.groupby("user").size()
    enough = int((counts >= 3).sum())
    if method == "temporal":
        if parts[VAL + empty[0]].empty:
            raise UserError(f"{source}: {what}: the interactions at the cut in time share one timestamp; use "
                            "split=random or split=leave_last_out, or change split_ratios")
        reason = f"no user with {names[0]} interactions (the latest in time) has an earlier one to train on"
        if enough:
            raise UserError(f"{source}: {what}: {reason}; split=leave_last_out or split=random hold out part of "
                            f"each user's own history instead ({enough} of the {len(counts)} users have the 3 "
                            "interactions that needs)")
        what = f"{what}: {reason}, and"
    else:
        what = f"{what}: a user needs 3 interactions, one each for training, validation and test, and"
    raise UserError(f"{source}: {what} {enough} of the {len(counts)} users have 3 interactions (the most is "
                    f"{counts.max()}, after de-duplication and the data.* filters); use a log with more interactions "
                    "per user")


def drop_unrankable(train: pd.DataFrame, val: pd.DataFrame, test: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Val and test keep users with training interactions only, and pairs not in the user's training set."""
    width = int(max(frame["item"].max() if len(frame) else 0 for frame in (train, val, test))) + 1
    known_users = train["user"].unique()
    seen_pairs = (train["user"] * width + train["item"]).unique()
    kept = []
    for name, frame in (("val", val), ("test", test)):
        known = frame["user"].isin(known_users)
        fresh = ~(frame["user"] * width + frame["item"]).isin(seen_pairs)
        if not known.all():
            log.info("data: dropped %d %s interactions of %d users without training interactions", int((~known).sum()),
                     name, frame.loc[~known, "user"].nunique())
        if not (fresh | ~known).all():
            log.info("data: dropped %d %s interactions already in their user's training set",
                     int((known & ~fresh).sum()), name)
        kept.append(frame[known & fresh].reset_index(drop=True))
    return kept[0], kept[1]
