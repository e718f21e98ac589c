"""The training loop every torch model goes through.

A use case gives it a step function (model, batch) -> loss; the loop does the rest: mixed precision, gradient
clipping, early stopping on a named validation metric with the best weights kept, atomic checkpoints and resume,
throughput and data-wait share, a progress line, and DDP when started by torchrun.

Under DDP every rank draws its own random numbers (dropout, augmentations, sampled negatives: identical draws on
every rank would repeat each one world-size times an epoch), and its own random state is checkpointed. Rank 0
alone writes checkpoints, possibly to a folder only its machine sees, so rank 0 alone decides whether there is one
to resume and sends its state to the others.
"""

from __future__ import annotations

import copy
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler, WeightedRandomSampler
from tqdm.auto import tqdm

from common.config import TrainConfig
from common.errors import UserError
from common.runtime.interrupt import Terminated, stop_point, stop_requested
from common.runtime.devices import Runtime
from common.training.workload import Predict, loader_rate, measure_model

log = logging.getLogger(__name__)

CHECKPOINT_NAME = "last.pt"
RANK_SEED_STRIDE = 0x9E3779B97F4A7C15  # far-apart seeds for the ranks' random streams
PROGRESS_EVERY_S = 30  # off a terminal (CI, a log file, `usecases demo`), a progress line at most this often

Step = Callable[[nn.Module, tuple[torch.Tensor, ...]], torch.Tensor]


