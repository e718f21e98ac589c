"""A seeded synthetic interaction log: learnable by construction, with popularity skew and timestamps."""

from __future__ import annotations

import hashlib

import numpy as np
import pandas as pd

from common.errors import UserError
from .config import Synthetic
from .logs import RawLog

SYNTHETIC_TEMPERATURE = 0.5  # affinity (unit variance) over this, next to log-popularity: taste dominates
SYNTHETIC_START = 1_577_836_800  # 2020-01-01 UTC
SYNTHETIC_SPAN_S = 365 * 86_400
SYNTHETIC_CHUNK_SCORES = 4_000_000  # user x item scores held at once (float32): bounded memory at any size


def synthetic_log(config: Synthetic) -> RawLog:
    """Users and items with normal latent factors; each user picks `interactions_per_user` distinct items with
    probability proportional to exp(affinity / temperature) x Zipf popularity, without replacement (Gumbel top-k).

    Times are uniform over a year and independent of taste, so every split sees the same preferences; ratings
    1..5 rise with the affinity (centred near 3.5, as MovieLens's are). Users are drawn in chunks, so memory stays
    bounded for any number of them.
    """
    users, items, per_user = config.users, config.items, config.interactions_per_user
    if per_user > items:
        raise UserError(f"data.synthetic.interactions_per_user={per_user} exceeds data.synthetic.items={items} "
                        "(each user picks distinct items)")
    rng = np.random.default_rng(config.seed)
    scale = np.float32(1 / np.sqrt(config.factors))  # unit-variance affinities whatever the number of factors
    user_factors = rng.standard_normal((users, config.factors), dtype=np.float32) * scale
    item_factors = rng.standard_normal((items, config.factors), dtype=np.float32)
    popularity_rank = rng.permutation(items) + 1
    log_popularity = (-config.popularity_exponent * np.log(popularity_rank)).astype(np.float32)
    picked = np.empty((users, per_user), dtype=np.int64)
    affinity_picked = np.empty((users, per_user), dtype=np.float32)
    chunk = max(1, SYNTHETIC_CHUNK_SCORES // items)
    for start in range(0, users, chunk):
        affinity = user_factors[start:start + chunk] @ item_factors.T
        with np.errstate(divide="ignore"):  # a uniform draw of exactly 0 only rules that one item out
            scores = -np.log(-np.log(rng.random(affinity.shape, dtype=np.float32)))
        scores += affinity / np.float32(SYNTHETIC_TEMPERATURE)
        scores += log_popularity
        top = np.argpartition(scores, items - per_user, axis=1)[:, items - per_user:]
        picked[start:start + chunk] = top
        affinity_picked[start:start + chunk] = np.take_along_axis(affinity, top, axis=1)
    standardised = (affinity_picked - affinity_picked.mean()) / max(float(affinity_picked.std()), 1e-6)
    noise = rng.standard_normal(affinity_picked.shape, dtype=np.float32)
    ratings = np.clip(np.rint(3.5 + standardised + 0.5 * noise), 1, 5)
    timestamps = SYNTHETIC_START + rng.integers(0, SYNTHETIC_SPAN_S, size=users * per_user)
    frame = pd.DataFrame({"user": np.repeat(np.arange(1, users + 1, dtype=np.int64), per_user),
                          "item": picked.ravel() + 1, "rating": ratings.ravel().astype(np.float64),
                          "timestamp": timestamps.astype(np.int64)})
    digest = hashlib.sha256(config.model_dump_json().encode()).hexdigest()
    return RawLog(frame, None, "synthetic", digest, has_timestamps=True)
