"""Training SASRec (Kang & McAuley, ICDM 2018; the network and its scorer are in `sequence.py`): the next item from
the order of a user's items, which the other models ignore. Trained with cross-entropy over the whole catalogue at
every position (Klenitskiy & Vasilev 2023: better than the paper's one sampled negative), or with a sampled softmax
where full logits do not fit.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import numpy as np
import pandas as pd
import scipy.sparse as sp
import torch

from common.errors import UserError
from common.job import Job
from common.training.loop import TensorBatches, Trainer, make_optimizer
from common.training.spec import TrainSpec
from .config import Config
from .data import Interactions
from .evaluate import full_ranking
from .sequence import SASRecNetwork, SequenceScorer, left_padded
from .train import MONITOR, metrics_logger, seconds_per_epoch

log = logging.getLogger(__name__)

NAME = "sasrec"


def sequences_by_user(frame: pd.DataFrame, n_users: int) -> list[np.ndarray]:
    """Each user code's item codes, oldest first: by timestamp, ties in the frame's row order (the log's; for
    `pd.concat([data.train, data.val])`, train before val)."""
    users, items = frame["user"].to_numpy(), frame["item"].to_numpy()
    order = np.lexsort((np.arange(len(frame)), frame["timestamp"].to_numpy(), users))
    bounds = np.searchsorted(users[order], np.arange(n_users + 1))
    ordered = items[order].astype(np.int64)
    return [ordered[bounds[user]:bounds[user + 1]] for user in range(n_users)]


def training_windows(sequences: Sequence[np.ndarray], max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-item targets, (U, max_len) each, for the users with at least two items: each user's last
    max_len + 1 items, shifted by one."""
    usable = [sequence for sequence in sequences if len(sequence) >= 2]
    return left_padded([s[:-1] for s in usable], max_len), left_padded([s[1:] for s in usable], max_len)


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
