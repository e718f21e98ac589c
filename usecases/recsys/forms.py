"""The four served forms behind one interface, none needing training code: factors (bpr, lightgcn, als), item-item
(itemknn, ease; scores x·B, linear in the binary history x, which both its paths use), a sequence network (sasrec)
and popularity (pop); exclusions, retrieval and top-k are the `Recommender`'s (`serving.py`)."""

from __future__ import annotations

import functools

import numpy as np
import scipy.sparse as sp
import torch

from common.errors import UserError
from .foldin import FoldIn, factor_foldin, item_item_scores, merged_history
from .ranking import UNKNOWN, binary_rows, csr_tensor, row_codes
from .sequence import SequenceScorer

KNOWN_CACHE_BYTES = 64 * 2**20  # item-item scores of the known histories of the last users served


class ServedForm:
    """Popularity alone, and what every form shares; users without rows of their own (`cold`) get popularity."""

    kind = "popularity"

    def __init__(self, bundle: dict):
        self.history: sp.csr_matrix = bundle["history"]
        self.seen: sp.csr_matrix = bundle["seen"]
        self.popularity = torch.as_tensor(bundle["popularity"], dtype=torch.float32)
        self.max_events = int(bundle.get("max_events", 200))
        self.has_rows = np.asarray(self._rows_of_own(bundle), bool)
        self.cold = ~torch.as_tensor(self.has_rows)
        self.cold[UNKNOWN] = True
        self.device = torch.device("cpu")
        self._on_device: dict[str, torch.Tensor] = {}

    def _rows_of_own(self, bundle: dict):
        return np.diff(self.history.indptr) > 0

    @property
    def n_items(self) -> int:
        return self.history.shape[1]

    def to(self, device: torch.device) -> ServedForm:
        self.device, self._on_device = device, {}
        return self

    def table(self, name: str, make):
        """A table (or the fold-in's tables) moved to the device once."""
        if name not in self._on_device:
            self._on_device[name] = make().to(self.device)
        return self._on_device[name]

    def raw_scores(self, users: np.ndarray) -> torch.Tensor:
        """(B, n_items) scores on the CPU for users without events, cold users not yet set."""
        return self.popularity.expand(len(users), -1).clone()

    def user_scores(self, user: int, events: np.ndarray) -> np.ndarray | None:
        """Every item's score for one user with fresh events (oldest first); None: served as without them."""
        return self.popularity.numpy().copy()

    def batch_scores(self, users: np.ndarray, events: list[np.ndarray], fresh: np.ndarray) \
            -> tuple[torch.Tensor, np.ndarray]:
        """Every item's score per row on the device, and the rows served popularity instead."""
        return torch.empty(len(users), self.n_items, device=self.device), np.ones(len(users), bool)

    def item_vectors(self) -> np.ndarray:
        raise UserError(f"a {self.kind} model has no item vectors to index (serving.retrieval applies to factor "
                        f"and sequence models)")

    def query(self, user: int, events: np.ndarray) -> np.ndarray | None:
        """The user's vector with their events, as two-stage serving retrieves by it (None: popularity)."""
        raise UserError(f"a {self.kind} model has no query vectors (it has no item vectors)")

    def query_vectors(self, users: np.ndarray) -> np.ndarray:
        raise UserError(f"a {self.kind} model has no query vectors (it has no item vectors)")


