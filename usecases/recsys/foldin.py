"""Request-time fold-in: users' vectors or scores from their item codes, on the tables a served bundle holds.

numpy, scipy and torch only, so that serving needs neither implicit nor the training code. Factor forms fold a
history in by least squares on the item factors (ALS exactly as implicit's `recalculate_user`; BPR and LightGCN with
their own lambda and alpha), by a few BPR gradient steps on fixed item factors, or, for LightGCN, by its forward pass
for the user as a new graph node. A batch of histories is folded in at once, padded to its longest with a mask, on
the device the tables are on: a replay's thousand requests or a GPU server's micro-batch is a few tensor operations,
and one user's request the same operations on a batch of one. Item-item forms score the binary history times the
item-item matrix (SAR), so each event counts at once. Histories are binary, as in training: an item given twice
counts once.
"""

import copy
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields

import numpy as np
import scipy.sparse as sp
import torch
from scipy.special import expit

from .ranking import UNKNOWN

LEAST_SQUARES_METHODS = ("als", "least_squares")
METHODS = (*LEAST_SQUARES_METHODS, "gradient", "graph")
CACHE_BYTES = 2**20  # a CPU block of padded histories: its gathered item rows at most this


@dataclass(frozen=True)
class FoldIn:
    """How a factor form folds a user's events in, and with what; stored in the bundle as `as_plain()`.

    als, least_squares: `regularization` (lambda) and `alpha` (confidence on observed items, 1 elsewhere).
    gradient: `steps` of BPR with `lr` and `weight_decay` (as in training), negatives drawn with `seed`.
    graph: LightGCN's `layers`. gradient and graph start from the user's trained row when `from_trained` and the
    caller has one, else from zero.
    """

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
        """Plain data the bundle codec stores (NumPy scalars would need pickling)."""
        return {key: value.item() if isinstance(value, np.generic) else value for key, value in asdict(self).items()}

    @classmethod
    def from_plain(cls, stored: dict) -> "FoldIn":
        unknown = set(stored) - {field.name for field in fields(cls)}
        if unknown:
            raise ValueError(f"fold-in has unknown keys: {', '.join(sorted(map(str, unknown)))}")
        return cls(**stored)


