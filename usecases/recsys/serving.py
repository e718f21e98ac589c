"""The best model as an MLflow pyfunc: user ids (their latest events, and K) in, their top-K unseen items out.

Every model is served in one of four forms that need no training code: user and item factors (bpr, lightgcn,
als), an item-item similarity applied to the user's history (itemknn, ease), a sequence network and each user's
events in order (sasrec), or popularity alone (pop).
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

import threading
from collections.abc import Sequence

import numpy as np
import pandas as pd
import scipy.sparse as sp
import torch

from common.errors import UserError
from common.serving.ann import VectorIndex
from common.serving.pyfunc import ServedModel
from .data import UNKNOWN
from .evaluate import csr_tensor, top_k
from .foldin import FactorFoldIn, FoldIn, excluded_items, item_item_scores, merged_history
from .requests import UserRequest, parse_rows, requested_k
from .retrieval import KINDS, TwoStage

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
        self.has_rows = np.asarray(has_rows, bool)  # factor forms: trained rows, where a fold-in starts (else zero)
        self.cold = ~torch.as_tensor(self.has_rows)
        self.cold[UNKNOWN] = True
        self.max_events = int(bundle.get("max_events", DEFAULT_MAX_EVENTS))
        self.foldin, self.starts, self.dense_similarity = None, None, None
        if self.kind == "factors" and bundle.get("foldin") is not None:
            spec = FoldIn.from_plain(bundle["foldin"])
            self.foldin = FactorFoldIn(spec, _numpy(self.items), layer_sum=_numpy(bundle.get("layer_sum")),
                                       degree=_numpy(bundle.get("degree")))
            self.starts = _numpy(bundle["egos"] if spec.method == "graph" else self.users)
            self._fold_in_known_histories()
        elif self.kind == "item_item":
            self.dense_similarity = _numpy(self.similarity) if isinstance(self.similarity, torch.Tensor) else None
        self.item_table = np.ascontiguousarray(_numpy(self.items)) if self.items is not None else None
        self.device = torch.device("cpu")
        self._on_device: dict[str, torch.Tensor] = {}
        self._known_cache: dict[int, np.ndarray] = {}
        self._known_lock = threading.Lock()
        self._known_cache_size = max(1, KNOWN_CACHE_BYTES // (4 * self.history.shape[1]))
        self.two_stage: TwoStage | None = None
        self.index = None if bundle.get("ann") is None else \
            VectorIndex.from_stored(bundle["ann"], self.item_vectors(), "the model's ANN index")
        self.candidates = int(bundle.get("ann_candidates", 50))
        self.use_retrieval(bundle.get("retrieval", "exact"))

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
            self.two_stage = TwoStage(self.index, self.item_vectors(), self.popularity.numpy(), self.candidates)
        return self

    @property
    def retrieval(self) -> str:
        return "exact" if self.two_stage is None else "ann"

    def item_vectors(self) -> np.ndarray:
        """(items, dim) float32: what a user's query vector is multiplied by (factor and sequence forms)."""
        if self.kind == "factors":
            return self.item_table
        if self.kind == "sequence":
            return np.ascontiguousarray(self.sequences.network.items.weight.detach().float().cpu().numpy())
        raise UserError(f"a {self.kind} model has no item vectors to index (serving.retrieval applies to factor "
                        f"and sequence models)")

    def query_vectors(self, users: np.ndarray) -> np.ndarray:
        """(B, dim) float32 vectors of users with trained rows (or a sequence), as served without events; under a
        factor form with a fold-in, then the vectors their histories fold into from zero (what a user's events
        make of a query: (2B, dim))."""
        if self.kind == "sequence":
            return self.sequences.hidden_states(torch.from_numpy(users)).cpu().numpy()
        vectors = np.ascontiguousarray(_numpy(self.users)[users], np.float32)
        if self.foldin is None:
            return vectors
        histories = [merged_history(self._row(self.history, user), max_length=self.max_events) for user in users]
        folded = self.foldin.users(histories, np.zeros((len(users), self.starts.shape[1]), np.float32))
        return np.concatenate([vectors, np.asarray(folded, np.float32)])

    def excluded(self, user: int) -> np.ndarray:
        """The items never served back to the user without events: their seen items and the unknown item."""
        return excluded_items(self._row(self.seen, user))

    def _query(self, user: int, events: np.ndarray) -> np.ndarray | None:
        """The user's vector with their events (as `_scores` ranks by it), or None where popularity serves them."""
        fresh = (events != UNKNOWN).any()
        if self.kind == "factors":
            if fresh and self.foldin is not None:
                history = merged_history(self._row(self.history, user), events, max_length=self.max_events)
                start = self.starts[user:user + 1] if self.has_rows[user] else np.zeros((1, self.starts.shape[1]))
                return np.asarray(self.foldin.users([history], start)[0], np.float32)
            return None if self.cold[user] else np.asarray(_numpy(self.users)[user], np.float32)
        own = self.sequences.user_sequences[user].numpy()
        sequence = np.concatenate([own[own != UNKNOWN], events]) if fresh else own[own != UNKNOWN]
        if not (sequence != UNKNOWN).any() or (not fresh and self.cold[user]):
            return None
        return self.sequences.sequence_states([sequence]).cpu().numpy()[0]

    def _two_stage_top_k(self, users: np.ndarray, events: Sequence[np.ndarray] | None, k: int) \
            -> tuple[np.ndarray, np.ndarray]:
        """(B, k) item codes and scores of two-stage serving, -inf (and item 0) where fewer items are unseen."""
        count = min(k, self.seen.shape[1] - 1)
        items, scores = np.zeros((len(users), count), np.int64), np.full((len(users), count), -np.inf, np.float32)
        for row, user in enumerate(users.tolist()):
            best, values = self.recommend(user, np.zeros(0, np.int64) if events is None else events[row], count)
            items[row, :len(best)], scores[row, :len(best)] = best, values
        return items, scores

    def _fold_in_known_histories(self) -> None:
        """Users with a known history but no trained rows (first seen after the training cut) get the vector the
        fold-in gives that history, from zero as for a new user with those events: folded once here, so that they
        cost what a trained row costs, in `recommend`, `top_k` and `top_k_batch` alike; only users without history
        stay cold."""
        untrained = np.flatnonzero(self.cold.numpy() & (np.diff(self.history.indptr) > 0))
        untrained = untrained[untrained != UNKNOWN]
        if not len(untrained):
            return
        histories = [merged_history(self._row(self.history, user), max_length=self.max_events) for user in untrained]
        users = torch.as_tensor(self.users).clone()
        users[torch.from_numpy(untrained)] = torch.from_numpy(self.foldin.users(histories)).to(users.dtype)
        self.users = users
        self.cold[torch.from_numpy(untrained)] = False

    def score(self, users: torch.Tensor) -> torch.Tensor:
        codes = users.cpu().numpy()
        if self.two_stage is not None:  # what two stages serve: their candidates' exact scores, -inf elsewhere
            queries = [self._query(user, np.zeros(0, np.int64)) for user in codes.tolist()]
            excludes = [self.excluded(user) for user in codes.tolist()]
            return self.two_stage.dense_scores(queries, excludes, self.history.shape[1], 0).to(users.device)
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
        if self.two_stage is not None:
            return self._two_stage_top_k(np.asarray(users, np.int64), None, k)
        items, scores = top_k(self, torch.from_numpy(users), self.seen, min(k, self.seen.shape[1] - 1),
                              torch.device("cpu"))
        return items.numpy(), scores.numpy()

    def recommend(self, user: int, events: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """One user's top k (item codes, scores; fewer where fewer items are unseen) given their recent item codes,
        oldest first: numpy only, the serving hot path."""
        exclude = excluded_items(self._row(self.seen, user), events)
        if self.two_stage is not None:
            return self.two_stage.recommend(self._query(user, events), exclude, k)
        scores = self._scores(user, events)
        scores[exclude] = -np.inf
        count = min(k, len(scores) - len(exclude))
        if count <= 0:
            return np.zeros(0, np.int64), np.zeros(0, np.float32)
        best = np.argpartition(-scores, count - 1)[:count]
        best = best[np.argsort(-scores[best], kind="stable")]
        return best, scores[best]

    def to(self, device: torch.device | str) -> Recommender:
        """Score batches on `device` (`recommend_batch` and `top_k_batch`: what a micro-batching server calls on a GPU,
        and what a replay calls on the run's device); the one-user numpy path stays on the CPU."""
        self.device = torch.device(device)
        self._on_device = {}
        if self.sequences is not None:
            from .sasrec import SequenceScorer

            self.sequences = SequenceScorer(self.sequences.network.to(self.device), self.sequences.user_sequences)
        return self

    def recommend_batch(self, users: np.ndarray, events: Sequence[np.ndarray], k: int) -> list[tuple[np.ndarray,
                                                                                                np.ndarray]]:
        """Each user's top k (item codes, scores) given their recent item codes, as `recommend` gives them, scored
        together on `self.device`: one product and one top-k for a micro-batch of concurrent requests (two-stage
        serving: one search per row, on the CPU)."""
        if self.two_stage is not None:
            return [self.recommend(int(user), np.asarray(row, np.int64), k) for user, row in zip(users, events)]
        best, best_scores = self.top_k_batch(users, events, k)
        return [(items[np.isfinite(values)], values[np.isfinite(values)]) for items, values in zip(best, best_scores)]

    @torch.no_grad()
    def top_k_batch(self, users: np.ndarray, events: Sequence[np.ndarray], k: int) -> tuple[np.ndarray, np.ndarray]:
        """(B, min(k, n_items)) item codes and scores, best first, ranked as `recommend` ranks each row; a score of
        -inf where the user has fewer unseen items. Rows of one user in a row (a replay's successive requests)
        cost little more than one: see `_item_item_batch`."""
        users = np.array(users, np.int64)  # a copy: torch warns of a read-only array (a pandas column's)
        events = [np.asarray(row, np.int64) for row in events]
        fresh = np.asarray([(row != UNKNOWN).any() for row in events], bool)
        scores, popular = self._batch_scores(users, events, fresh)
        scores[torch.from_numpy(popular).to(self.device)] = self._table("popularity", lambda: self.popularity)
        seen = self.seen[users]  # what `excluded_items` leaves out per row: seen items, every event, the unknown item
        rows = np.concatenate([np.repeat(np.arange(len(users)), np.diff(seen.indptr)),
                               np.repeat(np.arange(len(users)), [len(row) for row in events])])
        codes = np.concatenate([seen.indices.astype(np.int64), *events])
        scores[:, UNKNOWN] = -torch.inf
        scores[torch.from_numpy(rows).to(self.device), torch.from_numpy(codes).to(self.device)] = -torch.inf
        best_scores, best = torch.topk(scores, min(k, scores.shape[1]), dim=1)
        return best.cpu().numpy(), best_scores.cpu().numpy()

    def _batch_scores(self, users: np.ndarray, events: list[np.ndarray], fresh: np.ndarray) -> tuple[torch.Tensor,
                                                                                                     np.ndarray]:
        """Every item's score per row on the device, and the rows that get popularity instead (as `_scores`)."""
        cold = self.cold.numpy()[users]
        if self.kind == "factors":
            vectors = self._table("users", lambda: torch.as_tensor(self.users))[torch.from_numpy(users).to(self.device)]
            folded = np.flatnonzero(fresh) if self.foldin is not None else np.zeros(0, np.int64)
            if len(folded):
                histories = [merged_history(self._row(self.history, users[row]), events[row],
                                            max_length=self.max_events) for row in folded]
                starts = np.where(self.has_rows[users[folded], None], self.starts[users[folded]], 0.0)
                # numpy's tables on a CPU (its small arrays cost less per operation than torch's), else the device's
                foldin = self.foldin if self.device.type == "cpu" else self._table("foldin", lambda: self.foldin)
                vectors[torch.from_numpy(folded).to(self.device)] = \
                    foldin.vectors(histories, starts).to(self.device, vectors.dtype)
            popular = cold.copy()
            popular[folded] = False
            return vectors @ self._table("items", lambda: torch.as_tensor(self.items)).T, popular
        if self.kind == "item_item":
            histories = [self._merged_item_history(user, row) if is_fresh else self._row(self.history, user)
                         for user, row, is_fresh in zip(users.tolist(), events, fresh)]
            return self._item_item_batch(users, histories), np.asarray([len(history) == 0 for history in histories])
        if self.kind == "sequence":
            own = self.sequences.user_sequences[torch.from_numpy(users).to(self.device)].cpu().numpy()
            sequences = [np.concatenate([mine[mine != UNKNOWN], row]) if is_fresh else mine[mine != UNKNOWN]
                         for mine, row, is_fresh in zip(own, events, fresh)]
            return self.sequences.score_tensor(sequences), cold & ~fresh
        return torch.empty(len(users), self.history.shape[1], device=self.device), np.ones(len(users), bool)

    def _item_item_batch(self, users: np.ndarray, histories: list[np.ndarray]) -> torch.Tensor:
        """x·B for each row's binary history x, as one sparse product on the device. x·B is linear in x, so a row of
        the same user as the row before it is multiplied as its difference from that row (a replay's next request:
        one more event), and each run of one user's rows is summed back: the product reads a few rows of B per
        request instead of the user's whole history."""
        n_items = self.history.shape[1]
        lengths = np.asarray([len(history) for history in histories])
        rows = sp.csr_matrix((np.ones(lengths.sum(), np.float32), np.concatenate([np.zeros(0, np.int64), *histories]),
                              np.concatenate([[0], np.cumsum(lengths)])), shape=(len(histories), n_items))
        continues = np.concatenate([[False], users[1:] == users[:-1]])[:len(users)]
        before = sp.vstack([sp.csr_matrix((1, n_items), dtype=np.float32), rows[:-1]], format="csr")
        differences = (rows - sp.diags(continues.astype(np.float32)) @ before).tocsr()
        differences.eliminate_zeros()
        scores = _sparse_times(differences, self._table("similarity", lambda: _torch_matrix(self.similarity)),
                               self.device)
        starts = np.flatnonzero(~continues)
        for first, end in zip(starts, [*starts[1:], len(users)]):
            if end - first > 1:
                scores[first:end].cumsum_(dim=0)
        return scores

    def _merged_item_history(self, user: int, events: np.ndarray) -> np.ndarray:
        known = self._row(self.history, user)
        return np.concatenate([known, np.setdiff1d(events[events != UNKNOWN][-self.max_events:], known)])

    def _table(self, name: str, make):
        """A table (or the fold-in's tables) on the device, moved there once."""
        if name not in self._on_device:
            self._on_device[name] = make().to(self.device)
        return self._on_device[name]

    def _scores(self, user: int, events: np.ndarray) -> np.ndarray:
        if not (events != UNKNOWN).any() or (self.kind == "factors" and self.foldin is None):
            return self.score(torch.tensor([user])).numpy()[0]  # a model logged without fold-in: its trained rows
        if self.kind == "item_item":  # x·B is linear in the history: the known part, cached, plus the new items
            new = self._merged_item_history(user, events)[len(self._row(self.history, user)):]
            return self._known_item_item(user) + self._item_item(new)
        if self.kind == "sequence":  # the user's sequence then the events, in order: repeats count as events
            own = self.sequences.user_sequences[user].numpy()
            return self.sequences.score_sequences([np.concatenate([own[own != UNKNOWN], events])])[0]
        if self.kind == "factors":
            history = merged_history(self._row(self.history, user), events, max_length=self.max_events)
            start = self.starts[user:user + 1] if self.has_rows[user] else np.zeros((1, self.starts.shape[1]))
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


def _torch_matrix(matrix: sp.csr_matrix | torch.Tensor) -> torch.Tensor:
    """The item-item matrix as torch: dense as it is, sparse as a CSR tensor."""
    if isinstance(matrix, torch.Tensor):
        return matrix.float()
    return csr_tensor(sp.csr_matrix(matrix, dtype=np.float32))


def _sparse_times(rows: sp.csr_matrix, similarity: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Sparse rows times the item-item matrix `_torch_matrix` made (on `device`), as a dense float32 tensor."""
    product = torch.sparse.mm(csr_tensor(sp.csr_matrix(rows, dtype=np.float32)).to(device), similarity)
    return product.to_dense() if product.layout != torch.strided else product


def _times(histories: sp.csr_matrix, similarity: sp.csr_matrix | torch.Tensor) -> torch.Tensor:
    """Histories times the item-item matrix, whole (a tensor) or pruned (sparse)."""
    if isinstance(similarity, torch.Tensor):
        return torch.from_numpy(np.asarray(histories @ similarity.numpy(), np.float32))
    return torch.from_numpy(np.asarray((histories @ similarity).todense(), np.float32))


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
        without = [index for index, row in enumerate(codes) if not (row != UNKNOWN).any()]
        if without:  # one batched product for the users without events
            items, scores = self.recommender.top_k(users[without], k)
            for index, best, best_scores in zip(without, items, scores):
                finite = np.isfinite(best_scores)
                answers[index] = best[finite], best_scores[finite]
        for index, row in enumerate(codes):
            if answers[index] is None:
                answers[index] = self.recommender.recommend(int(users[index]), row, k)
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
