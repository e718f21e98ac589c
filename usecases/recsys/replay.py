"""Replay: what real-time serving is worth, measured on the test period's events in time order.

At each test event (user u, item i, time t), the served form ranks the catalogue for u twice: frozen (what it knew
at the test cut: training and validation) and fresh (the same, with u's test events before t folded in, as a served
model does with `recent_items` or `POST /events`). A hit is i in the top K; NDCG@K of one relevant item is
1 / log2(rank + 1). Both exclude what u had consumed by the cut, the fresh one also the events it folded in (what a
server does: an item just consumed is not recommended back). Users first seen in the validation period are known at
the cut by their validation events, and served from them in both rankings (a factor form folds them in). Users first
seen in the test period count: frozen, they get the popular items; fresh, a list of their own from their second
event on. The lift is fresh over frozen NDCG.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from .serving import Recommender

METRIC_K = 10
CHUNK = 1024  # requests ranked in one call: a (CHUNK, n_items) score matrix on the device


def replay(recommender: Recommender, events: pd.DataFrame, k: int = METRIC_K, max_users: int | None = None,
           seed: int = 0, chunk: int = CHUNK) -> dict[str, float]:
    """HR@k and NDCG@k of the frozen and the fresh rankings over `events` (columns user, item, timestamp: codes),
    each user's in time order; a seeded sample of `max_users` users where given."""
    return summary(*replay_gains(recommender, events, k, max_users, seed, chunk), k)


def replay_gains(recommender: Recommender, events: pd.DataFrame, k: int = METRIC_K, max_users: int | None = None,
                 seed: int = 0, chunk: int = CHUNK) -> tuple[np.ndarray, np.ndarray]:
    """Each event's frozen and fresh gain, events by user then time. Each event is a request (its user, their events
    before it), and `chunk` requests are ranked in one call (`Recommender.top_k_batch`, on the recommender's
    device). A user's first request has no events: its ranking is the frozen one of every event of theirs, and the
    fresh one of their first."""
    users = events["user"].unique()
    if max_users is not None and len(users) > max_users:
        users = np.random.default_rng(seed).choice(users, size=max_users, replace=False)
        events = events[events["user"].isin(users)]
    ordered = events.sort_values(["user", "timestamp"], kind="stable")
    users, items = ordered["user"].to_numpy(np.int64), ordered["item"].to_numpy(np.int64)
    first = np.flatnonzero(np.concatenate([[True], users[1:] != users[:-1]]))[:len(users)]
    own_first = np.repeat(first, np.diff(np.append(first, len(users))))  # per event, its user's first event
    ranked = np.full((len(items), k), -1, np.int64)
    for start in range(0, len(items), chunk):
        stop = min(start + chunk, len(items))
        best, scores = recommender.top_k_batch(users[start:stop], [items[own_first[event]:event]
                                                                    for event in range(start, stop)], k)
        ranked[start:stop, :best.shape[1]] = np.where(np.isfinite(scores), best, -1)
    return _gains(ranked[own_first], items), _gains(ranked, items)


def _gains(ranked: np.ndarray, items: np.ndarray) -> np.ndarray:
    """Per row, 1 / log2(rank + 1) where the row's item is in its list, else 0."""
    discounts = 1 / np.log2(np.arange(2, ranked.shape[1] + 2))
    return ((ranked == items[:, None]) * discounts).sum(axis=1)


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
