"""The training loop every torch model goes through: a model, its optimizer, a step function (model, batch) -> loss,
the runtime and a `TrainSpec`, trained and validated each epoch with mixed precision, gradient clipping and DDP when
started by torchrun. Everything else around the epochs is a callback (`common.training.callbacks`)."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler, WeightedRandomSampler

from common.errors import UserError
from common.runtime.interrupt import Terminated, stop_point, stop_requested
from common.runtime.devices import Runtime
from common.runtime.process import carry_determinism_to_the_compiler
from common.runtime.sharding import all_reduce_max, all_reduce_sum
from common.training.callbacks import CHECKPOINT_NAME, Callback, Checkpoint, EarlyStopping, Progress, RankRandomStreams
from common.training.spec import Step, TrainSpec
from common.training.workload import WorkloadProbe

log = logging.getLogger(__name__)


def supervised(loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Step:
    """The usual step: the last tensor of a batch is the target, the others are the model's inputs."""

    def step(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        *inputs, target = batch
        return loss_fn(model(*inputs).float(), target)

    step.predict = lambda model, batch: model(*batch[:-1])  # what serving runs, for the workload facts
    return step


class TensorBatches:
    """Mini-batches sliced from tensors already in memory, sharded by rank under DDP: per-item indexing through a
    DataLoader costs more than a small model itself. With `weights`, each epoch draws as many rows with replacement
    in proportion to them; with `max_batches`, an epoch stops after that many batches (a fresh sample each epoch)."""

    def __init__(self, *tensors: torch.Tensor, batch_size: int, shuffle: bool = True, seed: int = 0,
                 rank: int = 0, world_size: int = 1, weights: torch.Tensor | None = None,
                 max_batches: int | None = None):
        self.tensors, self.batch_size, self.shuffle, self.seed = tensors, batch_size, shuffle, seed
        self.rank, self.world_size, self.weights, self.max_batches = rank, world_size, weights, max_batches
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _indices(self) -> torch.Tensor:
        n = len(self.tensors[0])
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        if self.weights is not None:
            order = torch.multinomial(self.weights.double().cpu(), n, replacement=True, generator=generator)
        elif self.shuffle and self.max_batches and self.max_batches * self.batch_size * self.world_size < n:
            # a sample of the rows, without the permutation of all of them (800 MB at 100 M rows)
            order = torch.randint(n, (self.max_batches * self.batch_size * self.world_size,), generator=generator)
        elif self.shuffle:
            order = torch.randperm(n, generator=generator)
        else:
            order = torch.arange(n)
        padding = math.ceil(len(order) / self.world_size) * self.world_size - len(order)
        if padding:
            order = torch.cat([order, order[:padding]])  # pad as DistributedSampler does
        return order[self.rank :: self.world_size].to(self.tensors[0].device)

    def __len__(self) -> int:
        batches = math.ceil(math.ceil(len(self.tensors[0]) / self.world_size) / self.batch_size)
        return min(batches, self.max_batches) if self.max_batches else batches

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        indices = self._indices()
        if self.max_batches:
            indices = indices[: self.max_batches * self.batch_size]
        for start in range(0, len(indices), self.batch_size):
            batch = indices[start : start + self.batch_size]
            yield tuple(tensor[batch] for tensor in self.tensors)


OPTIMIZERS = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}


def make_optimizer(name: str, parameters: Iterable, runtime: Runtime, **options) -> torch.optim.Optimizer:
    """Adam or AdamW in one fused kernel where the device has one: the default's launch per tensor and operation
    bounds small models on a GPU and costs a tenth of a step on a CPU."""
    return OPTIMIZERS[name](parameters, fused=runtime.device.type in ("cpu", "cuda") or None, **options)


def make_loader(dataset: Dataset, batch_size: int, runtime: Runtime, *, shuffle: bool = True,
                num_workers: int = 0, seed: int = 0, weights: torch.Tensor | None = None) -> DataLoader:
    """A DataLoader for data that does not fit in memory; `weights` draws rows in proportion to them (not under DDP)."""
    sampler = None
    if weights is not None:
        if runtime.distributed:
            raise UserError("a weighted sampler cannot be combined with DDP here; use class weights in the loss")
        sampler = WeightedRandomSampler(weights.double(), len(dataset), generator=torch.Generator().manual_seed(seed))
    elif runtime.distributed:
        sampler = DistributedSampler(dataset, runtime.world_size, runtime.rank, shuffle=shuffle, seed=seed)
    return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle and sampler is None, sampler=sampler,
                      num_workers=num_workers, pin_memory=runtime.device.type == "cuda",
                      persistent_workers=num_workers > 0)


