"""Request-time fold-in: users' vectors or scores from their histories, with numpy, scipy and torch only: least
squares on the item factors, a few BPR steps on them, LightGCN's forward pass, or the item-item product."""

import copy
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields

import numpy as np
import scipy.sparse as sp
import torch
from scipy.special import expit

from .ranking import UNKNOWN, binary_rows

LEAST_SQUARES_METHODS = ("als", "least_squares")
METHODS = (*LEAST_SQUARES_METHODS, "gradient", "graph")
CACHE_BYTES = 2**20  # a CPU block of padded histories: its gathered item rows at most this


@dataclass(frozen=True)
class FoldIn:
    """How a factor form folds a user's events in, stored in the bundle as `as_plain()`; gradient and graph start
    from the user's trained row when `from_trained` and there is one."""

    method: str
    regularization: float = 0.0
    alpha: float = 1.0
    steps: int = 0
    lr: float = 0.0
    weight_decay: float = 0.0
    seed: int = 0
    layers: int = 0
    from_trained: bool = True

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"fold-in method must be one of {', '.join(METHODS)}, got {self.method!r}")
        for name in ("regularization", "steps", "lr", "weight_decay", "layers"):
            if getattr(self, name) < 0:
                raise ValueError(f"fold-in {name} must be at least 0, got {getattr(self, name)}")
        if self.alpha <= 0:
            raise ValueError(f"fold-in alpha must be above 0, got {self.alpha}")
        if self.method == "gradient" and self.steps > 0 and self.lr == 0:
            raise ValueError("gradient fold-in with steps needs lr above 0")
        if self.method == "graph" and self.layers < 1:
            raise ValueError("graph fold-in needs layers of at least 1 (LightGCN's propagation layers)")

    def as_plain(self) -> dict:
        """Plain data, as the bundle codec stores it (NumPy scalars would need pickling)."""
        return {key: value.item() if isinstance(value, np.generic) else value for key, value in asdict(self).items()}

    @classmethod
    def from_plain(cls, stored: dict) -> "FoldIn":
        unknown = set(stored) - {field.name for field in fields(cls)}
        if unknown:
            raise ValueError(f"fold-in has unknown keys: {', '.join(sorted(map(str, unknown)))}")
        return cls(**stored)


