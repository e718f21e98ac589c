"""Every neural fit of the walk-forward (each member of each refit) trained at once, as one `VolatilityEnsemble` through
the common Trainer: on a GPU one step of a few kernels instead of hundreds of launch-bound tiny fits. A fit keeps all it
had alone: its seed, scaler, training and early-stopping rows, patience and best weights. Every fit's rows are cut into
the same number of batches per epoch (the largest fit's of `train.batch_size` rows), and a step's loss is the sum of the
fits' own mean losses."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from common.job import Job
from common.runtime.devices import Runtime
from common.runtime.sharding import all_reduce_sum
from common.training.callbacks import Callback, FitState
from common.training.loop import Trainer, make_optimizer
from common.training.spec import TrainSpec
from .config import Config
from .models import VolatilityEnsemble, VolatilityMLP, fit_qlike


@dataclass
class Fit:
    """One member of one refit: the seed of its initial weights, and the rows it trains and early-stops on."""

    seed: int
    train_rows: np.ndarray
    val_rows: np.ndarray


def padded_rows(windows: list[np.ndarray], device: torch.device) -> torch.Tensor:
    """Each fit's rows in a row of one (fits, longest) tensor, a shorter one repeated (finite padding, weighted 0)."""
    longest = max(len(rows) for rows in windows)
    return torch.tensor(np.stack([np.resize(rows, longest) for rows in windows]), device=device)


