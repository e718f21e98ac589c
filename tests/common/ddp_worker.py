"""Run by test_ddp.py under torchrun: DDP training of a small MLP on CPU (gloo), saving what each rank ends with.

Each rank seeds differently before building its model, so equal final parameters can only come from DDP's
initial broadcast and gradient all-reduce. With a second argument R, rank R alone gets SIGTERM at the end of
the first epoch, and every rank must stop together at the start of the second.
"""

import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from common.runtime.interrupt import Terminated, stop_on_signals
from common.runtime.devices import make_runtime, shutdown
from common.config import TrainConfig
from common.training.callbacks import Callback
from common.training.loop import TensorBatches, Trainer, supervised
from common.training.spec import TrainSpec


class EpochMetrics(Callback):
    """A use case's callback: every rank gets every epoch's metrics, all-reduced."""

    def __init__(self):
        self.seen = []

    def on_epoch_end(self, trainer, epoch, metrics):
        self.seen.append((epoch, metrics["val/mse"]))


def main(outdir: Path, signal_rank: int | None = None) -> None:
    runtime = make_runtime("cpu")
    stop_on_signals()
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(256, 2, generator=generator)
    y = 2 * x[:, :1] - x[:, 1:] + 0.5
    epochs_validated = []

    def mse(model: nn.Module) -> float:
        with torch.no_grad():
            return nn.functional.mse_loss(model(x), y).item()

    def validate(model: nn.Module) -> dict[str, float]:
        epochs_validated.append(len(epochs_validated))
        if runtime.rank == signal_rank:
            os.kill(os.getpid(), signal.SIGTERM)
        return {"val/mse": mse(model)}

    torch.manual_seed(100 + runtime.rank)
    model = nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 1))
    initial = {key: value.clone() for key, value in model.state_dict().items()}
    loss_start = mse(model)
    batches = TensorBatches(x, y, batch_size=16, seed=0, rank=runtime.rank, world_size=runtime.world_size)
    epoch_metrics = EpochMetrics()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                      supervised(nn.functional.mse_loss), runtime, TrainSpec(TrainConfig(epochs=4), monitor="val/mse"),
                      callbacks=[epoch_metrics])
    outcome = {"world_size": runtime.world_size, "backend": dist.get_backend(), "initial": initial,
               "loss_start": loss_start}
    try:
        outcome["epochs_run"] = trainer.fit(batches, validate).epochs_run
    except Terminated:
        outcome["stopped_after"] = len(epochs_validated)
    outcome.update(state=model.state_dict(), loss_end=mse(model), epoch_metrics=epoch_metrics.seen)
    dist.barrier()  # no rank tears its connections down while another still talks to it
    del trainer  # its DDP model holds the process group
    shutdown(runtime)
    outcome["gloo_threads_left"] = gloo_threads()
    torch.save(outcome, outdir / f"rank{runtime.rank}.pt")


def gloo_threads() -> list[str]:
    """This process's gloo threads (its workers and socket loop): none once the group is really gone, else they run
    on into interpreter shutdown, where freeing the group aborted a rank now and then (Linux only: [] elsewhere)."""
    tasks = Path("/proc/self/task")
    names = []
    for task in tasks.iterdir() if tasks.is_dir() else ():
        try:
            names.append(task.joinpath("comm").read_text().strip())
        except FileNotFoundError:  # a thread that ended meanwhile
            pass
    return sorted(name for name in names if "gloo" in name)


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else None)
