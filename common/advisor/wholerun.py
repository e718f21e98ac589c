"""The whole run on an instance, phase by phase, as a range: what `usecases advise` prices.

A run logs its phases (`common.runtime.phases`: `time/<phase>_s` and how each scales). On another machine:

- a torch model's fit (`fit/<model>`, with the model's facts `model/<model>/...`) takes its steps, estimated
  (`common.advisor.estimate`: the device's roofline and the host's cost per step), over every epoch the run trained,
  each epoch's last partial batch a step of its own; on several GPUs, the DDP speed-up (`common.advisor.multigpu`);
  plus the fit's other time on the run's machine (validation, checkpoints, the probe: its phase's seconds less its
  steps' measured time), scaled as device work, at least one validation batch an epoch;
- other `device` work (evaluation, replay, fold-in, predictions) is divided by a speed-up derived from the run's own
  rates: its model's (the phase's name ends in the model's; else the model that trained longest), estimated rate on
  one GPU over its measured rate. That speed-up is the model's training's; another phase of the model can be more
  host-bound (then a GPU gains less, even loses: down to 1 / DEVICE_SLOWDOWN from a CPU run) or more device-bound
  (then it gains up to the device-only roofline's rate over the measured rate), which sets the range;
- `cores` work is shared among the instance's vCPUs as it was among the run's cores; `serial` work, and the time no
  phase covered, takes what it took, at another host's speed (HOST_SPEED);
- the command's start before the run's clock (PROCESS_START_S) is added, and a run moved from a CPU to a GPU adds
  the GPU's start-up (GPU_STARTUP_S).

Every figure is (low, expected, high) seconds; the training part is the sum of the torch models' fits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from common.advisor.catalog import GPU, Instance, Link
from common.advisor.estimate import Estimate, Range, Workload, device_only_rate, estimate
from common.advisor.facts import RunFacts
from common.advisor.host import (DEVICE_SLOWDOWN, GPU_STARTUP_S, HOST_SPEED, INFER_LOOP_OPS, LOOP_OPS,
                                 OPTIMIZER_OPS, PROCESS_START_S)
from common.advisor.multigpu import Scaling, data_parallel

NONE = Range(0.0, 0.0, 0.0)


def train_workload(facts: RunFacts, model: dict[str, float]) -> Workload:
    """One model's training step as measured; the rate measured on a GPU (the run's, or another run's of its preset),
    if any, calibrates it."""
    gpu = facts.gpu or facts.rates_gpu
    measured = model.get("measured_train_samples_per_s") if gpu is not None else None
    optimizer = model.get("optimizer_ops_per_step")
    extra = (optimizer + LOOP_OPS,) * 3 if optimizer is not None else OPTIMIZER_OPS
    return Workload("train", model.get("train_flops_per_sample", math.nan),
                    model.get("train_bytes_per_sample", math.nan), facts.precision, int(model.get("batch_size", 1)),
                    ops_per_batch=model.get("train_ops_per_step", 0.0), weight_bytes=model.get("weight_bytes", 0.0),
                    peak_memory_gb=model.get("peak_memory_gb", math.nan),
                    loader_samples_per_s=model.get("loader_samples_per_s", math.nan),
                    loader_cores=int(model.get("loader_cores", facts.cores)),
                    measured_gpu=gpu if measured else None, measured_samples_per_s=measured or None,
                    extra_ops=extra if facts.probed else (0.0, 0.0, 0.0),
                    syncs_per_batch=model.get("host_syncs_per_step", 0.0))


def serve_workload(facts: RunFacts, model: dict[str, float]) -> Workload:
    """One model's served batch: a forward pass (or a user's full ranking) and its loop, its answer read back."""
    gpu = facts.gpu or facts.rates_gpu
    measured = model.get("measured_serve_samples_per_s") if gpu is not None else None
    return Workload("serve", model.get("infer_flops_per_sample", math.nan),
                    model.get("infer_bytes_per_sample", math.nan), facts.precision, int(model.get("batch_size", 1)),
                    ops_per_batch=model.get("infer_ops_per_batch", 0.0), weight_bytes=model.get("weight_bytes", 0.0),
                    peak_memory_gb=model.get("peak_memory_gb", math.nan),
                    measured_gpu=gpu if measured else None, measured_samples_per_s=measured or None,
                    extra_ops=INFER_LOOP_OPS if facts.probed else (0.0, 0.0, 0.0),
                    syncs_per_batch=1.0 if facts.probed else 0.0)


@dataclass(frozen=True)
class ModelRun:
    """One torch model on the instance: its training rate on all the instance's GPUs, one epoch's steps, every
    epoch's steps, the rest of its fit, and how its other device work compares with the run's machine."""

    name: str
    samples_per_s: Range
    epoch_s: Range
    steps_s: Range
    rest_s: Range
    bound: str
    scaling: Scaling | None
    memory_share: float
    fits: bool
    speedup: Range | None  # of its device work over the run's machine, one GPU; None where nothing was measured
    serve_per_s: Range | None = None  # on one GPU
    latency_ms: Range | None = None  # at batch 1

    @property
    def fit_s(self) -> Range:
        return self.steps_s.plus(self.rest_s)

    def as_dict(self) -> dict:
        def rng(value: Range | None):
            return None if value is None else value.as_dict()

        return {"train_samples_per_s": rng(self.samples_per_s), "epoch_seconds": rng(self.epoch_s),
                "steps_seconds": rng(self.steps_s), "rest_of_fit_seconds": rng(self.rest_s),
                "fit_seconds": rng(self.fit_s), "bound": self.bound, "memory_share": self.memory_share,
                "fits": self.fits, "device_speedup": rng(self.speedup),
                "serve_samples_per_s": rng(self.serve_per_s), "latency_ms": rng(self.latency_ms),
                "scaling": self.scaling.as_dict() if self.scaling else None}


@dataclass(frozen=True)
class PhaseRun:
    """One phase on the instance: as measured (NaN for a fit the run did not time) and as estimated."""

    name: str
    scales: str
    measured_s: float
    seconds: Range
    model: str | None  # the model whose steps or speed-up it took

    def as_dict(self) -> dict:
        return {"scales": self.scales, "measured_s": None if math.isnan(self.measured_s) else self.measured_s,
                "model": self.model, "seconds": self.seconds.as_dict()}


@dataclass(frozen=True)
class WholeRun:
    models: dict[str, ModelRun]
    phases: list[PhaseRun]

    @property
    def training_s(self) -> Range:
        """The torch models' fits: their steps and the rest of their fits."""
        return _sum(model.fit_s for model in self.models.values())

    @property
    def total_s(self) -> Range:
        return _sum(phase.seconds for phase in self.phases)

    def as_dict(self) -> dict:
        return {"total_seconds": self.total_s.as_dict(), "training_seconds": self.training_s.as_dict(),
                "models": {name: model.as_dict() for name, model in self.models.items()},
                "phases": {phase.name: phase.as_dict() for phase in self.phases}}