class FitBatches:
    """Every fit's batches, stepped together: each epoch cuts every fit's shuffled rows into `len(self)` runs
    (padding weighted 0); under DDP each rank takes its own positions, as DistributedSampler does."""

    def __init__(self, features: torch.Tensor, targets: torch.Tensor, windows: list[np.ndarray], batch_size: int,
                 seed: int, training: torch.Tensor, rank: int = 0, world_size: int = 1):
        self.features, self.targets, self.training = features, targets, training
        self.seed, self.rank, self.world_size, self.epoch = seed, rank, world_size, 0
        device = features.device
        self.rows = padded_rows(windows, device)
        self.sizes = torch.tensor([len(rows) for rows in windows], device=device)
        self.shares = -(-self.sizes // world_size)  # each fit's rows on this rank
        share = -(-self.rows.shape[1] // world_size)
        self.batches = math.ceil(share / batch_size)
        self.width = math.ceil(share / self.batches)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.batches

    def epoch_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This epoch's (batches, fits, width) row numbers and weights (0 on padding), for every fit."""
        device = self.rows.device
        fits, longest = self.rows.shape
        generator = torch.Generator(device).manual_seed(self.seed + self.epoch)
        keys = torch.rand(fits, longest, generator=generator, device=device)
        order = keys.masked_fill(torch.arange(longest, device=device) >= self.sizes[:, None], 2.0).argsort(dim=1)
        # batch b holds positions ceil(b·share/B) up to ceil((b+1)·share/B) of each fit's share on this rank
        batch = torch.arange(self.batches, device=device)[:, None, None]
        shares = self.shares[None, :, None]
        first = (batch * shares + self.batches - 1) // self.batches
        last = ((batch + 1) * shares + self.batches - 1) // self.batches
        position = first + torch.arange(self.width, device=device)
        weights = (position < last).float()
        taken = (torch.minimum(position, shares - 1) * self.world_size + self.rank) % self.sizes[None, :, None]
        fit = torch.arange(fits, device=device)[None, :, None]
        return self.rows[fit, order[fit, taken]], weights

    def __iter__(self):
        rows, weights = self.epoch_rows()
        fits = self.training.nonzero().flatten().to(rows.device)
        for batch_rows, batch_weights in zip(rows[:, fits], weights[:, fits]):
            yield (self.features[batch_rows].flatten(0, 1), self.targets[batch_rows].flatten(0, 1),
                   batch_weights.flatten(), fits)


def ensemble_step(model: torch.nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The sum over the batch's fits of each one's QLIKE on its own rows: each fit gets its own gradient."""
    features, targets, weights, fits = batch
    rows = (len(fits), -1)
    forecast = model(features.view(*rows, features.shape[-1]), fits).float()
    return fit_qlike(forecast, targets.view(*rows, targets.shape[-1]), weights.view(rows)).mean(1).sum()


def served_prediction(members: int):
    """What serving runs on a batch's rows, for the workload facts: the latest refit's `members` fits on each row."""

    def predict(model: torch.nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        features, fits = batch[0], batch[-1][:members]
        return model(features.unsqueeze(0).expand(len(fits), -1, -1), fits)

    return predict


class FitEarlyStopping(Callback):
    """`EarlyStopping` for each fit alone by its own validation QLIKE: its best weights kept, its steps left
    out after `patience` epochs without improvement; `val/best_qlike` is the trainer's monitor."""

    def __init__(self, features: torch.Tensor, targets: torch.Tensor, windows: list[np.ndarray],
                 patience: int | None, horizon: int, runtime: Runtime):
        self.features, self.targets, self.patience, self.horizon, self.runtime = (features, targets, patience,
                                                                                  horizon, runtime)
        self.rows = padded_rows(windows, features.device)
        self.weights = torch.tensor(np.stack([np.arange(self.rows.shape[1]) < len(rows) for rows in windows]),
                                    dtype=torch.float32, device=features.device)
        fits = len(windows)
        self.training = torch.ones(fits, dtype=torch.bool)  # shared with FitBatches, changed in place
        self.best = torch.full((fits,), math.inf, dtype=torch.float64)
        self.best_epoch = torch.full((fits,), -1)
        self.best_state: dict[str, torch.Tensor] = {}
        self.latest: torch.Tensor | None = None  # this epoch's validation QLIKE of the fits still training

    def validate(self, module: VolatilityEnsemble) -> dict[str, float]:
        fits = self.training.nonzero().flatten()
        on_device = fits.to(self.rows.device)
        rows, weights = self.rows[on_device], self.weights[on_device]
        losses = fit_qlike(module(self.features[rows], on_device).float(), self.targets[rows], weights)
        losses = all_reduce_sum(losses, self.runtime) / self.runtime.world_size  # the same on every rank
        self.latest = losses.double().cpu()
        best = self.best.clone()
        best[fits] = torch.fmin(best[fits], self.latest[:, 0])
        return {"val/qlike": float(self.latest[:, 0].mean()),
                f"val/qlike_h{self.horizon}": float(self.latest[:, 1].mean()),
                "val/best_qlike": float(best.mean()), "val/fits_training": float(len(fits))}

    def on_fit_start(self, trainer: FitState) -> None:
        if trainer.resumed_from is None:
            self.training.fill_(True)
            self.best.fill_(math.inf)
            self.best_epoch.fill_(-1)
            self.best_state = {name: value.detach().clone() for name, value in trainer.module.state_dict().items()}

    def on_epoch_end(self, trainer: FitState, epoch: int, metrics: dict[str, float]) -> None:
        """As `EarlyStopping.on_epoch_end`, per fit: validated epochs count, and a NaN is no improvement."""
        if self.latest is not None:
            fits = self.training.nonzero().flatten()
            better = self.latest[:, 0] < self.best[fits]
            improved = fits[better]
            self.best[improved], self.best_epoch[improved] = self.latest[better, 0], epoch
            if len(improved):
                index = improved.to(self.rows.device)
                for name, value in trainer.module.state_dict().items():
                    if name not in VolatilityEnsemble.SHARED:
                        self.best_state[name].index_copy_(0, index, value.detach().index_select(0, index))
            self.latest = None
        if self.patience is not None:
            self.training &= epoch - self.best_epoch < self.patience
            if not self.training.any():
                trainer.should_stop = True

    def on_fit_end(self, trainer: FitState) -> None:
        """Each fit's best weights; every fit training again, so the workload probe measures a step of all."""
        trainer.module.load_state_dict(self.best_state)
        self.training.fill_(True)

    def state_dict(self) -> dict:
        return {"fits_best_qlike": self.best, "fits_best_epoch": self.best_epoch, "fits_best_state": self.best_state,
                "fits_training": self.training.clone()}

    def load_state_dict(self, checkpoint: dict) -> None:
        self.best, self.best_epoch = checkpoint["fits_best_qlike"], checkpoint["fits_best_epoch"]
        self.best_state = {name: value.to(self.rows.device) for name, value in checkpoint["fits_best_state"].items()}
        self.training.copy_(checkpoint["fits_training"])


def train_ensemble(fits: list[Fit], features: torch.Tensor, targets: torch.Tensor, config: Config,
                   job: Job) -> VolatilityEnsemble:
    """Every fit trained together; the ensemble with each fit's best weights, in eval mode, on the device."""
    runtime, settings = job.runtime, config.train
    architecture = {"n_features": features.shape[1], **config.neural.model_dump(exclude={"ensemble", "target"}),
                    "horizon": config.evaluation.horizon}
    members = []
    for fit in fits:
        torch.manual_seed(fit.seed)
        member = VolatilityMLP(**architecture)
        member.fit_scaler(features[fit.train_rows])
        members.append(member)
    ensemble = VolatilityEnsemble.stack(members, **architecture)
    features, targets = features.to(runtime.device), targets.to(runtime.device)
    stopping = FitEarlyStopping(features, targets, [fit.val_rows for fit in fits], settings.patience,
                                config.evaluation.horizon, runtime)
    batches = FitBatches(features, targets, [fit.train_rows for fit in fits], settings.batch_size,
                         config.runtime.seed, stopping.training, runtime.rank, runtime.world_size)
    optimizer = make_optimizer("adamw", ensemble.parameters(), runtime, lr=settings.lr,
                               weight_decay=settings.weight_decay)
    # the trainer's own early stopping sees only the mean over the fits: FitEarlyStopping stops and restores them
    spec = TrainSpec(settings.model_copy(update={"patience": None}), monitor="val/best_qlike",
                     checkpoint_dir=job.checkpoint_dir / "neural", log_metrics=job.tracker.log_metrics,
                     name=f"neural ({len(fits)} fits)", model_name="neural",
                     predict=served_prediction(config.neural.ensemble))
    trainer = Trainer(ensemble, optimizer, ensemble_step, runtime, spec, callbacks=[stopping])
    trainer.fit(batches, stopping.validate, resume=job.resume)
    return trainer.module.eval()
