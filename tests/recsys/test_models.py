"""The learned models' parts: negative sampling, the normalised graph, the loss."""

import numpy as np
import pytest
import scipy.sparse as sp
import torch

from usecases.recsys.models import BPR, LightGCN, NegativeSampler, bpr_loss, normalised_adjacency


def random_matrix(users=50, items=40, density=0.2, seed=0):
    dense = (np.random.default_rng(seed).random((users, items)) < density).astype(np.float32)
    dense[0, :] = dense[:, 0] = 0
    return sp.csr_matrix(dense)


def test_negatives_are_real_items_and_almost_never_positives():
    train = random_matrix()
    sampler = NegativeSampler(train, torch.device("cpu"))
    users = torch.from_numpy(np.repeat(np.arange(1, 50), 200))
    negatives = sampler(users)
    assert negatives.min() >= 1 and negatives.max() < 40
    positive = train.toarray()[users.numpy(), negatives.numpy()] > 0
    assert positive.mean() < 0.06  # ~20% before the retry, 0.2^2 after it


def test_normalised_adjacency_is_symmetric_with_the_degree_scaling():
    train = random_matrix()
    adjacency = normalised_adjacency(train).to_dense()
    assert torch.allclose(adjacency, adjacency.T)
    user, item = 3, int(train[3].indices[0])
    degrees = np.asarray(train.sum(axis=1)).ravel(), np.asarray(train.sum(axis=0)).ravel()
    expected = 1 / np.sqrt(degrees[0][user] * degrees[1][item])
    assert adjacency[user, 50 + item].item() == pytest.approx(expected)


def test_bpr_loss_falls_as_the_margin_grows_and_adds_the_penalty():
    small, large = torch.tensor([[0.1, 0.0]]), torch.tensor([[5.0, 0.0]])
    assert bpr_loss(large, None) < bpr_loss(small, None)
    assert bpr_loss(torch.tensor([[0.1, 0.5]]), None) == pytest.approx(bpr_loss(small, None) + 0.5)


@pytest.mark.parametrize("model_name", ["bpr", "lightgcn"])
def test_forward_gives_margin_and_norm_and_scores_every_item(model_name):
    train = random_matrix()
    sampler = NegativeSampler(train, torch.device("cpu"))
    torch.manual_seed(0)
    model = (BPR(50, 40, 8, sampler, weight_decay=1e-3) if model_name == "bpr"
             else LightGCN(train, 8, 2, sampler, torch.device("cpu"), weight_decay=1e-3))
    output = model(torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6]))
    assert output.shape == (3, 2) and (output[:, 1] > 0).all()
    assert model.score(torch.tensor([1, 2])).shape == (2, 40)
