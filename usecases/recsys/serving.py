"""The best model as an MLflow pyfunc: user ids (their latest events, and K) in, their top-K unseen items out.

Every model is served in one of four forms (`forms.py`) that need no training code: user and item factors (bpr,
lightgcn, als), an item-item similarity applied to the user's history (itemknn, ease), a sequence network and each
user's events in order (sasrec), or popularity alone (pop).
History, seen items and popularity are everything the run read (train, validation and test); nothing is refit
on them. A request's `recent_items` (and the events a server recorded) join the user's history at once: item-item
forms score the merged history, factor forms fold it in (`foldin.py`: ALS in closed form, BPR and LightGCN as the
bundle's `foldin` says), the sequence form reads the events after the user's sequence, and the items are not
recommended back. A user known to the run without training rows (first seen after the temporal cut) is served from
their known history as a new user with those events: folded in under a factor form (from zero, whatever the method),
scored under an item-item form, read as their sequence by the sequence form. Only a user without any events gets the
most popular items unseen by them (under a factor form logged without fold-in, every user without training rows).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
import torch

from common.errors import UserError
from common.serving.ann import VectorIndex
from common.serving.pyfunc import ServedModel
from .foldin import excluded_items
from .forms import FactorForm, SequenceForm, ServedForm
from .itemitem import ItemItemForm
from .ranking import UNKNOWN, row_codes, top_k
from .requests import UserRequest, parse_rows, requested_k
from .retrieval import KINDS, TwoStage


FORMS = {form.kind: form for form in (ServedForm, FactorForm, ItemItemForm, SequenceForm)}


def form_of(bundle: dict) -> ServedForm:
    """The served form the bundle describes (its `kind`)."""
    if bundle["kind"] not in FORMS:
        raise UserError(f"unknown served form {bundle['kind']!r} (expected one of {', '.join(FORMS)})")
    return FORMS[bundle["kind"]](bundle)


class Recommender:
    """A served form (`forms.py`) behind what serving, the replay and the evaluation call: every item's score, the
    top k with the seen items left out, one user's or a batch's with their events; exactly, or by two stages
    (candidates from an ANN index, scored exactly)."""

    def __init__(self, bundle: dict):
        self.form = form_of(bundle)
        self.two_stage: TwoStage | None = None
        self.index = None if bundle.get("ann") is None else \
            VectorIndex.from_stored(bundle["ann"], self.item_vectors(), "the model's ANN index")
        self.candidates = int(bundle.get("ann_candidates", 50))
        self.use_retrieval(bundle.get("retrieval", "exact"))

    @property
    def kind(self) -> str:
        return self.form.kind

    @property
    def max_events(self) -> int:
        return self.form.max_events

    @property
    def has_rows(self) -> np.ndarray:
        return self.form.has_rows

    @property
    def device(self) -> torch.device:
        return self.form.device

    def use_retrieval(self, mode: str, index: VectorIndex | None = None) -> Recommender:
        """Serve by ranking every item (`exact`) or by two stages (`ann`: candidates from `index`, else the
        bundle's, scored exactly); a form without item vectors, or without an index, is refused in one line."""
        if mode not in ("exact", "ann"):
            raise UserError(f"retrieval must be exact or ann, got {mode!r}")
        if index is not None:
            self.index = index
        if mode == "exact":
            self.two_stage = None
        elif self.index is None:
            raise UserError(f"this model ({self.kind}) has no ANN index: it is served exact"
                            + ("" if self.kind in KINDS else " (only factor and sequence models have item vectors)"))
        else:
            self.two_stage = TwoStage(self.index, self.item_vectors(), self.form.popularity.numpy(), self.candidates)
        return self

    @property
    def retrieval(self) -> str:
        return "exact" if self.two_stage is None else "ann"

    def item_vectors(self) -> np.ndarray:
        """(items, dim) float32: what a user's query vector is multiplied by (factor and sequence forms)."""
        return self.form.item_vectors()

    def query_vectors(self, users: np.ndarray) -> np.ndarray:
        """Vectors of users as served without events (`FactorForm.query_vectors` adds their folded histories)."""
        return self.form.query_vectors(users)

    def excluded(self, user: int) -> np.ndarray:
        """The items never served back to the user without events: their seen items and the unknown item."""
        return excluded_items(row_codes(self.form.seen, user))

    def to(self, device: torch.device | str) -> Recommender:
        """Score batches on `device` (`recommend_batch` and `top_k_batch`: what a micro-batching server calls on a GPU,
        and what a replay calls on the run's device); the one-user numpy path stays on the CPU."""
        self.form.to(torch.device(device))
        return self

    def score(self, users: torch.Tensor) -> torch.Tensor:
        """Every item's score for user codes without events (cold users: popularity); under two stages, their
        candidates' exact scores and -inf elsewhere."""
        codes = users.cpu().numpy()
        if self.two_stage is not None:
            queries = [self.form.query(user, np.zeros(0, np.int64)) for user in codes.tolist()]
            excludes = [self.excluded(user) for user in codes.tolist()]
            return self.two_stage.dense_scores(queries, excludes, self.form.n_items, 0).to(users.device)
        return self._exact_scores(codes).to(users.device)

    def _exact_scores(self, codes: np.ndarray) -> torch.Tensor:
        scores = self.form.raw_scores(codes)
        scores[self.form.cold[torch.from_numpy(codes)]] = self.form.popularity
        return scores

    def top_k(self, users: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Item codes and scores, best first, the user's seen items and the unknown item left out."""
        if self.two_stage is not None:
            return self._two_stage_top_k(np.asarray(users, np.int64), k)
        items, scores = top_k(self, torch.from_numpy(users), self.form.seen, min(k, self.form.n_items - 1),
                              torch.device("cpu"))
        return items.numpy(), scores.numpy()

    def _two_stage_top_k(self, users: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(B, k) item codes and scores of two-stage serving, -inf (and item 0) where fewer items are unseen."""
        count = min(k, self.form.n_items - 1)
        items, scores = np.zeros((len(users), count), np.int64), np.full((len(users), count), -np.inf, np.float32)
        for index, user in enumerate(users.tolist()):
            best, values = self.recommend(user, np.zeros(0, np.int64), count)
            items[index, :len(best)], scores[index, :len(best)] = best, values
        return items, scores

    def recommend(self, user: int, events: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """One user's top k (item codes, scores; fewer where fewer items are unseen) given their recent item codes,
        oldest first: numpy only, the serving hot path."""
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
        """Each user's top k (item codes, scores) given their recent item codes, as `recommend` gives them, scored
        together on the device: one product and one top-k for a micro-batch of concurrent requests (two-stage
        serving: one search per row, on the CPU)."""
        if self.two_stage is not None:
            return [self.recommend(int(user), np.asarray(events_of_row, np.int64), k)
                    for user, events_of_row in zip(users, events)]
        best, best_scores = self.top_k_batch(users, events, k)
        return [(items[np.isfinite(values)], values[np.isfinite(values)]) for items, values in zip(best, best_scores)]

    @torch.no_grad()
    def top_k_batch(self, users: np.ndarray, events: Sequence[np.ndarray], k: int) -> tuple[np.ndarray, np.ndarray]:
        """(B, min(k, n_items)) item codes and scores, best first, ranked as `recommend` ranks each row; a score of
        -inf where the user has fewer unseen items. Rows of one user in a row (a replay's successive requests)
        cost little more than one (`ItemItemForm`)."""
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
    """Input: a column `user_id` (raw ids as in the training log), optionally `recent_items` (per row a list of item
    ids, newest last), `recent_timestamps` (one per recent item) and `k` (default 10; a column wins over the MLflow
    param `k`), refused in one line where they break the rules the lean server's routes follow (`requests.py`).
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
        answers = self._answers(rows, k, stored)
        return [record for row, answer in zip(rows, answers) for record in self._records(row.user_id, *answer)]

    def recommend_requests(self, requests: Sequence[tuple[Sequence[UserRequest], int, Sequence[Sequence]]]) \
            -> list[list[dict]]:
        """Several requests' `recommend(rows, k, stored)` answered as one batch (a micro-batching server's call):
        every row scored at the largest k, each request's lists then cut to its own k."""
        rows = [row for request_rows, _, _ in requests for row in request_rows]
        stored = [events for request_rows, _, request_stored in requests
                  for events in (request_stored or [()] * len(request_rows))]
        answers = iter(self._answers(rows, max(k for _, k, _ in requests), stored))
        return [[record for row in request_rows
                 for record in self._records(row.user_id, *_cut(next(answers), k))]
                for request_rows, k, _ in requests]

    def _answers(self, rows: Sequence[UserRequest], k: int, stored: Sequence[Sequence]) -> list[tuple]:
        """Per row (item codes, scores, how many recent items were unknown): on a GPU every row in one batch, on
        the CPU users without events in one product and the others one at a time (their events folded in)."""
        events = [[*(stored[index] if stored else ()), *row.recent_items] for index, row in enumerate(rows)]
        codes = [np.asarray([self.item_codes.get(str(item), UNKNOWN) for item in row], np.int64) for row in events]
        users = np.asarray([self.user_codes.get(str(row.user_id), UNKNOWN) for row in rows], np.int64)
        unknown = [int((row == UNKNOWN).sum()) for row in codes]
        if self.recommender.device.type != "cpu" and self.recommender.two_stage is None:
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

    def _records(self, user_id, items: np.ndarray, scores: np.ndarray, unknown: int) -> list[dict]:
        user_id = python_value(user_id)
        records = []
        for rank, (item, score) in enumerate(zip(items.tolist(), scores.tolist()), start=1):
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


def _cut(answer: tuple, k: int) -> tuple:
    items, scores, unknown = answer
    return items[:k], scores[:k], unknown


def python_value(value):
    """A NumPy scalar as the Python value JSON and MLflow take."""
    return value.item() if isinstance(value, np.generic) else value
