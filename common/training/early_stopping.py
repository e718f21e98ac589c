"""The best epoch of a fit, its weights, and the stop when `patience` epochs bring no improvement."""

from __future__ import annotations

import copy
import math

from common.training.callbacks import Callback, FitState


class EarlyStopping(Callback):
    """Keeps a copy of the weights of the best epoch by `monitor` (lower is better in `mode` min, higher in max) and
    puts them in the model at the end of the fit; stops the fit after `patience` epochs without improvement (None:
    never). `tie_break` names a metric (lower is better, a loss) that decides between epochs with the same `monitor`
    value: a saturated metric (a validation AUC of 1.0) would otherwise keep the first, least-trained of them."""

    def __init__(self, monitor: str, mode: str = "min", patience: int | None = None, tie_break: str | None = None):
        if mode not in ("min", "max"):
            raise ValueError(f"mode must be min or max, got {mode}")
        self.monitor = monitor
        self.mode = mode
        self.patience = patience
        self.tie_break = tie_break
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
        """Only validated epochs count; the epochs since the best one, validated or not, are what `patience` is."""
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