def synchronised_batch_norm(model: nn.Module, runtime: Runtime) -> nn.Module:
    """Batch norm over the global batch under DDP on GPUs (a small per-GPU batch's statistics are noisy); CPU
    (gloo) jobs keep per-rank batch norm. The names stay, so that checkpoints load into plain BatchNorm."""
    if runtime.distributed and runtime.device.type == "cuda":
        return nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return model


def all_reduce_mean(values: dict[str, float], runtime: Runtime) -> dict[str, float]:
    if not runtime.distributed or not values:
        return values
    keys = sorted(values)
    tensor = all_reduce_sum(torch.tensor([float(values[key]) for key in keys], dtype=torch.float64,
                                         device=runtime.device), runtime)
    return dict(zip(keys, (tensor / runtime.world_size).tolist()))


def stop_if_any_rank_asked(runtime: Runtime) -> None:
    """Every rank stops at the same point when any of them got Ctrl-C or SIGTERM."""
    if not runtime.distributed:
        stop_point()
        return
    if all_reduce_max(float(stop_requested()), runtime):
        stop_point()
        raise Terminated("another rank was asked to stop")


@dataclass
class FitResult:
    best_metric: float
    best_epoch: int
    epochs_run: int
    resumed_from: int | None = None
    history: list[dict[str, float]] = field(default_factory=list)