class FactorForm(ServedForm):
    """User and item factors; a user's events fold into a vector (`foldin.py`) where the bundle says how."""

    kind = "factors"

    def __init__(self, bundle: dict):
        self.users, self.items = bundle["users"], bundle["items"]
        super().__init__(bundle)
        self.foldin, self.starts = None, None
        if bundle.get("foldin") is not None:
            spec = FoldIn.from_plain(bundle["foldin"])
            self.foldin = factor_foldin(spec, as_numpy(self.items), layer_sum=as_numpy(bundle.get("layer_sum")),
                                        degree=as_numpy(bundle.get("degree")))
            self.starts = as_numpy(bundle["egos"] if spec.method == "graph" else self.users)
            self._fold_in_known_histories()
        self.item_table = np.ascontiguousarray(as_numpy(self.items))

    def _rows_of_own(self, bundle: dict):
        return bundle["trained"]  # trained rows, where a fold-in starts (else from zero)

    def _fold_in_known_histories(self) -> None:
        """Users with a history but no trained rows get the vector it folds into from zero, once here."""
        untrained = np.flatnonzero(self.cold.numpy() & (np.diff(self.history.indptr) > 0))
        untrained = untrained[untrained != UNKNOWN]
        if not len(untrained):
            return
        histories = [merged_history(row_codes(self.history, user), max_length=self.max_events) for user in untrained]
        users = torch.as_tensor(self.users).clone()
        users[torch.from_numpy(untrained)] = torch.from_numpy(self.foldin.users(histories)).to(users.dtype)
        self.users = users
        self.cold[torch.from_numpy(untrained)] = False

    def raw_scores(self, users: np.ndarray) -> torch.Tensor:
        return self.users[torch.from_numpy(users)] @ self.items.T

    def user_scores(self, user: int, events: np.ndarray) -> np.ndarray | None:
        return None if self.foldin is None else self.item_table @ self.query(user, events)  # None: trained rows

    def batch_scores(self, users: np.ndarray, events: list[np.ndarray], fresh: np.ndarray) \
            -> tuple[torch.Tensor, np.ndarray]:
        vectors = self.table("users", lambda: torch.as_tensor(self.users))[torch.from_numpy(users).to(self.device)]
        folded = np.flatnonzero(fresh) if self.foldin is not None else np.zeros(0, np.int64)
        if len(folded):
            histories = [merged_history(row_codes(self.history, users[index]), events[index],
                                        max_length=self.max_events) for index in folded]
            starts = np.where(self.has_rows[users[folded], None], self.starts[users[folded]], 0.0)
            # numpy's tables on a CPU (its small arrays cost less per operation than torch's), else the device's
            foldin = self.foldin if self.device.type == "cpu" else self.table("foldin", lambda: self.foldin)
            vectors[torch.from_numpy(folded).to(self.device)] = \
                foldin.vectors(histories, starts).to(self.device, vectors.dtype)
        popular = self.cold.numpy()[users].copy()
        popular[folded] = False
        return vectors @ self.table("items", lambda: torch.as_tensor(self.items)).T, popular

    def item_vectors(self) -> np.ndarray:
        return self.item_table

    def query(self, user: int, events: np.ndarray) -> np.ndarray | None:
        if (events != UNKNOWN).any() and self.foldin is not None:
            history = merged_history(row_codes(self.history, user), events, max_length=self.max_events)
            start = self.starts[user:user + 1] if self.has_rows[user] else np.zeros((1, self.starts.shape[1]))
            return np.asarray(self.foldin.users([history], start)[0], np.float32)
        return None if self.cold[user] else np.asarray(as_numpy(self.users)[user], np.float32)

    def query_vectors(self, users: np.ndarray) -> np.ndarray:
        """The users' vectors, and with a fold-in then those their histories fold into from zero."""
        vectors = np.ascontiguousarray(as_numpy(self.users)[users], np.float32)
        if self.foldin is None:
            return vectors
        histories = [merged_history(row_codes(self.history, user), max_length=self.max_events) for user in users]
        folded = self.foldin.users(histories, np.zeros((len(users), self.starts.shape[1]), np.float32))
        return np.concatenate([vectors, np.asarray(folded, np.float32)])


class SequenceForm(ServedForm):
    """The SASRec network and each user's events in order, newest last; fresh events are read after them."""

    kind = "sequence"

    def __init__(self, bundle: dict):
        self.sequences = SequenceScorer.from_form(bundle)
        super().__init__(bundle)

    def _rows_of_own(self, bundle: dict):
        return (self.sequences.user_sequences != UNKNOWN).any(dim=1)

    def to(self, device: torch.device) -> SequenceForm:
        self.sequences = SequenceScorer(self.sequences.network.to(device), self.sequences.user_sequences)
        return super().to(device)

    def _own(self, user: int) -> np.ndarray:
        own = self.sequences.user_sequences[user].cpu().numpy()
        return own[own != UNKNOWN]

    def raw_scores(self, users: np.ndarray) -> torch.Tensor:
        return self.sequences.score(torch.from_numpy(users))

    def user_scores(self, user: int, events: np.ndarray) -> np.ndarray:
        """Repeats count as events."""
        return self.sequences.score_sequences([np.concatenate([self._own(user), events])])[0]

    def batch_scores(self, users: np.ndarray, events: list[np.ndarray], fresh: np.ndarray) \
            -> tuple[torch.Tensor, np.ndarray]:
        own = self.sequences.user_sequences[torch.from_numpy(users).to(self.device)].cpu().numpy()
        sequences = [np.concatenate([mine[mine != UNKNOWN], events_of_row]) if is_fresh else mine[mine != UNKNOWN]
                     for mine, events_of_row, is_fresh in zip(own, events, fresh)]
        return self.sequences.score_tensor(sequences), self.cold.numpy()[users] & ~fresh

    def item_vectors(self) -> np.ndarray:
        return np.ascontiguousarray(self.sequences.network.items.weight.detach().float().cpu().numpy())

    def query(self, user: int, events: np.ndarray) -> np.ndarray | None:
        fresh = (events != UNKNOWN).any()
        sequence = np.concatenate([self._own(user), events]) if fresh else self._own(user)
        if not (sequence != UNKNOWN).any() or (not fresh and self.cold[user]):
            return None
        return self.sequences.sequence_states([sequence]).cpu().numpy()[0]

    def query_vectors(self, users: np.ndarray) -> np.ndarray:
        return self.sequences.hidden_states(torch.from_numpy(users)).cpu().numpy()


