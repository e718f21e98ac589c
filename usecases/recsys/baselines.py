"""The simple baselines that learned recommenders must beat (Dacrema et al., RecSys 2019, found that most neural
models do not): popularity, item k-NN, EASE and ALS, each scoring every item for a batch of users on the device."""

from __future__ import annotations

import importlib.util

import numpy as np
import scipy.sparse as sp
import torch

from common.errors import UserError
from . import config as cfg
from .evaluate import rows_as_dense

DENSE_SIMILARITY_BYTES = 1 << 30
SIMILARITY_BLOCK_VALUES = 1 << 26
EASE_LIVE_MATRICES = 4  # the Gram matrix, its Cholesky factor, the inverse and the weights, alive at once
EASE_MEMORY_SHARE = 0.8  # of the device's free memory that EASE may plan to use
ITEMKNN_MAX_ITEMS = 200_000  # item x item similarities in blocks: the work grows with the square of the catalogue
COSINE_EPSILON = 1e-6  # RecBole's, keeps items without interactions from dividing by zero


class ModelUnavailable(UserError):
    """A model that cannot run here (a missing package, too large a catalogue): the pipeline skips it."""


class Popularity:

    def __init__(self, train: sp.csr_matrix, device: torch.device):
        counts = np.bincount(train.tocsr().indices, minlength=train.shape[1])
        self.counts = torch.from_numpy(counts.astype(np.float32)).to(device)

    def score(self, users: torch.Tensor) -> torch.Tensor:
        return self.counts.expand(len(users), -1)


