"""Fold-in is implicit's ALS solve, ranks a user's unseen items from their history, recovers a planted user, is
LightGCN's own forward pass for a trained user, folds a batch in as each user alone (numpy or torch), scores item-item
histories as the dense product, and refuses arrays that do not fit in one line."""

import ast
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
import torch

from common.serving.bundle import decode, encode
from usecases.recsys import foldin
from usecases.recsys.foldin import (FoldIn, GradientSteps, GraphFoldIn, LeastSquares, excluded_items, factor_foldin,
                                    item_item_scores, merged_history)

TRAINED_USERS, NEW_USERS, ITEMS, RANK = 300, 20, 200, 4
PICKS, HELD_OUT = 24, 8


def binary_rows(histories: list[np.ndarray], n_items: int) -> sp.csr_matrix:
    users = np.repeat(np.arange(len(histories)), [len(history) for history in histories])
    items = np.concatenate([np.asarray(history, np.int64) for history in histories])
    rows = sp.csr_matrix((np.ones(len(items), np.float32), (users, items)), shape=(len(histories), n_items))
    rows.data[:] = 1  # a repeated item counts once
    return rows


FLOAT32_EPS = float(np.finfo(np.float32).eps)


def rounding_tolerance(terms: int, scale: float) -> float:
    """How far two float32 computations of the same sums of `terms` terms of magnitude up to `scale` may round apart
    in another order (another CPU's kernels, thread count or batch shape): (terms - 1) roundings of eps/2 each, on
    each side."""
    return max(terms, 1) * FLOAT32_EPS * scale


def cosine(left: np.ndarray, right: np.ndarray) -> float:
    return float(left @ right / np.linalg.norm(left) / np.linalg.norm(right))


def test_als_fold_in_is_implicits_recalculate_user_also_for_a_user_never_trained_on():
    implicit_als = pytest.importorskip("implicit.cpu.als")
    from threadpoolctl import threadpool_limits

    generator = np.random.default_rng(0)
    train = (generator.random((40, 60)) < 0.15).astype(np.float32)
    train[0] = 0  # user 0 is never trained on
    with threadpool_limits(1, "blas"):
        model = implicit_als.AlternatingLeastSquares(factors=8, regularization=0.1, alpha=3.0, iterations=3,
                                                     num_threads=1, random_state=0)
        model.fit(sp.csr_matrix(train), show_progress=False)
        new = generator.choice(np.arange(60), 5, replace=False)
        histories = [np.append(new, new[0]), train[3].nonzero()[0], np.zeros(0, np.int64)]
        expected = model.recalculate_user(np.arange(3), binary_rows(histories, 60))
    folded = LeastSquares(model.item_factors, regularization=0.1, alpha=3.0).users(histories)
    assert folded.dtype == np.float32 and np.abs(expected[0]).max() > 0.1
    # implicit solves in float32 (ours in float64): its YᵀY sums 60 items and its Cholesky solve rounds, errors its
    # system's condition number amplifies (about 40 here; measured: 3e-6 of 2e-4 allowed)
    items = model.item_factors.astype(np.float64)
    for user, history in enumerate(histories):
        liked = items[np.unique(history)]
        system = items.T @ items + 0.1 * np.eye(8) + 2.0 * liked.T @ liked
        tolerance = np.linalg.cond(system) * rounding_tolerance(len(items) + 8, np.abs(expected[user]).max())
        np.testing.assert_allclose(folded[user], expected[user], rtol=0, atol=tolerance)


def low_rank_log(seed: int = 0) -> list[np.ndarray]:
    """Each user picks 24 distinct items, an item the more likely the higher its rank-4 affinity with the user."""
    generator = np.random.default_rng(seed)
    tastes = generator.normal(size=(TRAINED_USERS + NEW_USERS, RANK))
    traits = generator.normal(size=(ITEMS, RANK))
    affinity = 3 * tastes @ traits.T
    probability = np.exp(affinity - affinity.max(axis=1, keepdims=True))
    probability /= probability.sum(axis=1, keepdims=True)
    return [generator.choice(ITEMS, PICKS, replace=False, p=row) for row in probability]


