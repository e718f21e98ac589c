"""What the training loop calls around its epochs: each concern of a fit (early stopping, checkpoints, progress, the
workload probe, a use case's own) is a `Callback`, so that a new one is added without editing the loop.

The hooks, in the order a fit calls them; every rank of a DDP job calls every hook, together:

| Hook | When | Notes |
|---|---|---|
| `load_state_dict(checkpoint)` | on a resume, before `on_fit_start` | the whole checkpoint: the trainer's keys (`epoch`, `history`, `finished`...) and every callback's; a resume of a finished fit calls this hook alone |
| `on_fit_start(trainer)` | once, before the first epoch | `trainer.resumed_from` is None on a fresh start: initialise here, not over a restored state |
| `on_train_batch_end(trainer, index, batch, loss)` | after each training step's optimizer step | `loss` is the step's loss tensor, on the device: read it (`.item()`) only where a pause of the GPU is worth it; only callbacks that define this hook are called |
| `on_epoch_end(trainer, epoch, metrics)` | after each epoch (and its validation, on the epochs that have one: `settings.validate_every`) | `metrics` all-reduced over the ranks, already in `trainer.history` and logged; set `trainer.should_stop` to end the fit after this epoch (alike on every rank: decide from `metrics`) |
| `on_fit_end(trainer)` | once, after the last epoch | also after a stop; not after an exception |
| `state_dict()` | when a checkpoint is written | keys added to the checkpoint's top level, distinct from the trainer's and every other callback's; it may gather across ranks (rank 0 alone writes) |

The trainer's own callbacks run first (random streams, early stopping, progress), then those passed as
`callbacks=[...]`, then the checkpoint (which so holds every callback's state after the epoch) and the workload probe.

A hook gets the trainer as a `FitState`: what a callback may read and set of the fit, so that the callbacks depend on
this module and not on the loop that calls them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch
from torch import nn

from common.runtime.devices import Runtime
from common.training.spec import LogMetrics, Predict, Step, TrainSpec


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
    """A concern of the fit; every hook does nothing unless overridden."""

    def on_fit_start(self, trainer: FitState) -> None:
        pass

    def on_train_batch_end(self, trainer: FitState, index: int, batch: tuple[torch.Tensor, ...],
                           loss: torch.Tensor) -> None:
        pass

    def on_epoch_end(self, trainer: FitState, epoch: int, metrics: dict[str, float]) -> None:
        pass

    def on_fit_end(self, trainer: FitState) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, checkpoint: dict) -> None:
        pass
