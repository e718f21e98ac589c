"""The learned models' parts: negative sampling, the normalised graph, the loss."""

import numpy as np
import pytest
import scipy.sparse as sp
import torch

import torch.nn.functional as F

from usecases.recsys.models import BPR, LightGCN, NegativeSampler, normalised_adjacency


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


def fixed_negatives(negatives):
    """A sampler that always draws `negatives`, so the loss can be computed by hand."""
    return lambda users: negatives


@pytest.mark.parametrize("weight_decay", [0.0, 1e-2])
def test_forward_is_the_bpr_loss_with_the_rows_l2_penalty(weight_decay):
    torch.manual_seed(0)
    model = BPR(50, 40, 8, fixed_negatives(torch.tensor([7, 8, 9])), weight_decay=weight_decay)
    users, positives, negatives = torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6]), torch.tensor([7, 8, 9])
    user, items = model.users.weight[users], model.items.weight
    margin = (user * items[positives]).sum(-1) - (user * items[negatives]).sum(-1)
    penalty = weight_decay * (user.pow(2).sum(-1) + items[positives].pow(2).sum(-1) + items[negatives].pow(2).sum(-1))
    expected = -F.logsigmoid(margin).mean() + penalty.mean()
    assert model(users, positives).item() == pytest.approx(expected.item(), rel=1e-5)


@pytest.mark.parametrize("model_name", ["bpr", "lightgcn"])
def test_forward_gives_a_loss_that_falls_as_positives_outscore_negatives_and_scores_every_item(model_name):
    train = random_matrix()
    sampler = NegativeSampler(train, torch.device("cpu"))
    torch.manual_seed(0)
    model = (BPR(50, 40, 8, sampler, weight_decay=1e-3) if model_name == "bpr"
             else LightGCN(train, 8, 2, sampler, torch.device("cpu"), weight_decay=1e-3))
    users, positives = torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6])
    loss = model(users, positives)
    assert loss.shape == () and loss.item() > 0
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    for _ in range(50):
        optimizer.zero_grad()
        model(users, positives).backward()
        optimizer.step()
    assert model(users, positives).item() < loss.item()
    assert model.score(torch.tensor([1, 2])).shape == (2, 40)
