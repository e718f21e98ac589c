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
    if len(ratios) != 3 or min(ratios) < 0 or ratios[0] <= 0 or abs(total - 1) > 1e-6:
        raise UserError(f"split_ratios: expected three fractions (train, val, test) summing to 1 with a positive "
                        f"train share, got {list(ratios)}")
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
    ordered = frame["timestamp"].sort_values(ignore_index=True)
    count = len(ordered)
    cuts = []
    for fraction in (ratios[0], ratios[0] + ratios[1]):
        position = int(np.floor(fraction * count + 1e-9))
        cuts.append(ordered.iloc[position] if position < count else ordered.iloc[-1] + 1)
    timestamps = frame["timestamp"].to_numpy()
    labels = (timestamps >= cuts[0]).astype(np.int8) + (timestamps >= cuts[1]).astype(np.int8)
    if not (labels == TRAIN).any():
        raise UserError(f"split=temporal leaves no training interactions: the first {ratios[0]:.0%} of the log "
                        f"shares one timestamp ({cuts[0]}); use split=random")
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
    """Per user, a seeded shuffle cut by `split_sizes`: RecBole's `RS` with `group_by: user`, vectorised."""
    frame = frame.reset_index(drop=True)
    shuffled = frame[["user"]].assign(key=np.random.default_rng(seed).permutation(len(frame)))
    rank = shuffled.sort_values(["user", "key"]).groupby("user").cumcount().sort_index().to_numpy()
    sizes = split_sizes(frame.groupby("user")["user"].transform("size").to_numpy(), ratios)
    labels = (rank >= sizes[:, 0]).astype(np.int8) + (rank >= sizes[:, 0] + sizes[:, 1]).astype(np.int8)
    return _by_label(frame, labels)


def split_leave_last_out(frame: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """Per user the latest interaction is test and the one before val (ties in log order); users with fewer than
    three interactions keep them all in train."""
    frame = frame.reset_index(drop=True)
    ordered = frame.assign(order=np.arange(len(frame))).sort_values(["user", "timestamp", "order"])
    from_end = ordered.groupby("user").cumcount(ascending=False).sort_index().to_numpy()
    counts = frame.groupby("user")["user"].transform("size").to_numpy()
    labels = np.where(counts >= 3, np.where(from_end == 0, TEST, np.where(from_end == 1, VAL, TRAIN)), TRAIN)
    return _by_label(frame, labels)


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
