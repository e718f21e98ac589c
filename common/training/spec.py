"""What a fit is asked to do, apart from what it trains: the types the training modules share, at the bottom of the
package so that the loop, its callbacks and the workload probe all import them and none imports the loop."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from common.config import TrainConfig

Step = Callable[[nn.Module, tuple[torch.Tensor, ...]], torch.Tensor]
Predict = Callable[[nn.Module, tuple[torch.Tensor, ...]], torch.Tensor]
LogMetrics = Callable[[dict[str, float], int], None]


@dataclass(frozen=True)
class TrainSpec:
    """How one fit runs, as `TrainingArguments` or Lightning's Trainer flags group it: the model, its optimizer and
    step and the runtime are the `Trainer`'s own arguments.

    `settings` gives epochs, patience, gradient clipping, validation and checkpoint intervals; `monitor` names the
    validation metric that picks the best epoch, `mode` whether lower (min) or higher (max) is better, `tie_break`
    the loss that decides between epochs of equal `monitor` (`EarlyStopping`). With `checkpoint_dir` the fit writes
    checkpoints there and can resume from them. `log_metrics(metrics, step)` gets each epoch's metrics at step
    `step_offset + epoch`; `name` is the fit's, in progress lines; `model_name` the model's, for the workload facts
    (shared by the fits of one model; `name` where None), and `predict` what serving runs of it (the step's own
    `predict` where None)."""

    settings: TrainConfig
    monitor: str
    mode: str = "min"
    tie_break: str | None = None
    checkpoint_dir: Path | None = None
    log_metrics: LogMetrics | None = None
    step_offset: int = 0
    name: str = "train"
    model_name: str | None = None
    predict: Predict | None = None