def fit_als(histories: list[np.ndarray], factors: int = 8, regularization: float = 1.0, alpha: float = 10.0,
            sweeps: int = 8) -> np.ndarray:
    """Item factors by alternating the fold-in itself over users and items."""
    by_item = binary_rows(histories, ITEMS).T.tocsr()
    item_histories = [by_item.indices[by_item.indptr[item]:by_item.indptr[item + 1]] for item in range(ITEMS)]
    item_factors = np.random.default_rng(0).normal(scale=0.1, size=(ITEMS, factors)).astype(np.float32)
    for _ in range(sweeps):
        user_factors = LeastSquares(item_factors, regularization, alpha).users(histories)
        item_factors = LeastSquares(user_factors, regularization, alpha).users(item_histories)
    return item_factors


def held_out_auc(scores: np.ndarray, seen: list[np.ndarray], held_out: list[np.ndarray]) -> float:
    """How often a held-out item outscores an unseen item the user never picked, averaged over users."""
    aucs = []
    for row, known, relevant in zip(scores, seen, held_out):
        others = np.setdiff1d(np.arange(ITEMS), np.concatenate([known, relevant]))
        aucs.append((row[relevant][:, None] > row[others][None, :]).mean())
    return float(np.mean(aucs))


def test_a_user_folded_in_from_their_history_ranks_their_held_out_items_far_above_random():
    picks = low_rank_log()
    history, held_out = [user[:-HELD_OUT] for user in picks], [user[-HELD_OUT:] for user in picks]
    item_factors = fit_als(history[:TRAINED_USERS])  # the new users' rows never reach the fit
    users = LeastSquares(item_factors, regularization=1.0, alpha=10.0).users(history)
    scores = users @ item_factors.T
    trained, new = slice(0, TRAINED_USERS), slice(TRAINED_USERS, None)
    assert held_out_auc(scores[trained], history[trained], held_out[trained]) > 0.85  # the planted affinity: 0.96
    assert held_out_auc(scores[new], history[new], held_out[new]) > 0.85
    shuffled = np.random.default_rng(1).permutation(len(picks))  # someone else's history: no better than chance
    assert held_out_auc(scores[shuffled], [history[user] for user in shuffled], held_out) < 0.6