def _sum(ranges) -> Range:
    total = NONE
    for value in ranges:
        total = total.plus(value)
    return total


def model_run(name: str, facts: RunFacts, instance: Instance, gpus: dict[str, GPU], link: Link | None,
              ceiling: Range | None = None) -> ModelRun:
    """One torch model's training and serving on `instance` (see the module docstring); `ceiling` the samples per
    second the data's storage can feed, where it bounds training."""
    model = facts.models[name]
    workload = train_workload(facts, model)
    found = estimate(workload, instance.gpu, gpus, instance.vcpus, facts.tf32)
    scaling = data_parallel(workload.batch_size / found.samples_per_s.expected, model.get("weight_bytes", 0.0),
                            instance.gpu_count, link)
    rate, bound = found.samples_per_s.times(scaling.speedup), found.bound
    if ceiling is not None:
        rate, bound = rate.capped_by(ceiling), "data storage"
    samples = model.get("samples_per_epoch", workload.batch_size)
    epoch = _epoch_seconds(samples, rate, workload, instance, gpus, facts)
    epochs = (model.get("trained_samples") or samples * model.get("epochs_run", 1)) / samples
    fit = facts.phases.get(f"fit/{name}")
    trained = epochs * samples / facts.data_scale  # as the run trained them
    measured = _measured_rate(model, facts, trained, fit.seconds if fit is not None else math.nan)
    speedup = _speedup(found, workload, instance.gpu, facts, measured)
    serve, latency, _ = serving(facts, model, instance, gpus)
    rest = NONE
    if fit is not None and measured:
        rest = device_seconds(max(fit.seconds - trained / measured, 0.0), speedup)
        if serve is not None:  # at least one validation batch an epoch
            rest = rest.floored(serve.inverse().scaled(workload.batch_size * epochs))
    return ModelRun(name, rate, epoch, epoch.scaled(epochs), rest, bound, scaling, found.memory_share, found.fits,
                    speedup, serve, latency)


def _epoch_seconds(samples: float, rate: Range, workload: Workload, instance: Instance, gpus: dict[str, GPU],
                   facts: RunFacts) -> Range:
    """The full batches at `rate`, and the last partial batch as a step of its own (its rate by the roofline's ratio
    of the two batch sizes: a host-bound step costs the same for fewer samples)."""
    full, last = divmod(round(samples), workload.batch_size)
    seconds = rate.inverse().scaled(full * workload.batch_size)
    if last:
        partial = estimate(workload.at_batch(last), instance.gpu, gpus, instance.vcpus, facts.tf32)
        whole = estimate(workload.at_batch(workload.batch_size), instance.gpu, gpus, instance.vcpus, facts.tf32)
        ratio = partial.samples_per_s.expected / whole.samples_per_s.expected
        seconds = seconds.plus(rate.scaled(ratio).inverse().scaled(last))
    return seconds


