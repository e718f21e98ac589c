"""The item-item served form (itemknn, ease): a user's scores are their binary history x times the similarity B.
x·B is linear in x, which the one-user path (the known part cached, plus the new items) and the batch path (a row
as its difference from the row before it) both use."""

from __future__ import annotations

import threading

import numpy as np
import scipy.sparse as sp
import torch

from .foldin import item_item_scores
from .forms import ServedForm, as_numpy
from .ranking import UNKNOWN, csr_tensor, row_codes

KNOWN_CACHE_BYTES = 64 * 2**20  # item-item scores of the known histories of the last users served


class ItemItemForm(ServedForm):
    kind = "item_item"

    def __init__(self, bundle: dict):
        super().__init__(bundle)
        self.similarity: sp.csr_matrix | torch.Tensor = bundle["similarity"]
        self.dense_similarity = as_numpy(self.similarity) if isinstance(self.similarity, torch.Tensor) else None
        self._known_cache: dict[int, np.ndarray] = {}
        self._known_lock = threading.Lock()
        self._known_cache_size = max(1, KNOWN_CACHE_BYTES // (4 * self.n_items))

    def raw_scores(self, users: np.ndarray) -> torch.Tensor:
        """Histories times the item-item matrix, whole (a tensor) or pruned (sparse)."""
        histories = self.history[users]
        if isinstance(self.similarity, torch.Tensor):
            return torch.from_numpy(np.asarray(histories @ self.similarity.numpy(), np.float32))
        return torch.from_numpy(np.asarray((histories @ self.similarity).todense(), np.float32))

    def user_scores(self, user: int, events: np.ndarray) -> np.ndarray:
        """The known part, cached, plus the new items."""
        new = self.merged_history(user, events)[len(row_codes(self.history, user)):]
        return self._known_scores(user) + self._scores_of(new)

    def merged_history(self, user: int, events: np.ndarray) -> np.ndarray:
        known = row_codes(self.history, user)
        return np.concatenate([known, np.setdiff1d(events[events != UNKNOWN][-self.max_events:], known)])

    def batch_scores(self, users: np.ndarray, events: list[np.ndarray], fresh: np.ndarray) \
            -> tuple[torch.Tensor, np.ndarray]:
        histories = [self.merged_history(user, events_of_row) if is_fresh else row_codes(self.history, user)
                     for user, events_of_row, is_fresh in zip(users.tolist(), events, fresh)]
        return self._batch_product(users, histories), np.asarray([len(history) == 0 for history in histories])

    def _batch_product(self, users: np.ndarray, histories: list[np.ndarray]) -> torch.Tensor:
        """x·B for each row's binary history x, as one sparse product on the device. A row of the same user as the
        row before it is multiplied as its difference from that row (a replay's next request: one more event), and
        each run of one user's rows is summed back: the product reads a few rows of B per request instead of the
        user's whole history."""
        lengths = np.asarray([len(history) for history in histories])
        rows = sp.csr_matrix((np.ones(lengths.sum(), np.float32), np.concatenate([np.zeros(0, np.int64), *histories]),
                              np.concatenate([[0], np.cumsum(lengths)])), shape=(len(histories), self.n_items))
        continues = np.concatenate([[False], users[1:] == users[:-1]])[:len(users)]
        before = sp.vstack([sp.csr_matrix((1, self.n_items), dtype=np.float32), rows[:-1]], format="csr")
        differences = (rows - sp.diags(continues.astype(np.float32)) @ before).tocsr()
        differences.eliminate_zeros()
        similarity = self.table("similarity", lambda: _torch_matrix(self.similarity))
        product = torch.sparse.mm(csr_tensor(sp.csr_matrix(differences, dtype=np.float32)).to(self.device),
                                  similarity)
        scores = product.to_dense() if product.layout != torch.strided else product
        starts = np.flatnonzero(~continues)
        for first, end in zip(starts, [*starts[1:], len(users)]):
            if end - first > 1:
                scores[first:end].cumsum_(dim=0)
        return scores

    def _scores_of(self, codes: np.ndarray) -> np.ndarray:
        if self.dense_similarity is not None:
            return self.dense_similarity[codes].sum(axis=0)
        return item_item_scores(self.similarity, [codes])[0]

    def _known_scores(self, user: int) -> np.ndarray:
        """x_u·B of the user's known history; the last users' are kept (a user's events arrive one after another)."""
        with self._known_lock:
            cached = self._known_cache.get(user)
        if cached is None:
            cached = self._scores_of(row_codes(self.history, user))
            with self._known_lock:  # a scoring server may call from several threads
                if len(self._known_cache) >= self._known_cache_size:
                    self._known_cache.pop(next(iter(self._known_cache)))
                self._known_cache[user] = cached
        return cached.copy()


def _torch_matrix(matrix: sp.csr_matrix | torch.Tensor) -> torch.Tensor:
    """The item-item matrix as torch: dense as it is, sparse as a CSR tensor."""
    if isinstance(matrix, torch.Tensor):
        return matrix.float()
    return csr_tensor(sp.csr_matrix(matrix, dtype=np.float32))
