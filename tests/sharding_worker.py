"""Run by test_sharding.py under torchrun (2 CPU processes, gloo): the sharded helpers and the recsys full-ranking
evaluation, each rank doing its share; how a failure or a stop on one rank reaches the other; every rank saves what
it got."""

import sys
from pathlib import Path

import numpy as np
import scipy.sparse as sp
import torch
import torch.distributed as dist

from common import interrupt
from common.errors import UserError
from common.interrupt import Terminated, stop_point, stops_deferred
from common.runner import _on_main
from common.runtime import make_runtime, shutdown
from common.sharding import all_reduce_max, gather_objects, gather_rows, my_share, shared_predictions
from common.training import stop_if_any_rank_asked
from usecases.recsys.evaluate import full_ranking


class FixedScores:
    """A scorer whose scores are a fixed random matrix, the same on every rank."""

    def __init__(self, n_users: int, n_items: int):
        self.scores = torch.randn(n_users, n_items, generator=torch.Generator().manual_seed(3))

    def score(self, users: torch.Tensor) -> torch.Tensor:
        return self.scores[users]


def refuse():
    raise UserError("a bad key")


def interactions(n_users: int, n_items: int, seed: int) -> sp.csr_matrix:
    return sp.random(n_users, n_items, density=0.05, format="csr", random_state=seed, data_rvs=np.ones)


def main(outdir: Path) -> None:
    runtime = make_runtime("cpu")
    rows = torch.arange(7 * 3, dtype=torch.float32).reshape(7, 3)
    truth, exclude = interactions(50, 40, 1), interactions(50, 40, 2)
    outcome = {
        "rows": gather_rows(rows[my_share(7, runtime)], 7, runtime),
        "predictions": torch.from_numpy(shared_predictions(lambda share: rows[share].numpy() * 2, 7, runtime)),
        "objects": gather_objects(f"rank {runtime.rank}", runtime),
        "max": all_reduce_max(float(runtime.rank), runtime),
        "ranking": full_ranking(FixedScores(50, 40), truth, exclude, [5, 10], runtime.device, 8, runtime),
    }
    for name, failing in (("user_error", refuse), ("bug", lambda: 1 / 0)):
        try:
            _on_main(runtime, failing)
        except (UserError, ZeroDivisionError, RuntimeError) as exc:
            outcome[name] = f"{type(exc).__name__}: {exc}"
    with stops_deferred():
        if runtime.rank == 1:
            interrupt._requested = 15  # as SIGTERM to rank 1 alone would
        stop_point()  # deferred: rank 1 goes on to the collective with rank 0
    try:
        stop_if_any_rank_asked(runtime)
    except Terminated:
        outcome["stopped"] = True
    torch.save(outcome, outdir / f"rank{runtime.rank}.pt")
    dist.barrier()
    shutdown(runtime)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
