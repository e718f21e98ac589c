"""Training the learned models through the common loop, early stopping on validation NDCG@10 by full ranking:
BPR and LightGCN on (user, positive item) pairs with negatives sampled on the device, SASRec on the order of each
user's items with cross-entropy over the whole catalogue (Klenitskiy & Vasilev 2023) or a sampled softmax."""

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
from common.training.loop import FitResult, TensorBatches, Trainer, make_optimizer
from common.training.spec import Predict, TrainSpec
from .config import Config
from .data import Interactions
from .evaluate import full_ranking
from .models import BPR, LightGCN, NegativeSampler, PairwiseRanker
from .sequence import SASRecNetwork, SequenceScorer, left_padded

log = logging.getLogger(__name__)

MONITOR = "val/ndcg@10"
SHARED_KEYS = ("throughput/", "time/", "model/")  # the keys every use case logs alike, for comparing runs and advising
SASREC = "sasrec"


def fit_ranker(name: str, train: sp.csr_matrix, val: sp.csr_matrix, config: Config,
               job: Job) -> tuple[PairwiseRanker, FitResult]:
    """Train from scratch; the returned model holds the weights of the epoch with the best validation NDCG@10."""
    runtime, settings = job.runtime, getattr(config, name)
    torch.manual_seed(config.runtime.seed)
    sampler = NegativeSampler(train, runtime.device)
    if name == "bpr":
        model = BPR(train.shape[0], train.shape[1], settings.dim, sampler, settings.weight_decay)
    else:
        model = LightGCN(train, settings.dim, settings.layers, sampler, runtime.device, settings.weight_decay)
    users, items = training_pairs(train, runtime.device)
    batches = TensorBatches(users, items, batch_size=settings.batch_size, seed=config.runtime.seed, rank=runtime.rank,
                            world_size=runtime.world_size, max_batches=settings.steps_per_epoch)
    optimizer = make_optimizer("adam", model.parameters(), runtime, lr=settings.lr)
    trainer = Trainer(model, optimizer, bpr_step, runtime, train_spec(name, config, job, rank_every_item))
    result = fit_on_validation(trainer, batches, name, lambda network: network, val, train, config, job)
    return trainer.module.eval(), result


def train_spec(name: str, config: Config, job: Job, predict: Predict, tie_break: str | None = None) -> TrainSpec:
    """Each model's training curves under its own name (`bpr/train/loss`), the keys all use cases share as they are."""

    def log_metrics(metrics: dict[str, float], step: int) -> None:
        job.tracker.log_metrics({key if key.startswith((f"val/{name}", *SHARED_KEYS)) else f"{name}/{key}": value
                                 for key, value in metrics.items() if key != MONITOR}, step)

    return TrainSpec(getattr(config, name), monitor=MONITOR, mode="max", tie_break=tie_break,
                     checkpoint_dir=job.checkpoint_dir / name, log_metrics=log_metrics, name=name, predict=predict)


def fit_on_validation(trainer: Trainer, batches: TensorBatches, name: str, scorer_of, val: sp.csr_matrix,
                      train: sp.csr_matrix, config: Config, job: Job) -> FitResult:
    """The fit, validated each epoch by the NDCG@10 of `scorer_of(network)` ranking `val`, `train`'s items left out."""
    runtime = job.runtime

    def validate(network) -> dict[str, float]:
        ndcg = full_ranking(scorer_of(network), val, train, [10], runtime.device, config.evaluation.batch_users,
                            runtime)["ndcg@10"]
        return {f"val/{name}/ndcg@10": ndcg, MONITOR: ndcg}

    result = trainer.fit(batches, validate, resume=job.resume)
    log.info("%s: best val NDCG@10 %.4f at epoch %d of %d", name, result.best_metric, result.best_epoch + 1,
             result.epochs_run)
    return result


def training_pairs(train: sp.csr_matrix, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Every (user, item) of the training matrix as int32 tensors: half int64's memory (`bpr_step` widens them)."""
    users = np.repeat(np.arange(train.shape[0], dtype=np.int32), np.diff(train.indptr))
    items = np.asarray(train.indices, dtype=np.int32)
    return torch.from_numpy(users).to(device), torch.from_numpy(items).to(device)


def bpr_step(model: PairwiseRanker, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    users, positives = batch
    return model(users.long(), positives.long())


def rank_every_item(model: PairwiseRanker, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return model.score(batch[0].long())


def fit_figures(started: float, result: FitResult, pairs_per_epoch: int) -> dict[str, float]:
    """Seconds per epoch from the loop's own throughput (validation excluded)."""
    return {"fit_seconds": time.perf_counter() - started, "best_epoch": result.best_epoch + 1,
            "seconds_per_epoch": seconds_per_epoch(result.history, pairs_per_epoch)}


def seconds_per_epoch(history: list[dict[str, float]], pairs_per_epoch: int) -> float:
    rates = [row["throughput/samples_per_s"] for row in history if "throughput/samples_per_s" in row]
    return float(np.mean([pairs_per_epoch / rate for rate in rates]))


def sequences_by_user(frame: pd.DataFrame, n_users: int) -> list[np.ndarray]:
    """Each user code's item codes, oldest first: by timestamp, ties in the frame's row order."""
    users, items = frame["user"].to_numpy(), frame["item"].to_numpy()
    order = np.lexsort((np.arange(len(frame)), frame["timestamp"].to_numpy(), users))
    bounds = np.searchsorted(users[order], np.arange(n_users + 1))
    ordered = items[order].astype(np.int64)
    return [ordered[bounds[user]:bounds[user + 1]] for user in range(n_users)]


def training_windows(sequences: Sequence[np.ndarray], max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-item targets: each user's last max_len + 1 items, shifted by one (users of two or more)."""
    usable = [sequence for sequence in sequences if len(sequence) >= 2]
    return left_padded([s[:-1] for s in usable], max_len), left_padded([s[1:] for s in usable], max_len)


def fit_sasrec(data: Interactions, val: sp.csr_matrix, config: Config, job: Job) -> tuple[SequenceScorer, dict]:
    """The scorer of the best epoch on each user's training sequence, and the fit's figures."""
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
    user_sequences = left_padded(sequences, settings.max_len)
    spec = train_spec(SASREC, config, job, rank_from_newest, tie_break="train/loss")
    trainer = Trainer(network, optimizer, next_item_loss, runtime, spec)
    result = fit_on_validation(trainer, batches, SASREC, lambda model: SequenceScorer(model, user_sequences), val,
                               data.matrix("train"), config, job)
    return SequenceScorer(trainer.module.eval(), user_sequences), fit_figures(started, result, len(inputs))


def next_item_loss(model: SASRecNetwork, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    inputs, targets = batch
    return model(inputs, targets)


def rank_from_newest(model: SASRecNetwork, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return model.scores(model.last_hidden(batch[0]))
