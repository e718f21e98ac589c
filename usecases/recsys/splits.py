"""Train, val and test: the ratio check, the temporal, random (RecBole's rounding) and leave-last-out splits, and
dropping the val and test rows no model can rank."""

from __future__ import annotations

import logging

import numpy as np
import pandas as pd

from common.errors import UserError

log = logging.getLogger(__name__)

TRAIN, VAL, TEST = 0, 1, 2


def check_ratios(ratios: list[float]) -> list[float]:
    """Train, val and test fractions, normalised as RecBole does so that its rounding is reproduced exactly."""
    total = sum(ratios)
    if len(ratios) != 3 or not all(0 < ratio < 1 for ratio in ratios) or abs(total - 1) > 1e-6:
        raise UserError(f"split_ratios: expected three fractions (train, val, test), each between 0 and 1 (a model "
                        f"needs a validation and a test split), summing to 1, got {list(ratios)}")
    return [ratio / total for ratio in ratios]


def split(frame: pd.DataFrame, method: str, ratios: list[float], seed: int
          ) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    if method == "temporal":
        return split_temporal(frame, ratios)
    if method == "random":
        return split_random(frame, ratios, seed)
    if method == "leave_last_out":
        return split_leave_last_out(frame)
    raise UserError(f"split: unknown method '{method}' (expected temporal, random or leave_last_out)")


def _by_label(frame: pd.DataFrame, labels: np.ndarray) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    return tuple(frame[labels == label].reset_index(drop=True) for label in (TRAIN, VAL, TEST))


def split_temporal(frame: pd.DataFrame, ratios: list[float]) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """One global cut in time, so that no model trains on the future of what it is tested on.

    The cuts are the timestamps at positions floor(0.8 n) and floor(0.9 n) of the time-sorted log (for 8:1:1);
    interactions at exactly a cut's timestamp go to the later split, so max(train) < min(val) <= max(val) <
    min(test), and a split can come out a little smaller than its ratio when many interactions share a time.
    """
    ordered = frame["timestamp"].sort_values(ignore_index=True).to_numpy()
    count = len(ordered)
    cuts = [ordered[position] if position < count else ordered[-1] + 1
            for position in cut_positions(count, ratios)]
    return split_at(frame, cuts)


def cut_positions(count: int, ratios: list[float]) -> list[int]:
    """Where in the time-sorted log the validation and the test split start."""
    return [int(np.floor(fraction * count + 1e-9)) for fraction in (ratios[0], ratios[0] + ratios[1])]


def split_at(frame: pd.DataFrame, cuts: list[int]) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    timestamps = frame["timestamp"].to_numpy()
    labels = (timestamps >= cuts[0]).astype(np.int8) + (timestamps >= cuts[1]).astype(np.int8)
    return _by_label(frame, labels)


def split_sizes(counts: np.ndarray, ratios: list[float]) -> np.ndarray:
    """Train, val and test sizes per user with RecBole's rounding (`Dataset._calcu_split_ids`): val and test get
    floor(ratio x n), train the rest; then a split whose exact share is between 0 and 1 gets one interaction
    taken from train, test first, as long as train keeps at least two."""
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
    """Per user, a seeded shuffle cut by `split_sizes`: RecBole's `RS` with `group_by: user`, vectorised. The
    shuffle orders each user's items by a seeded hash of (user, item), so that a user's split does not depend on
    the rest of the log, and any engine that holds all of a user's interactions together cuts it the same way."""
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
    """Per user the latest interaction is test and the one before val (ties in log order); users with fewer than
    three interactions keep them all in train."""
    frame = frame.reset_index(drop=True)
    ordered = frame.assign(order=np.arange(len(frame))).sort_values(["user", "timestamp", "order"])
    from_end = ordered.groupby("user").cumcount(ascending=False).sort_index().to_numpy()
    counts = frame.groupby("user")["user"].transform("size").to_numpy()
    labels = np.where(counts >= 3, np.where(from_end == 0, TEST, np.where(from_end == 1, VAL, TRAIN)), TRAIN)
    return _by_label(frame, labels)


def check_evaluable(frame: pd.DataFrame, method: str, parts: tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame],
                    kept: tuple[pd.DataFrame, pd.DataFrame], source: str) -> None:
    """Refuse a split that leaves nothing to train on, or the validation or the test split empty: every metric
    would be 0, and a model would still be registered. `parts` are train, val and test as split, `kept` what
    `drop_unrankable` left of val and test."""
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


def drop_unrankable(train: pd.DataFrame, val: pd.DataFrame, test: pd.DataFrame
                    ) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Val and test keep users with training interactions only (a model cannot rank for a user it never saw) and
    pairs not in the user's training set (only repeated interactions could be; duplicates are dropped earlier)."""
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
