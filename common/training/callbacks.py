"""What the training loop calls around its epochs: each concern of a fit is a `Callback`, so that a new one is added
without editing the loop; and the trainer's own (random streams, early stopping, progress, checkpoints). Every rank
of a DDP job calls every hook, together. The trainer's own callbacks run first, then those passed as
`callbacks=[...]`, then the checkpoint (which so holds every callback's state) and the workload probe. A hook gets
the trainer as a `FitState`, so that the callbacks do not depend on the loop."""

from __future__ import annotations

import copy
import logging
import math
import os
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn
from tqdm.auto import tqdm

from common.runtime.devices import Runtime
from common.runtime.sharding import on_main
from common.training.spec import LogMetrics, Predict, Step, TrainSpec

log = logging.getLogger(__name__)

CHECKPOINT_NAME = "last.pt"
RANK_SEED_STRIDE = 0x9E3779B97F4A7C15  # far-apart seeds for the ranks' random streams
PROGRESS_EVERY_S = 30


class FitState(Protocol):
    """The trainer as its callbacks see it (`common.training.loop.Trainer` is one)."""

    spec: TrainSpec
    runtime: Runtime
    module: nn.Module  # the model trained, without its DDP or compiled wrapper
    optimizer: torch.optim.Optimizer
    step: Step
    predict: Predict | None  # the spec's, or the step's own
    log_metrics: LogMetrics  # the spec's, or one that drops them
    batches: Iterable  # the fit's
    history: list[dict[str, float]]  # each epoch's metrics so far
    epoch: int  # the last epoch done, -1 before the first
    resumed_from: int | None  # the first epoch after the checkpoint resumed from; None on a fresh start
    should_stop: bool  # set to end the fit after this epoch
    samples_per_epoch: int  # of the last epoch, over every rank

    def state_dict(self, finished: bool) -> dict:
        """The checkpoint after `epoch`: the trainer's state and every callback's; every rank calls it together."""


class Callback:
    """A concern of the fit; every hook does nothing unless overridden. The hooks, in the order a fit calls them:"""

    def load_state_dict(self, checkpoint: dict) -> None:
        """On a resume, before `on_fit_start`: the whole checkpoint, the trainer's keys (`epoch`, `history`,
        `finished`...) and every callback's; a resume of a finished fit calls this hook alone."""

    def on_fit_start(self, trainer: FitState) -> None:
        """`trainer.resumed_from` is None on a fresh start: initialise here, not over a restored state."""

    def on_train_batch_end(self, trainer: FitState, index: int, batch: tuple[torch.Tensor, ...],
                           loss: torch.Tensor) -> None:
        """After each optimizer step; `loss` is on the device: read it only where a pause of the GPU is worth it.
        Only callbacks that define this hook are called."""

    def on_epoch_end(self, trainer: FitState, epoch: int, metrics: dict[str, float]) -> None:
        """After each epoch and its validation (on the epochs that have one): `metrics` all-reduced over the ranks,
        already logged; set `trainer.should_stop` to end the fit (alike on every rank: decide from `metrics`)."""

    def on_fit_end(self, trainer: FitState) -> None:
        """After the last epoch, or a stop; not after an exception."""

    def state_dict(self) -> dict:
        """When a checkpoint is written: keys for its top level, distinct from every other's (rank 0 alone writes)."""
        return {}


def save_atomic(state: dict, path: Path) -> None:
    """Write beside the target, then rename: a kill never leaves a truncated checkpoint."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    try:
        torch.save(state, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def every_rank(value, runtime: Runtime) -> list:
    """Each rank's `value` in rank order, on every rank."""
    if not runtime.distributed:
        return [value]
    values = [None] * runtime.world_size
    dist.all_gather_object(values, value)
    return values


class RankRandomStreams(Callback):
    """Each DDP rank its own random stream, derived from the seed (identical draws of dropout or negatives on every
    rank would repeat each one world-size times an epoch; rank 0 keeps the seed's), checkpointed per rank."""

    def __init__(self, runtime: Runtime):
        self.runtime = runtime

    def on_fit_start(self, trainer: FitState) -> None:
        if trainer.resumed_from is None and self.runtime.distributed and self.runtime.rank:
            torch.manual_seed((torch.initial_seed() + RANK_SEED_STRIDE * self.runtime.rank) % 2**63)

    def state_dict(self) -> dict:
        cuda = torch.cuda.get_rng_state_all() if self.runtime.device.type == "cuda" else []
        return {"torch_rng": every_rank(torch.get_rng_state(), self.runtime),
                "cuda_rng": every_rank(cuda, self.runtime)}

    def load_state_dict(self, checkpoint: dict) -> None:
        """This rank's saved state (a job restarted on other ranks reuses them in turn; an old checkpoint holds one)."""
        states, cuda_states = checkpoint["torch_rng"], checkpoint["cuda_rng"]
        if torch.is_tensor(states):
            states, cuda_states = [states], [cuda_states]
        own = self.runtime.rank % len(states)
        torch.set_rng_state(states[own].cpu())
        if cuda_states[own] and self.runtime.device.type == "cuda":  # dropout, flips, negatives on the GPU
            torch.cuda.set_rng_state_all([rng.cpu() for rng in cuda_states[own]])


