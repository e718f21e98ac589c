"""Request-time fold-in: a user's vector or scores from their item codes, on the tables a served bundle holds.

Pure numpy and scipy, so that serving needs neither implicit nor the training code. Factor forms fold a history in
by least squares on the item factors (ALS exactly as implicit's `recalculate_user`; BPR and LightGCN with their own
lambda and alpha), by a few BPR gradient steps on fixed item factors, or, for LightGCN, by its forward pass for the
user as a new graph node. Item-item forms score the binary history times the item-item matrix (SAR), so each event
counts at once. Histories are binary, as in training: an item given twice counts once.
"""

from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields

import numpy as np
import scipy.sparse as sp
from scipy.special import expit

UNKNOWN_ITEM = 0  # data.UNKNOWN, the code of ids the run never read; not imported because data.py needs pandas
LEAST_SQUARES_METHODS = ("als", "least_squares")
METHODS = (*LEAST_SQUARES_METHODS, "gradient", "graph")


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


class LeastSquares:
    """p_u = (YᵀC_uY + λI)⁻¹ YᵀC_u x_u, with C_u = alpha on the user's items and 1 elsewhere and x_u binary:
    implicit 0.7.3's `recalculate_user` (an exact solve, not the CG steps its fit takes). YᵀY + λI is formed once
    per model, so a user costs |h|·d² for their items plus one d×d solve."""

    def __init__(self, items: np.ndarray, regularization: float, alpha: float):
        self.items = _table(items, "items")
        self.alpha = float(alpha)
        factors = self.items.astype(np.float64)
        self.gram = factors.T @ factors + regularization * np.eye(factors.shape[1])

    def users(self, histories: Sequence[np.ndarray]) -> np.ndarray:
        """One float32 row per history; an empty history gives zeros (b = 0), as in implicit."""
        codes = _histories(histories, len(self.items))
        size = self.gram.shape[0]
        lhs = np.repeat(self.gram[None], len(codes), axis=0)
        rhs = np.zeros((len(codes), size))
        for row, user_codes in enumerate(codes):
            if len(user_codes):
                liked = self.items[user_codes].astype(np.float64)
                lhs[row] += (self.alpha - 1) * (liked.T @ liked)
                rhs[row] = self.alpha * liked.sum(axis=0)
        try:
            solved = np.linalg.solve(lhs, rhs[..., None])[..., 0]
        except np.linalg.LinAlgError:
            raise ValueError("the fold-in system is singular: use a regularization above 0") from None
        return solved.astype(np.float32)


def gradient_steps(items: np.ndarray, histories: Sequence[np.ndarray], starts: np.ndarray | None = None, *,
                   steps: int, lr: float, weight_decay: float = 0.0, seed: int = 0) -> np.ndarray:
    """BPR on fixed item factors: per step, one uniform negative per liked item (redrawn once where it is liked, as
    training's sampler does), g = −mean(σ(−p·(q_i−q_j))(q_i−q_j)) + 2·weight_decay·p, p −= lr·g. Starts from
    `starts` (one row per history) or zero. Each user draws from their own generator seeded with `seed`, so a
    user's vector does not depend on who else is in the batch. An empty history keeps its start."""
    table = _table(items, "items")
    codes = _histories(histories, len(table))
    vectors = np.zeros((len(codes), table.shape[1])) if starts is None else \
        _rows(starts, (len(codes), table.shape[1]), "starts").astype(np.float64)
    for row, liked in enumerate(codes):
        if len(liked):
            vectors[row] = _bpr_steps(table, liked, vectors[row], steps, lr, weight_decay,
                                      np.random.default_rng(seed))
    return vectors.astype(np.float32)


def _bpr_steps(items: np.ndarray, liked: np.ndarray, vector: np.ndarray, steps: int, lr: float,
               weight_decay: float, generator: np.random.Generator) -> np.ndarray:
    positives = items[liked].astype(np.float64)
    negatives = generator.integers(1, len(items), (steps, len(liked)))  # real items only, as in training
    hit = _contains(liked, negatives)
    negatives[hit] = generator.integers(1, len(items), int(hit.sum()))  # every step's at once: a call costs 10 µs
    for step_negatives in negatives:
        difference = positives - items[step_negatives]
        weight = expit(-(difference @ vector))
        vector = vector - lr * (2 * weight_decay * vector - weight @ difference / len(liked))
    return vector