def supervised(loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Step:
    """The usual step: the last tensor of a batch is the target, the others are the model's inputs."""

    def step(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        *inputs, target = batch
        return loss_fn(model(*inputs).float(), target)

    step.predict = lambda model, batch: model(*batch[:-1])  # what serving runs, for the workload facts
    return step


class TensorBatches:
    """Mini-batches sliced from tensors already in memory (on the GPU when there is one).

    Per-item indexing through a DataLoader costs more than the model itself for small tabular or image
    data that fits in memory; this shuffles indices once per epoch and slices, sharded by rank under DDP.
    With `weights`, each epoch draws as many rows with replacement in proportion to them (a weighted sampler).
    With `max_batches`, an epoch stops after that many batches of its shuffled order (a fresh sample each epoch).
    """

    def __init__(self, *tensors: torch.Tensor, batch_size: int, shuffle: bool = True, seed: int = 0,
                 rank: int = 0, world_size: int = 1, weights: torch.Tensor | None = None,
                 max_batches: int | None = None):
        self.tensors = tensors
        self.max_batches = max_batches
        self.weights = weights
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
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


def make_loader(dataset: Dataset, batch_size: int, runtime: Runtime, *, shuffle: bool = True,
                num_workers: int = 0, seed: int = 0, weights: torch.Tensor | None = None) -> DataLoader:
    """A DataLoader for data that does not fit in memory: workers, pinned memory, and a DistributedSampler.

    `weights` draws rows with replacement in proportion to them; not under DDP, whose sampler shards by rank.
    """
    sampler = None
    if weights is not None:
        if runtime.distributed:
            raise UserError("a weighted sampler cannot be combined with DDP here; use class weights in the loss")
        sampler = WeightedRandomSampler(weights.double(), len(dataset), generator=torch.Generator().manual_seed(seed))
    elif runtime.distributed:
        sampler = DistributedSampler(dataset, runtime.world_size, runtime.rank, shuffle=shuffle, seed=seed)
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=shuffle and sampler is None,
        sampler=sampler,
        num_workers=num_workers,
        pin_memory=runtime.device.type == "cuda",
        persistent_workers=num_workers > 0,
    )


def synchronised_batch_norm(model: nn.Module, runtime: Runtime) -> nn.Module:
    """Batch norm over the global batch under DDP on GPUs: each rank's batch is 1/world_size of it, and statistics
    of a small per-GPU batch are noisy. SyncBatchNorm runs on CUDA only, so CPU (gloo) jobs keep per-rank batch norm.
    The parameters and buffers keep their names, so checkpoints and logged weights load into plain BatchNorm."""
    if runtime.distributed and runtime.device.type == "cuda":
        return nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return model


def all_reduce_mean(values: dict[str, float], runtime: Runtime) -> dict[str, float]:
    if not runtime.distributed or not values:
        return values
    keys = sorted(values)
    tensor = torch.tensor([float(values[key]) for key in keys], dtype=torch.float64, device=runtime.device)
    dist.all_reduce(tensor)
    return dict(zip(keys, (tensor / runtime.world_size).tolist()))


def stop_if_any_rank_asked(runtime: Runtime) -> None:
    """Every rank stops at the same point when any of them got Ctrl-C or SIGTERM."""
    if not runtime.distributed:
        stop_point()
        return
    flag = torch.tensor([float(stop_requested())], device=runtime.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item():
        stop_point()
        raise Terminated("another rank was asked to stop")


def save_atomic(state: dict, path: Path) -> None:
    """Write beside the target, then rename: a kill mid-write never leaves a truncated checkpoint."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    try:
        torch.save(state, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


@dataclass
class FitResult:
    best_metric: float
    best_epoch: int
    epochs_run: int
    resumed_from: int | None = None
    history: list[dict[str, float]] = field(default_factory=list)


class Trainer:
    """`settings` gives epochs, patience, gradient clipping and the checkpoint interval; `monitor` names the
    validation metric that picks the best epoch, `mode` whether lower (min) or higher (max) is better. `tie_break`
    names a validation metric (lower is better, a loss) that decides between epochs with the same `monitor` value:
    a saturated metric (a validation AUC of 1.0) would otherwise keep the first, least-trained of them."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        step: Step,
        runtime: Runtime,
        settings: TrainConfig,
        *,
        monitor: str,
        mode: str = "min",
        scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
        checkpoint_dir: Path | None = None,
        log_metrics: Callable[[dict[str, float], int], None] | None = None,
        step_offset: int = 0,
        name: str = "train",
        predict: Predict | None = None,
        model_name: str | None = None,
        tie_break: str | None = None,
    ):
        if mode not in ("min", "max"):
            raise ValueError(f"mode must be min or max, got {mode}")
        self.runtime = runtime
        self.model = synchronised_batch_norm(model, runtime).to(runtime.device)
        self.module = self.model
        if runtime.distributed:
            device_ids = [runtime.device.index] if runtime.device.type == "cuda" else None
            self.model = DistributedDataParallel(self.model, device_ids=device_ids)
        if runtime.compile:
            self.model = torch.compile(self.model)  # trains compiled; validation and checkpoints use `module`
        self.optimizer = optimizer
        self.step = step
        self.settings = settings
        self.monitor = monitor
        self.mode = mode
        self.tie_break = tie_break
        self.scheduler = scheduler
        self.checkpoint_path = checkpoint_dir / CHECKPOINT_NAME if checkpoint_dir else None
        self.log_metrics = log_metrics or (lambda metrics, step: None)
        self.step_offset = step_offset
        self.name = name
        self.predict = predict or getattr(step, "predict", None)
        self.model_name = model_name or name  # of the workload facts, shared by the fits of one model
        self.samples_per_epoch = 0
        fp16 = runtime.amp_dtype == torch.float16
        self.scaler = torch.amp.GradScaler(runtime.device.type, enabled=fp16)

    def _improved(self, metrics: dict[str, float], best: float, best_tie: float) -> bool:
        value = metrics[self.monitor]
        if math.isnan(value):
            return False
        if value == best and self.tie_break is not None:
            return metrics[self.tie_break] < best_tie
        return value < best if self.mode == "min" else value > best

    def _state(self, epoch: int, best: float, best_epoch: int, best_state: dict, bad_epochs: int,
               history: list, finished: bool) -> dict:
        return {
            "epoch": epoch,
            "model": self.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler else None,
            "scaler": self.scaler.state_dict(),
            "best_metric": best,
            "best_epoch": best_epoch,
            "best_state": best_state,
            "bad_epochs": bad_epochs,
            "history": history,
            "finished": finished,
            "torch_rng": self._every_rank(torch.get_rng_state()),
            "cuda_rng": self._every_rank(torch.cuda.get_rng_state_all() if self.runtime.device.type == "cuda" else []),
        }

    def _every_rank(self, value):
        """Each rank's `value`, in rank order (a list of one outside DDP): every rank calls this together."""
        if not self.runtime.distributed:
            return [value]
        values = [None] * self.runtime.world_size
        dist.all_gather_object(values, value)
        return values

    def _checkpoint(self) -> dict | None:
        """The checkpoint to resume from, as rank 0 finds it, on every rank (None where rank 0 has none); its tensors
        on the CPU, from where loading the state dicts copies them to the device."""
        state = None
        if self.runtime.is_main and self.checkpoint_path is not None and self.checkpoint_path.is_file():
            state = torch.load(self.checkpoint_path, map_location="cpu", weights_only=True)
        if self.runtime.distributed:
            shared = [state]
            dist.broadcast_object_list(shared, src=0)
            state = shared[0]
        return state

    def _restore_random_state(self, state: dict) -> None:
        """This rank's random state as it was saved (a job restarted on fewer or more ranks reuses them in turn; a
        checkpoint written before the states were per rank holds one state, not a list of them)."""
        states, cuda_states = state["torch_rng"], state["cuda_rng"]
        if torch.is_tensor(states):
            states, cuda_states = [states], [cuda_states]
        own = self.runtime.rank % len(states)
        torch.set_rng_state(states[own].cpu())
        if cuda_states[own] and self.runtime.device.type == "cuda":  # dropout, flips, negatives on the GPU
            torch.cuda.set_rng_state_all([rng.cpu() for rng in cuda_states[own]])

    def _own_random_stream(self) -> None:
        """Under DDP, a random stream per rank, derived from the seed (rank 0 keeps it, so a one-rank job and rank
        0 draw alike); DDP's first broadcast still gives every rank rank 0's initial weights."""
        if self.runtime.distributed and self.runtime.rank:
            torch.manual_seed((torch.initial_seed() + RANK_SEED_STRIDE * self.runtime.rank) % 2**63)

    def _save(self, state: dict) -> None:
        if self.checkpoint_path is not None and self.runtime.is_main:
            save_atomic(state, self.checkpoint_path)

    def _train_epoch(self, batches: Iterable) -> dict[str, float]:
        self.model.train()
        device = self.runtime.device
        total_loss = torch.zeros((), device=device)
        samples, wait = 0, 0.0
        started = time.perf_counter()
        iterator = iter(batches)
        while True:
            if not self.runtime.distributed:
                stop_point()
            fetch = time.perf_counter()
            try:
                batch = next(iterator)
            except StopIteration:
                break
            wait += time.perf_counter() - fetch
            batch = tuple(tensor.to(device, non_blocking=True) for tensor in batch)
            with torch.autocast(device.type, dtype=self.runtime.amp_dtype, enabled=self.runtime.amp_dtype is not None):
                loss = self.step(self.model, batch).float()
            self.optimizer.zero_grad(set_to_none=True)
            self.scaler.scale(loss).backward()
            if self.settings.grad_clip:
                self.scaler.unscale_(self.optimizer)
                nn.utils.clip_grad_norm_(self.model.parameters(), self.settings.grad_clip)
            self.scaler.step(self.optimizer)
            self.scaler.update()
            total_loss += loss.detach() * len(batch[0])  # summed on the device: no sync per step
            samples += len(batch[0])
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - started
        self.samples_per_epoch = samples * self.runtime.world_size
        return {
            "train/loss": total_loss.item() / max(samples, 1),
            "throughput/samples_per_s": samples * self.runtime.world_size / max(elapsed, 1e-9),
            "time/data_wait_share": wait / max(elapsed, 1e-9),
        }

    def fit(self, batches: Iterable, validate: Callable[[nn.Module], dict[str, float]],
            resume: bool = False) -> FitResult:
        """Train for `settings.epochs`, or until `settings.patience` epochs bring no improvement; the best weights
        end in the model.

        `validate(model)` returns metrics named as logged (for example `val/qlike`), one of them `monitor`.
        """
        settings, monitor = self.settings, self.monitor
        best = math.inf if self.mode == "min" else -math.inf
        best_tie = math.inf
        best_epoch, bad_epochs, start_epoch, history = -1, 0, 0, []
        best_state = copy.deepcopy(self.module.state_dict())
        resumed_from = None
        state = self._checkpoint() if resume else None
        if state is None:
            self._own_random_stream()
        else:
            self.module.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            if self.scheduler and state["scheduler"]:
                self.scheduler.load_state_dict(state["scheduler"])
            self.scaler.load_state_dict(state["scaler"])
            self._restore_random_state(state)
            best, best_epoch, best_state = state["best_metric"], state["best_epoch"], state["best_state"]
            bad_epochs, history = state["bad_epochs"], state["history"]
            if self.tie_break is not None and best_epoch >= 0:
                best_tie = next(row[self.tie_break] for row in history if row["epoch"] == best_epoch)
            start_epoch = resumed_from = state["epoch"] + 1
            if state["finished"]:
                self.module.load_state_dict(best_state)
                return FitResult(best, best_epoch, state["epoch"] + 1, resumed_from, history)
            log.info("%s: resumed from the checkpoint after epoch %d", self.name, state["epoch"] + 1)

        epoch = start_epoch - 1
        on_terminal = sys.stderr.isatty()
        progress = tqdm(range(start_epoch, settings.epochs), desc=self.name, leave=False,
                        disable=not on_terminal or not self.runtime.is_main)
        last_line = time.perf_counter()
        for epoch in progress:
            stop_if_any_rank_asked(self.runtime)
            if hasattr(batches, "set_epoch"):
                batches.set_epoch(epoch)
            elif isinstance(getattr(batches, "sampler", None), DistributedSampler):
                batches.sampler.set_epoch(epoch)
            metrics = self._train_epoch(batches)
            if self.runtime.compile and epoch == start_epoch:  # compilation time is not the model's speed
                metrics.pop("throughput/samples_per_s")
            self.model.eval()
            with torch.no_grad(), torch.autocast(self.runtime.device.type, dtype=self.runtime.amp_dtype,
                                                 enabled=self.runtime.amp_dtype is not None):
                metrics.update(validate(self.module))
            if self.scheduler is not None:
                self.scheduler.step()
            metrics = {key: float(value) for key, value in all_reduce_mean(metrics, self.runtime).items()}
            if monitor not in metrics:
                raise KeyError(f"validate() returned no '{monitor}' (got {sorted(metrics)})")
            if self.tie_break is not None and self.tie_break not in metrics:
                raise KeyError(f"validate() returned no '{self.tie_break}' (got {sorted(metrics)})")
            value = metrics[monitor]
            if self._improved(metrics, best, best_tie):
                best, best_epoch, bad_epochs = value, epoch, 0
                best_tie = metrics.get(self.tie_break, math.inf)
                best_state = copy.deepcopy(self.module.state_dict())
            else:
                bad_epochs += 1
            history.append({"epoch": epoch, **metrics})
            self.log_metrics(metrics, self.step_offset + epoch)
            progress.set_postfix({monitor: f"{value:.4f}", "best": f"{best:.4f}"})
            if not on_terminal and self.runtime.is_main and time.perf_counter() - last_line >= PROGRESS_EVERY_S:
                log.info("%s: epoch %d/%d, %s %.4f (best %.4f at epoch %d)", self.name, epoch + 1, settings.epochs,
                         monitor, value, best, best_epoch + 1)
                last_line = time.perf_counter()
            stop = settings.patience is not None and bad_epochs >= settings.patience
            if (epoch + 1) % settings.checkpoint_every == 0 and not stop:
                self._save(self._state(epoch, best, best_epoch, best_state, bad_epochs, history, False))
            if stop:
                break
        self.module.load_state_dict(best_state)
        self._save(self._state(epoch, best, best_epoch, best_state, bad_epochs, history, True))
        if history:  # every rank measures: SyncBatchNorm's forward is a collective under DDP; rank 0 logs
            facts = self._workload(batches, history[-1], epoch + 1)
            if self.runtime.is_main:
                self.log_metrics(facts, self.step_offset + epoch)
        return FitResult(best, best_epoch, epoch + 1, resumed_from, history)

    def _workload(self, batches: Iterable, last: dict[str, float], epochs_run: int) -> dict[str, float]:
        """The model's workload facts (`common.training.workload`), under `model/<model_name>/`, measured on one batch with the
        random state restored after, so that the run goes on as it would have without them."""
        device = self.runtime.device
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            loader_samples_per_s, batch = loader_rate(batches)
            if batch is None:
                return {}
            batch = tuple(tensor.to(device) for tensor in batch)
            facts = measure_model(self.module, self.step, self.predict, batch, self.optimizer, device,
                                  self.runtime.amp_dtype)
        facts.update(loader_samples_per_s=loader_samples_per_s, samples_per_epoch=float(self.samples_per_epoch),
                     epochs_run=float(epochs_run), train_samples_per_s=last.get("throughput/samples_per_s", math.nan),
                     data_wait_share=last.get("time/data_wait_share", math.nan))
        return {f"model/{self.model_name}/{key}": value for key, value in facts.items() if not math.isnan(value)}
