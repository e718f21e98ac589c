"""What a fit is asked to do: the types the training modules share, at the bottom so that none imports the loop."""

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
    """How one fit runs, as Lightning's Trainer flags group it: `monitor` picks the best epoch (`mode` min or max,
    `tie_break` as `EarlyStopping` says); with `checkpoint_dir` the fit can resume; `log_metrics(metrics, step)` gets
    each epoch's at `step_offset + epoch`; `model_name` names the workload facts (`name` where None), `predict` what
    serving runs (the step's own where None)."""

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
