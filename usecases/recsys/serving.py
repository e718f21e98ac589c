"""The best model as an MLflow pyfunc: user ids (their latest events, and K) in, their top-K unseen items out,
scored by a served form (`forms.py`) with everything the run read and the user's events joined at once."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
import torch

from common.errors import UserError
from common.serving.ann import VectorIndex
from common.serving.pyfunc import ServedModel
from .foldin import excluded_items
from .forms import FactorForm, ItemItemForm, SequenceForm, ServedForm
from .ranking import UNKNOWN, row_codes, top_k
from .requests import UserRequest, parse_rows, requested_k
from .retrieval import KINDS, TwoStage


FORMS = {form.kind: form for form in (ServedForm, FactorForm, ItemItemForm, SequenceForm)}


class Recommender:
    """A served form's top k, the seen items left out, exactly or by two stages (candidates from an ANN index)."""

    def __init__(self, bundle: dict):
        if bundle["kind"] not in FORMS:
            raise UserError(f"unknown served form {bundle['kind']!r} (expected one of {', '.join(FORMS)})")
        self.form = FORMS[bundle["kind"]](bundle)
        self.two_stage: TwoStage | None = None
        self.index = None if bundle.get("ann") is None else \
            VectorIndex.from_stored(bundle["ann"], self.item_vectors(), "the model's ANN index")
        self.candidates = int(bundle.get("ann_candidates", 50))
        self.use_retrieval(bundle.get("retrieval", "exact"))

    def use_retrieval(self, mode: str, index: VectorIndex | None = None) -> Recommender:
        """Serve by ranking every item (`exact`) or by two stages (`ann`: from `index`, else the bundle's)."""
        if mode not in ("exact", "ann"):
            raise UserError(f"retrieval must be exact or ann, got {mode!r}")
        if index is not None:
            self.index = index
        if mode == "exact":
            self.two_stage = None
        elif self.index is None:
            kind = self.form.kind
            raise UserError(f"this model ({kind}) has no ANN index: it is served exact"
                            + ("" if kind in KINDS else " (only factor and sequence models have item vectors)"))
        else:
            self.two_stage = TwoStage(self.index, self.item_vectors(), self.form.popularity.numpy(), self.candidates)
        return self

    @property
    def retrieval(self) -> str:
        return "exact" if self.two_stage is None else "ann"

    def item_vectors(self) -> np.ndarray:
        return self.form.item_vectors()

    def excluded(self, user: int) -> np.ndarray:
        return excluded_items(row_codes(self.form.seen, user))

    def to(self, device: torch.device | str) -> Recommender:
        """Score batches on `device`; the one-user numpy path stays on the CPU."""
        self.form.to(torch.device(device))
        return self

    def score(self, users: torch.Tensor) -> torch.Tensor:
        """Every item's score for user codes without events; under two stages, -inf outside their candidates."""
        codes = users.cpu().numpy()
        if self.two_stage is not None:
            queries = [self.form.query(user, np.zeros(0, np.int64)) for user in codes.tolist()]
            excludes = [self.excluded(user) for user in codes.tolist()]
            return self.two_stage.dense_scores(queries, excludes, self.form.n_items).to(users.device)
        return self._exact_scores(codes).to(users.device)

    def _exact_scores(self, codes: np.ndarray) -> torch.Tensor:
        scores = self.form.raw_scores(codes)
        scores[self.form.cold[torch.from_numpy(codes)]] = self.form.popularity
        return scores

    def top_k(self, users: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Item codes and scores, best first, the user's seen items and the unknown item left out."""
        count = min(k, self.form.n_items - 1)
        if self.two_stage is None:
            items, scores = top_k(self, torch.from_numpy(users), self.form.seen, count, torch.device("cpu"))
            return items.numpy(), scores.numpy()
        items, scores = np.zeros((len(users), count), np.int64), np.full((len(users), count), -np.inf, np.float32)
        answers = self.recommend_many(np.asarray(users, np.int64), [np.zeros(0, np.int64)] * len(users), count)
        for index, (best, values) in enumerate(answers):  # -inf (and item 0) past the unseen
            items[index, :len(best)], scores[index, :len(best)] = best, values
        return items, scores

    def recommend_many(self, users: np.ndarray, events: Sequence[np.ndarray], k: int) -> list[tuple[np.ndarray,
                                                                                                np.ndarray]]:
        """`recommend` of each row; by two stages, every row's candidates from one search of the index."""
        if self.two_stage is None:
            return [self.recommend(int(user), np.asarray(mine, np.int64), k) for user, mine in zip(users, events)]
        users = [int(user) for user in users]
        events = [np.asarray(mine, np.int64) for mine in events]
        return self.two_stage.recommend_many([self.form.query(user, mine) for user, mine in zip(users, events)],
                                             [excluded_items(row_codes(self.form.seen, user), mine)
                                              for user, mine in zip(users, events)], k)

    def recommend(self, user: int, events: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """One user's top k given their recent item codes, oldest first: numpy only, the serving hot path."""
        exclude = excluded_items(row_codes(self.form.seen, user), events)
        if self.two_stage is not None:
            return self.two_stage.recommend(self.form.query(user, events), exclude, k)
        scores = self.form.user_scores(user, events) if (events != UNKNOWN).any() else None
        if scores is None:
            scores = self._exact_scores(np.asarray([user], np.int64)).numpy()[0]
        scores[exclude] = -np.inf
        count = min(k, len(scores) - len(exclude))
        if count <= 0:
            return np.zeros(0, np.int64), np.zeros(0, np.float32)
        best = np.argpartition(-scores, count - 1)[:count]
        best = best[np.argsort(-scores[best], kind="stable")]
        return best, scores[best]

    def recommend_batch(self, users: np.ndarray, events: Sequence[np.ndarray], k: int) -> list[tuple[np.ndarray,
                                                                                                np.ndarray]]:
        """`recommend` of each row, ranked exactly and scored together on the device (two stages: `recommend_many`)."""
        best, best_scores = self.top_k_batch(users, events, k)
        return [(items[np.isfinite(values)], values[np.isfinite(values)]) for items, values in zip(best, best_scores)]

    @torch.no_grad()
    def top_k_batch(self, users: np.ndarray, events: Sequence[np.ndarray], k: int) -> tuple[np.ndarray, np.ndarray]:
        """(B, min(k, n_items)) item codes and scores as `recommend` ranks each row (-inf past the unseen items)."""
        users = np.array(users, np.int64)  # a copy: torch warns of a read-only array (a pandas column's)
        events = [np.asarray(events_of_row, np.int64) for events_of_row in events]
        fresh = np.asarray([(events_of_row != UNKNOWN).any() for events_of_row in events], bool)
        device = self.form.device
        scores, popular = self.form.batch_scores(users, events, fresh)
        scores[torch.from_numpy(popular).to(device)] = self.form.table("popularity", lambda: self.form.popularity)
        seen = self.form.seen[users]  # what `excluded_items` leaves out per row: seen items, every event, item 0
        rows = np.concatenate([np.repeat(np.arange(len(users)), np.diff(seen.indptr)),
                               np.repeat(np.arange(len(users)), [len(events_of_row) for events_of_row in events])])
        codes = np.concatenate([seen.indices.astype(np.int64), *events])
        scores[:, UNKNOWN] = -torch.inf
        scores[torch.from_numpy(rows).to(device), torch.from_numpy(codes).to(device)] = -torch.inf
        best_scores, best = torch.topk(scores, min(k, scores.shape[1]), dim=1)
        return best.cpu().numpy(), best_scores.cpu().numpy()


class RecommenderModel(ServedModel):
    """The columns of `requests.py` in, one row per user and rank out (unknown recent items skipped, counted)."""

    def load(self, bundle: dict) -> None:
        self.recommender = Recommender(bundle)
        self.user_codes = {str(raw): code for code, raw in enumerate(bundle["user_ids"]) if code != UNKNOWN}
        self.item_codes = {str(raw): code for code, raw in enumerate(bundle["item_ids"]) if code != UNKNOWN}
        self.user_ids, self.item_ids = bundle["user_ids"], bundle["item_ids"]
        self.titles, self.default_k = bundle["titles"], bundle["k"]
        self.events_after = bundle.get("events_after")  # stored events up to it are in the model already
        self.retrieval_rule, self.auto_above_ms = bundle.get("retrieval_rule"), bundle.get("auto_above_ms")

    def recommend(self, rows: Sequence[UserRequest], k: int, stored: Sequence[Sequence] = ()) -> list[dict]:
        """The answer as records; per row, the `stored` events (oldest first) come before the recent items."""
        return self.recommend_requests([(rows, k, stored)])[0]

    def recommend_requests(self, requests: Sequence[tuple[Sequence[UserRequest], int, Sequence[Sequence]]]) \
            -> list[list[dict]]:
        """Several requests' `recommend(rows, k, stored)` as one batch, scored at the largest k."""
        rows = [row for request_rows, _, _ in requests for row in request_rows]
        stored = [events for request_rows, _, request_stored in requests
                  for events in (request_stored or [()] * len(request_rows))]
        answers = iter(self._answers(rows, max(k for _, k, _ in requests), stored))
        return [[record for row in request_rows for record in self._records(row.user_id, *next(answers), k)]
                for request_rows, k, _ in requests]

    def _answers(self, rows: Sequence[UserRequest], k: int, stored: Sequence[Sequence]) -> list[tuple]:
        """Per row (item codes, scores, unknown recent items); on the CPU, the users with events one at a time."""
        events = [[*(stored[index] if stored else ()), *row.recent_items] for index, row in enumerate(rows)]
        codes = [np.asarray([self.item_codes.get(str(item), UNKNOWN) for item in row], np.int64) for row in events]
        users = np.asarray([self.user_codes.get(str(row.user_id), UNKNOWN) for row in rows], np.int64)
        unknown = [int((row == UNKNOWN).sum()) for row in codes]
        if self.recommender.two_stage is not None:  # every row's candidates from one search of the index
            known = [row if (row != UNKNOWN).any() else row[:0] for row in codes]
            return [(*answer, count) for answer, count in zip(self.recommender.recommend_many(users, known, k),
                                                               unknown)]
        if self.recommender.form.device.type != "cpu":
            return [(*answer, count) for answer, count in zip(self.recommender.recommend_batch(users, codes, k),
                                                               unknown)]
        answers: list = [None] * len(rows)
        without = [index for index, known in enumerate(codes) if not (known != UNKNOWN).any()]
        if without:  # one batched product for the users without events
            items, scores = self.recommender.top_k(users[without], k)
            for index, best, best_scores in zip(without, items, scores):
                finite = np.isfinite(best_scores)
                answers[index] = best[finite], best_scores[finite]
        for index, known in enumerate(codes):
            if answers[index] is None:
                answers[index] = self.recommender.recommend(int(users[index]), known, k)
        return [(*answer, count) for answer, count in zip(answers, unknown)]

    def _records(self, user_id, items: np.ndarray, scores: np.ndarray, unknown: int, k: int) -> list[dict]:
        """The first `k` of a row's answer, as records."""
        user_id = python_value(user_id)
        records = []
        for rank, (item, score) in enumerate(zip(items[:k].tolist(), scores[:k].tolist()), start=1):
            record = {"user_id": user_id, "rank": rank, "item_id": python_value(self.item_ids[item]), "score": score,
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


def python_value(value):
    """A NumPy scalar as the Python value JSON and MLflow take."""
    return value.item() if isinstance(value, np.generic) else value