def as_numpy(value):
    return value.numpy() if isinstance(value, torch.Tensor) else value


class ItemItemForm(ServedForm):
    kind = "item_item"

    def __init__(self, bundle: dict):
        super().__init__(bundle)
        self.similarity: sp.csr_matrix | torch.Tensor = bundle["similarity"]
        self.dense_similarity = as_numpy(self.similarity) if isinstance(self.similarity, torch.Tensor) else None
        # the last users' known scores (a user's events arrive one after another); thread-safe, as a server needs
        self._known_scores = functools.lru_cache(max(1, KNOWN_CACHE_BYTES // (4 * self.n_items)))(self._history_scores)

    def raw_scores(self, users: np.ndarray) -> torch.Tensor:
        product = self.history[users] @ (self.similarity if self.dense_similarity is None else self.dense_similarity)
        return torch.from_numpy(np.asarray(product.todense() if sp.issparse(product) else product, np.float32))

    def user_scores(self, user: int, events: np.ndarray) -> np.ndarray:
        """The known part, cached, plus the new items."""
        new = self.merged_history(user, events)[len(row_codes(self.history, user)):]
        return self._known_scores(user) + self._scores_of(new)  # a new array: the cached one is left as it is

    def merged_history(self, user: int, events: np.ndarray) -> np.ndarray:
        known = row_codes(self.history, user)
        return np.concatenate([known, np.setdiff1d(events[events != UNKNOWN][-self.max_events:], known)])

    def batch_scores(self, users: np.ndarray, events: list[np.ndarray], fresh: np.ndarray) \
            -> tuple[torch.Tensor, np.ndarray]:
        histories = [self.merged_history(user, events_of_row) if is_fresh else row_codes(self.history, user)
                     for user, events_of_row, is_fresh in zip(users.tolist(), events, fresh)]
        return self._batch_product(users, histories), np.asarray([len(history) == 0 for history in histories])

    def _batch_product(self, users: np.ndarray, histories: list[np.ndarray]) -> torch.Tensor:
        """x·B per row as one sparse product, a row of the user before it (a replay's) as their difference."""
        rows = binary_rows(histories, self.n_items)
        continues = np.concatenate([[False], users[1:] == users[:-1]])[:len(users)]
        before = sp.vstack([sp.csr_matrix((1, self.n_items), dtype=np.float32), rows[:-1]], format="csr")
        differences = (rows - sp.diags(continues.astype(np.float32)) @ before).tocsr()
        differences.eliminate_zeros()
        similarity = self.table("similarity", lambda: _torch_matrix(self.similarity))
        product = torch.sparse.mm(csr_tensor(sp.csr_matrix(differences, dtype=np.float32)).to(self.device), similarity)
        scores = product.to_dense() if product.layout != torch.strided else product
        starts = np.flatnonzero(~continues)
        for first, end in zip(starts, [*starts[1:], len(users)]):
            if end - first > 1:
                scores[first:end].cumsum_(dim=0)
        return scores

    def _scores_of(self, codes: np.ndarray) -> np.ndarray:
        if self.dense_similarity is not None:
            return self.dense_similarity[codes].sum(axis=0)
        return item_item_scores(self.similarity, [codes])[0]

    def _history_scores(self, user: int) -> np.ndarray:
        """x_u·B of the user's known history."""
        return self._scores_of(row_codes(self.history, user))


def _torch_matrix(matrix: sp.csr_matrix | torch.Tensor) -> torch.Tensor:
    return matrix.float() if isinstance(matrix, torch.Tensor) else csr_tensor(sp.csr_matrix(matrix, dtype=np.float32))
