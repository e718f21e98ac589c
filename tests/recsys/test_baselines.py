"""The baselines learn structure a random ranking cannot see, and each keeps the shape its definition gives it."""

from __future__ import annotations

import types

import numpy as np
import pytest
import scipy.sparse as sp
import torch

from usecases.recsys import baselines
from usecases.recsys import config as cfg
from usecases.recsys.baselines import ALS, EASE, ItemKNN, ModelUnavailable, Popularity, als_available
from usecases.recsys.evaluate import full_ranking

CPU = torch.device("cpu")
USERS_PER_GROUP, ITEMS_PER_BLOCK = 100, 50
INTERACTIONS_PER_USER, HELD_OUT_PER_USER = 15, 3


def two_taste_groups(seed: int = 0) -> tuple[sp.csr_matrix, sp.csr_matrix]:
    """Users 1..100 pick from items 1..50, users 101..200 from items 51..100, popular items more often; each user
    holds out 3 of their 15 items. Row and column 0 stay empty, as for the unknown id."""
    generator = np.random.default_rng(seed)
    popularity = 1 / np.arange(1, ITEMS_PER_BLOCK + 1) ** 0.7
    popularity /= popularity.sum()
    train, test = ([], []), ([], [])
    for user in range(1, 2 * USERS_PER_GROUP + 1):
        first_item = 1 if user <= USERS_PER_GROUP else 1 + ITEMS_PER_BLOCK
        items = first_item + generator.choice(ITEMS_PER_BLOCK, INTERACTIONS_PER_USER, replace=False, p=popularity)
        for split, picked in ((test, items[:HELD_OUT_PER_USER]), (train, items[HELD_OUT_PER_USER:])):
            split[0].extend([user] * len(picked))
            split[1].extend(picked)
    shape = (2 * USERS_PER_GROUP + 1, 2 * ITEMS_PER_BLOCK + 1)
    return tuple(sp.csr_matrix((np.ones(len(users), np.float32), (users, items)), shape=shape)
                 for users, items in (train, test))


@pytest.fixture(scope="module")
def data() -> tuple[sp.csr_matrix, sp.csr_matrix]:
    return two_taste_groups()


class RandomScorer:
    def __init__(self, n_items: int):
        self.n_items = n_items
        self.generator = torch.Generator().manual_seed(0)

    def score(self, users: torch.Tensor) -> torch.Tensor:
        return torch.rand(len(users), self.n_items, generator=self.generator)


def ndcg_at_10(scorer, train: sp.csr_matrix, test: sp.csr_matrix) -> float:
    return full_ranking(scorer, test, train, [10], CPU, batch_users=64)["ndcg@10"]


MODELS = {
    "pop": lambda train: Popularity(train, CPU),
    "itemknn": lambda train: ItemKNN(train, cfg.ItemKNN(neighbours=20), CPU),
    "ease": lambda train: EASE(train, cfg.EASE(l2=50.0), CPU),
    "als": lambda train: ALS(train, cfg.ALS(factors=8, iterations=10), CPU),
}


@pytest.mark.parametrize("name", [
    "pop", "itemknn", "ease",
    pytest.param("als", marks=pytest.mark.skipif(not als_available(), reason="implicit is not installed")),
])
def test_beats_random_ranking(data, name):
    train, test = data
    random_ndcg = ndcg_at_10(RandomScorer(train.shape[1]), train, test)
    model_ndcg = ndcg_at_10(MODELS[name](train), train, test)
    assert model_ndcg > random_ndcg + 0.05, (name, model_ndcg, random_ndcg)


def test_personalised_models_beat_popularity(data):
    """Popularity ignores the taste groups; the others must find them."""
    train, test = data
    popularity_ndcg = ndcg_at_10(MODELS["pop"](train), train, test)
    for name in ("itemknn", "ease"):
        assert ndcg_at_10(MODELS[name](train), train, test) > popularity_ndcg + 0.05, name


def test_popularity_counts_training_interactions(data):
    train, _ = data
    scores = Popularity(train, CPU).score(torch.tensor([1, 150]))
    expected = np.bincount(train.tocoo().col, minlength=train.shape[1])
    np.testing.assert_array_equal(scores[0].numpy(), expected)
    np.testing.assert_array_equal(scores[1].numpy(), expected)


def test_itemknn_keeps_at_most_the_neighbours_with_shrunk_cosine(data):
    train, _ = data
    shrink = 10.0
    model = ItemKNN(train, cfg.ItemKNN(neighbours=5, shrink=shrink), CPU)
    similarity = sp.csc_matrix(model.similarity)
    assert similarity.getnnz(axis=0).max() <= 5
    assert similarity.diagonal().sum() == 0

    columns = train.toarray()
    target = 2
    neighbour = similarity[:, target].indices[0]
    x_i, x_j = columns[:, neighbour], columns[:, target]
    expected = x_i @ x_j / (np.linalg.norm(x_i) * np.linalg.norm(x_j) + shrink + 1e-6)
    assert similarity[neighbour, target] == pytest.approx(expected, rel=1e-5)