def planted(seed: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Gaussian item factors, a planted user, and the user's history: the 50 items they score highest."""
    generator = np.random.default_rng(seed)
    items = generator.normal(size=(1000, 8)).astype(np.float32)
    user = generator.normal(size=8)
    return items, user, np.argsort(items @ user)[-50:]


def test_least_squares_on_bpr_like_factors_recovers_a_planted_user():
    items, user, liked = planted()
    folded = LeastSquares(items, regularization=1.0, alpha=2.0).users([liked])[0]
    assert cosine(folded, user) > 0.9
    assert len(np.intersect1d(np.argsort(items @ folded)[-50:], liked)) >= 35


def bpr_loss(items: np.ndarray, liked: np.ndarray, vector: np.ndarray) -> float:
    others = np.setdiff1d(np.arange(1, len(items)), liked)
    margins = (items[liked] @ vector)[:, None] - (items[others] @ vector)[None, :]
    return float(np.logaddexp(0, -margins).mean())


def test_gradient_steps_from_zero_find_the_planted_user_and_lower_the_bpr_loss():
    items, user, liked = planted()
    folded = GradientSteps(items, steps=30, lr=0.5, weight_decay=1e-4, seed=3).users([liked])[0]
    assert cosine(folded, user) > 0.9
    assert bpr_loss(items, liked, folded) < 0.5 * bpr_loss(items, liked, np.zeros(8))


def test_gradient_steps_start_from_the_trained_vector_and_do_not_depend_on_the_batch():
    items, user, liked = planted()
    start = user[None].astype(np.float32)
    assert np.array_equal(GradientSteps(items, steps=0, lr=0.5).users([liked], start), start)
    five = GradientSteps(items, steps=5, lr=0.5, seed=7)
    alone = five.users([liked], start)
    batch = five.users([np.array([1, 2]), liked], np.vstack([start, start]))
    # float32 steps: each step's sums over the user's 50 items and 8 factors may round apart in a batch of two (other
    # kernels); negatives drawn for the batch rather than the user move the vector by tenths
    steps_tolerance = 5 * rounding_tolerance(len(liked) + items.shape[1], np.abs(alone).max())
    np.testing.assert_allclose(batch[1], alone[0], rtol=0, atol=steps_tolerance)
    assert cosine(alone[0], user) > 0.95 and not np.allclose(alone, start)
    decayed = GradientSteps(items, steps=20, lr=0.1, weight_decay=5.0).users([liked], start)  # p -= p each step
    assert np.linalg.norm(decayed) < 0.2 * np.linalg.norm(start)
    empty = five.users([np.zeros(0, np.int64), liked], np.vstack([start, start]))
    np.testing.assert_array_equal(empty[0], start[0])


def test_graph_fold_in_of_a_trained_user_is_lightgcns_own_embedding():
    torch = pytest.importorskip("torch")
    from usecases.recsys.models import LightGCN, NegativeSampler

    torch.manual_seed(0)
    generator = np.random.default_rng(0)
    train = sp.csr_matrix((generator.random((30, 50)) < 0.2).astype(np.float32))
    layers, cpu = 3, torch.device("cpu")
    model = LightGCN(train, dim=8, layers=layers, sampler=NegativeSampler(train, cpu), device=cpu)
    with torch.no_grad():
        users, _ = model.embeddings()
        layer, item_layers = model.ego_embeddings.weight, []
        for _ in range(layers):
            item_layers.append(layer[train.shape[0]:].numpy())
            layer = torch.sparse.mm(model.adjacency, layer)
        egos = model.ego_embeddings.weight[: train.shape[0]].numpy()
    graph = GraphFoldIn(np.sum(item_layers, axis=0), np.asarray(train.sum(axis=0)).ravel(), layers)
    histories = [train.indices[train.indptr[user]:train.indptr[user + 1]] for user in range(train.shape[0])]
    # LightGCN propagates in float32, each layer a sum over a node's neighbours (at most 15 here); ours is float64
    neighbours = max(np.diff(train.indptr).max(), np.diff(train.tocsc().indptr).max())
    tolerance = layers * rounding_tolerance(neighbours + 1, np.abs(model.ego_embeddings.weight.detach().numpy()).max())
    np.testing.assert_allclose(graph.users(histories, egos), users.numpy(), rtol=0, atol=tolerance)
    new = graph.users([histories[4]])[0]  # the same items, no layer-0 row: only the propagated part
    np.testing.assert_allclose(new, users[4].numpy() - egos[4] / (layers + 1), rtol=0, atol=tolerance)


SOLVERS = {
    "als": lambda items: LeastSquares(items, regularization=0.1, alpha=3.0),
    "least_squares": lambda items: LeastSquares(items, regularization=1.0, alpha=1.0),
    "gradient": lambda items: GradientSteps(items, steps=5, lr=0.5, weight_decay=0.01, seed=2),
    "graph": lambda items: GraphFoldIn(items * 2, np.arange(len(items)) % 7, layers=2),
}


@pytest.mark.parametrize("method", SOLVERS)
def test_a_batch_folds_each_user_in_as_alone_in_numpy_and_in_torch(method, monkeypatch):
    """Histories of every length (padding), in blocks (a small cache), with numpy's tables (a server's one user) and
    torch's (`to`: a batch on the device, here the CPU): each row is the user's vector alone."""
    items, user, liked = planted()
    histories = [liked, np.zeros(0, np.int64), liked[:3], np.array([5, 5, 9]), liked[10:]]
    starts = np.random.default_rng(0).normal(size=(len(histories), items.shape[1])).astype(np.float32)
    solver = SOLVERS[method](items)
    alone = np.vstack([solver.users([history], start[None]) for history, start in zip(histories, starts)])
    # Another batch shape or numpy against torch sums in another order. Float64 methods differ by float64 roundings,
    # which can still flip the float32 rounding of their rows: one float32 eps of the largest value. Gradient steps
    # are float32 throughout: each step's sums over the longest history and the factors, for each of its steps.
    terms = 1 if solver.dtype == np.float64 else solver.steps * (len(liked) + items.shape[1])
    tolerance = rounding_tolerance(terms, np.abs(alone).max())
    monkeypatch.setattr(foldin, "CACHE_BYTES", 1)  # a block per history
    np.testing.assert_allclose(solver.users(histories, starts), alone, rtol=0, atol=tolerance)
    monkeypatch.undo()
    on_torch = solver.to("cpu").vectors(histories, torch.from_numpy(starts))
    assert on_torch.dtype == torch.float32
    np.testing.assert_allclose(on_torch.numpy(), alone, rtol=0, atol=tolerance)
    assert np.abs(alone).max() > 0.01


@pytest.mark.parametrize("sparse", [True, False], ids=["csr", "dense"])
def test_item_item_scores_are_the_binary_history_times_the_matrix(sparse):
    generator = np.random.default_rng(0)
    dense = (generator.random((30, 30)) * (generator.random((30, 30)) < 0.2)).astype(np.float32)
    histories = [np.array([3, 7, 3, 12]), np.zeros(0, np.int64), np.array([29])]
    expected = np.zeros((3, 30), np.float32)
    for row, history in enumerate(histories):
        for item in set(history.tolist()):
            expected[row] += dense[item]
    scores = item_item_scores(sp.csr_matrix(dense) if sparse else dense, histories)
    assert scores.dtype == np.float32
    np.testing.assert_allclose(scores, expected, rtol=1e-6)


def test_merged_history_keeps_each_item_once_at_its_latest_place_newest_last_capped():
    known, posted, recent = np.array([3, 5, 9]), np.array([5, 7]), np.array([2, 7, 0])
    np.testing.assert_array_equal(merged_history(known, posted, recent), [3, 9, 5, 2, 7])
    np.testing.assert_array_equal(merged_history(known, posted, recent, max_length=4), [9, 5, 2, 7])
    assert merged_history(known, posted, max_length=0).size == 0
    np.testing.assert_array_equal(merged_history(np.zeros(0, np.int64), np.array([4, 4, 1])), [4, 1])
    np.testing.assert_array_equal(merged_history(np.array([], dtype=np.float32), []), [])


def test_excluded_items_are_seen_and_every_event_and_the_unknown_item():
    excluded = excluded_items(np.array([5, 3]), np.array([7, 5]), np.zeros(0, np.int64))
    np.testing.assert_array_equal(excluded, [0, 3, 5, 7])
    np.testing.assert_array_equal(excluded_items(np.zeros(0, np.int32)), [0])


def test_fold_in_spec_round_trips_through_the_bundle_codec_and_dispatches():
    spec = FoldIn("gradient", steps=np.int64(5), lr=0.5, weight_decay=1e-4, seed=2, from_trained=False)
    stored = decode(encode({"fold_in": spec.as_plain()}))["fold_in"]
    assert FoldIn.from_plain(stored) == spec
    items, user, liked = planted()
    from_zero = factor_foldin(spec, items).users([liked], user[None])  # from_trained=False: the start is ignored
    np.testing.assert_array_equal(from_zero, GradientSteps(items, steps=5, lr=0.5, weight_decay=1e-4,
                                                           seed=2).users([liked]))
    als = factor_foldin(FoldIn("als", regularization=0.1, alpha=3.0), items)
    np.testing.assert_array_equal(als.users([liked]), LeastSquares(items, 0.1, 3.0).users([liked]))


@pytest.mark.parametrize("stored, message", [
    ({"method": "svd"}, "must be one of als, least_squares, gradient, graph"),
    ({"method": "als", "alpha": 0.0}, "alpha must be above 0"),
    ({"method": "als", "regularization": -1.0}, "regularization must be at least 0"),
    ({"method": "gradient", "steps": 10}, "needs lr above 0"),
    ({"method": "graph"}, "needs layers of at least 1"),
    ({"method": "als", "lambda": 0.1}, "unknown keys: lambda"),
])
def test_a_bad_fold_in_spec_is_refused_in_one_line(stored, message):
    with pytest.raises(ValueError, match=message) as refused:
        FoldIn.from_plain(stored)
    assert "\n" not in str(refused.value)


ITEMS_10 = np.random.default_rng(0).normal(size=(10, 3)).astype(np.float32)


@pytest.mark.parametrize("call, message", [
    (lambda: LeastSquares(np.ones(10), 0.1, 1.0), r"items must be a 2-D float array \(items × factors\)"),
    (lambda: LeastSquares(ITEMS_10, 0.1, 1.0).users(np.array([1, 2])), "a list of item-code arrays"),
    (lambda: LeastSquares(ITEMS_10, 0.1, 1.0).users([np.array([[1, 2]])]), r"history 0: .* 1-D array"),
    (lambda: LeastSquares(ITEMS_10, 0.1, 1.0).users([[1], [1.5]]), "history 1: item codes must be integers"),
    (lambda: LeastSquares(ITEMS_10, 0.1, 1.0).users([[1, 10]]), r"history 0: item code 10 is outside 0\.\.9"),
    (lambda: LeastSquares(np.zeros((10, 3), np.float32), 0.0, 1.0).users([[1]]), "singular"),
    (lambda: GradientSteps(ITEMS_10, steps=1, lr=0.1).users([[1]], np.zeros((2, 3))), r"starts must hold .*\(1, 3\)"),
    (lambda: GraphFoldIn(ITEMS_10, np.ones(3), 2), r"degree must hold one count per item, shape \(10,\)"),
    (lambda: GraphFoldIn(ITEMS_10, np.ones(10), 2).users([[1]], np.zeros(3)), "egos must hold one row"),
    (lambda: factor_foldin(FoldIn("graph", layers=2), ITEMS_10), "needs the items' layer_sum and degree"),
    (lambda: item_item_scores(np.ones((3, 4), np.float32), [[1]]), r"must be square, got shape \(3, 4\)"),
    (lambda: merged_history(np.array([[1]])), "known: item codes must be a 1-D array"),
    (lambda: excluded_items(np.array([1]), np.array([0.5])), "events.0.: item codes must be integers"),
])
def test_arrays_that_do_not_fit_are_refused_in_one_line(call, message):
    with pytest.raises(ValueError, match=message) as refused:
        call()
    assert "\n" not in str(refused.value)


def test_fold_in_imports_only_numpy_scipy_torch_and_the_standard_library():
    """And the bottom layer of the use case (`ranking.py`, the unknown id's code), which holds to the same."""
    from usecases.recsys import ranking

    for module in (foldin, ranking):
        tree = ast.parse(Path(module.__file__).read_text())
        imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                    for alias in node.names}
        imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                     if isinstance(node, ast.ImportFrom) and node.level == 0}
        local = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level}
        assert imported <= {"numpy", "scipy", "torch", "collections", "copy", "dataclasses", "__future__",
                            "warnings", "typing"}
        assert local <= {"ranking"}
