"""Full-ranking metrics checked against arithmetic done by hand, and the masking that keeps them honest."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.sparse as sp
import torch

from common.errors import UserError
from usecases.recsys.evaluate import full_ranking, rows_as_dense, sample_users
from usecases.recsys.ranking import top_k

CPU = torch.device("cpu")
N_ITEMS = 11  # item 0 (unknown) and the catalogue 1..10
RANKING = [3, 7, 1, 9, 2, 5, 4, 6, 8, 10]  # best first


class TableScorer:
    def __init__(self, table: np.ndarray):
        self.table = torch.as_tensor(table, dtype=torch.float32)

    def score(self, users: torch.Tensor) -> torch.Tensor:
        return self.table[users]


def user_item_matrix(rows: dict[int, list[int]], n_users: int, n_items: int = N_ITEMS) -> sp.csr_matrix:
    users = [user for user, items in rows.items() for _ in items]
    items = [item for user_items in rows.values() for item in user_items]
    return sp.csr_matrix((np.ones(len(items), np.float32), (users, items)), shape=(n_users, n_items))


def ranked_scorer(n_users: int) -> TableScorer:
    """Every user ranks items in RANKING order; item 0 gets the highest score, so masking it must not shift ranks."""
    table = np.zeros((n_users, N_ITEMS), np.float32)
    for position, item in enumerate(RANKING):
        table[:, item] = len(RANKING) - position
    table[:, 0] = 100.0
    return TableScorer(table)


def dcg(*ranks: int) -> float:
    return sum(1 / math.log2(rank + 1) for rank in ranks)


def test_metrics_match_hand_computation():
    # user 1: relevant {7, 2, 6} at ranks 2, 5, 8; user 2: relevant {10} at rank 10; user 3 has no test items
    truth = user_item_matrix({1: [7, 2, 6], 2: [10]}, n_users=4)
    results = full_ranking(ranked_scorer(4), truth, sp.csr_matrix((4, N_ITEMS)), [1, 3, 5, 10], CPU, batch_users=8)

    assert results["users_evaluated"] == 2
    for metric in ("hit", "recall", "precision", "mrr", "ndcg"):
        assert results[f"{metric}@1"] == 0.0  # both users' first item (3) is irrelevant

    three_relevant_idcg = dcg(1, 2, 3)
    expected = {
        # K=3: user 1 has one hit at rank 2, user 2 none
        "hit@3": (1 + 0) / 2,
        "recall@3": (1 / 3 + 0) / 2,
        "precision@3": (1 / 3 + 0) / 2,
        "mrr@3": (1 / 2 + 0) / 2,
        "ndcg@3": (dcg(2) / three_relevant_idcg + 0) / 2,
        # K=5: user 1 hits at ranks 2 and 5
        "hit@5": (1 + 0) / 2,
        "recall@5": (2 / 3 + 0) / 2,
        "precision@5": (2 / 5 + 0) / 2,
        "mrr@5": (1 / 2 + 0) / 2,
        "ndcg@5": (dcg(2, 5) / three_relevant_idcg + 0) / 2,
        # K=10 > |relevant|: user 1 hits at 2, 5, 8 (IDCG stops at 3 items); user 2 at 10 (IDCG of one item = 1)
        "hit@10": (1 + 1) / 2,
        "recall@10": (3 / 3 + 1 / 1) / 2,
        "precision@10": (3 / 10 + 1 / 10) / 2,
        "mrr@10": (1 / 2 + 1 / 10) / 2,
        "ndcg@10": (dcg(2, 5, 8) / three_relevant_idcg + dcg(10) / dcg(1)) / 2,
        # both users get the same list: 1, 3 and all 10 distinct items of the 10-item catalogue
        "coverage@1": 1 / 10,
        "coverage@3": 3 / 10,
        "coverage@10": 10 / 10,
    }
    for key, value in expected.items():
        assert results[key] == pytest.approx(value, abs=1e-12), key
    assert results["users_per_s"] > 0


def test_top_k_never_returns_unknown_or_excluded_items():
    generator = np.random.default_rng(0)
    n_users, n_items = 20, 30
    table = generator.random((n_users, n_items))
    table[:, 0] = 10.0
    excluded = {user: list(generator.choice(np.arange(1, n_items), 8, replace=False)) for user in range(n_users)}
    for user, items in excluded.items():
        table[user, items] += 5.0  # the excluded items would otherwise top every list
    exclude = user_item_matrix(excluded, n_users, n_items)

    items, scores = top_k(TableScorer(table), torch.arange(n_users), exclude, 10, CPU)

    assert items.shape == (n_users, 10)
    assert torch.all(scores[:, :-1] >= scores[:, 1:])
    for user in range(n_users):
        returned = set(items[user].tolist())
        assert 0 not in returned
        assert not returned & set(excluded[user])


def test_excluded_relevant_item_is_never_a_hit_but_counts_as_relevant():
    # as RecBole: item 3 (ranked first) is in the user's history and in the truth; it is masked, yet counted in |R|
    truth = user_item_matrix({1: [3, 7]}, n_users=2)
    exclude = user_item_matrix({1: [3]}, n_users=2)
    results = full_ranking(ranked_scorer(2), truth, exclude, [1], CPU, batch_users=4)
    assert results["recall@1"] == pytest.approx(1 / 2)  # 7 moves up to rank 1
    assert results["ndcg@1"] == pytest.approx(1.0)  # IDCG@1 = 1 however many are relevant


def test_users_with_fewer_candidates_than_k_get_no_phantom_hits():
    # user 1 has every item but 9 and 10 in its history, and 4 of them in its truth
    exclude = user_item_matrix({1: [1, 2, 3, 4, 5, 6, 7, 8]}, n_users=2)
    truth = user_item_matrix({1: [1, 2, 9, 10]}, n_users=2)
    items, scores = top_k(ranked_scorer(2), torch.tensor([1]), exclude, 5, CPU)
    assert items[0, :2].tolist() == [9, 10]
    assert torch.isinf(scores[0, 2:]).all()

    results = full_ranking(ranked_scorer(2), truth, exclude, [5], CPU, batch_users=4)
    assert results["recall@5"] == pytest.approx(2 / 4)
    assert results["coverage@5"] == pytest.approx(2 / 10)


def test_batch_size_does_not_change_results():
    generator = np.random.default_rng(1)
    n_users, n_items = 50, 40
    table = generator.random((n_users, n_items))
    truth = sp.random(n_users, n_items, density=0.1, format="csr", random_state=2, dtype=np.float32)
    exclude = sp.random(n_users, n_items, density=0.2, format="csr", random_state=3, dtype=np.float32)
    one_by_one = full_ranking(TableScorer(table), truth, exclude, [5, 10], CPU, batch_users=1)
    all_at_once = full_ranking(TableScorer(table), truth, exclude, [5, 10], CPU, batch_users=1000)

    assert one_by_one["users_evaluated"] == np.count_nonzero(np.diff(truth.indptr))
    for key, value in one_by_one.items():
        if key != "users_per_s":
            assert all_at_once[key] == pytest.approx(value, rel=1e-12), key


def test_k_beyond_the_catalogue_is_a_user_error():
    truth = user_item_matrix({1: [2]}, n_users=2)
    with pytest.raises(UserError, match="K=11"):
        full_ranking(ranked_scorer(2), truth, sp.csr_matrix((2, N_ITEMS)), [10, 11], CPU, batch_users=4)


def test_rows_as_dense_matches_scipy():
    matrix = sp.random(6, 9, density=0.3, format="csr", random_state=4, dtype=np.float32)
    rows = np.array([4, 0, 4, 2])
    dense = rows_as_dense(matrix, torch.from_numpy(rows), CPU)
    np.testing.assert_array_equal(dense.numpy(), matrix[rows].toarray())


def test_a_sample_of_users_keeps_their_whole_rows_and_is_seeded():
    truth = sp.random(500, 40, density=0.1, format="csr", random_state=1, dtype=np.float32)
    sampled = sample_users(truth, 50, seed=3)
    kept = np.flatnonzero(np.diff(sampled.indptr))
    assert len(kept) == 50 and (sampled[kept] != truth[kept]).nnz == 0
    assert np.array_equal(kept, np.flatnonzero(np.diff(sample_users(truth, 50, seed=3).indptr)))
    assert sample_users(truth, None, seed=3) is truth and sample_users(truth, 10_000, seed=3) is truth


class CloseScores:
    """Factor scores 1 + 0.001 i: distinct in fp32, tied in bf16 (whose step at 1.0 is 0.008)."""

    def __init__(self, n_items: int):
        self.items = 1 + 1e-3 * torch.arange(n_items, dtype=torch.float32)[:, None]

    def score(self, users: torch.Tensor) -> torch.Tensor:
        return torch.ones(len(users), 1) @ self.items.T


def test_ranking_inside_an_autocast_region_uses_fp32_scores():
    """The training loop validates under autocast: the best epoch must be picked from the scores test ranks by."""
    n_users, n_items = 4, 40
    truth = sp.csr_matrix((np.ones(n_users), (np.arange(n_users), np.full(n_users, n_items - 5))),
                          shape=(n_users, n_items))
    exclude = sp.csr_matrix((n_users, n_items))
    fp32 = full_ranking(CloseScores(n_items), truth, exclude, [10], CPU, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = full_ranking(CloseScores(n_items), truth, exclude, [10], CPU, 8)
    assert fp32["mrr@10"] == pytest.approx(1 / 5)
    assert mixed == {**fp32, "users_per_s": mixed["users_per_s"]}
