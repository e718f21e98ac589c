"""The learned models, BPR matrix factorisation and LightGCN, trained with the BPR loss on sampled negatives; both
score a user against every item with one matrix product of embeddings."""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np
import scipy.sparse as sp
import torch
import torch.nn.functional as F
from torch import nn

from .ranking import csr_tensor

INIT_STD = 0.1
DENSE_POSITIVES_BYTES = 256 * 2**20  # a users x items table of booleans up to this size; else sorted keys


class NegativeSampler:
    """Uniform negatives over the real items, resampled where they hit a positive, looked up on the device in a
    table of one boolean per pair where it fits (a tenth of the binary search's time), else among sorted keys."""

    def __init__(self, train: sp.csr_matrix, device: torch.device):
        train = train if train.has_sorted_indices else train.sorted_indices()
        keys = np.repeat(np.arange(train.shape[0], dtype=np.int64), np.diff(train.indptr))
        keys *= train.shape[1]
        keys += train.indices  # row by row, items in order: already sorted
        self.keys = torch.from_numpy(keys).to(device)
        self.table = None
        if train.shape[0] * train.shape[1] <= DENSE_POSITIVES_BYTES:
            self.table = torch.zeros(train.shape[0] * train.shape[1], dtype=torch.bool, device=device)
            self.table[self.keys] = True
        self.n_items = train.shape[1]

    def _is_positive(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        keys = users * self.n_items + items
        if self.table is not None:
            return torch.take(self.table, keys)
        found = torch.searchsorted(self.keys, keys).clamp(max=len(self.keys) - 1)
        return self.keys[found] == keys

    def __call__(self, users: torch.Tensor) -> torch.Tensor:
        """One retry, drawn for the whole batch: no branch on the device's values."""
        negatives = torch.randint(1, self.n_items, users.shape, device=users.device)
        hit = self._is_positive(users, negatives)
        return torch.where(hit, torch.randint(1, self.n_items, users.shape, device=users.device), negatives)


class PairwiseRanker(nn.Module, ABC):
    """The batch's BPR loss against sampled negatives: the common loop's step is a forward pass."""

    def __init__(self, sampler: NegativeSampler, weight_decay: float):
        super().__init__()
        self.sampler, self.weight_decay = sampler, weight_decay

    @abstractmethod
    def embeddings(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The user and item tables that scores come from."""

    @abstractmethod
    def rows(self, users: torch.Tensor, items: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The scoring embeddings of a batch's users and items."""

    @abstractmethod
    def ego(self, users: torch.Tensor, items: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The trainable rows behind a batch, for the L2 penalty."""

    def forward(self, users: torch.Tensor, positives: torch.Tensor) -> torch.Tensor:
        """-log sigmoid(margin) plus the rows' L2 penalty (per row, as RecBole), averaged."""
        pair = torch.stack([positives, self.sampler(users)])
        user, items = self.rows(users, pair)
        margin = (user * items[0]).sum(-1) - (user * items[1]).sum(-1)
        loss = -F.logsigmoid(margin.float()).mean()
        if self.weight_decay == 0:
            return loss
        ego_user, ego_items = self.ego(users, pair)
        penalty = self.weight_decay * (ego_user.pow(2).sum(-1) + ego_items.pow(2).sum(-1).sum(0))
        return loss + penalty.float().mean()

    @torch.no_grad()
    def score(self, users: torch.Tensor) -> torch.Tensor:
        user_table, item_table = self.embeddings()
        return user_table[users].float() @ item_table.float().T


class BPR(PairwiseRanker):
    """Matrix factorisation trained with Bayesian personalised ranking (Rendle et al. 2009)."""

    def __init__(self, n_users: int, n_items: int, dim: int, sampler: NegativeSampler, weight_decay: float = 0.0):
        super().__init__(sampler, weight_decay)
        self.users, self.items = nn.Embedding(n_users, dim), nn.Embedding(n_items, dim)
        nn.init.normal_(self.users.weight, std=INIT_STD)
        nn.init.normal_(self.items.weight, std=INIT_STD)

    def embeddings(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.users.weight, self.items.weight

    def rows(self, users: torch.Tensor, items: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.users(users), self.items(items)

    ego = rows


def normalised_adjacency(train: sp.csr_matrix) -> torch.Tensor:
    """D^-1/2 A D^-1/2 of the user-item graph as a sparse CSR tensor (a quarter of COO's product time on a CPU)."""
    adjacency = sp.bmat([[None, train], [train.T, None]], format="csr").astype(np.float32)
    degree = np.asarray(adjacency.sum(axis=1)).ravel()
    inverse_sqrt = np.divide(1.0, np.sqrt(degree), out=np.zeros_like(degree), where=degree > 0)
    return csr_tensor(sp.csr_matrix(sp.diags(inverse_sqrt) @ adjacency @ sp.diags(inverse_sqrt), dtype=np.float32))


class _SymmetricProduct(torch.autograd.Function):
    """A @ X for a symmetric sparse A, whose gradient is A @ G (torch's own backward transposes A: 3x slower)."""

    @staticmethod
    def forward(ctx, adjacency: torch.Tensor, layer: torch.Tensor) -> torch.Tensor:
        ctx.adjacency = adjacency
        return torch.sparse.mm(adjacency, layer)

    @staticmethod
    def backward(ctx, gradient: torch.Tensor) -> tuple[None, torch.Tensor]:
        return None, torch.sparse.mm(ctx.adjacency, gradient)


propagate = _SymmetricProduct.apply  # one LightGCN layer: the normalised adjacency times the embeddings


class LightGCN(PairwiseRanker):
    """LightGCN (He et al. 2020): embeddings smoothed over the interaction graph, the layers averaged."""

    def __init__(self, train: sp.csr_matrix, dim: int, layers: int, sampler: NegativeSampler,
                 device: torch.device, weight_decay: float = 0.0):
        super().__init__(sampler, weight_decay)
        self.n_users = train.shape[0]
        self.layers = layers
        self.ego_embeddings = nn.Embedding(train.shape[0] + train.shape[1], dim)
        nn.init.normal_(self.ego_embeddings.weight, std=INIT_STD)
        # A plain attribute, not a buffer: the same graph on every rank, which DDP could not broadcast (sparse).
        self.adjacency = normalised_adjacency(train).to(device)

    def embeddings(self) -> tuple[torch.Tensor, torch.Tensor]:
        layer = self.ego_embeddings.weight
        total = layer
        with torch.autocast(layer.device.type, enabled=False):
            for _ in range(self.layers):
                layer = propagate(self.adjacency, layer.float())
                total = total + layer
        final = total / (self.layers + 1)
        return final[: self.n_users], final[self.n_users :]

    def rows(self, users: torch.Tensor, items: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        user_table, item_table = self.embeddings()
        return user_table[users], item_table[items]

    @torch.no_grad()
    def foldin_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The users' layer-0 rows and the items' rows summed over layers 0..L-1 (`foldin.GraphFoldIn`)."""
        layer = self.ego_embeddings.weight.detach().float()
        total = torch.zeros_like(layer)
        for _ in range(self.layers):
            total += layer
            layer = propagate(self.adjacency, layer)
        return self.ego_embeddings.weight[: self.n_users].detach().float(), total[self.n_users :]

    def ego(self, users: torch.Tensor, items: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ego_embeddings(users), self.ego_embeddings(items + self.n_users)