class _Solver:
    """What the fold-in methods share: tables of the method's `dtype`, as numpy arrays (a server's one-user request:
    numpy's small arrays cost a fraction of torch's per operation) or, after `to(device)`, as tensors on that device
    (a batch: a replay's chunk, a GPU server's micro-batch); each method's arithmetic is written once for both. A
    batch of histories is padded to its longest with a mask. On a CPU it goes through in blocks whose gathered item
    rows stay in the cache (`CACHE_BYTES`): a thousand padded histories at once wait on memory, and ran slower than
    one at a time."""

    start_name = "starts"  # what the method's `starts` are called in an error
    dtype = np.float64

    def to(self, device: torch.device | str) -> "_Solver":
        moved = copy.copy(self)
        for name, value in vars(self).items():
            if isinstance(value, (np.ndarray, torch.Tensor)):
                setattr(moved, name, torch.as_tensor(value).to(device))
        return moved

    def users(self, histories: Sequence[np.ndarray], starts=None) -> np.ndarray:
        """One float32 row per history (see `vectors`), as numpy."""
        rows = self._fold(histories, starts)
        return rows.cpu().numpy() if isinstance(rows, torch.Tensor) else rows

    def vectors(self, histories: Sequence[np.ndarray], starts=None) -> torch.Tensor:
        """One float32 row per history, a tensor where the tables are, from `starts` (one row per history, as the
        method takes them; zeros when None)."""
        return torch.as_tensor(self._fold(histories, starts))

    def _fold(self, histories: Sequence[np.ndarray], starts) -> np.ndarray | torch.Tensor:
        codes = _histories(histories, len(self.factors))
        size = self.factors.shape[1]
        starts = np.zeros((len(codes), size)) if starts is None else _rows(starts, (len(codes), size),
                                                                            self.start_name)
        starts = self._like(starts)
        longest = max((len(row) for row in codes), default=0)
        on_cpu = not isinstance(self.factors, torch.Tensor) or self.factors.device.type == "cpu"
        row_bytes = np.dtype(self.dtype).itemsize * size * max(longest, 1)
        rows = max(1, CACHE_BYTES // row_bytes) if on_cpu else max(len(codes), 1)
        blocks = [self._block(codes[first:first + rows], starts[first:first + rows])
                  for first in range(0, len(codes), rows)] or [starts]
        if isinstance(starts, torch.Tensor):
            return torch.cat(blocks).float()
        return np.concatenate(blocks).astype(np.float32)

    def _block(self, codes: list[np.ndarray], starts):
        """The rows of one block of histories (sorted distinct codes) in the tables' dtype, an array or a tensor as
        the tables are."""
        raise NotImplementedError

    def _like(self, values):
        """Values (numpy or torch) in the tables' dtype, where the tables are: a numpy array, or a tensor on their
        device."""
        if isinstance(self.factors, torch.Tensor):
            return torch.as_tensor(values).to(self.factors.device, self.factors.dtype)
        return np.asarray(values.cpu() if isinstance(values, torch.Tensor) else values, self.dtype)

    def _padded(self, codes: list[np.ndarray]):
        """(B, L) item codes, each history's sorted codes then zeros (int64, where the tables are), and the mask of
        the real ones (in the tables' dtype)."""
        lengths = np.asarray([len(row) for row in codes], np.int64)
        real = np.arange(max(lengths.max(initial=0), 1)) < lengths[:, None]
        padded = np.zeros(real.shape, np.int64)
        padded[real] = np.concatenate([np.zeros(0, np.int64), *codes])
        if isinstance(self.factors, torch.Tensor):
            return torch.from_numpy(padded).to(self.factors.device), self._like(real)
        return padded, real.astype(self.dtype)


def _sigmoid(values):
    return torch.sigmoid(values) if isinstance(values, torch.Tensor) else expit(values)


class LeastSquares(_Solver):
    """p_u = (YᵀC_uY + λI)⁻¹ YᵀC_u x_u, with C_u = alpha on the user's items and 1 elsewhere and x_u binary:
    implicit 0.7.3's `recalculate_user` (an exact solve, not the CG steps its fit takes). YᵀY + λI is formed once
    per model, so a user costs |h|·d² for their items plus one d×d solve (one solve for the whole batch where
    alpha is 1: every user's system is then YᵀY + λI). An empty history gives zeros (b = 0), as in implicit;
    `starts` are not used."""

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
    """BPR on fixed item factors: per step, one uniform negative per liked item (redrawn once where it is liked, as
    training's sampler does), g = −mean(σ(−p·(q_i−q_j))(q_i−q_j)) + 2·weight_decay·p, p −= lr·g, from `starts`
    (the users' trained vectors) or zero; an empty history keeps its start. Each user's negatives come from their
    own generator seeded with `seed`, so a user's vector does not depend on who else is in the batch. In float32,
    the item factors' own precision: the steps wait on memory, and took 3.5 times as long in float64."""

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
            weight = _sigmoid(-(difference @ vectors[..., None])[..., 0]) * per_item
            vectors = vectors * decay + self.lr * (weight[:, None, :] @ difference)[:, 0]
        return vectors

    def _negatives(self, codes: list[np.ndarray], length: int) -> np.ndarray:
        """(B, steps, length) negatives, each user's drawn at once from their own generator (a call costs 10 µs);
        padding draws item 1, weighted 0."""
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
    """LightGCN's forward pass for the user as a node added to the training graph, other nodes held fixed:
    e_u^(l) = Σ_{i∈N(u)} e_i^(l−1) / √(|N(u)|·d_i) and p_u = (e_u^(0) + Σ_{l=1..L} e_u^(l)) / (L+1). Every layer
    sums the same items with the same weights, so only the sum of the item tables of layers 0..L−1 is needed
    (`layer_sum`, n_items × d). For a trained user, given their layer-0 row (`starts`: `egos`, zero for a user never
    trained on) and their training items, this is their trained embedding. An item without training edges counts
    as degree 1: the user is its only neighbour."""

    start_name = "egos"

    def __init__(self, layer_sum: np.ndarray, degree: np.ndarray, layers: int):
        self.factors = _table(layer_sum, "layer_sum").astype(np.float64)
        degree = np.asarray(degree)
        if degree.shape != (len(self.factors),):
            raise ValueError(f"degree must hold one count per item, shape ({len(self.factors)},), got "
                             f"{degree.shape}")
        if layers < 1:
            raise ValueError(f"layers must be at least 1, got {layers}")
        self.inverse_sqrt_degree = 1 / np.sqrt(np.maximum(degree.astype(np.float64), 1))
        self.layers = layers

    def _block(self, codes: list[np.ndarray], starts):
        items, real = self._padded(codes)
        weights = self.inverse_sqrt_degree[items] * real / real.sum(1)[:, None].clip(min=1) ** 0.5
        return (starts + (weights[:, None, :] @ self.factors[items])[:, 0]) / (self.layers + 1)


class FactorFoldIn:
    """A factor form's user vectors from histories by the bundle's `FoldIn`, with the per-model work done once."""

    def __init__(self, spec: FoldIn, items: np.ndarray, *, layer_sum: np.ndarray | None = None,
                 degree: np.ndarray | None = None):
        self.spec = spec
        items = _table(items, "items")
        if spec.method in LEAST_SQUARES_METHODS:
            self.solver: _Solver = LeastSquares(items, spec.regularization, spec.alpha)
        elif spec.method == "graph":
            if layer_sum is None or degree is None:
                raise ValueError("graph fold-in needs the items' layer_sum and degree")
            self.solver = GraphFoldIn(layer_sum, degree, spec.layers)
        else:
            self.solver = GradientSteps(items, steps=spec.steps, lr=spec.lr, weight_decay=spec.weight_decay,
                                        seed=spec.seed)

    def to(self, device: torch.device | str) -> "FactorFoldIn":
        moved = copy.copy(self)
        moved.solver = self.solver.to(device)
        return moved

    def users(self, histories: Sequence[np.ndarray], starts=None) -> np.ndarray:
        """`starts`: per history the trained row (gradient: the user's vector; graph: their layer-0 row), zeros for
        a user never trained on. Least squares needs none and ignores them. Float32 rows, as numpy."""
        return self.solver.users(histories, starts if self.spec.from_trained else None)

    def vectors(self, histories: Sequence[np.ndarray], starts=None) -> torch.Tensor:
        """`users` as a tensor where the fold-in's tables are (`to`)."""
        return self.solver.vectors(histories, starts if self.spec.from_trained else None)


def item_item_scores(similarity: np.ndarray | sp.spmatrix, histories: Sequence[np.ndarray]) -> np.ndarray:
    """x_u B for each binary history x_u, as float32 rows: B dense (EASE) or CSR (ItemKNN, pruned EASE)."""
    if similarity.ndim != 2 or similarity.shape[0] != similarity.shape[1]:
        raise ValueError(f"the item-item matrix must be square, got shape {similarity.shape}")
    n_items = similarity.shape[0]
    codes = _histories(histories, n_items)
    lengths = [len(user_codes) for user_codes in codes]
    indptr = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    indices = np.concatenate([np.zeros(0, np.int64), *codes])
    rows = sp.csr_matrix((np.ones(len(indices), np.float32), indices, indptr), shape=(len(codes), n_items))
    product = rows @ similarity
    return np.asarray(product.toarray() if sp.issparse(product) else product, dtype=np.float32)


def merged_history(known: np.ndarray, *events: np.ndarray, max_length: int | None = None) -> np.ndarray:
    """The user's item codes for fold-in, newest last: the bundle's row (unordered, so it comes first), then each
    source of events, oldest first. An item seen again moves to its latest place; the unknown item is dropped; the
    newest `max_length` are kept."""
    if max_length is not None and max_length < 0:
        raise ValueError(f"max_length must be at least 0, got {max_length}")
    codes = np.concatenate([_codes(part, f"events[{index - 1}]" if index else "known")
                            for index, part in enumerate((known, *events))])
    latest = len(codes) - 1 - np.unique(codes[::-1], return_index=True)[1]
    merged = codes[np.sort(latest)]
    merged = merged[merged != UNKNOWN]
    return merged if max_length is None else merged[max(len(merged) - max_length, 0):]


def excluded_items(seen: np.ndarray, *events: np.ndarray) -> np.ndarray:
    """The sorted codes to set to -inf before top-k: the bundle's seen row, every event (uncapped) and the unknown
    item."""
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


def _rows(values, shape: tuple[int, int], name: str):
    if tuple(values.shape if isinstance(values, torch.Tensor) else np.shape(values)) != shape:
        raise ValueError(f"{name} must hold one row per history, shape {shape}, got "
                         f"{tuple(np.shape(values) if not isinstance(values, torch.Tensor) else values.shape)}")
    return values
