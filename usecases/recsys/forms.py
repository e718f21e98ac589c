"""The four forms a recommender is served in, behind one interface (as MONAI puts its readers behind one): user and
item factors (bpr, lightgcn, als), an item-item similarity applied to the user's history (itemknn, ease), a sequence
network and each user's events in order (sasrec), and popularity alone (pop). None needs training code.

Each form scores every item for users without events (`raw_scores`), for one user with their events on the CPU
(`user_scores`, the serving hot path: numpy only) and for a batch with their events on its device (`batch_scores`,
what a micro-batching server and a replay call). The vector forms (factors, sequence) also give item vectors and the
query vectors two-stage serving retrieves by. What rows and items are left out, retrieval and top-k are the
`Recommender`'s (`serving.py`).
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp
import torch

from common.errors import UserError
from .foldin import FactorFoldIn, FoldIn, merged_history
from .ranking import UNKNOWN, row_codes

DEFAULT_MAX_EVENTS = 200


class ServedForm:
    """Popularity alone, and what every form shares: the histories, seen items and popularity the run read, the
    users with rows of their own (the others, `cold`, are served popularity), and tables moved to the device once."""

    kind = "popularity"

    def __init__(self, bundle: dict):
        self.history: sp.csr_matrix = bundle["history"]
        self.seen: sp.csr_matrix = bundle["seen"]
        self.popularity = torch.as_tensor(bundle["popularity"], dtype=torch.float32)
        self.max_events = int(bundle.get("max_events", DEFAULT_MAX_EVENTS))
        self.has_rows = np.asarray(self._rows_of_own(bundle), bool)
        self.cold = ~torch.as_tensor(self.has_rows)
        self.cold[UNKNOWN] = True
        self.device = torch.device("cpu")
        self._on_device: dict[str, torch.Tensor] = {}

    def _rows_of_own(self, bundle: dict):
        """Per user code, whether the form scores them from rows of their own: here, a known history."""
        return np.diff(self.history.indptr) > 0

    @property
    def n_items(self) -> int:
        return self.history.shape[1]

    def to(self, device: torch.device) -> ServedForm:
        self.device = device
        self._on_device = {}
        return self

    def table(self, name: str, make):
        """A table (or the fold-in's tables) on the device, moved there once."""
        if name not in self._on_device:
            self._on_device[name] = make().to(self.device)
        return self._on_device[name]

    def raw_scores(self, users: np.ndarray) -> torch.Tensor:
        """(B, n_items) scores on the CPU for users without events, before cold users get popularity."""
        return self.popularity.expand(len(users), -1).clone()

    def user_scores(self, user: int, events: np.ndarray) -> np.ndarray | None:
        """Every item's score for one user with fresh events (item codes, oldest first), or None where the form
        serves that user as without them."""
        return self.popularity.numpy().copy()

    def batch_scores(self, users: np.ndarray, events: list[np.ndarray], fresh: np.ndarray) \
            -> tuple[torch.Tensor, np.ndarray]:
        """Every item's score per row on the device, and the rows that get popularity instead."""
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
            self.foldin = FactorFoldIn(spec, as_numpy(self.items), layer_sum=as_numpy(bundle.get("layer_sum")),
                                       degree=as_numpy(bundle.get("degree")))
            self.starts = as_numpy(bundle["egos"] if spec.method == "graph" else self.users)
            self._fold_in_known_histories()
        self.item_table = np.ascontiguousarray(as_numpy(self.items))

    def _rows_of_own(self, bundle: dict):
        return bundle["trained"]  # trained rows, where a fold-in starts (else from zero)

    def _fold_in_known_histories(self) -> None:
        """Users with a known history but no trained rows (first seen after the training cut) get the vector the
        fold-in gives that history, from zero as for a new user with those events: folded once here, so that they
        cost what a trained row costs on every path; only users without history stay cold."""
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

    def _start(self, user: int) -> np.ndarray:
        return self.starts[user:user + 1] if self.has_rows[user] else np.zeros((1, self.starts.shape[1]))

    def user_scores(self, user: int, events: np.ndarray) -> np.ndarray | None:
        if self.foldin is None:
            return None  # a model logged without fold-in: its trained rows
        history = merged_history(row_codes(self.history, user), events, max_length=self.max_events)
        return self.item_table @ self.foldin.users([history], self._start(user))[0]

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
            return np.asarray(self.foldin.users([history], self._start(user))[0], np.float32)
        return None if self.cold[user] else np.asarray(as_numpy(self.users)[user], np.float32)

    def query_vectors(self, users: np.ndarray) -> np.ndarray:
        """(B, dim) vectors of users with trained rows; with a fold-in, then the vectors their histories fold into
        from zero (what a user's events make of a query: (2B, dim))."""
        vectors = np.ascontiguousarray(as_numpy(self.users)[users], np.float32)
        if self.foldin is None:
            return vectors
        histories = [merged_history(row_codes(self.history, user), max_length=self.max_events) for user in users]
        folded = self.foldin.users(histories, np.zeros((len(users), self.starts.shape[1]), np.float32))
        return np.concatenate([vectors, np.asarray(folded, np.float32)])


class SequenceForm(ServedForm):
    """The SASRec network and each user's events in order, newest last; a user's events are read after them."""

    kind = "sequence"

    def __init__(self, bundle: dict):
        from .sequence import SequenceScorer

        self.sequences = SequenceScorer.from_form(bundle)
        super().__init__(bundle)

    def _rows_of_own(self, bundle: dict):
        return (self.sequences.user_sequences != UNKNOWN).any(dim=1)

    def to(self, device: torch.device) -> SequenceForm:
        from .sequence import SequenceScorer

        self.sequences = SequenceScorer(self.sequences.network.to(device), self.sequences.user_sequences)
        return super().to(device)

    def _own(self, user: int) -> np.ndarray:
        own = self.sequences.user_sequences[user].cpu().numpy()
        return own[own != UNKNOWN]

    def raw_scores(self, users: np.ndarray) -> torch.Tensor:
        return self.sequences.score(torch.from_numpy(users))

    def user_scores(self, user: int, events: np.ndarray) -> np.ndarray:
        """The user's sequence then the events, in order: repeats count as events."""
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
    """A tensor as a NumPy array (sharing its memory); anything else as it is."""
    return value.numpy() if isinstance(value, torch.Tensor) else value
