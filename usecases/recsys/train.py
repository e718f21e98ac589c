"""Training the learned models through the common loop: (user, positive item) pairs sliced from tensors on the
device, negatives sampled there per batch, early stopping on validation NDCG@10 by full ranking."""

from __future__ import annotations

import logging

import numpy as np
import scipy.sparse as sp
import torch

from common.job import Job
from common.training.loop import FitResult, TensorBatches, Trainer, make_optimizer
from common.training.spec import TrainSpec
from .config import Config
from .evaluate import full_ranking
from .models import BPR, LightGCN, NegativeSampler, PairwiseRanker

log = logging.getLogger(__name__)

MONITOR = "val/ndcg@10"


def build_ranker(name: str, train: sp.csr_matrix, config: Config, device: torch.device) -> PairwiseRanker:
    sampler = NegativeSampler(train, device)
    if name == "bpr":
        return BPR(train.shape[0], train.shape[1], config.bpr.dim, sampler, config.bpr.weight_decay)
    return LightGCN(train, config.lightgcn.dim, config.lightgcn.layers, sampler, device,
                    config.lightgcn.weight_decay)


def fit_ranker(name: str, train: sp.csr_matrix, val: sp.csr_matrix, config: Config,
               job: Job) -> tuple[PairwiseRanker, FitResult]:
    """Train from scratch; the returned model holds the weights of the epoch with the best validation NDCG@10."""
    runtime, settings = job.runtime, getattr(config, name)
    torch.manual_seed(config.runtime.seed)
    model = build_ranker(name, train, config, runtime.device)
    users, items = training_pairs(train, runtime.device)
    batches = TensorBatches(users, items, batch_size=settings.batch_size, seed=config.runtime.seed, rank=runtime.rank,
                            world_size=runtime.world_size, max_batches=settings.steps_per_epoch)
    optimizer = make_optimizer("adam", model.parameters(), runtime, lr=settings.lr)

    def validate(network: PairwiseRanker) -> dict[str, float]:
        metrics = full_ranking(network, val, train, [10], runtime.device, config.evaluation.batch_users, runtime)
        return {f"val/{name}/ndcg@10": metrics["ndcg@10"], MONITOR: metrics["ndcg@10"]}

    spec = TrainSpec(settings, monitor=MONITOR, mode="max", checkpoint_dir=job.checkpoint_dir / name,
                     log_metrics=metrics_logger(job, name), name=name, predict=rank_every_item)
    trainer = Trainer(model, optimizer, bpr_step, runtime, spec)
    result = trainer.fit(batches, validate, resume=job.resume)
    log.info("%s: best val NDCG@10 %.4f at epoch %d of %d", name, result.best_metric, result.best_epoch + 1,
             result.epochs_run)
    return trainer.module.eval(), result


def training_pairs(train: sp.csr_matrix, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Every (user, item) of the training matrix as two int32 tensors (half the memory of int64 at 100 M pairs;
    batches are widened in `bpr_step`), the items straight from the matrix's own array."""
    users = np.repeat(np.arange(train.shape[0], dtype=np.int32), np.diff(train.indptr))
    items = np.asarray(train.indices, dtype=np.int32)
    return torch.from_numpy(users).to(device), torch.from_numpy(items).to(device)


def bpr_step(model: PairwiseRanker, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """A batch of (user, positive item) pairs; the model samples the negatives and returns the BPR loss."""
    users, positives = batch
    return model(users.long(), positives.long())


def rank_every_item(model: PairwiseRanker, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """What serving does per user: a score for every item."""
    return model.score(batch[0].long())


SHARED_KEYS = ("throughput/", "time/", "model/")  # the keys every use case logs alike, for comparing runs and advising


def metrics_logger(job: Job, name: str):
    """Each model's training curves under its own name (`bpr/train/loss`), in the one run; throughput and time keep
    the names all use cases share."""

    def log_metrics(metrics: dict[str, float], step: int) -> None:
        job.tracker.log_metrics({key if key.startswith((f"val/{name}", *SHARED_KEYS)) else f"{name}/{key}": value
                                 for key, value in metrics.items() if key != MONITOR}, step)

    return log_metrics


def seconds_per_epoch(history: list[dict[str, float]], pairs_per_epoch: int) -> float:
    """Training time per epoch from the loop's own throughput (validation excluded)."""
    rates = [row["throughput/samples_per_s"] for row in history if "throughput/samples_per_s" in row]
    return float(np.mean([pairs_per_epoch / rate for rate in rates]))
