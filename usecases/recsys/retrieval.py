"""Two-stage serving of factor and sequence models: an ANN index over the item vectors retrieves candidates, which
are scored exactly (the user's vector, or the sequence network's last hidden state, times each candidate's vector)
and the best k served, as Merlin's, YouTube's and Pinterest's retrieval-then-ranking does.

The exclusions are today's (the user's seen items, every event, the unknown item), filtered inside the index's
search; users served from popularity (no vector: no training row and no event) are served from the popularity order
unseen by them, as the exact path serves them. `serving.retrieval: auto` serves ann where exact ranking's p95 per
request, measured in the run, is above `serving.ann.auto_above_ms`; the run logs the ANN top-10's recall against the
exact top-10 and the served NDCG@10 of both, the index's build time and size.
"""

from __future__ import annotations

import logging

import numpy as np
import scipy.sparse as sp
import torch

from common.serving.ann import VectorIndex, overlap
from .config import Config
from .ranking import UNKNOWN

log = logging.getLogger(__name__)

RECALL_BATCH = 128  # users ranked exactly at once for the recall: a bounded users x items matrix
KINDS = ("factors", "sequence")  # the served forms with item vectors; item-item and popularity are always exact


class TwoStage:
    """Candidates from `index`, rescored exactly against `vectors` (items x dim); popularity for queries without a
    vector."""

    def __init__(self, index: VectorIndex, vectors: np.ndarray, popularity: np.ndarray, candidates: int):
        self.index, self.vectors, self.candidates = index, vectors, candidates
        self.popularity = np.asarray(popularity, np.float32)
        self.popular_order = np.argsort(-self.popularity, kind="stable")
        self.popular_order = self.popular_order[self.popular_order != UNKNOWN]

    def recommend(self, query: np.ndarray | None, exclude: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Item codes and exact scores, best first, none of `exclude` (sorted codes, the unknown item among them)."""
        if query is None:
            return self._popular(exclude, k)
        found = self.index.search(query[None], max(k, self.candidates), [exclude])[0]
        found = found[found >= 0]
        scores = self.vectors[found] @ query
        order = np.argsort(-scores, kind="stable")[:k]
        return found[order], scores[order]

    def _popular(self, exclude: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        head = self.popular_order[:k + len(exclude)]
        best = head[~np.isin(head, exclude, assume_unique=True)][:k]
        return best, self.popularity[best]

    def dense_scores(self, queries: list[np.ndarray | None], excludes: list[np.ndarray], n_items: int,
                     k: int) -> torch.Tensor:
        """(B, n_items) scores as a full ranking reads them: each row's served top `max(k, candidates)` with its
        exact scores, -inf elsewhere (what `full_ranking` of the served model ranks)."""
        scores = torch.full((len(queries), n_items), -torch.inf)
        for row, (query, exclude) in enumerate(zip(queries, excludes)):
            items, values = self.recommend(query, exclude, max(k, self.candidates))
            scores[row, torch.from_numpy(items)] = torch.from_numpy(np.asarray(values, np.float32))
        return scores


def build_index(recommender, config: Config) -> VectorIndex:
    """The index over the served form's item vectors (`serving.ann.index`), its search effort tuned on a seeded
    sample of users' vectors (and, under a fold-in, the vectors their histories fold into), each with its seen items
    excluded: the least effort whose top-10 holds `target_recall` of the exact top-10; no label is read."""
    settings = config.serving.ann
    vectors = recommender.item_vectors()
    users = np.flatnonzero(recommender.has_rows)
    users = users[users != UNKNOWN]
    sample = np.sort(np.random.default_rng(config.runtime.seed).permutation(users)[:settings.tune_users])
    queries = recommender.query_vectors(sample)
    excluded = [recommender.excluded(user) for user in sample.tolist()]
    index, measured = VectorIndex.tuned(vectors, settings.index, queries, 10, settings.candidates,
                                        settings.target_recall, excluded * (len(queries) // len(sample)),
                                        config.runtime.seed)
    for spec, tuned in measured.items():
        log.info("ANN index %s over %d items: %s %s for recall@10 %.4f on %d users' vectors (tried %s)", spec,
                 index.rows, index.effort_name if spec == index.spec else "effort", tuned.effort, tuned.recall,
                 len(queries), ", ".join(f"{effort}: {recall:.3f}" for effort, recall in tuned.tried.items()) or "-")
    log.info("ANN index %s served: built in %.1f s, recall@10 %.4f against a target of %g", index.spec,
             index.build_seconds, index.recall, settings.target_recall)
    return index


def ann_figures(recommender, index: VectorIndex, test: sp.csr_matrix, config: Config, ranking) -> dict[str, float]:
    """The served model by two stages against itself exact, on the same users and history: recall@10 of the ANN
    top-10 against the exact top-10 on a seeded sample of test users (no label read), and the served NDCG@10 of
    two stages by `ranking`; the recommender is left exact."""
    users = np.flatnonzero(np.diff(test.indptr))
    users = np.sort(np.random.default_rng(config.runtime.seed).permutation(users)[:config.serving.ann.recall_users])
    exact = np.concatenate([recommender.top_k(users[first:first + RECALL_BATCH], 10)[0]
                            for first in range(0, len(users), RECALL_BATCH)])
    recommender.use_retrieval("ann", index)
    try:
        recall = overlap(recommender.top_k(users, 10)[0], exact)
        ndcg = ranking(recommender)["ndcg@10"]
    finally:
        recommender.use_retrieval("exact")
    return {"ann_recall@10": recall, "ann_served_ndcg@10": ndcg, "ann_build_seconds": index.build_seconds,
            "ann_index_mb": index_megabytes(index), "ann_search_effort": float(index.effort or 0)}


def index_megabytes(index: VectorIndex) -> float:
    return len(index.stored()["index"]) / 2**20
