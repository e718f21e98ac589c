"""How far a fit is: a progress bar on a terminal; elsewhere (CI, a log file, `usecases demo`) a log line at most
every PROGRESS_EVERY_S seconds. Rank 0 alone shows either."""

from __future__ import annotations

import logging
import sys
import time

from tqdm.auto import tqdm

from common.training.callbacks import Callback, FitState
from common.training.early_stopping import EarlyStopping

log = logging.getLogger(__name__)

PROGRESS_EVERY_S = 30


class Progress(Callback):
    """Shows the `monitor` value of each epoch and the best so far, as `best` keeps it."""

    def __init__(self, monitor: str, best: EarlyStopping):
        self.monitor = monitor
        self.best = best
        self.bar: tqdm | None = None
        self.on_terminal = False
        self.last_line = 0.0

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