class Checkpoint(Callback):
    """Writes the fit's state to `path` every `every_s` seconds of it (0: every epoch; never in the epoch it stops in)
    and, marked finished, at the end of a fit that wrote or resumed one, or lasted `every_s`. By time, not by epochs:
    a 180 MB network written every few seconds of a fast GPU's epochs would be most of the run."""

    def __init__(self, path: Path, every_s: float, runtime: Runtime):
        self.path, self.every_s, self.runtime = path, every_s, runtime
        self.started = self.last = 0.0
        self.holds_state = False

    def read(self) -> dict | None:
        """The checkpoint to resume from as rank 0 finds it (None: none), on every rank, its tensors on the CPU: rank 0
        alone writes checkpoints, possibly to a folder only its machine sees."""
        return on_main(self.runtime, self._load)

    def _load(self) -> dict | None:
        return torch.load(self.path, map_location="cpu", weights_only=True) if self.path.is_file() else None

    def on_fit_start(self, trainer: FitState) -> None:
        self.started = self.last = self._now()
        self.holds_state = trainer.resumed_from is not None  # a resumed fit writes its end

    def on_epoch_end(self, trainer: FitState, epoch: int, metrics: dict[str, float]) -> None:
        if not trainer.should_stop and self._now() - self.last >= self.every_s:
            self._write(trainer.state_dict(finished=False))

    def on_fit_end(self, trainer: FitState) -> None:
        if self.holds_state or self._now() - self.started >= self.every_s:
            self._write(trainer.state_dict(finished=True))

    def _now(self) -> float:
        """Rank 0's clock, on every rank: the ranks decide together whether to write."""
        return on_main(self.runtime, time.monotonic)

    def _write(self, state: dict) -> None:
        if self.runtime.is_main:
            save_atomic(state, self.path)
        self.last, self.holds_state = self._now(), True


class EarlyStopping(Callback):
    """Keeps the weights of the best epoch by `monitor` and puts them in the model at the end; stops after `patience`
    epochs without improvement (None: never). `tie_break` (a loss) decides between epochs of equal `monitor`: a
    saturated metric (a validation AUC of 1.0) would otherwise keep the first, least-trained of them."""

    def __init__(self, monitor: str, mode: str = "min", patience: int | None = None, tie_break: str | None = None):
        if mode not in ("min", "max"):
            raise ValueError(f"mode must be min or max, got {mode}")
        self.monitor, self.mode, self.patience, self.tie_break = monitor, mode, patience, tie_break
        self.best = self.best_tie = math.nan
        self.best_epoch = self.bad_epochs = 0
        self.best_state: dict = {}

    def on_fit_start(self, trainer: FitState) -> None:
        if trainer.resumed_from is None:
            self.best = math.inf if self.mode == "min" else -math.inf
            self.best_tie = math.inf
            self.best_epoch, self.bad_epochs = -1, 0
            self.best_state = copy.deepcopy(trainer.module.state_dict())

    def _improved(self, metrics: dict[str, float]) -> bool:
        value = metrics[self.monitor]
        if math.isnan(value):
            return False
        if value == self.best and self.tie_break is not None:
            return metrics[self.tie_break] < self.best_tie
        return value < self.best if self.mode == "min" else value > self.best

    def on_epoch_end(self, trainer: FitState, epoch: int, metrics: dict[str, float]) -> None:
        """Only validated epochs count; `patience` counts every epoch since the best one."""
        if self.monitor not in metrics:
            return
        if self._improved(metrics):
            self.best, self.best_epoch = metrics[self.monitor], epoch
            self.best_tie = metrics.get(self.tie_break, math.inf)
            self.best_state = copy.deepcopy(trainer.module.state_dict())
        self.bad_epochs = epoch - self.best_epoch
        if self.patience is not None and self.bad_epochs >= self.patience:
            trainer.should_stop = True

    def on_fit_end(self, trainer: FitState) -> None:
        trainer.module.load_state_dict(self.best_state)

    def state_dict(self) -> dict:
        return {"best_metric": self.best, "best_epoch": self.best_epoch, "best_state": self.best_state,
                "bad_epochs": self.bad_epochs}

    def load_state_dict(self, checkpoint: dict) -> None:
        self.best, self.best_epoch = checkpoint["best_metric"], checkpoint["best_epoch"]
        self.best_state, self.bad_epochs = checkpoint["best_state"], checkpoint["bad_epochs"]
        self.best_tie = math.inf
        if self.tie_break is not None and self.best_epoch >= 0:
            self.best_tie = next(row[self.tie_break] for row in checkpoint["history"] if row["epoch"] == self.best_epoch)


class Progress(Callback):
    def __init__(self, monitor: str, best: EarlyStopping):
        self.monitor, self.best = monitor, best
        self.bar: tqdm | None = None
        self.on_terminal, self.last_line = False, 0.0

    def on_fit_start(self, trainer: FitState) -> None:
        self.on_terminal = sys.stderr.isatty()
        start = trainer.resumed_from or 0
        self.bar = tqdm(total=max(trainer.spec.settings.epochs - start, 0), desc=trainer.spec.name, leave=False,
                        disable=not self.on_terminal or not trainer.runtime.is_main)
        self.last_line = time.perf_counter()

    def on_epoch_end(self, trainer: FitState, epoch: int, metrics: dict[str, float]) -> None:
        if self.monitor not in metrics:  # an epoch without validation
            self.bar.update()
            return
        value, best = metrics[self.monitor], self.best.best
        self.bar.set_postfix({self.monitor: f"{value:.4f}", "best": f"{best:.4f}"})
        self.bar.update()
        if not self.on_terminal and trainer.runtime.is_main and time.perf_counter() - self.last_line >= PROGRESS_EVERY_S:
            log.info("%s: epoch %d/%d, %s %.4f (best %.4f at epoch %d)", trainer.spec.name, epoch + 1,
                     trainer.spec.settings.epochs, self.monitor, value, best, self.best.best_epoch + 1)
            self.last_line = time.perf_counter()

    def on_fit_end(self, trainer: FitState) -> None:
        self.bar.close()
