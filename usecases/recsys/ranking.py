"""The bottom layer that training, evaluation and serving all stand on: the unknown id's code, the top k of scores
with the seen items left out, sparse helpers; no data loading, training or evaluation code."""

from __future__ import annotations

import warnings
from typing import Protocol

import numpy as np
import scipy.sparse as sp
import torch

UNKNOWN = 0  # the code of an unseen user or item; real ids are encoded from 1


class Scorer(Protocol):
    """What every recommender offers the evaluation and the server."""

    def score(self, users: torch.Tensor) -> torch.Tensor:
        """Scores (B, n_items), higher is better, for a LongTensor of user codes on the model's device."""


def csr_tensor(matrix: sp.csr_matrix) -> torch.Tensor:
    """A scipy CSR matrix as a torch sparse CSR tensor (on the CPU; `.to(device)` moves it), sharing its values."""
    matrix = matrix if matrix.has_sorted_indices else matrix.sorted_indices()
    with warnings.catch_warnings():  # torch calls its sparse CSR support beta; products on it are what we use
        warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
        return torch.sparse_csr_tensor(torch.from_numpy(matrix.indptr.astype(np.int64)),
                                       torch.from_numpy(matrix.indices.astype(np.int64)),
                                       torch.from_numpy(matrix.data), size=matrix.shape, check_invariants=True)


def top_k(scorer: Scorer, users: torch.Tensor, exclude: sp.csr_matrix, k: int,
          device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The k best items (B, k) and their scores for each user, never item 0 nor their items in `exclude` (-inf past
    them). In fp32 even inside an autocast region (the loop validates in one): bf16 or fp16 scores tie items."""
    users = users.to(device)
    with torch.no_grad(), torch.autocast(device.type, enabled=False):
        scores = scorer.score(users).float()
    picked = exclude[users.cpu().numpy()]
    per_user = np.diff(picked.indptr)
    rows = np.concatenate([np.arange(len(per_user)), np.repeat(np.arange(len(per_user)), per_user)])
    items = np.concatenate([np.full(len(per_user), UNKNOWN), picked.indices])
    masked = scores.index_put((torch.from_numpy(rows).to(device), torch.from_numpy(items.astype(np.int64)).to(device)),
                              torch.tensor(-torch.inf, device=device))
    best_scores, best_items = torch.topk(masked, min(k, masked.shape[1]), dim=1)
    return best_items, best_scores


def row_codes(matrix: sp.csr_matrix, index: int) -> np.ndarray:
    """The column codes of one row of a CSR matrix (a user's items), as int64."""
    return matrix.indices[matrix.indptr[index]:matrix.indptr[index + 1]].astype(np.int64)


def binary_rows(histories: list[np.ndarray], n_items: int) -> sp.csr_matrix:
    """One row of ones per history of distinct item codes."""
    lengths = [len(history) for history in histories]
    return sp.csr_matrix((np.ones(sum(lengths), np.float32), np.concatenate([np.zeros(0, np.int64), *histories]),
                          np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)), shape=(len(histories), n_items))
