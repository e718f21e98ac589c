"""What a torch model's work is, in units that carry to another machine, so that `usecases advise` can estimate it
there: measured at the end of a fit by its `WorkloadProbe` on one batch, logged as `model/<name>/<fact>` (the facts
are listed in docs/advisor.md). Memory traffic is estimated: a training step reads the weights twice, writes their
gradients, and the optimizer reads and writes weights and its state once; the activations saved for backward are
written and read once, the batch read once. A prediction reads the weights, the batch and its activations, and
writes its output."""

from __future__ import annotations

import itertools
import math
import time
from collections import Counter
from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from common.training.callbacks import Callback, FitState
from common.training.spec import Predict

LOADER_BATCHES = 8
LOADER_SECONDS = 2.0
PREDICT_SAMPLES = 256  # of the batch, for a prediction: a recommender's scores are users x every item

aten = torch.ops.aten

# Operators whose output the host needs before it can return: a scalar read, or an output shape that depends on the
# values (nonzero and everything that selects by a mask or counts).
SYNCING = {aten._local_scalar_dense.default,  # .item(), float(t), bool(t), `if t:`
           aten.is_nonzero.default, aten.equal.default, aten.nonzero.default, aten.argwhere.default,
           aten.masked_select.default, aten._unique2.default, aten.unique_dim.default, aten.unique_consecutive.default,
           aten.repeat_interleave.Tensor,  # the output length is the sum of the repeats
           aten.bincount.default}
# Indexing with a boolean mask finds the mask's true positions first (a nonzero).
MASK_INDEXED = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}


def _masked(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8) for index in indices)


class HostSyncs(TorchDispatchMode):
    """Counts the operators that make the host wait for the device, by name in `by_name`: on a GPU one in a training
    step stalls the host until the queue drains. Counted as dispatched, on any device, so that a CPU test shows them:
        with HostSyncs() as syncs:
            loss = step(model, batch)
            loss.backward()
        assert syncs.count == 0, syncs.by_name
    """

    def __init__(self):
        super().__init__()
        self.by_name: Counter[str] = Counter()

    @property
    def count(self) -> int:
        return sum(self.by_name.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in SYNCING or (func in MASK_INDEXED and _masked(args)):
            output_size = kwargs.get("output_size") if func is aten.repeat_interleave.Tensor else None
            if output_size is None:
                self.by_name[str(func.overloadpacket.__name__)] += 1
        return func(*args, **kwargs)


def steady_step_syncs(loss: Callable[[], torch.Tensor], optimizer: torch.optim.Optimizer,
                      before_step: Callable[[], object] = lambda: None) -> HostSyncs:
    """The host synchronisations of a training step (`loss()`, its backward, `before_step()` such as clipping, the
    optimiser's step), counted on the second step: the first makes what is made once (the optimiser's state)."""

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss().backward()
        before_step()
        optimizer.step()

    step()
    with HostSyncs() as syncs:
        step()
    return syncs


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
    """Samples per second of the input pipeline alone (a few batches), and the first batch, to measure the model on."""
    iterator = itertools.islice(batches, LOADER_BATCHES)  # iter(batches) now, before the clock starts
    first, samples, started = None, 0, time.perf_counter()
    for batch in iterator:
        first = batch if first is None else first
        samples += len(batch[0])
        if time.perf_counter() - started > LOADER_SECONDS:
            break
    elapsed = time.perf_counter() - started
    return (samples / elapsed if samples and elapsed > 0 else math.nan), first


def measure_model(module: nn.Module, step: Callable, predict: Predict | None, batch: tuple[torch.Tensor, ...],
                  optimizer: torch.optim.Optimizer, device: torch.device, amp_dtype: torch.dtype | None
                  ) -> dict[str, float]:
    """The model's facts on one batch; its gradients cleared and its buffers (batch norm's running statistics)
    restored, so that the model evaluated and logged after it is the one trained."""
    buffers = {name: buffer.detach().clone() for name, buffer in module.named_buffers()}
    try:
        return _measure(module, step, predict, batch, optimizer, device, amp_dtype)
    finally:
        with torch.no_grad():
            for name, buffer in module.named_buffers():
                buffer.copy_(buffers[name])


def _measure(module: nn.Module, step: Callable, predict: Predict | None, batch: tuple[torch.Tensor, ...],
             optimizer: torch.optim.Optimizer, device: torch.device, amp_dtype: torch.dtype | None) -> dict[str, float]:
    size = len(batch[0])
    parameters = list(module.parameters())
    weights = _bytes(parameters)
    state = _bytes(value for per_parameter in optimizer.state.values() for value in per_parameter.values()
                   if torch.is_tensor(value) and value.dim() > 0) or 2 * weights  # before any step: Adam's moments
    own = {parameter.data_ptr() for parameter in parameters}
    saved = [0]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        # a weight kept for backward is not an activation, nor is a sparse constant (LightGCN's graph)
        if tensor.layout == torch.strided and tensor.data_ptr() not in own:
            saved[0] += tensor.numel() * tensor.element_size()
        return tensor

    cuda = device.type == "cuda"
    autocast = dict(device_type=device.type, dtype=amp_dtype, enabled=amp_dtype is not None)
    with torch.random.fork_rng(devices=[device] if cuda else []):
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
    return {"params": float(sum(parameter.numel() for parameter in parameters)), "weight_bytes": float(weights),
            "batch_size": float(size), "train_ops_per_step": float(train_ops.ops),
            "host_syncs_per_step": float(syncs.count), "infer_ops_per_batch": float(infer_ops),
            "train_flops_per_sample": train_flops / size, "infer_flops_per_sample": infer_flops / size,
            "train_bytes_per_sample": (5 * weights + 2 * state + 2 * activations + inputs) / size,
            "infer_bytes_per_sample": (weights + activations + inputs + output_bytes) / size,
            "peak_memory_gb": (peak if peak is not None else estimated_peak) / 2**30,
            "peak_memory_measured": float(peak is not None)}


def _inference(module: nn.Module, predict: Predict | None, batch: tuple[torch.Tensor, ...],
               autocast: dict) -> tuple[float, float, float]:
    """FLOPs, output bytes and operator calls of `predict` on the batch (from PREDICT_SAMPLES of it), or NaN."""
    if predict is None:
        return math.nan, 0, math.nan
    size = len(batch[0])
    part = tuple(tensor[:PREDICT_SAMPLES] for tensor in batch)
    with torch.no_grad(), FlopCounterMode(display=False) as counter, OpCounter() as ops, torch.autocast(**autocast):
        output = predict(module, part)
    return counter.get_total_flops() / len(part[0]) * size, _bytes([output]) / len(part[0]) * size, ops.ops


class WorkloadProbe(Callback):
    """At the end of a fit that trained, the model's facts, with the random state restored after, so that the run goes
    on as it would have; logged by rank 0. Every rank measures: SyncBatchNorm's forward is a collective under DDP."""

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