class GraphFoldIn:
    """LightGCN's forward pass for the user as a node added to the training graph, other nodes held fixed:
    e_u^(l) = Σ_{i∈N(u)} e_i^(l−1) / √(|N(u)|·d_i) and p_u = (e_u^(0) + Σ_{l=1..L} e_u^(l)) / (L+1). Every layer
    sums the same items with the same weights, so only the sum of the item tables of layers 0..L−1 is needed
    (`layer_sum`, n_items × d). For a trained user, given their layer-0 row and their training items, this is their
    trained embedding. An item without training edges counts as degree 1: the user is its only neighbour."""

    def __init__(self, layer_sum: np.ndarray, degree: np.ndarray, layers: int):
        self.layer_sum = _table(layer_sum, "layer_sum")
        degree = np.asarray(degree)
        if degree.shape != (len(self.layer_sum),):
            raise ValueError(f"degree must hold one count per item, shape ({len(self.layer_sum)},), got "
                             f"{degree.shape}")
        if layers < 1:
            raise ValueError(f"layers must be at least 1, got {layers}")
        self.inverse_sqrt_degree = 1 / np.sqrt(np.maximum(degree.astype(np.float64), 1))
        self.layers = layers

    def users(self, histories: Sequence[np.ndarray], egos: np.ndarray | None = None) -> np.ndarray:
        """One float32 row per history; `egos` are the users' layer-0 rows (zero for a user never trained on)."""
        codes = _histories(histories, len(self.layer_sum))
        size = self.layer_sum.shape[1]
        total = np.zeros((len(codes), size)) if egos is None else \
            _rows(egos, (len(codes), size), "egos").astype(np.float64)
        for row, user_codes in enumerate(codes):
            if len(user_codes):
                weights = self.inverse_sqrt_degree[user_codes] / np.sqrt(len(user_codes))
                total[row] += weights @ self.layer_sum[user_codes]
        return (total / (self.layers + 1)).astype(np.float32)


class FactorFoldIn:
    """A factor form's user vectors from histories by the bundle's `FoldIn`, with the per-model work done once."""

    def __init__(self, spec: FoldIn, items: np.ndarray, *, layer_sum: np.ndarray | None = None,
                 degree: np.ndarray | None = None):
        self.spec = spec
        self.items = _table(items, "items")
        if spec.method in LEAST_SQUARES_METHODS:
            self.solver = LeastSquares(self.items, spec.regularization, spec.alpha)
        elif spec.method == "graph":
            if layer_sum is None or degree is None:
                raise ValueError("graph fold-in needs the items' layer_sum and degree")
            self.solver = GraphFoldIn(layer_sum, degree, spec.layers)

    def users(self, histories: Sequence[np.ndarray], starts: np.ndarray | None = None) -> np.ndarray:
        """`starts`: per history the trained row (gradient: the user's vector; graph: their layer-0 row), zeros for
        a user never trained on. Least squares needs none and ignores them."""
        starts = starts if self.spec.from_trained else None
        if self.spec.method in LEAST_SQUARES_METHODS:
            return self.solver.users(histories)
        if self.spec.method == "graph":
            return self.solver.users(histories, starts)
        return gradient_steps(self.items, histories, starts, steps=self.spec.steps, lr=self.spec.lr,
                              weight_decay=self.spec.weight_decay, seed=self.spec.seed)


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
    merged = merged[merged != UNKNOWN_ITEM]
    return merged if max_length is None else merged[max(len(merged) - max_length, 0):]


def excluded_items(seen: np.ndarray, *events: np.ndarray) -> np.ndarray:
    """The sorted codes to set to -inf before top-k: the bundle's seen row, every event (uncapped) and the unknown
    item."""
    parts = [_codes(part, f"events[{index - 1}]" if index else "seen") for index, part in enumerate((seen, *events))]
    return np.unique(np.concatenate([[UNKNOWN_ITEM], *parts]))


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


def _rows(values, shape: tuple[int, int], name: str) -> np.ndarray:
    rows = np.asarray(values)
    if rows.shape != shape:
        raise ValueError(f"{name} must hold one row per history, shape {shape}, got {rows.shape}")
    return rows


def _contains(sorted_codes: np.ndarray, codes: np.ndarray) -> np.ndarray:
    found = np.searchsorted(sorted_codes, codes).clip(max=len(sorted_codes) - 1)
    return sorted_codes[found] == codes
