"""What a run's work is, in units that carry to another machine, so that `usecases advise` can estimate it there.

Per torch model, measured at the end of a fit by its `WorkloadProbe` on one batch (`measure_model`), logged as metrics
`model/<name>/<fact>`:

- `params`, `weight_bytes`; `batch_size`; `samples_per_epoch`; `epochs_run`;
- `train_ops_per_step`, `infer_ops_per_batch`: operators dispatched (on a GPU, kernel launches: the bound of small
  models); `host_syncs_per_step`: those of a training step that make the host wait for the device
  (`common.training.syncs`), each a drained GPU queue;
- `train_flops_per_sample`, `infer_flops_per_sample`: `torch.utils.flop_counter.FlopCounterMode` over one training
  step (forward and backward) and one prediction (what serving does: a forward pass, or a user's full ranking);
- `train_bytes_per_sample`, `infer_bytes_per_sample` (estimated): memory traffic per sample. A training step reads
  the weights twice (forward, backward), writes their gradients, and the optimizer reads and writes weights and its
  state once; the activations saved for backward (counted with saved-tensor hooks) are written and read once; the
  batch is read once. A prediction reads the weights, the batch and its activations, and writes its output;
- `peak_memory_gb` and `peak_memory_measured`: `torch.cuda.max_memory_allocated` over that step on a GPU (1),
  else the sum of weights, gradients, optimizer state, saved activations and the batch (0);
- `loader_samples_per_s`: the input pipeline alone, timed over a few batches with the model removed;
- `train_samples_per_s` and `data_wait_share`: the last epoch's, as the loop measured them.

The rest of a run (the GARCH fits, ItemKNN, EASE, the evaluation, the replays) is timed as its phases
(`common.runtime.phases`), each saying whether a GPU, more cores or neither would shorten it.

A run logged by another tool with the same keys can be advised on as well.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from common.training.callbacks import Callback, FitState
from common.training.spec import Predict
from common.training.syncs import HostSyncs

LOADER_BATCHES = 8
LOADER_SECONDS = 2.0
PREDICT_SAMPLES = 256  # of the batch, for a prediction: a recommender's scores are users x every item


class OpCounter(TorchDispatchMode):
    """How many operators run: on a GPU each is at least one kernel launch, which bounds small models' speed."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors)


def loader_rate(batches: Iterable) -> tuple[float, tuple[torch.Tensor, ...] | None]:
    """Samples per second the input pipeline delivers on its own (a few batches, at most LOADER_SECONDS), and
    the first batch, to measure the model on."""
    iterator: Iterator = iter(batches)
    first, samples, started = None, 0, time.perf_counter()
    for _ in range(LOADER_BATCHES):
        try:
            batch = next(iterator)
        except StopIteration:
            break
        first = batch if first is None else first
        samples += len(batch[0])
        if time.perf_counter() - started > LOADER_SECONDS:
            break
    elapsed = time.perf_counter() - started
    return (samples / elapsed if samples and elapsed > 0 else math.nan), first


def measure_model(module: nn.Module, step: Callable, predict: Predict | None, batch: tuple[torch.Tensor, ...],
                  optimizer: torch.optim.Optimizer, device: torch.device, amp_dtype: torch.dtype | None
                  ) -> dict[str, float]:
    """The per-model facts of the module docstring for one batch; the gradients it leaves are cleared, and the
    buffers (batch norm's running statistics, which a train-mode forward moves) and the random state (a sampler's
    negatives, dropout) are restored, so that the model evaluated and logged after it is the one trained."""
    buffers = {name: buffer.detach().clone() for name, buffer in module.named_buffers()}
    try:
        return _measure(module, step, predict, batch, optimizer, device, amp_dtype)
    finally:
        with torch.no_grad():
            for name, buffer in module.named_buffers():
                buffer.copy_(buffers[name])


