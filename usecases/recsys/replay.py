"""Replay: what real-time serving is worth, measured on the test period's events in time order.

At each test event (user u, item i, time t), the served form ranks the catalogue for u twice: frozen (what it knew
at the test cut: training and validation) and fresh (the same, with u's test events before t folded in, as a served
model does with `recent_items` or `POST /events`). A hit is i in the top K; NDCG@K of one relevant item is
1 / log2(rank + 1). Both exclude what u had consumed by the cut, the fresh one also the events it folded in (what a
server does: an item just consumed is not recommended back). Users first seen in the test period count: frozen, they
get the popular items; fresh, a list of their own from their second event on. The lift is fresh over frozen NDCG.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from .serving import Recommender

METRIC_K = 10


def replay(recommender: Recommender, events: pd.DataFrame, k: int = METRIC_K, max_users: int | None = None,
           seed: int = 0) -> dict[str, float]:
    """HR@k and NDCG@k of the frozen and the fresh rankings over `events` (columns user, item, timestamp: codes),
    each user's in time order; a seeded sample of `max_users` users where given."""
    users = events["user"].unique()
    if max_users is not None and len(users) > max_users:
        users = np.random.default_rng(seed).choice(users, size=max_users, replace=False)
        events = events[events["user"].isin(users)]
    ordered = events.sort_values(["user", "timestamp"], kind="stable")
    frozen_gains, fresh_gains = [], []
    for user, items in ordered.groupby("user", sort=False)["item"]:
        codes = items.to_numpy(np.int64)
        frozen, _ = recommender.recommend(int(user), np.zeros(0, np.int64), k)
        for position, item in enumerate(codes):
            fresh, _ = recommender.recommend(int(user), codes[:position], k)
            frozen_gains.append(_gain(frozen, item))
            fresh_gains.append(_gain(fresh, item))
    return summary(np.asarray(frozen_gains), np.asarray(fresh_gains), k)


def _gain(ranked: np.ndarray, item: int) -> float:
    """1 / log2(rank + 1) where `item` is in the list, else 0."""
    where = np.flatnonzero(ranked == item)
    return 1 / math.log2(where[0] + 2) if len(where) else 0.0


def summary(frozen: np.ndarray, fresh: np.ndarray, k: int) -> dict[str, float]:
    """The replay's metrics: per ranking, hit rate and NDCG at k, the events counted and the NDCG lift."""
    if not len(frozen):
        return {"replay_events": 0.0}
    figures = {"replay_events": float(len(frozen))}
    for name, gains in (("frozen", frozen), ("fresh", fresh)):
        figures[f"replay_{name}_hr@{k}"] = float((gains > 0).mean())
        figures[f"replay_{name}_ndcg@{k}"] = float(gains.mean())
    base = figures[f"replay_frozen_ndcg@{k}"]
    figures[f"replay_lift_ndcg@{k}"] = figures[f"replay_fresh_ndcg@{k}"] / base - 1 if base > 0 else math.nan
    return figures
