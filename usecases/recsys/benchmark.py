"""Speed on the same data: BPR through our loop against a hand-written PyTorch loop (the same fused Adam, no
checkpoints or metrics; each loop's first epoch a warm-up, not counted), our full ranking against `implicit`'s."""

from __future__ import annotations

import logging
import time

import numpy as np
import scipy.sparse as sp
import torch
import torch.nn.functional as F
from torch import nn

from common.errors import UserError
from common.runtime.devices import Runtime
from common.runtime.interrupt import stop_point
from common.job import Job
from common.training.loop import make_optimizer
from .baselines import als_available
from .config import Config
from .data import Interactions
from .evaluate import synchronize
from .ranking import top_k
from .train import fit_ranker, seconds_per_epoch

log = logging.getLogger(__name__)

RANKED_USERS = 20_000
RANK_BATCH = 2048
K = 10


def plain_bpr(train: sp.csr_matrix, config: Config, runtime: Runtime, epochs: int) -> list[float]:
    """Seconds per epoch of a hand-written BPR loop with the same size, batch and optimiser (fused Adam) as ours."""
    settings, device = config.bpr, runtime.device
    torch.manual_seed(config.runtime.seed)
    coo = train.tocoo()
    users = torch.from_numpy(coo.row.astype(np.int64)).to(device)
    items = torch.from_numpy(coo.col.astype(np.int64)).to(device)
    user_table, item_table = (nn.Embedding(rows, settings.dim).to(device) for rows in train.shape)
    optimizer = make_optimizer("adam", [*user_table.parameters(), *item_table.parameters()], runtime, lr=settings.lr)
    seconds = []
    for _ in range(epochs):
        started = time.perf_counter()
        order = torch.randperm(len(users), device=device)
        for first in range(0, len(order), settings.batch_size):
            stop_point()
            batch = order[first : first + settings.batch_size]
            user = user_table(users[batch])
            negatives = torch.randint(1, train.shape[1], (len(batch),), device=device)
            margin = (user * item_table(items[batch])).sum(-1) - (user * item_table(negatives)).sum(-1)
            loss = -F.logsigmoid(margin).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        synchronize(device)
        seconds.append(time.perf_counter() - started)
    return seconds


def ranked_users(train: sp.csr_matrix) -> np.ndarray:
    """The training users repeated to `RANKED_USERS`."""
    known = np.flatnonzero(np.diff(train.indptr))
    return np.resize(known, max(RANKED_USERS, len(known)))


def our_ranking_speed(model, train: sp.csr_matrix, device: torch.device) -> float:
    users = torch.from_numpy(ranked_users(train)).to(device)
    started = time.perf_counter()
    for first in range(0, len(users), RANK_BATCH):
        top_k(model, users[first : first + RANK_BATCH], train, K, device)
    synchronize(device)
    return len(users) / (time.perf_counter() - started)


def implicit_ranking_speed(model, train: sp.csr_matrix) -> float:
    """`implicit`'s own batched top-K over the same users, from the same BPR factors."""
    from implicit.cpu.als import AlternatingLeastSquares

    reference = AlternatingLeastSquares()
    reference.user_factors, reference.item_factors = (table.detach().float().cpu().numpy()
                                                      for table in model.embeddings())
    chosen = ranked_users(train)
    started = time.perf_counter()
    for first in range(0, len(chosen), RANK_BATCH):
        batch = chosen[first : first + RANK_BATCH]
        reference.recommend(batch, train[batch], N=K, filter_already_liked_items=True)
    return len(chosen) / (time.perf_counter() - started)


def benchmark(config: Config, data: Interactions, job: Job) -> dict[str, dict[str, float]]:
    if job.runtime.distributed:
        raise UserError("the benchmark compares single-process loops; run it without torchrun")
    epochs = config.benchmark.epochs
    train, device = data.matrix("train"), job.runtime.device
    log.info("benchmark: plain BPR loop, %d epochs", epochs)
    plain = float(np.mean(plain_bpr(train, config, job.runtime, epochs)[1:]))
    log.info("benchmark: our BPR through the common loop, %d epochs", epochs)
    timed = config.model_copy(deep=True)
    timed.bpr.epochs, timed.bpr.patience = epochs, epochs + 1
    model, result = fit_ranker("bpr", train, data.matrix("val"), timed, job)
    ours = seconds_per_epoch(result.history[1:], train.nnz)
    results = {"pipeline": {"seconds_per_epoch": ours, "epoch_speedup": plain / ours,
                            "ranking_users_per_s": our_ranking_speed(model, train, device)},
               "plain_loop": {"seconds_per_epoch": plain, "epoch_speedup": 1.0}}
    if als_available():
        results["implicit"] = {"ranking_users_per_s": implicit_ranking_speed(model, train)}
    return results