def test_ease_matches_closed_form_with_zero_diagonal(data):
    train, _ = data
    model = EASE(train, cfg.EASE(l2=50.0), CPU)
    weights = model.weights.numpy()
    assert np.all(np.diag(weights) == 0)

    x = train.toarray().astype(np.float64)
    precision = np.linalg.inv(x.T @ x + 50.0 * np.eye(x.shape[1]))
    expected = -precision / np.diag(precision)
    np.fill_diagonal(expected, 0.0)
    # EASE inverts in float32: a Cholesky inverse of n items is within about n * eps of a nearby matrix's, which the
    # system's condition number (9 here) amplifies; measured 5e-8 of 1.3e-5. A user's score sums their items' rows.
    n_items = x.shape[1]
    tolerance = np.linalg.cond(x.T @ x + 50.0 * np.eye(n_items)) * n_items * np.finfo(np.float32).eps \
        * np.abs(expected).max()
    np.testing.assert_allclose(weights, expected, rtol=0, atol=tolerance)
    np.testing.assert_allclose(model.score(torch.tensor([3])).numpy()[0], x[3] @ expected, rtol=0,
                               atol=x[3].sum() * tolerance)


@pytest.mark.parametrize("name", [
    "itemknn", "ease",
    pytest.param("als", marks=pytest.mark.skipif(not als_available(), reason="implicit is not installed")),
])
def test_exported_form_scores_like_the_model(data, name):
    """What serving stores (item-item weights or factors) reproduces the model's scores."""
    train, _ = data
    model = MODELS[name](train)
    users = torch.tensor([1, 120, 200])
    if name == "als":
        user_factors, item_factors = model.factors()
        exported = user_factors[users] @ item_factors.T
    else:
        similarity = model.similarity_matrix(train.shape[1], max_bytes=0) if name == "ease" else model.similarity_matrix()
        exported = torch.from_numpy((train[users.numpy()] @ similarity).toarray())
    torch.testing.assert_close(exported, model.score(users), atol=1e-5, rtol=1e-5)


def test_ease_is_served_whole_when_it_fits_the_budget_and_pruned_above_it(data):
    train, _ = data
    model = MODELS["ease"](train)
    whole = model.similarity_matrix(5, max_bytes=model.weights.numel() * 4)
    assert isinstance(whole, torch.Tensor) and torch.equal(whole, model.weights)
    assert whole.is_contiguous(), "a column-major matrix is copied whole by every served request's product"
    assert sp.issparse(model.similarity_matrix(5, max_bytes=model.weights.numel() * 4 - 1))


def test_pruned_ease_keeps_each_columns_largest_weights(data):
    train, _ = data
    model = MODELS["ease"](train)
    pruned = model.similarity_matrix(5, max_bytes=0).toarray()
    assert ((pruned != 0).sum(axis=0) <= 5).all()
    weights = model.weights.numpy()
    column = 7
    assert set(np.flatnonzero(pruned[:, column])) == set(np.argsort(-weights[:, column])[:5])


def test_ease_counts_the_four_matrices_alive_at_once_against_the_free_memory(monkeypatch):
    """35,000 items in float32 with 20 GB free on a GPU: one matrix (4.9 GB) would fit, the four of the fit (19.6
    GB) do not, so it is a one-line skip rather than an out-of-memory error midway; on a CPU as well."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (20 * 10**9, 80 * 10**9))
    with pytest.raises(ModelUnavailable, match=r"ease: 35,000 items need 18.3 GB .* on cuda \(18.6 GB free\)"):
        EASE(sp.csr_matrix((3, 35_000), dtype=np.float32), cfg.EASE(), torch.device("cuda"))
    free = types.SimpleNamespace(available=4 * 4 * 1000**2 / baselines.EASE_MEMORY_SHARE * 0.99)
    monkeypatch.setattr("psutil.virtual_memory", lambda: free)
    with pytest.raises(ModelUnavailable, match="ease: 1,000 items need"):
        EASE(sp.csr_matrix((3, 1000), dtype=np.float32), cfg.EASE(), CPU)


def test_itemknn_refuses_a_huge_catalogue_as_a_skippable_error():
    train = sp.csr_matrix((3, baselines.ITEMKNN_MAX_ITEMS + 1), dtype=np.float32)
    with pytest.raises(ModelUnavailable, match="itemknn: 200,001 items is too many"):
        ItemKNN(train, cfg.ItemKNN(), CPU)


def test_als_without_implicit_is_a_skippable_error(monkeypatch, data):
    monkeypatch.setattr(baselines, "als_available", lambda: False)
    with pytest.raises(ModelUnavailable, match="pip install implicit"):
        ALS(data[0], cfg.ALS(), CPU)