class Trainer:
    """Fits `model` through `step` as `spec` says (`scheduler` stepped after each epoch); `callbacks` join its own."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, step: Step, runtime: Runtime,
                 spec: TrainSpec, *, scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
                 callbacks: Iterable[Callback] = ()):
        settings = spec.settings
        early_stopping = EarlyStopping(spec.monitor, spec.mode, settings.patience, spec.tie_break)
        self.runtime = runtime
        self.model = synchronised_batch_norm(model, runtime).to(runtime.device)
        self.module = self.model
        if runtime.distributed:
            self.model = DistributedDataParallel(self.model, device_ids=[runtime.device.index]
                                                 if runtime.device.type == "cuda" else None)
        if runtime.compile:
            carry_determinism_to_the_compiler()
            self.model = torch.compile(self.model)  # trains compiled; validation and checkpoints use `module`
        self.optimizer = optimizer
        self.step = step
        self.spec = spec
        self.scheduler = scheduler
        self.log_metrics = spec.log_metrics or (lambda metrics, step: None)
        self.predict = spec.predict or getattr(step, "predict", None)
        self.scaler = torch.amp.GradScaler(runtime.device.type, enabled=runtime.amp_dtype == torch.float16)
        self.callbacks: list[Callback] = [RankRandomStreams(runtime), early_stopping,
                                          Progress(spec.monitor, early_stopping), *callbacks]
        if spec.checkpoint_dir is not None:
            self.callbacks.append(Checkpoint(spec.checkpoint_dir / CHECKPOINT_NAME, settings.checkpoint_every_s,
                                             runtime))
        self.callbacks.append(WorkloadProbe())
        # what a fit is at, for the callbacks
        self.batches: Iterable = ()
        self.history: list[dict[str, float]] = []
        self.epoch = -1
        self.resumed_from: int | None = None
        self.should_stop, self.samples_per_epoch = False, 0

    def state_dict(self, finished: bool) -> dict:
        state = {"epoch": self.epoch, "model": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                 "scheduler": self.scheduler.state_dict() if self.scheduler else None,
                 "scaler": self.scaler.state_dict(), "history": self.history, "finished": finished}
        for callback in self.callbacks:
            own = callback.state_dict()
            if clash := own.keys() & state.keys():
                raise ValueError(f"{type(callback).__name__} would overwrite the checkpoint's {sorted(clash)}")
            state.update(own)
        return state

    def load_state_dict(self, state: dict) -> None:
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler and state["scheduler"]:
            self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        self.epoch, self.history, self.resumed_from = state["epoch"], state["history"], state["epoch"] + 1
        for callback in self.callbacks:
            callback.load_state_dict(state)

    def _train_epoch(self, batches: Iterable) -> dict[str, float]:
        """One pass over `batches`. Nothing in a step reads a value back from the device (the loss is summed there),
        so that on a GPU the host queues step after step without waiting."""
        self.model.train()
        device, amp_dtype = self.runtime.device, self.runtime.amp_dtype
        autocast = partial(torch.autocast, device.type, dtype=amp_dtype) if amp_dtype is not None else nullcontext
        clip = self.spec.settings.grad_clip
        parameters = list(self.model.parameters()) if clip else []
        # A model of independent members (an ensemble with stacked parameters) clips each member's gradient alone.
        clip_gradients = getattr(self.module, "clip_grad_norm_", None) or partial(nn.utils.clip_grad_norm_, parameters)
        hooks = [callback for callback in self.callbacks
                 if type(callback).on_train_batch_end is not Callback.on_train_batch_end]
        check_stop = not self.runtime.distributed
        total_loss = torch.zeros((), device=device)
        samples, wait, index = 0, 0.0, 0
        started = time.perf_counter()
        iterator = iter(batches)
        while True:
            if check_stop:
                stop_point()
            fetch = time.perf_counter()
            try:
                batch = next(iterator)
            except StopIteration:
                break
            wait += time.perf_counter() - fetch
            batch = tuple(tensor if tensor.device == device else tensor.to(device, non_blocking=True)
                          for tensor in batch)
            with autocast():
                loss = self.step(self.model, batch).float()
            self.optimizer.zero_grad(set_to_none=True)
            self.scaler.scale(loss).backward()  # a scaler that is not enabled (not fp16) passes each call through
            if clip:
                self.scaler.unscale_(self.optimizer)
                clip_gradients(clip)
            self.scaler.step(self.optimizer)
            self.scaler.update()
            size = len(batch[0])
            total_loss.add_(loss.detach(), alpha=size)  # summed on the device: no sync per step
            samples += size
            for callback in hooks:
                callback.on_train_batch_end(self, index, batch, loss)
            index += 1
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - started
        self.samples_per_epoch = samples * self.runtime.world_size
        return {"train/loss": total_loss.item() / max(samples, 1),
                "throughput/samples_per_s": samples * self.runtime.world_size / max(elapsed, 1e-9),
                "time/data_wait_share": wait / max(elapsed, 1e-9)}

    def fit(self, batches: Iterable, validate: Callable[[nn.Module], dict[str, float]],
            resume: bool = False) -> FitResult:
        """Train for `settings.epochs`, or until a callback stops the fit. `validate(model)` returns metrics named as
        logged, the spec's `monitor` among them; it runs every `settings.validate_every`-th epoch and after the last."""
        spec, settings = self.spec, self.spec.settings
        self.batches, self.history, self.epoch = batches, [], -1
        self.resumed_from, self.should_stop = None, False
        checkpoint = next((callback for callback in self.callbacks if isinstance(callback, Checkpoint)), None)
        state = checkpoint.read() if resume and checkpoint is not None else None
        if state is not None:
            self.load_state_dict(state)
            if state["finished"]:  # its model is the best epoch's: the fit put them in before writing it
                return self._result()
            log.info("%s: resumed from the checkpoint after epoch %d", spec.name, state["epoch"] + 1)
        for callback in self.callbacks:
            callback.on_fit_start(self)
        start_epoch = self.epoch + 1
        for epoch in range(start_epoch, settings.epochs):
            stop_if_any_rank_asked(self.runtime)
            if hasattr(batches, "set_epoch"):
                batches.set_epoch(epoch)
            elif isinstance(getattr(batches, "sampler", None), DistributedSampler):
                batches.sampler.set_epoch(epoch)
            metrics = self._train_epoch(batches)
            if self.runtime.compile and epoch == start_epoch:  # compilation time is not the model's speed
                metrics.pop("throughput/samples_per_s")
            validating = (epoch + 1) % settings.validate_every == 0 or epoch + 1 == settings.epochs
            if validating:
                self.model.eval()
                with torch.no_grad(), torch.autocast(self.runtime.device.type, dtype=self.runtime.amp_dtype,
                                                     enabled=self.runtime.amp_dtype is not None):
                    metrics.update(validate(self.module))
            if self.scheduler is not None:
                self.scheduler.step()
            metrics = {key: float(value) for key, value in all_reduce_mean(metrics, self.runtime).items()}
            for required in (spec.monitor, spec.tie_break) if validating else ():
                if required is not None and required not in metrics:
                    raise KeyError(f"validate() returned no '{required}' (got {sorted(metrics)})")
            self.epoch = epoch
            self.history.append({"epoch": epoch, **metrics})
            self.log_metrics(metrics, spec.step_offset + epoch)
            for callback in self.callbacks:
                callback.on_epoch_end(self, epoch, metrics)
            if self.should_stop:
                break
        for callback in self.callbacks:
            callback.on_fit_end(self)
        return self._result()

    def _result(self) -> FitResult:
        best = next((callback for callback in self.callbacks if isinstance(callback, EarlyStopping)), None)
        if best is not None:
            best_metric, best_epoch = best.best, best.best_epoch
        elif self.history:
            best_metric, best_epoch = self.history[-1][self.spec.monitor], self.epoch
        else:
            best_metric, best_epoch = math.nan, -1
        return FitResult(best_metric, best_epoch, self.epoch + 1, self.resumed_from, self.history)
