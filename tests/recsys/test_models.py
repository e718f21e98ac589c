"""The learned models' parts: negative sampling, the normalised graph and its product, the loss, a training step
without a host synchronisation."""

import numpy as np
import pytest
import scipy.sparse as sp
import torch

import torch.nn.functional as F

from common.runtime.devices import Runtime
from common.training.loop import make_optimizer
from common.training.workload import steady_step_syncs
from usecases.recsys.models import BPR, LightGCN, NegativeSampler, normalised_adjacency, propagate


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


def test_the_graph_product_and_its_gradient_are_the_sparse_products_of_torch():
    """LightGCN's propagation multiplies by the symmetric adjacency in CSR, forward and backward."""
    adjacency = normalised_adjacency(random_matrix())
    layer = torch.randn(adjacency.shape[0], 4, requires_grad=True)
    weights = torch.randn(adjacency.shape[0], 4)
    (propagate(adjacency, propagate(adjacency, layer)) * weights).sum().backward()
    reference = layer.detach().clone().requires_grad_()
    dense = adjacency.to_dense()
    (dense @ (dense @ reference) * weights).sum().backward()
    assert torch.allclose(layer.grad, reference.grad, atol=1e-5)


@pytest.mark.parametrize("model_name", ["bpr", "lightgcn"])
def test_a_training_step_never_waits_for_the_device(model_name):
    """Forward, backward and the fused optimiser's step queue every operator without reading a value back (the
    sampler's resampling included), so that on a GPU the host runs ahead of the kernels."""
    train = random_matrix()
    cpu = torch.device("cpu")
    sampler = NegativeSampler(train, cpu)
    model = (BPR(50, 40, 8, sampler, weight_decay=1e-3) if model_name == "bpr"
             else LightGCN(train, 8, 2, sampler, cpu, weight_decay=1e-3))
    optimizer = make_optimizer("adam", model.parameters(), Runtime(cpu, None), lr=0.01)
    users, positives = torch.from_numpy(train.nonzero()[0]).long(), torch.from_numpy(train.nonzero()[1]).long()
    syncs = steady_step_syncs(lambda: model(users, positives), optimizer)
    assert syncs.count == 0, syncs.by_name


def test_the_positives_table_and_the_sorted_keys_find_the_same_positives(monkeypatch):
    from usecases.recsys import models

    train = random_matrix()
    users, items = torch.from_numpy(np.repeat(np.arange(50), 40)), torch.from_numpy(np.tile(np.arange(40), 50))
    expected = torch.from_numpy(train.toarray().ravel() > 0)
    in_table = NegativeSampler(train, torch.device("cpu"))
    monkeypatch.setattr(models, "DENSE_POSITIVES_BYTES", 10)  # too small a budget: the binary search
    searched = NegativeSampler(train, torch.device("cpu"))
    assert in_table.table is not None and searched.table is None
    for sampler in (in_table, searched):
        assert torch.equal(sampler._is_positive(users, items), expected)