def _measure(module: nn.Module, step: Callable, predict: Predict | None, batch: tuple[torch.Tensor, ...],
             optimizer: torch.optim.Optimizer, device: torch.device, amp_dtype: torch.dtype | None
             ) -> dict[str, float]:
    size = len(batch[0])
    parameters = list(module.parameters())
    weights = _bytes(parameters)
    state = _bytes(value for per_parameter in optimizer.state.values() for value in per_parameter.values()
                   if torch.is_tensor(value) and value.dim() > 0)
    state = state or 2 * weights  # before the first step: Adam's two moments
    own = {parameter.data_ptr() for parameter in parameters}
    saved = [0]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        # a weight kept for backward is not an activation, nor is a sparse constant (LightGCN's graph)
        if tensor.layout == torch.strided and tensor.data_ptr() not in own:
            saved[0] += tensor.numel() * tensor.element_size()
        return tensor

    cuda = device.type == "cuda"
    devices = [device] if cuda else []
    autocast = dict(device_type=device.type, dtype=amp_dtype, enabled=amp_dtype is not None)
    with torch.random.fork_rng(devices=devices):
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        module.train()
        with FlopCounterMode(display=False) as counter, OpCounter() as train_ops, HostSyncs() as syncs, \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with torch.autocast(**autocast):
                loss = step(module, batch).float()
            loss.backward()
        train_flops = counter.get_total_flops()
        peak = torch.cuda.max_memory_allocated(device) if cuda else None
        module.zero_grad(set_to_none=True)
        module.eval()
        infer_flops, output_bytes, infer_ops = _inference(module, predict, batch, autocast)
    inputs = _bytes(batch)
    activations = saved[0]
    estimated_peak = 2 * weights + state + activations + inputs
    return {
        "params": float(sum(parameter.numel() for parameter in parameters)),
        "weight_bytes": float(weights),
        "batch_size": float(size),
        "train_ops_per_step": float(train_ops.ops),
        "host_syncs_per_step": float(syncs.count),
        "infer_ops_per_batch": float(infer_ops),
        "train_flops_per_sample": train_flops / size,
        "infer_flops_per_sample": infer_flops / size,
        "train_bytes_per_sample": (5 * weights + 2 * state + 2 * activations + inputs) / size,
        "infer_bytes_per_sample": (weights + activations + inputs + output_bytes) / size,
        "peak_memory_gb": (peak if peak is not None else estimated_peak) / 2**30,
        "peak_memory_measured": float(peak is not None),
    }


def _inference(module: nn.Module, predict: Predict | None, batch: tuple[torch.Tensor, ...],
               autocast: dict) -> tuple[float, float, float]:
    """FLOPs, output bytes and operator calls of `predict` on the batch, measured on its first PREDICT_SAMPLES
    samples and scaled to the whole batch; NaN (0 bytes) without one."""
    if predict is None:
        return math.nan, 0, math.nan
    size = len(batch[0])
    part = tuple(tensor[:PREDICT_SAMPLES] for tensor in batch)
    with torch.no_grad(), FlopCounterMode(display=False) as counter, OpCounter() as ops, torch.autocast(**autocast):
        output = predict(module, part)
    return counter.get_total_flops() / len(part[0]) * size, _bytes([output]) / len(part[0]) * size, ops.ops


class WorkloadProbe(Callback):
    """At the end of a fit that trained, the model's facts, measured on one batch of the fit's batches with the random
    state restored after, so that the run goes on as it would have without them, and logged by rank 0 under
    `model/<model_name>/` (the spec's `model_name`, else its `name`). Every rank measures: SyncBatchNorm's forward
    is a collective under DDP."""

    def on_fit_end(self, trainer: FitState) -> None:
        if not trainer.history or trainer.spec.log_metrics is None:  # nothing trained, or nobody to log them to
            return
        device = trainer.runtime.device
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            loader_samples_per_s, batch = loader_rate(trainer.batches)
            if batch is None:
                return
            batch = tuple(tensor.to(device) for tensor in batch)
            facts = measure_model(trainer.module, trainer.step, trainer.predict, batch, trainer.optimizer, device,
                                  trainer.runtime.amp_dtype)
        last = trainer.history[-1]
        facts.update(loader_samples_per_s=loader_samples_per_s, samples_per_epoch=float(trainer.samples_per_epoch),
                     epochs_run=float(trainer.epoch + 1),
                     train_samples_per_s=last.get("throughput/samples_per_s", math.nan),
                     data_wait_share=last.get("time/data_wait_share", math.nan))
        if trainer.runtime.is_main:
            spec = trainer.spec
            model_name = spec.model_name or spec.name
            trainer.log_metrics({f"model/{model_name}/{key}": value for key, value in facts.items()
                                 if not math.isnan(value)}, spec.step_offset + trainer.epoch)
