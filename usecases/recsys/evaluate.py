"""Full-ranking top-K evaluation, metric for metric as RecBole's, so that numbers compare with papers (sampled
evaluation overstates quality and reorders models: Krichene and Rendle, KDD 2020); coverage leaves out item 0."""

from __future__ import annotations

import time

import numpy as np
import scipy.sparse as sp
import torch

from common.errors import UserError
from common.runtime.devices import Runtime
from common.runtime.sharding import all_reduce_max, all_reduce_sum, my_share
from .ranking import Scorer, top_k

METRICS = ("hit", "recall", "precision", "mrr", "ndcg", "coverage")


def rows_as_dense(matrix: sp.csr_matrix, rows: torch.Tensor | np.ndarray, device: torch.device) -> torch.Tensor:
    """The chosen rows of a CSR matrix as a dense float32 tensor built on the device: only the non-zeros travel."""
    index = rows.cpu().numpy() if isinstance(rows, torch.Tensor) else np.asarray(rows)
    picked = matrix[index]
    row_of_value = np.repeat(np.arange(len(index)), np.diff(picked.indptr))
    dense = torch.zeros(len(index), matrix.shape[1], dtype=torch.float32, device=device)
    dense[torch.from_numpy(row_of_value).to(device), torch.from_numpy(picked.indices.astype(np.int64)).to(device)] = (
        torch.from_numpy(picked.data.astype(np.float32)).to(device))
    return dense


def sample_users(truth: sp.csr_matrix, count: int | None, seed: int) -> sp.csr_matrix:
    """`truth` with only the rows of a seeded sample of `count` of its users kept (None: all of them)."""
    users = np.flatnonzero(np.diff(truth.indptr))
    if count is None or count >= len(users):
        return truth
    keep = np.zeros(truth.shape[0], dtype=np.float32)
    keep[np.random.default_rng(seed).choice(users, size=count, replace=False)] = 1
    return (sp.diags(keep) @ truth).tocsr()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def full_ranking(scorer: Scorer, truth: sp.csr_matrix, exclude: sp.csr_matrix, ks: list[int], device: torch.device,
                 batch_users: int, runtime: Runtime | None = None) -> dict[str, float]:
    """`{metric}@{k}` over the users with a `truth` row, `exclude`'s items left out; with a distributed `runtime`,
    each rank ranks its share of the users, and every rank must call this together."""
    n_items = truth.shape[1]
    largest = max(ks)
    if largest > n_items - 1:
        raise UserError(f"evaluation.ks: K={largest} is more than the {n_items - 1} items of the catalogue")
    truth = truth.tocsr()
    relevant_count = np.diff(truth.indptr)
    users = np.flatnonzero(relevant_count)
    n_users = len(users)
    users = users[my_share(n_users, runtime)]
    ranks = torch.arange(1, largest + 1, device=device, dtype=torch.float64)
    discounts = 1.0 / torch.log2(ranks + 1)
    ideal_dcg = torch.cumsum(discounts, 0)
    totals = {f"{name}@{k}": torch.zeros((), dtype=torch.float64, device=device)
              for name in METRICS if name != "coverage" for k in ks}
    recommended = {k: torch.zeros(n_items, dtype=torch.bool, device=device) for k in ks}

    synchronize(device)
    start = time.perf_counter()
    for first in range(0, len(users), batch_users):
        batch = torch.from_numpy(users[first:first + batch_users]).to(device)
        items, scores = top_k(scorer, batch, exclude, largest, device)
        returned = scores > -torch.inf
        hits = (rows_as_dense(truth, batch, device).gather(1, items) > 0) & returned
        n_relevant = torch.from_numpy(relevant_count[batch.cpu().numpy()]).to(device, torch.float64)
        for k in ks:
            hits_k = hits[:, :k].double()
            n_hits = hits_k.sum(1)
            totals[f"hit@{k}"] += (n_hits > 0).double().sum()
            totals[f"recall@{k}"] += (n_hits / n_relevant).sum()
            totals[f"precision@{k}"] += n_hits.sum() / k
            totals[f"mrr@{k}"] += (hits_k / ranks[:k]).amax(1).sum()
            ideal = ideal_dcg[torch.clamp(n_relevant, max=k).long() - 1]
            totals[f"ndcg@{k}"] += ((hits_k * discounts[:k]).sum(1) / ideal).sum()
            recommended[k][items[:, :k][returned[:, :k]]] = True
    synchronize(device)
    elapsed = all_reduce_max(time.perf_counter() - start, runtime)

    names = list(totals)
    summed = all_reduce_sum(torch.stack([totals[name] for name in names]), runtime)
    results = {name: total / max(n_users, 1) for name, total in zip(names, summed.tolist())}
    for k, seen in recommended.items():
        results[f"coverage@{k}"] = (all_reduce_sum(seen.int(), runtime) > 0).sum().item() / (n_items - 1)
    results["users_evaluated"] = n_users
    results["users_per_s"] = n_users / elapsed if elapsed > 0 else 0.0
    return results
