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
        return self.recommend_many([query], [exclude], k)[0]

    def recommend_many(self, queries: list[np.ndarray | None], excludes: list[np.ndarray],
                       k: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """`recommend` of each row; the rows with a query searched in one call to the index (a micro-batch, a
        request of several users: one search, not one a user)."""
        answers: list = [None] * len(queries)
        searched = [row for row, query in enumerate(queries) if query is not None]
        if searched:
            found = self.index.search(np.stack([queries[row] for row in searched]), max(k, self.candidates),
                                      [excludes[row] for row in searched])
            for row, ids in zip(searched, found):
                ids = ids[ids >= 0]
                scores = self.vectors[ids] @ queries[row]
                order = np.argsort(-scores, kind="stable")[:k]
                answers[row] = ids[order], scores[order]
        for row in set(range(len(queries))) - set(searched):  # popularity
            head = self.popular_order[:k + len(excludes[row])]
            best = head[~np.isin(head, excludes[row], assume_unique=True)][:k]
            answers[row] = best, self.popularity[best]
        return answers

    def dense_scores(self, queries: list[np.ndarray | None], excludes: list[np.ndarray], n_items: int) -> torch.Tensor:
        """(B, n_items) scores for a full ranking: each row's top `candidates`, -inf elsewhere."""
        scores = torch.full((len(queries), n_items), -torch.inf)
        for row, (items, values) in enumerate(self.recommend_many(queries, excludes, self.candidates)):
            scores[row, torch.from_numpy(items)] = torch.from_numpy(np.asarray(values, np.float32))
        return scores
