"""The best model as an MLflow pyfunc: user ids (their latest events, and K) in, their top-K unseen items out.

Every model is served in one of four forms that need no training code: user and item factors (bpr, lightgcn,
als), an item-item similarity applied to the user's history (itemknn, ease), a sequence network and each user's
events in order (sasrec), or popularity alone (pop).
History, seen items and popularity are everything the run read (train, validation and test); nothing is refit
on them. A request's `recent_items` (and the events a server recorded) join the user's history at once: item-item
forms score the merged history, factor forms fold it in (`foldin.py`: ALS in closed form, BPR and LightGCN as the
bundle's `foldin` says), the sequence form reads the events after the user's sequence, and the items are not
recommended back. A user the form has nothing for gets the most
popular items unseen by them: an unknown user without events, a user with no training rows under a factor form
(their factors never trained), a user without history under an item-item form.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Sequence

import numpy as np
import pandas as pd
import scipy.sparse as sp
import torch

from common.serving.pyfunc import ServedModel, log_served
from common.usecase import Served
from .data import UNKNOWN
from .evaluate import top_k
from .foldin import FactorFoldIn, FoldIn, excluded_items, item_item_scores, merged_history
from .requests import UserRequest, parse_rows, requested_k

LATENCY_BATCH = 1000
DEFAULT_MAX_EVENTS = 200
KNOWN_CACHE_BYTES = 64 * 2**20  # item-item scores of the known histories of the last users served


class Recommender:
    """Scores every item for known user codes, from one of the four served forms; with events, folded in."""

    def __init__(self, bundle: dict):
        self.kind = bundle["kind"]
        self.users, self.items = bundle.get("users"), bundle.get("items")
        self.similarity: sp.csr_matrix | torch.Tensor | None = bundle.get("similarity")
        self.history: sp.csr_matrix = bundle["history"]
        self.seen: sp.csr_matrix = bundle["seen"]
        self.popularity = torch.as_tensor(bundle["popularity"], dtype=torch.float32)
        self.sequences = None
        if self.kind == "sequence":  # SASRec: the network and each user's events in order, newest last
            from .sasrec import SequenceScorer

            self.sequences = SequenceScorer.from_form(bundle)
            has_rows = (self.sequences.user_sequences != UNKNOWN).any(dim=1)
        else:
            has_rows = bundle["trained"] if self.kind == "factors" else np.diff(self.history.indptr) > 0
        self.cold = ~torch.as_tensor(has_rows)
        self.cold[UNKNOWN] = True
        self.max_events = int(bundle.get("max_events", DEFAULT_MAX_EVENTS))
        self.foldin, self.starts, self.dense_similarity = None, None, None
        if self.kind == "factors" and bundle.get("foldin") is not None:
            spec = FoldIn.from_plain(bundle["foldin"])
            self.foldin = FactorFoldIn(spec, _numpy(self.items), layer_sum=_numpy(bundle.get("layer_sum")),
                                       degree=_numpy(bundle.get("degree")))
            self.starts = _numpy(bundle["egos"] if spec.method == "graph" else self.users)
        elif self.kind == "item_item":
            self.dense_similarity = _numpy(self.similarity) if isinstance(self.similarity, torch.Tensor) else None
        self.item_table = np.ascontiguousarray(_numpy(self.items)) if self.items is not None else None
        self._known_cache: dict[int, np.ndarray] = {}
        self._known_lock = threading.Lock()
        self._known_cache_size = max(1, KNOWN_CACHE_BYTES // (4 * self.history.shape[1]))

    def score(self, users: torch.Tensor) -> torch.Tensor:
        codes = users.cpu().numpy()
        if self.kind == "factors":
            scores = self.users[users.cpu()] @ self.items.T
        elif self.kind == "item_item":
            scores = _times(self.history[codes], self.similarity)
        elif self.kind == "sequence":
            scores = self.sequences.score(users.cpu())
        else:
            scores = self.popularity.expand(len(codes), -1).clone()
        scores[self.cold[users.cpu()]] = self.popularity
        return scores.to(users.device)

    def top_k(self, users: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Item codes and scores, best first, the user's seen items and the unknown item left out."""
        items, scores = top_k(self, torch.from_numpy(users), self.seen, min(k, self.seen.shape[1] - 1),
                              torch.device("cpu"))
        return items.numpy(), scores.numpy()

    def recommend(self, user: int, events: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """One user's top k (item codes, scores; fewer where fewer items are unseen) given their recent item codes,
        oldest first: numpy only, the serving hot path."""
        exclude = excluded_items(self._row(self.seen, user), events)
        scores = self._scores(user, events)
        scores[exclude] = -np.inf
        count = min(k, len(scores) - len(exclude))
        if count <= 0:
            return np.zeros(0, np.int64), np.zeros(0, np.float32)
        best = np.argpartition(-scores, count - 1)[:count]
        best = best[np.argsort(-scores[best], kind="stable")]
        return best, scores[best]

    def _scores(self, user: int, events: np.ndarray) -> np.ndarray:
        if not (events != UNKNOWN).any() or (self.kind == "factors" and self.foldin is None):
            return self.score(torch.tensor([user])).numpy()[0]  # a model logged without fold-in: its trained rows
        if self.kind == "item_item":  # x·B is linear in the history: the known part, cached, plus the new items
            known = self._row(self.history, user)
            new = np.setdiff1d(events[events != UNKNOWN][-self.max_events:], known)
            return self._known_item_item(user) + self._item_item(new)
        if self.kind == "sequence":  # the user's sequence then the events, in order: repeats count as events
            own = self.sequences.user_sequences[user].numpy()
            return self.sequences.score_sequences([np.concatenate([own[own != UNKNOWN], events])])[0]
        if self.kind == "factors":
            history = merged_history(self._row(self.history, user), events, max_length=self.max_events)
            start = self.starts[user:user + 1] if not self.cold[user] else np.zeros((1, self.starts.shape[1]))
            vector = self.foldin.users([history], start)
            return self.item_table @ vector[0]
        return self.popularity.numpy().copy()

    def _item_item(self, codes: np.ndarray) -> np.ndarray:
        if self.dense_similarity is not None:
            return self.dense_similarity[codes].sum(axis=0)
        return item_item_scores(self.similarity, [codes])[0]

    def _known_item_item(self, user: int) -> np.ndarray:
        """x_u·B of the user's known history; the last users' are kept (a user's events arrive one after another)."""
        with self._known_lock:
            cached = self._known_cache.get(user)
        if cached is None:
            cached = self._item_item(self._row(self.history, user))
            with self._known_lock:  # a scoring server may call from several threads
                if len(self._known_cache) >= self._known_cache_size:
                    self._known_cache.pop(next(iter(self._known_cache)))
                self._known_cache[user] = cached
        return cached.copy()

    @staticmethod
    def _row(matrix: sp.csr_matrix, user: int) -> np.ndarray:
        return matrix.indices[matrix.indptr[user]:matrix.indptr[user + 1]].astype(np.int64)


def _numpy(value):
    return value.numpy() if isinstance(value, torch.Tensor) else value


def _times(histories: sp.csr_matrix, similarity: sp.csr_matrix | torch.Tensor) -> torch.Tensor:
    """Histories times the item-item matrix, whole (a tensor) or pruned (sparse)."""
    if isinstance(similarity, torch.Tensor):
        return torch.from_numpy(np.asarray(histories @ similarity.numpy(), np.float32))
    return torch.from_numpy(np.asarray((histories @ similarity).todense(), np.float32))


class RecommenderModel(ServedModel):
    """Input: a column `user_id` (raw ids as in the training log), optionally `recent_items` (per row a list of item
    ids, newest last), `recent_timestamps` (one per recent item) and `k` (default 10; a column wins over the MLflow
    param `k`).
    Output: one row per user and rank with `user_id`, `rank`, `item_id`, `score`, `unknown_recent_items` (the
    recent item ids the model does not know, skipped), and `title` when the data had titles."""

    def load(self, bundle: dict) -> None:
        self.recommender = Recommender(bundle)
        self.user_codes = {str(raw): code for code, raw in enumerate(bundle["user_ids"]) if code != UNKNOWN}
        self.item_codes = {str(raw): code for code, raw in enumerate(bundle["item_ids"]) if code != UNKNOWN}
        self.user_ids, self.item_ids = bundle["user_ids"], bundle["item_ids"]
        self.titles, self.default_k = bundle["titles"], bundle["k"]

    def recommend(self, rows: Sequence[UserRequest], k: int, stored: Sequence[Sequence] = ()) -> list[dict]:
        """The answer as records (what MLflow's scoring server returns for a DataFrame): per row, the user's
        `stored` events (a server's event store, oldest first) then the request's recent items."""
        events = [[*(stored[index] if stored else ()), *row.recent_items] for index, row in enumerate(rows)]
        codes = [np.asarray([self.item_codes.get(str(item), UNKNOWN) for item in row], np.int64) for row in events]
        users = np.asarray([self.user_codes.get(str(row.user_id), UNKNOWN) for row in rows], np.int64)
        answers: list = [None] * len(rows)
        without = [index for index, row in enumerate(codes) if not (row != UNKNOWN).any()]
        if without:  # one batched product for the users without events
            items, scores = self.recommender.top_k(users[without], k)
            for index, best, best_scores in zip(without, items, scores):
                finite = np.isfinite(best_scores)
                answers[index] = best[finite], best_scores[finite]
        for index, row in enumerate(codes):
            if answers[index] is None:
                answers[index] = self.recommender.recommend(int(users[index]), row, k)
        return [record for index, row in enumerate(rows)
                for record in self._records(row.user_id, *answers[index], int((codes[index] == UNKNOWN).sum()))]

    def _records(self, user_id, items: np.ndarray, scores: np.ndarray, unknown: int) -> list[dict]:
        user_id = _plain(user_id)
        records = []
        for rank, (item, score) in enumerate(zip(items.tolist(), scores.tolist()), start=1):
            record = {"user_id": user_id, "rank": rank, "item_id": _plain(self.item_ids[item]), "score": score,
                      "unknown_recent_items": unknown}
            if self.titles is not None:
                record["title"] = str(self.titles[item])
            records.append(record)
        return records

    def answer(self, model_input: pd.DataFrame, params: dict | None = None) -> pd.DataFrame:
        frame = pd.DataFrame(model_input)
        columns = {name: frame[name].tolist() for name in frame.columns}
        k = requested_k(columns, params, self.default_k)
        records = self.recommend(parse_rows(columns, len(frame)), k)
        names = ["user_id", "rank", "item_id", "score", "unknown_recent_items"] + \
            (["title"] if self.titles is not None else [])
        return pd.DataFrame.from_records(records, columns=names)


def _plain(value):
    return value.item() if isinstance(value, np.generic) else value


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


def request_example(bundle: dict, users: np.ndarray) -> pd.DataFrame:
    """Two known users, the second with two recent items (the most popular, oldest first): the logged input
    example, whose columns and types the signature is inferred from."""
    popular = np.argsort(-np.asarray(bundle["popularity"]), kind="stable")[:2]
    recent = [_plain(bundle["item_ids"][code]) for code in popular if code != UNKNOWN][:2]
    return pd.DataFrame({"user_id": users, "k": [bundle["k"]] * len(users),
                         "recent_items": [recent[:1], recent], "recent_timestamps": [[0], [0, 1]][:len(users)]})


def log_recommender(bundle: dict, model_name: str, job) -> tuple[dict[str, float], Served | None]:
    """Log the served form of the best model as `model`; its latency figures, and what was logged."""
    served = RecommenderModel.from_bundle(bundle)  # timed and scored as it will be loaded
    known = np.asarray(bundle["user_ids"][1:])
    figures = latency(served, known, bundle["latency_users"])
    example = request_example(bundle, known[:2])
    with warnings.catch_warnings():  # ids are never missing: MLflow's advice on integer columns does not apply
        warnings.filterwarnings("ignore", message="Hint: Inferred schema contains integer")
        logged = log_served(served, bundle, example, job.tracker, name=model_name, package=__package__,
                            requirements=["torch", "numpy", "pandas", "scipy", "mlflow"],
                            optional_inputs=("k", "recent_items", "recent_timestamps"), params={"k": bundle["k"]},
                            metadata={"model": model_name, "kind": bundle["kind"]})
    return figures, logged
