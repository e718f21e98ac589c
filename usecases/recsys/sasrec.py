"""SASRec (Kang & McAuley, ICDM 2018): the next item from the order of a user's items, which the other models
ignore. Causal self-attention over the user's last `max_len` items; the output at each position is scored against
the item embedding table (tied), trained with cross-entropy over the whole catalogue at every position (Klenitskiy &
Vasilev 2023: better than the paper's one sampled negative), or with a sampled softmax where full logits do not fit.

Sequences are left-padded with 0 (the unknown item code), so the last position is always the newest item. Positions
count from the oldest item in the window and padded keys are masked, so padding never changes a score, and the
sequence a served user is scored from may be any length.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence

import numpy as np
import pandas as pd
import scipy.sparse as sp
import torch
import torch.nn.functional as F
from torch import nn

from common.errors import UserError
from common.job import Job
from common.training.loop import TensorBatches, Trainer, make_optimizer
from common.training.spec import TrainSpec
from .config import Config
from .data import UNKNOWN, Interactions
from .evaluate import full_ranking
from .train import MONITOR, metrics_logger, seconds_per_epoch

log = logging.getLogger(__name__)

NAME = "sasrec"
SETTINGS = ("n_items", "dim", "layers", "heads", "dropout", "max_len")  # what rebuilds the network


class SASRecNetwork(nn.Module):
    """Item and position embeddings, pre-norm causal self-attention blocks, a final LayerNorm; `forward` is the
    training loss, `last_hidden` what ranking and serving score from."""

    def __init__(self, n_items: int, dim: int, layers: int, heads: int, dropout: float, max_len: int,
                 sampled_negatives: int | None = None):
        super().__init__()
        self.settings = {"n_items": n_items, "dim": dim, "layers": layers, "heads": heads, "dropout": dropout,
                         "max_len": max_len}
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
        return self.norm(self.blocks(x, mask=self._attention_mask(real)))

    def _attention_mask(self, real: torch.Tensor) -> torch.Tensor:
        """True where a query may not look: later positions, and padding (a padded query sees only itself, so that
        no row of the softmax is empty and no NaN reaches the real positions)."""
        length = real.shape[1]
        later = torch.ones(length, length, dtype=torch.bool, device=real.device).triu(1)
        itself = torch.eye(length, dtype=torch.bool, device=real.device)
        blocked = later | (~real[:, None, :] & ~itself)
        return blocked.repeat_interleave(self.heads, dim=0)

    def last_hidden(self, sequences: torch.Tensor) -> torch.Tensor:
        return self.hidden(sequences)[:, -1]

    def scores(self, hidden: torch.Tensor) -> torch.Tensor:
        """Every item's score (tied to the input embeddings); the unknown item's is 0."""
        return hidden @ self.items.weight.T

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-item cross-entropy over the real positions (targets 0 are padding and ignored). Every position
        is scored and the padded ones weigh nothing: the shapes do not depend on the batch's values, so a step never
        waits for the GPU to count its real positions."""
        hidden, targets = self.hidden(inputs).flatten(0, 1), targets.flatten()
        if self.sampled_negatives is None:  # every real item; the unknown item 0 is left out of the softmax
            return F.cross_entropy((hidden @ self.items.weight[1:].T).float(), targets - 1, ignore_index=UNKNOWN - 1)
        return self._sampled_softmax(hidden, targets)

    def _sampled_softmax(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The target against `sampled_negatives` uniform items shared by the batch; a negative that is the
        target itself is masked. Uniform sampling needs no logQ correction (a constant)."""
        negatives = torch.randint(1, self.items.num_embeddings, (self.sampled_negatives,), device=hidden.device)
        positive = (hidden * self.items(targets)).sum(-1, keepdim=True)
        negative = (hidden @ self.items(negatives).T).masked_fill(negatives[None, :] == targets[:, None], -torch.inf)
        logits = torch.cat([positive, negative], dim=1).float()
        losses = F.cross_entropy(logits, torch.zeros(len(logits), dtype=torch.long, device=logits.device),
                                 reduction="none")
        real = (targets != UNKNOWN).float()
        return (losses * real).sum() / real.sum()


def sequences_by_user(frame: pd.DataFrame, n_users: int) -> list[np.ndarray]:
    """Each user code's item codes, oldest first: by timestamp, ties in the frame's row order (the log's; for
    `pd.concat([data.train, data.val])`, train before val)."""
    users, items = frame["user"].to_numpy(), frame["item"].to_numpy()
    order = np.lexsort((np.arange(len(frame)), frame["timestamp"].to_numpy(), users))
    bounds = np.searchsorted(users[order], np.arange(n_users + 1))
    ordered = items[order].astype(np.int64)
    return [ordered[bounds[user]:bounds[user + 1]] for user in range(n_users)]


def left_padded(sequences: Sequence[np.ndarray], length: int) -> torch.Tensor:
    """(len(sequences), length) int64: each sequence's last `length` known items (unknown codes 0 dropped),
    right-aligned after zeros."""
    padded = np.zeros((len(sequences), length), dtype=np.int64)
    for row, sequence in enumerate(sequences):
        known = np.asarray(sequence, dtype=np.int64)
        known = known[known != UNKNOWN][-length:]
        if len(known):
            padded[row, -len(known):] = known
    return torch.from_numpy(padded)


def training_windows(sequences: Sequence[np.ndarray], max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-item targets, (U, max_len) each, for the users with at least two items: each user's last
    max_len + 1 items, shifted by one."""
    usable = [sequence for sequence in sequences if len(sequence) >= 2]
    return left_padded([s[:-1] for s in usable], max_len), left_padded([s[1:] for s in usable], max_len)


class SequenceScorer:
    """A trained network and the sequence each user code is scored from.

    `score(users)` (what `full_ranking` and the pipeline call) ranks from the newest position of each user's
    sequence: the training sequences after `fit_sasrec`, for validation; for test, the pipeline sets the history known
    at the test cut with `with_history(sequences_by_user(pd.concat([data.train, data.val]), data.n_users))`.
    `score_sequences` scores any item-code sequences (a user's history and fresh events, newest last): what serving
    and the replay evaluation call. Scores are for the network in eval mode, which `fit_sasrec` and `from_form` set.
    """

    def __init__(self, network: SASRecNetwork, user_sequences: torch.Tensor):
        self.network = network
        self.device = network.items.weight.device
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
        """(B, dim) last hidden states of user codes' sequences: the query vectors two-stage serving retrieves by."""
        return self.network.last_hidden(self.user_sequences[users.to(self.device)]).float()

    @torch.no_grad()
    def sequence_states(self, sequences: Sequence[np.ndarray]) -> torch.Tensor:
        """`hidden_states` of item-code sequences (a user's history and fresh events, newest last)."""
        return self.network.last_hidden(left_padded(sequences, self.max_len).to(self.device)).float()

    def score_sequences(self, sequences: Sequence[np.ndarray]) -> np.ndarray:
        """(len(sequences), n_items) float32 scores, each from the sequence's last `max_len` known items; a sequence
        with no known item scores every item 0 (nothing to go on: the caller falls back to popularity)."""
        return self.score_tensor(sequences).cpu().numpy()

    @torch.no_grad()
    def score_tensor(self, sequences: Sequence[np.ndarray]) -> torch.Tensor:
        """`score_sequences` as a tensor on the network's device."""
        padded = left_padded(sequences, self.max_len).to(self.device)
        scores = self.network.scores(self.network.last_hidden(padded)).float()
        scores[padded[:, -1] == UNKNOWN] = 0.0
        return scores

    @classmethod
    def from_form(cls, form: dict, device: torch.device | str = "cpu") -> SequenceScorer:
        """The scorer `served_sequence_form` describes, on `device`, in eval mode."""
        settings = form["settings"]
        network = SASRecNetwork(**{key: settings[key] for key in SETTINGS})
        network.load_state_dict(form["state"])
        return cls(network.to(device).eval(), form["user_sequences"])


def served_sequence_form(scorer: SequenceScorer) -> dict:
    """What the bundle stores, tensors and plain data only: the weights, the settings that rebuild the network, and
    each user code's sequence as the scorer holds it (set the history to serve with `with_history` first)."""
    state = {name: tensor.detach().float().cpu() for name, tensor in scorer.network.state_dict().items()}
    return {"kind": "sequence", "state": state, "settings": dict(scorer.network.settings),
            "user_sequences": scorer.user_sequences.to(torch.int32).cpu()}


def fit_sasrec(data: Interactions, val: sp.csr_matrix, config: Config, job: Job) -> tuple[SequenceScorer, dict]:
    """Train on each user's training sequence, early stopping on validation NDCG@10 by full ranking (from the
    training sequences, items in train excluded); returns the scorer of the best epoch and the fit's figures."""
    if data.train is None:
        raise UserError("sasrec needs the order of each user's events, which the Dask engine does not keep; "
                        "run it with runtime.engine=pandas")
    started = time.perf_counter()
    runtime, settings = job.runtime, config.sasrec
    torch.manual_seed(config.runtime.seed)
    sequences = sequences_by_user(data.train, data.n_users)
    inputs, targets = (tensor.to(runtime.device) for tensor in training_windows(sequences, settings.max_len))
    network = SASRecNetwork(data.n_items, settings.dim, settings.layers, settings.heads, settings.dropout,
                            settings.max_len, settings.sampled_negatives)
    batches = TensorBatches(inputs, targets, batch_size=settings.batch_size, seed=config.runtime.seed,
                            rank=runtime.rank, world_size=runtime.world_size)
    optimizer = make_optimizer("adamw", network.parameters(), runtime, lr=settings.lr,
                               weight_decay=settings.weight_decay)
    train, user_sequences = data.matrix("train"), left_padded(sequences, settings.max_len)

    def validate(model: SASRecNetwork) -> dict[str, float]:
        scorer = SequenceScorer(model, user_sequences)
        metrics = full_ranking(scorer, val, train, [10], runtime.device, config.evaluation.batch_users, runtime)
        return {f"val/{NAME}/ndcg@10": metrics["ndcg@10"], MONITOR: metrics["ndcg@10"]}

    spec = TrainSpec(settings, monitor=MONITOR, mode="max", tie_break="train/loss",
                     checkpoint_dir=job.checkpoint_dir / NAME, log_metrics=metrics_logger(job, NAME), name=NAME,
                     predict=rank_every_item)
    trainer = Trainer(network, optimizer, next_item_loss, runtime, spec)
    result = trainer.fit(batches, validate, resume=job.resume)
    log.info("%s: best val NDCG@10 %.4f at epoch %d of %d", NAME, result.best_metric, result.best_epoch + 1,
             result.epochs_run)
    scorer = SequenceScorer(trainer.module.eval(), user_sequences)
    return scorer, {"fit_seconds": time.perf_counter() - started, "best_epoch": result.best_epoch + 1,
                    "seconds_per_epoch": seconds_per_epoch(result.history, len(inputs))}


def next_item_loss(model: SASRecNetwork, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    inputs, targets = batch
    return model(inputs, targets)


def rank_every_item(model: SASRecNetwork, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """What serving does per user: every item scored from the newest position."""
    return model.scores(model.last_hidden(batch[0]))