class _Solver:
    """Tables as numpy arrays (one user: numpy's small arrays cost a fraction of torch's) or, after `to(device)`,
    tensors, one arithmetic for both; on a CPU in blocks whose gathered item rows stay in the cache."""

    start_name = "starts"  # what the method's `starts` are called in an error
    dtype = np.float64
    spec: FoldIn | None = None  # the bundle's (`factor_foldin`): `starts` are ignored unless `from_trained`

    def to(self, device: torch.device | str) -> "_Solver":
        moved = copy.copy(self)
        for name, value in vars(self).items():
            if isinstance(value, (np.ndarray, torch.Tensor)):
                setattr(moved, name, torch.as_tensor(value).to(device))
        return moved

    def users(self, histories: Sequence[np.ndarray], starts=None) -> np.ndarray:
        """`vectors` as numpy; `starts`: per history the trained row, zeros for a user never trained on."""
        rows = self._fold(histories, starts)
        return rows.cpu().numpy() if isinstance(rows, torch.Tensor) else rows

    def vectors(self, histories: Sequence[np.ndarray], starts=None) -> torch.Tensor:
        """One float32 row per history, a tensor where the tables are, from `starts` (zeros when None)."""
        return torch.as_tensor(self._fold(histories, starts))

    def _fold(self, histories: Sequence[np.ndarray], starts) -> np.ndarray | torch.Tensor:
        codes = _histories(histories, len(self.factors))
        shape = (len(codes), self.factors.shape[1])
        if starts is None or (self.spec is not None and not self.spec.from_trained):
            starts = np.zeros(shape)
        elif tuple(np.shape(starts)) != shape:  # a tensor's shape too
            raise ValueError(f"{self.start_name} must hold one row per history, shape {shape}, got "
                             f"{tuple(np.shape(starts))}")
        starts = self._like(starts)
        longest = max((len(row) for row in codes), default=0)
        on_cpu = not isinstance(self.factors, torch.Tensor) or self.factors.device.type == "cpu"
        row_bytes = np.dtype(self.dtype).itemsize * shape[1] * max(longest, 1)
        rows = max(1, CACHE_BYTES // row_bytes) if on_cpu else max(len(codes), 1)
        blocks = [self._block(codes[first:first + rows], starts[first:first + rows])
                  for first in range(0, len(codes), rows)] or [starts]
        if isinstance(starts, torch.Tensor):
            return torch.cat(blocks).float()
        return np.concatenate(blocks).astype(np.float32)

    def _block(self, codes: list[np.ndarray], starts):
        """The rows of one block of histories (sorted distinct codes), an array or a tensor as the tables are."""
        raise NotImplementedError

    def _like(self, values):
        """Values (numpy or torch) in the tables' dtype, where the tables are."""
        if isinstance(self.factors, torch.Tensor):
            return torch.as_tensor(values).to(self.factors.device, self.factors.dtype)
        return np.asarray(values.cpu() if isinstance(values, torch.Tensor) else values, self.dtype)

    def _padded(self, codes: list[np.ndarray]):
        """(B, L) item codes, each history's then zeros, where the tables are, and the mask of the real ones."""
        lengths = np.asarray([len(row) for row in codes], np.int64)
        real = np.arange(max(lengths.max(initial=0), 1)) < lengths[:, None]
        padded = np.zeros(real.shape, np.int64)
        padded[real] = np.concatenate([np.zeros(0, np.int64), *codes])
        if isinstance(self.factors, torch.Tensor):
            return torch.from_numpy(padded).to(self.factors.device), self._like(real)
        return padded, real.astype(self.dtype)


class LeastSquares(_Solver):
    """p_u = (YᵀC_uY + λI)⁻¹ YᵀC_u x_u: implicit 0.7.3's `recalculate_user`, exactly; `starts` are not used."""

    def __init__(self, items: np.ndarray, regularization: float, alpha: float):
        self.factors = _table(items, "items").astype(np.float64)
        self.alpha = float(alpha)
        self.gram = self.factors.T @ self.factors + regularization * np.eye(self.factors.shape[1])

    def _block(self, codes: list[np.ndarray], starts):
        items, real = self._padded(codes)
        liked = self.factors[items] * real[..., None]
        rhs = self.alpha * liked.sum(1)
        linalg = torch.linalg if isinstance(liked, torch.Tensor) else np.linalg
        try:
            if self.alpha == 1:
                return linalg.solve(self.gram, rhs.T).T
            return linalg.solve(self.gram + (self.alpha - 1) * (liked.swapaxes(1, 2) @ liked), rhs[..., None])[..., 0]
        except (np.linalg.LinAlgError, torch.linalg.LinAlgError):
            raise ValueError("the fold-in system is singular: use a regularization above 0") from None


class GradientSteps(_Solver):
    """BPR steps on fixed item factors from `starts`, each user's negatives from their own generator seeded with
    `seed` (a vector does not depend on the batch); in float32, which took a third of float64's time."""

    dtype = np.float32

    def __init__(self, items: np.ndarray, *, steps: int, lr: float, weight_decay: float = 0.0, seed: int = 0):
        self.factors = _table(items, "items").astype(np.float32)
        self.steps, self.lr, self.weight_decay, self.seed = steps, lr, weight_decay, seed

    def _block(self, codes: list[np.ndarray], starts):
        liked, real = self._padded(codes)
        negatives = self._negatives(codes, liked.shape[1])
        if isinstance(liked, torch.Tensor):
            negatives = torch.from_numpy(negatives).to(liked.device)
        positives = self.factors[liked]
        per_item = real / real.sum(1)[:, None].clip(min=1)  # the mean over each user's items
        decay = 1 - 2 * self.lr * self.weight_decay * real[:, :1]  # an empty history stays where it started
        vectors = starts
        for step in range(self.steps):
            difference = positives - self.factors[negatives[:, step]]
            margin = -(difference @ vectors[..., None])[..., 0]
            weight = (torch.sigmoid(margin) if isinstance(margin, torch.Tensor) else expit(margin)) * per_item
            vectors = vectors * decay + self.lr * (weight[:, None, :] @ difference)[:, 0]
        return vectors

    def _negatives(self, codes: list[np.ndarray], length: int) -> np.ndarray:
        """(B, steps, length) negatives, each user's drawn at once from their own generator; padding is item 1."""
        n_items = len(self.factors)
        padded = np.ones((len(codes), self.steps, length), np.int64)
        liked = np.zeros(n_items, bool)
        for row, items in enumerate(codes):
            if len(items):
                generator = np.random.default_rng(self.seed)
                drawn = generator.integers(1, n_items, (self.steps, len(items)))  # real items only, as training
                liked[items] = True
                hit = liked[drawn]
                liked[items] = False
                drawn[hit] = generator.integers(1, n_items, int(hit.sum()))
                padded[row, :, :len(items)] = drawn
        return padded


class GraphFoldIn(_Solver):
    """LightGCN's forward pass for the user as a node added to the training graph: every layer sums the same items
    with the same weights, so the sum of the item tables of layers 0..L−1 (`layer_sum`) is all it needs."""

    start_name = "egos"

    def __init__(self, layer_sum: np.ndarray, degree: np.ndarray, layers: int):
        self.factors = _table(layer_sum, "layer_sum").astype(np.float64)
        degree = np.asarray(degree)
        if degree.shape != (len(self.factors),):
            raise ValueError(f"degree must hold one count per item, shape ({len(self.factors)},), got {degree.shape}")
        if layers < 1:
            raise ValueError(f"layers must be at least 1, got {layers}")
        self.inverse_sqrt_degree = 1 / np.sqrt(np.maximum(degree.astype(np.float64), 1))
        self.layers = layers

    def _block(self, codes: list[np.ndarray], starts):
        items, real = self._padded(codes)
        weights = self.inverse_sqrt_degree[items] * real / real.sum(1)[:, None].clip(min=1) ** 0.5
        return (starts + (weights[:, None, :] @ self.factors[items])[:, 0]) / (self.layers + 1)


def factor_foldin(spec: FoldIn, items: np.ndarray, *, layer_sum: np.ndarray | None = None,
                  degree: np.ndarray | None = None) -> _Solver:
    """The solver of the bundle's `FoldIn`, with the per-model work done once."""
    items = _table(items, "items")
    if spec.method in LEAST_SQUARES_METHODS:
        solver: _Solver = LeastSquares(items, spec.regularization, spec.alpha)
    elif spec.method == "graph":
        if layer_sum is None or degree is None:
            raise ValueError("graph fold-in needs the items' layer_sum and degree")
        solver = GraphFoldIn(layer_sum, degree, spec.layers)
    else:
        solver = GradientSteps(items, steps=spec.steps, lr=spec.lr, weight_decay=spec.weight_decay, seed=spec.seed)
    solver.spec = spec
    return solver


def item_item_scores(similarity: np.ndarray | sp.spmatrix, histories: Sequence[np.ndarray]) -> np.ndarray:
    """x_u B for each binary history x_u, as float32 rows: B dense (EASE) or CSR (ItemKNN, pruned EASE)."""
    if similarity.ndim != 2 or similarity.shape[0] != similarity.shape[1]:
        raise ValueError(f"the item-item matrix must be square, got shape {similarity.shape}")
    product = binary_rows(_histories(histories, similarity.shape[0]), similarity.shape[0]) @ similarity
    return np.asarray(product.toarray() if sp.issparse(product) else product, dtype=np.float32)


def merged_history(known: np.ndarray, *events: np.ndarray, max_length: int | None = None) -> np.ndarray:
    """The user's item codes, newest last (an item seen again at its latest place), the newest `max_length`."""
    if max_length is not None and max_length < 0:
        raise ValueError(f"max_length must be at least 0, got {max_length}")
    codes = np.concatenate([_codes(part, f"events[{index - 1}]" if index else "known")
                            for index, part in enumerate((known, *events))])
    latest = len(codes) - 1 - np.unique(codes[::-1], return_index=True)[1]
    merged = codes[np.sort(latest)]
    merged = merged[merged != UNKNOWN]
    return merged if max_length is None else merged[max(len(merged) - max_length, 0):]


def excluded_items(seen: np.ndarray, *events: np.ndarray) -> np.ndarray:
    """The sorted codes never recommended: the seen row, every event (uncapped) and the unknown item."""
    parts = [_codes(part, f"events[{index - 1}]" if index else "seen") for index, part in enumerate((seen, *events))]
    return np.unique(np.concatenate([[UNKNOWN], *parts]))


def _codes(values, where: str) -> np.ndarray:
    codes = np.asarray(values)
    if codes.ndim != 1:
        raise ValueError(f"{where}: item codes must be a 1-D array, got shape {codes.shape}")
    if codes.size and not np.issubdtype(codes.dtype, np.integer):
        raise ValueError(f"{where}: item codes must be integers, got {codes.dtype}")
    return codes.astype(np.int64, copy=False)


def _histories(histories: Sequence[np.ndarray], n_items: int) -> list[np.ndarray]:
    """Each history's distinct codes, sorted, checked against the catalogue."""
    if isinstance(histories, np.ndarray) and histories.ndim < 2 and histories.dtype != object:
        raise ValueError("histories must be a list of item-code arrays, one per user, not one array")
    result = []
    for index, history in enumerate(histories):
        codes = np.unique(_codes(history, f"history {index}"))
        if codes.size and (codes[0] < 0 or codes[-1] >= n_items):
            bad = codes[0] if codes[0] < 0 else codes[-1]
            raise ValueError(f"history {index}: item code {bad} is outside 0..{n_items - 1}")
        result.append(codes)
    return result


def _table(values, name: str) -> np.ndarray:
    table = np.asarray(values)
    if table.ndim != 2 or not np.issubdtype(table.dtype, np.floating):
        raise ValueError(f"{name} must be a 2-D float array (items × factors), got {table.dtype} of shape "
                         f"{table.shape}")
    return table
