"""Run by test_sharding.py under torchrun (2 CPU processes, gloo): the sharded helpers and the recsys full-ranking
evaluation, each rank doing its share; how a failure or a stop on one rank reaches the other; the negatives each
rank draws, and a resume from a checkpoint that only rank 0's machine has; every rank saves what it got."""

import sys
from pathlib import Path

import numpy as np
import scipy.sparse as sp
import torch
import torch.distributed as dist

from common.runtime import interrupt
from common.errors import UserError
from common.runtime.interrupt import Terminated, stop_point, stops_deferred
from common.runtime.sharding import on_main as _on_main
from common.config import TrainConfig
from common.runtime.devices import make_runtime, shutdown
from common.runtime.sharding import all_reduce_max, gather_objects, gather_rows, my_share, shared_predictions
from common.training.loop import TensorBatches, Trainer, stop_if_any_rank_asked
from common.training.spec import TrainSpec
from usecases.recsys.evaluate import full_ranking
from usecases.recsys.models import BPR, NegativeSampler
from usecases.recsys.train import bpr_step, training_pairs


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


class RecordedNegatives(NegativeSampler):
    def __init__(self, train: sp.csr_matrix, device: torch.device):
        super().__init__(train, device)
        self.drawn = []

    def __call__(self, users: torch.Tensor) -> torch.Tensor:
        self.drawn.append(super().__call__(users))
        return self.drawn[-1]


def bpr_fits(outdir: Path, runtime) -> dict:
    """A BPR fit stopped after its first epoch on every rank, checkpointed in a folder of rank 0's "machine" only,
    then resumed by fresh processes' state: the negatives each rank drew, and where each rank resumed."""
    train = interactions(200, 20, 4)
    users, items = training_pairs(train, runtime.device)

    def trainer(model, log_metrics=None):
        return Trainer(model, torch.optim.Adam(model.parameters(), lr=0.01), bpr_step, runtime,
                       TrainSpec(TrainConfig(epochs=3, checkpoint_every_s=0), monitor="val/score", name="bpr",
                                 checkpoint_dir=outdir / f"machine{runtime.rank}", log_metrics=log_metrics))

    def stop_after_first_epoch(metrics, step):  # the first epoch's checkpoint is written; the second's is not
        if step == 1:
            raise Terminated("signal 15")

    torch.manual_seed(0)
    first = BPR(200, 20, 4, RecordedNegatives(train, runtime.device))
    batches = TensorBatches(users, items, batch_size=8, seed=0, rank=runtime.rank, world_size=runtime.world_size)
    try:
        trainer(first, stop_after_first_epoch).fit(batches, lambda model: {"val/score": 1.0}, resume=True)
    except Terminated:
        pass
    torch.manual_seed(100 + runtime.rank)
    again = BPR(200, 20, 4, NegativeSampler(train, runtime.device))
    resumed = trainer(again).fit(batches, lambda model: {"val/score": 1.0}, resume=True)
    return {"negatives": torch.cat(first.sampler.drawn), "resumed_from": resumed.resumed_from,
            "resumed_state": again.state_dict(),
            "checkpoints": sorted(path.name for path in (outdir / f"machine{runtime.rank}").glob("*"))}


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
        **bpr_fits(outdir, runtime),
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