class ItemKNN:
    """Item-based k-NN as RecBole's (cosine with shrinkage), computed a block of items at a time."""

    def __init__(self, train: sp.csr_matrix, config: cfg.ItemKNN, device: torch.device):
        n_items = train.shape[1]
        if n_items > ITEMKNN_MAX_ITEMS:
            raise ModelUnavailable(f"itemknn: {n_items:,} items is too many for its item x item similarities (at most "
                                   f"{ITEMKNN_MAX_ITEMS:,})")
        self.train, self.device = train.tocsr(), device
        item_users = self.train.T.tocsr()
        norms = torch.from_numpy(np.sqrt(np.diff(item_users.indptr)).astype(np.float32)).to(device)
        keep = min(config.neighbours, n_items)
        block = max(1, SIMILARITY_BLOCK_VALUES // n_items)
        targets, neighbours, values = [], [], []
        for first in range(0, n_items, block):
            items = torch.arange(first, min(first + block, n_items), device=device)
            overlap = torch.from_numpy((item_users[first:first + block] @ self.train).toarray()).to(device)
            similarity = overlap / (norms[items, None] * norms[None, :] + config.shrink + COSINE_EPSILON)
            similarity[torch.arange(len(items), device=device), items] = 0.0
            top_values, top_items = torch.topk(similarity, keep, dim=1)
            positive = top_values > 0
            targets.append(items[:, None].expand(-1, keep)[positive])
            neighbours.append(top_items[positive])
            values.append(top_values[positive])
        neighbour, target, value = torch.cat(neighbours), torch.cat(targets), torch.cat(values)
        if device.type == "cuda" and n_items**2 * 4 <= DENSE_SIMILARITY_BYTES:
            self.similarity = torch.zeros(n_items, n_items, device=device).index_put_((neighbour, target), value)
        else:
            self.similarity = sp.csr_matrix((value.cpu().numpy(), (neighbour.cpu().numpy(), target.cpu().numpy())),
                                            shape=(n_items, n_items))

    def score(self, users: torch.Tensor) -> torch.Tensor:
        return _history_times(self.train, users, self.similarity, self.device)

    def similarity_matrix(self) -> sp.csr_matrix:
        """W with score(u) = x_u W, on the CPU, for serving."""
        if isinstance(self.similarity, torch.Tensor):
            return sp.csr_matrix(self.similarity.cpu().numpy())
        return self.similarity


class EASE:
    """Steck's EASE (WWW 2019), in float32: λ keeps the system well conditioned, and on ml-latest-small every metric
    was float64's, in half the time and memory."""

    def __init__(self, train: sp.csr_matrix, config: cfg.EASE, device: torch.device):
        import psutil

        n_items = train.shape[1]
        needed = EASE_LIVE_MATRICES * n_items**2 * 4  # bytes at the fit's peak (float32)
        free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else psutil.virtual_memory().available
        if needed > EASE_MEMORY_SHARE * free:
            raise ModelUnavailable(f"ease: {n_items:,} items need {needed / 2**30:.1f} GB for its items x items "
                                   f"matrices on {device.type} ({free / 2**30:.1f} GB free); raise "
                                   "data.min_item_interactions to keep fewer items")
        self.train, self.device = train.tocsr(), device
        gram = torch.from_numpy((self.train.T @ self.train).toarray()).to(device, torch.float32)
        gram.diagonal().add_(config.l2)
        # G = L Lᵀ, then P = G⁻¹ from L (LAPACK's potri): n³ in all, where solving against the identity costs 2n³
        # (33 s against 52 s on one core of the 2-core machine in float64, for ml-latest-small's 9,724 items)
        precision = torch.cholesky_inverse(torch.linalg.cholesky(gram))
        del gram
        weights = precision / -precision.diagonal()[None, :]
        weights.diagonal().zero_()
        self.weights = weights.contiguous()  # LAPACK leaves it column-major: a copy per product

    def score(self, users: torch.Tensor) -> torch.Tensor:
        return _history_times(self.train, users, self.weights, self.device)

    def similarity_matrix(self, neighbours: int, max_bytes: float) -> torch.Tensor | sp.csr_matrix:
        """B for serving: whole within `max_bytes` (the evaluated model), else each column's `neighbours` largest."""
        if self.weights.numel() * self.weights.element_size() <= max_bytes:
            return self.weights.cpu()
        keep = min(neighbours, self.weights.shape[0])
        values, sources = torch.topk(self.weights, keep, dim=0)
        targets = torch.arange(self.weights.shape[1], device=self.weights.device).expand(keep, -1)
        return sp.csr_matrix((values.cpu().numpy().ravel(), (sources.cpu().numpy().ravel(),
                                                              targets.cpu().numpy().ravel())),
                             shape=self.weights.shape)


def als_available() -> bool:
    return importlib.util.find_spec("implicit") is not None


class ALS:
    """Implicit-feedback matrix factorisation (Hu, Koren and Volinsky 2008) by `implicit`, on the GPU if it can."""

    def __init__(self, train: sp.csr_matrix, config: cfg.ALS, device: torch.device, seed: int = 0):
        if not als_available():
            raise ModelUnavailable("als: the implicit package is not installed (pip install implicit)")
        import implicit.gpu
        from implicit.als import AlternatingLeastSquares
        from threadpoolctl import threadpool_limits

        use_gpu = device.type == "cuda" and implicit.gpu.HAS_CUDA
        with threadpool_limits(1, "blas"):  # implicit parallelises itself; threaded BLAS inside it only contends
            model = AlternatingLeastSquares(factors=config.factors, regularization=config.regularization,
                                            alpha=config.alpha, iterations=config.iterations, use_gpu=use_gpu,
                                            random_state=seed)
            model.fit(sp.csr_matrix(train, dtype=np.float32), show_progress=False)
        if use_gpu:
            model = model.to_cpu()
        self.user_factors = torch.from_numpy(np.asarray(model.user_factors)).to(device)
        self.item_factors = torch.from_numpy(np.asarray(model.item_factors)).to(device)

    def score(self, users: torch.Tensor) -> torch.Tensor:
        return self.user_factors[users] @ self.item_factors.T

    def factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.user_factors, self.item_factors


def _history_times(train: sp.csr_matrix, users: torch.Tensor, weights: torch.Tensor | sp.csr_matrix,
                   device: torch.device) -> torch.Tensor:
    """x_u W for a batch of users: dense on the GPU, scipy's sparse product on the CPU (several times faster)."""
    if device.type == "cuda" and isinstance(weights, torch.Tensor):
        return rows_as_dense(train, users, device) @ weights
    operand = weights.numpy() if isinstance(weights, torch.Tensor) else weights
    product = train[users.cpu().numpy()] @ operand
    return torch.from_numpy(product.toarray() if sp.issparse(product) else product).to(device)