def _measured_rate(model: dict[str, float], facts: RunFacts, trained: float, fit_s: float) -> float | None:
    """The training rate measured on the run's machine (per GPU on a GPU): the last epoch's, or the fit's average
    where that is faster (a loaded machine slowed the last epoch)."""
    last = model.get("train_samples_per_s") if facts.gpu is None else model.get("measured_train_samples_per_s")
    if not last:
        return None
    return max(last, trained / fit_s) if fit_s > 0 and facts.gpu is None else last


def _speedup(found: Estimate, workload: Workload, gpu: GPU, facts: RunFacts, measured: float | None) -> Range | None:
    """The model's device work on one `gpu` against the run's machine: expected, its training's (estimated rate
    over measured); slow, all host work (a GPU's host per operator against a CPU's, or another host's speed);
    fast, the device-only roofline over the measured rate."""
    if not measured:
        return None
    training = found.samples_per_s.scaled(1 / measured)
    slowest = 1 / DEVICE_SLOWDOWN if facts.gpu is None else HOST_SPEED[0]
    return Range(min(training.low, slowest), training.expected,
                 max(training.high, device_only_rate(workload, gpu, facts.tf32) / measured))


def device_seconds(seconds: float, speedup: Range) -> Range:
    """Device work that took `seconds` on the run's machine, on the instance's GPU."""
    return Range(seconds / speedup.high, seconds / speedup.expected, seconds / speedup.low)


def serving(facts: RunFacts, model: dict[str, float], instance: Instance, gpus: dict[str, GPU]
            ) -> tuple[Range | None, Range | None, str]:
    """Predictions per second on one GPU at the run's batch size, the latency of one in ms, and what bounds them."""
    if math.isnan(model.get("infer_flops_per_sample", math.nan)):
        return None, None, ""
    workload = serve_workload(facts, model)
    found = estimate(workload, instance.gpu, gpus, instance.vcpus, facts.tf32)
    single = estimate(workload.at_batch(1), instance.gpu, gpus, instance.vcpus, facts.tf32)
    return found.samples_per_s, single.samples_per_s.inverse().scaled(1000), found.bound


def whole_run(facts: RunFacts, instance: Instance, gpus: dict[str, GPU], link: Link | None,
              ceiling: Range | None = None) -> WholeRun:
    """Every phase of the run on `instance` (see the module docstring); a run or workload without phases is its
    models' steps alone."""
    models = {name: model_run(name, facts, instance, gpus, link, ceiling) for name, model in facts.models.items()
              if "train_flops_per_sample" in model}
    longest = max(models.values(), key=lambda model: model.fit_s.expected, default=None)
    phases, timed = [], set()
    for name, phase in facts.phases.items():
        owner = name.split("/", 1)[1] if "/" in name else None
        if name.startswith("fit/") and owner in models:
            phases.append(PhaseRun(name, phase.scales, phase.seconds, models[owner].fit_s, owner))
            timed.add(owner)
            continue
        if phase.scales == "device" and (owner in models or longest is not None):
            model = models[owner] if owner in models else longest
            if model.speedup is not None:
                phases.append(PhaseRun(name, phase.scales, phase.seconds, device_seconds(phase.seconds, model.speedup),
                                       model.name))
                continue
        share = facts.cores / instance.vcpus if phase.scales == "cores" else 1.0
        phases.append(PhaseRun(name, phase.scales, phase.seconds, host_seconds(phase.seconds * share), None))
    phases += [PhaseRun(f"fit/{name}", "device", math.nan, model.fit_s, name) for name, model in models.items()
               if name not in timed]
    if facts.phases and facts.total_seconds > 0:
        other = max(facts.total_seconds - sum(phase.seconds for phase in facts.phases.values()), 0.0)
        phases.append(PhaseRun("other", "serial", other, host_seconds(other), None))
    if facts.probed:
        phases.append(PhaseRun("start", "serial", math.nan, Range(*reversed(PROCESS_START_S)), None))
    if facts.probed and facts.gpu is None:
        phases.append(PhaseRun("gpu start-up", "device", math.nan, Range(*reversed(GPU_STARTUP_S)), None))
    return WholeRun(models, phases)


def host_seconds(seconds: float) -> Range:
    """Host work that took `seconds` on the run's machine, on another host."""
    return Range(seconds / HOST_SPEED[2], seconds / HOST_SPEED[1], seconds / HOST_SPEED[0])
