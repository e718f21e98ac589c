"""The SASRec network (Kang & McAuley, ICDM 2018) and its scorer, apart from its training (`train.py`) so that a
server loads no training code; sequences are left-padded with the unknown item 0, which never changes a score."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .ranking import UNKNOWN


class SASRecNetwork(nn.Module):
    """Causal self-attention over the last `max_len` items; `forward` is the training loss."""

    def __init__(self, n_items: int, dim: int, layers: int, heads: int, dropout: float, max_len: int,
                 sampled_negatives: int | None = None):
        super().__init__()
        self.settings = {"n_items": n_items, "dim": dim, "layers": layers, "heads": heads, "dropout": dropout,
                         "max_len": max_len}  # what rebuilds the network
        self.heads, self.sampled_negatives = heads, sampled_negatives
        self.items = nn.Embedding(n_items, dim, padding_idx=UNKNOWN)
        self.positions = nn.Embedding(max_len, dim)
        self.dropout = nn.Dropout(dropout)
        block = nn.TransformerEncoderLayer(dim, heads, dim_feedforward=dim, dropout=dropout, batch_first=True,
                                           norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        nn.init.normal_(self.items.weight, std=dim ** -0.5)
        nn.init.normal_(self.positions.weight, std=dim ** -0.5)
        with torch.no_grad():
            self.items.weight[UNKNOWN].zero_()

    def hidden(self, sequences: torch.Tensor) -> torch.Tensor:
        """(B, L, dim) for left-padded (B, L) item codes: position i sees the real items up to i only."""
        real = sequences != UNKNOWN
        positions = (real.cumsum(1) - 1).clamp(min=0)
        x = self.dropout(self.items(sequences) * math.sqrt(self.items.embedding_dim) + self.positions(positions))
        length = real.shape[1]
        later = torch.ones(length, length, dtype=torch.bool, device=real.device).triu(1)
        itself = torch.eye(length, dtype=torch.bool, device=real.device)
        blocked = later | (~real[:, None, :] & ~itself)  # a padded query sees itself: no softmax row is empty
        return self.norm(self.blocks(x, mask=blocked.repeat_interleave(self.heads, dim=0)))

    def last_hidden(self, sequences: torch.Tensor) -> torch.Tensor:
        return self.hidden(sequences)[:, -1]

    def scores(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.items.weight.T

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-item cross-entropy over the real positions; all are scored, so a step never waits for the GPU."""
        hidden, targets = self.hidden(inputs).flatten(0, 1), targets.flatten()
        if self.sampled_negatives is None:  # every real item; the unknown item 0 is left out of the softmax
            return F.cross_entropy((hidden @ self.items.weight[1:].T).float(), targets - 1, ignore_index=UNKNOWN - 1)
        return self._sampled_softmax(hidden, targets)

    def _sampled_softmax(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The target against `sampled_negatives` uniform items shared by the batch (no logQ correction needed)."""
        negatives = torch.randint(1, self.items.num_embeddings, (self.sampled_negatives,), device=hidden.device)
        positive = (hidden * self.items(targets)).sum(-1, keepdim=True)
        negative = (hidden @ self.items(negatives).T).masked_fill(negatives[None, :] == targets[:, None], -torch.inf)
        logits = torch.cat([positive, negative], dim=1).float()
        losses = F.cross_entropy(logits, torch.zeros(len(logits), dtype=torch.long, device=logits.device),
                                 reduction="none")
        real = (targets != UNKNOWN).float()
        return (losses * real).sum() / real.sum()


def left_padded(sequences: Sequence[np.ndarray], length: int) -> torch.Tensor:
    """Each sequence's last `length` known items, right-aligned after zeros."""
    padded = np.zeros((len(sequences), length), dtype=np.int64)
    for row, sequence in enumerate(sequences):
        known = np.asarray(sequence, dtype=np.int64)
        known = known[known != UNKNOWN][-length:]
        if len(known):
            padded[row, -len(known):] = known
    return torch.from_numpy(padded)


class SequenceScorer:
    """A trained network (in eval mode) and the sequence each user code is scored from."""

    def __init__(self, network: SASRecNetwork, user_sequences: torch.Tensor):
        self.network, self.device = network, network.items.weight.device
        self.user_sequences = user_sequences.to(self.device)

    @property
    def max_len(self) -> int:
        return self.network.settings["max_len"]

    def with_history(self, sequences: Sequence[np.ndarray]) -> SequenceScorer:
        """The same network scoring each user code from `sequences[code]` (oldest first)."""
        return SequenceScorer(self.network, left_padded(sequences, self.max_len))

    @torch.no_grad()
    def score(self, users: torch.Tensor) -> torch.Tensor:
        sequences = self.user_sequences[users.to(self.device)]
        return self.network.scores(self.network.last_hidden(sequences)).float()

    @torch.no_grad()
    def hidden_states(self, users: torch.Tensor) -> torch.Tensor:
        """(B, dim) last hidden states of user codes' sequences: two-stage serving's query vectors."""
        return self.network.last_hidden(self.user_sequences[users.to(self.device)]).float()

    @torch.no_grad()
    def sequence_states(self, sequences: Sequence[np.ndarray]) -> torch.Tensor:
        """`hidden_states` of item-code sequences (a user's history and fresh events, newest last)."""
        return self.network.last_hidden(left_padded(sequences, self.max_len).to(self.device)).float()

    def score_sequences(self, sequences: Sequence[np.ndarray]) -> np.ndarray:
        """(len(sequences), n_items) float32 scores; a sequence with no known item scores every item 0."""
        return self.score_tensor(sequences).cpu().numpy()

    @torch.no_grad()
    def score_tensor(self, sequences: Sequence[np.ndarray]) -> torch.Tensor:
        padded = left_padded(sequences, self.max_len).to(self.device)
        scores = self.network.scores(self.network.last_hidden(padded)).float()
        scores[padded[:, -1] == UNKNOWN] = 0.0
        return scores

    @classmethod
    def from_form(cls, form: dict, device: torch.device | str = "cpu") -> SequenceScorer:
        """The scorer `served_sequence_form` describes, on `device`, in eval mode."""
        network = SASRecNetwork(**form["settings"])
        network.load_state_dict(form["state"])
        return cls(network.to(device).eval(), form["user_sequences"])


def served_sequence_form(scorer: SequenceScorer) -> dict:
    """What the bundle stores: the weights, the settings that rebuild the network, and each user's sequence."""
    state = {name: tensor.detach().float().cpu() for name, tensor in scorer.network.state_dict().items()}
    return {"kind": "sequence", "state": state, "settings": dict(scorer.network.settings),
            "user_sequences": scorer.user_sequences.to(torch.int32).cpu()}
