"""Two-stage serving of factor and sequence models: an ANN index over the item vectors retrieves candidates, which
are scored exactly and the best k served; the exclusions are filtered inside the index's search."""

from __future__ import annotations

import numpy as np
import torch

from common.serving.ann import VectorIndex
from .ranking import UNKNOWN

KINDS = ("factors", "sequence")  # the served forms with item vectors; item-item and popularity are always exact


class TwoStage:
    """Candidates from `index`, rescored exactly against `vectors`; popularity for queries without a vector."""

    def __init__(self, index: VectorIndex, vectors: np.ndarray, popularity: np.ndarray, candidates: int):
        self.index, self.vectors, self.candidates = index, vectors, candidates
        self.popularity = np.asarray(popularity, np.float32)
        self.popular_order = np.argsort(-self.popularity, kind="stable")
        self.popular_order = self.popular_order[self.popular_order != UNKNOWN]

    def recommend(self, query: np.ndarray | None, exclude: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Item codes and exact scores, best first, none of `exclude` (sorted codes, the unknown item among them)."""
        if query is None:  # popularity
            head = self.popular_order[:k + len(exclude)]
            best = head[~np.isin(head, exclude, assume_unique=True)][:k]
            return best, self.popularity[best]
        found = self.index.search(query[None], max(k, self.candidates), [exclude])[0]
        found = found[found >= 0]
        scores = self.vectors[found] @ query
        order = np.argsort(-scores, kind="stable")[:k]
        return found[order], scores[order]

    def dense_scores(self, queries: list[np.ndarray | None], excludes: list[np.ndarray], n_items: int) -> torch.Tensor:
        """(B, n_items) scores for a full ranking: each row's top `candidates`, -inf elsewhere."""
        scores = torch.full((len(queries), n_items), -torch.inf)
        for row, (query, exclude) in enumerate(zip(queries, excludes)):
            items, values = self.recommend(query, exclude, self.candidates)
            scores[row, torch.from_numpy(items)] = torch.from_numpy(np.asarray(values, np.float32))
        return scores
