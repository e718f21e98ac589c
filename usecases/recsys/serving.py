"""The best model as an MLflow pyfunc: user ids (and K) in, their top-K unseen items with scores out.

Every model is served in one of three forms that need no training code: user and item factors (bpr, lightgcn,
als), an item-item similarity applied to the user's history (itemknn, ease), or popularity alone (pop).
History, seen items and popularity are everything the run read (train, validation and test); nothing is refit
on them. A user the form has nothing for gets the most popular items unseen by them: an unknown user, a user
with no training rows under a factor form (their factors never trained), a user without history under an
item-item form.
"""

from __future__ import annotations

import time
import warnings

import numpy as np
import pandas as pd
import scipy.sparse as sp
import torch

from common.serving.pyfunc import BadInput, ServedModel, log_served
from common.usecase import Served
from .data import UNKNOWN
from .evaluate import top_k

MAX_K = 1000
LATENCY_BATCH = 1000


class Recommender:
    """Scores every item for known user codes, from one of the three served forms."""

    def __init__(self, bundle: dict):
        self.kind = bundle["kind"]
        self.users, self.items = bundle.get("users"), bundle.get("items")
        self.similarity: sp.csr_matrix | torch.Tensor | None = bundle.get("similarity")
        self.history: sp.csr_matrix = bundle["history"]
        self.seen: sp.csr_matrix = bundle["seen"]
        self.popularity = torch.as_tensor(bundle["popularity"], dtype=torch.float32)
        has_rows = bundle["trained"] if self.kind == "factors" else np.diff(self.history.indptr) > 0
        self.cold = ~torch.as_tensor(has_rows)
        self.cold[UNKNOWN] = True

    def score(self, users: torch.Tensor) -> torch.Tensor:
        codes = users.cpu().numpy()
        if self.kind == "factors":
            scores = self.users[users.cpu()] @ self.items.T
        elif self.kind == "item_item":
            scores = _times(self.history[codes], self.similarity)
        else:
            scores = self.popularity.expand(len(codes), -1).clone()
        scores[self.cold[users.cpu()]] = self.popularity
        return scores.to(users.device)

    def top_k(self, users: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Item codes and scores, best first, the user's seen items and the unknown item left out."""
        items, scores = top_k(self, torch.from_numpy(users), self.seen, min(k, self.seen.shape[1] - 1),
                              torch.device("cpu"))
        return items.numpy(), scores.numpy()


def _times(histories: sp.csr_matrix, similarity: sp.csr_matrix | torch.Tensor) -> torch.Tensor:
    """Histories times the item-item matrix, whole (a tensor) or pruned (sparse)."""
    if isinstance(similarity, torch.Tensor):
        return torch.from_numpy(np.asarray(histories @ similarity.numpy(), np.float32))
    return torch.from_numpy(np.asarray((histories @ similarity).todense(), np.float32))


class RecommenderModel(ServedModel):
    """Input: a column `user_id` (raw ids as in the training log) and optionally `k` (default 10, the first row's
    value counts). Output: one row per user and rank with `user_id`, `rank`, `item_id`, `score`, and `title` when
    the data had titles."""

    def load(self, bundle: dict) -> None:
        self.recommender = Recommender(bundle)
        self.user_codes = {str(raw): code for code, raw in enumerate(bundle["user_ids"]) if code != UNKNOWN}
        self.item_ids, self.titles, self.default_k = bundle["item_ids"], bundle["titles"], bundle["k"]

    def answer(self, model_input: pd.DataFrame) -> pd.DataFrame:
        frame = pd.DataFrame(model_input)
        if "user_id" not in frame.columns:
            raise BadInput(f"input is missing column 'user_id' (got {', '.join(map(str, frame.columns))})")
        k = int(frame["k"].iloc[0]) if "k" in frame.columns and len(frame) else self.default_k
        if not 1 <= k <= MAX_K:
            raise BadInput(f"k must be between 1 and {MAX_K}, got {k}")
        raw = frame["user_id"].to_numpy()
        codes = np.array([self.user_codes.get(str(user), UNKNOWN) for user in raw], dtype=np.int64)
        items, scores = self.recommender.top_k(codes, k)
        result = pd.DataFrame({
            "user_id": np.repeat(raw, items.shape[1]),
            "rank": np.tile(np.arange(1, items.shape[1] + 1), len(raw)),
            "item_id": self.item_ids[items.ravel()],
            "score": scores.ravel().astype(np.float64),
        })
        if self.titles is not None:
            result["title"] = self.titles[items.ravel()]
        return result[np.isfinite(result["score"].to_numpy())].reset_index(drop=True)  # fewer unseen items than k


def latency(model: RecommenderModel, users: np.ndarray, single: int) -> dict[str, float]:
    """p50 and p95 of one-user requests, and users per second in batches, through the pyfunc's own predict."""
    rng = np.random.default_rng(0)
    timings = []
    for user in rng.choice(users, size=single):
        started = time.perf_counter()
        model.predict(None, pd.DataFrame({"user_id": [user]}))
        timings.append(time.perf_counter() - started)
    batch = rng.choice(users, size=LATENCY_BATCH)
    started = time.perf_counter()
    model.predict(None, pd.DataFrame({"user_id": batch}))
    batch_seconds = time.perf_counter() - started
    return {"latency_p50_ms": float(np.percentile(timings, 50) * 1000),
            "latency_p95_ms": float(np.percentile(timings, 95) * 1000),
            "batch_users_per_s": LATENCY_BATCH / batch_seconds}


def log_recommender(bundle: dict, model_name: str, job) -> tuple[dict[str, float], Served | None]:
    """Log the served form of the best model as `model`; its latency figures, and what was logged."""
    served = RecommenderModel.from_bundle(bundle)  # timed and scored as it will be loaded
    known = np.asarray(bundle["user_ids"][1:])
    figures = latency(served, known, bundle["latency_users"])
    example = pd.DataFrame({"user_id": known[:2], "k": [bundle["k"]] * 2})
    with warnings.catch_warnings():  # ids are never missing: MLflow's advice on integer columns does not apply
        warnings.filterwarnings("ignore", message="Hint: Inferred schema contains integer")
        logged = log_served(served, bundle, example, job.tracker, name=model_name, package=__package__,
                            requirements=["torch", "numpy", "pandas", "scipy", "mlflow"], optional_inputs=("k",),
                            metadata={"model": model_name, "kind": bundle["kind"]})
    return figures, logged
