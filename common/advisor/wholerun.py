"""The whole run on an instance, phase by phase, as a range: what `usecases advise` prices (docs/advisor.md, "The
whole-run model" and "Several GPUs").

A torch model's fit is its estimated steps over every epoch the run trained (on several GPUs, times the DDP
speed-up), plus the rest of its fit as measured, scaled as device work. Other `device` work is divided by its model's
speed-up over the run's machine, `cores` work shared among the instance's vCPUs, `serial` work and the time no phase
covered taken at another host's speed; the command's start, and a CPU run's move to a GPU, are added."""

from __future__ import annotations

import math
from dataclasses import dataclass

from common.advisor.catalog import GPU, Instance, Link, load_links
from common.advisor.estimate import (DEVICE_SLOWDOWN, GPU_STARTUP_S, HOST_SPEED, INFER_LOOP_OPS, LOOP_OPS,
                                     OPTIMIZER_OPS, PROCESS_START_S, Estimate, Range, Workload, device_only_rate,
                                     estimate)
from common.advisor.facts import RunFacts

NONE = Range(0.0, 0.0, 0.0)
# DDP, levels (slow, expected, fast). Fitted (`scaling_efficiency` in tests/common/advisor_calibration.py): what else
# an n-GPU job loses per GPU, from DeepLearningExamples' six 8-GPU ResNet-50 figures (6.7x to 7.8x). Assumed: the share
# of a link NCCL's ring reaches, the share of the backward pass (2/3 of a step) the transfer hides behind, DDP's fixed
# cost per step and each extra hop's latency between machines; they set the range for small, fast steps.
SCALING_EFFICIENCY = (0.80, 0.91, 1.0)
LINK_EFFICIENCY = (0.5, 0.7, 0.85)
OVERLAP = (0.0, 0.5, 0.9)
STEP_OVERHEAD_S = (500e-6, 200e-6, 50e-6)
NETWORK_HOP_S = (200e-6, 100e-6, 30e-6)
BACKWARD_SHARE = 2 / 3
UNKNOWN_LINK = "pcie3"  # where the catalogue does not say: the slowest link a GPU server has


@dataclass(frozen=True)
class Scaling:
    """`gpus` GPUs on `nodes` machines against one GPU of the kind: the speed-up, and the all-reduce per step."""

    gpus: int
    nodes: int
    speedup: Range
    all_reduce_s: Range  # the gradients' transfer per step, before any overlap
    step_s: float
    paced_by: str  # the link the all-reduce waits on
    gradient_bytes: float

    def as_dict(self) -> dict:
        return {"gpus": self.gpus, "nodes": self.nodes, "speedup": self.speedup,
                "all_reduce_ms": self.all_reduce_s.scaled(1000), "step_ms": 1000 * self.step_s,
                "gradient_bytes": self.gradient_bytes, "paced_by": self.paced_by}


def _ring_seconds(members: int, gradient_bytes: float, gbs: float, efficiency: float) -> float:
    return 2 * (members - 1) / members * gradient_bytes / (gbs * 1e9 * efficiency) if members > 1 else 0.0


def data_parallel(step_s: float, gradient_bytes: float, gpus_per_node: int, link: Link | None, nodes: int = 1,
                  network_gbps: float = math.nan, efficiency: tuple[float, float, float] = SCALING_EFFICIENCY
                  ) -> Scaling | None:
    """DDP on `gpus_per_node` x `nodes` GPUs, the gradients all-reduced as a ring; None where the network is unknown."""
    gpus = gpus_per_node * nodes
    if gpus <= 1:
        return Scaling(gpus, nodes, Range(1.0, 1.0, 1.0), NONE, step_s, "", gradient_bytes)
    if nodes > 1 and not network_gbps > 0:
        return None
    gbs = (link or load_links()[UNKNOWN_LINK]).gbs_per_gpu
    paced_by = f"{network_gbps:g} Gbit/s network" if nodes > 1 else (link.name if link else
                                                                        f"{UNKNOWN_LINK} (link unknown)")
    speedups, transfers = [], []
    for level in range(3):
        transfer = _ring_seconds(gpus_per_node, gradient_bytes, gbs, LINK_EFFICIENCY[level])
        if nodes > 1:
            transfer += (_ring_seconds(nodes, gradient_bytes, network_gbps / 8, LINK_EFFICIENCY[level]) +
                         2 * (nodes - 1) * NETWORK_HOP_S[level])
        exposed = max(0.0, transfer - OVERLAP[level] * BACKWARD_SHARE * step_s)
        step = step_s + STEP_OVERHEAD_S[level] + exposed
        speedups.append(min(gpus, gpus * step_s / step * efficiency[level]))
        transfers.append(transfer)
    return Scaling(gpus, nodes, Range(*speedups), Range(min(transfers), transfers[1], max(transfers)), step_s,
                   paced_by, gradient_bytes)


def _workload(facts: RunFacts, model: dict[str, float], task: str) -> Workload:
    """One model's training step, or served batch (a forward pass and its loop, the answer read back), as measured;
    a rate measured on a GPU (the run's, or another run's of its preset) calibrates it."""
    gpu = facts.gpu or facts.rates_gpu
    measured = model.get(f"measured_{task}_samples_per_s") if gpu is not None else None
    shared = {"weight_bytes": model.get("weight_bytes", 0.0), "peak_memory_gb": model.get("peak_memory_gb", math.nan),
              "measured_gpu": gpu if measured else None, "measured_samples_per_s": measured or None}
    unprobed = (0.0, 0.0, 0.0)
    if task == "serve":
        return Workload("serve", model.get("infer_flops_per_sample", math.nan),
                        model.get("infer_bytes_per_sample", math.nan), facts.precision, int(model.get("batch_size", 1)),
                        ops_per_batch=model.get("infer_ops_per_batch", 0.0),
                        extra_ops=INFER_LOOP_OPS if facts.probed else unprobed,
                        syncs_per_batch=1.0 if facts.probed else 0.0, **shared)
    optimizer = model.get("optimizer_ops_per_step")
    extra = (optimizer + LOOP_OPS,) * 3 if optimizer is not None else OPTIMIZER_OPS
    return Workload("train", model.get("train_flops_per_sample", math.nan),
                    model.get("train_bytes_per_sample", math.nan), facts.precision, int(model.get("batch_size", 1)),
                    ops_per_batch=model.get("train_ops_per_step", 0.0),
                    loader_samples_per_s=model.get("loader_samples_per_s", math.nan),
                    loader_cores=int(model.get("loader_cores", facts.cores)),
                    extra_ops=extra if facts.probed else unprobed,
                    syncs_per_batch=model.get("host_syncs_per_step", 0.0), **shared)


@dataclass(frozen=True)
class ModelRun:
    """One torch model on the instance; its device work's `speedup` is over the run's machine."""

    name: str
    samples_per_s: Range
    epoch_s: Range
    steps_s: Range
    rest_s: Range
    bound: str
    scaling: Scaling | None
    memory_share: float
    fits: bool
    speedup: Range | None  # on one GPU; None where nothing was measured
    serve_per_s: Range | None = None  # on one GPU
    latency_ms: Range | None = None  # at batch 1

    @property
    def fit_s(self) -> Range:
        return self.steps_s + self.rest_s

    def as_dict(self) -> dict:
        return {"train_samples_per_s": self.samples_per_s, "epoch_seconds": self.epoch_s, "steps_seconds": self.steps_s,
                "rest_of_fit_seconds": self.rest_s, "fit_seconds": self.fit_s, "bound": self.bound,
                "memory_share": self.memory_share, "fits": self.fits, "device_speedup": self.speedup,
                "serve_samples_per_s": self.serve_per_s, "latency_ms": self.latency_ms, "scaling": self.scaling}


@dataclass(frozen=True)
class PhaseRun:
    """One phase on the instance: as measured (NaN for a fit the run did not time) and as estimated."""

    name: str
    scales: str
    measured_s: float
    seconds: Range
    model: str | None  # the model whose steps or speed-up it took

    def as_dict(self) -> dict:
        return {"scales": self.scales, "measured_s": self.measured_s, "model": self.model, "seconds": self.seconds}


@dataclass(frozen=True)
class WholeRun:
    models: dict[str, ModelRun]
    phases: list[PhaseRun]

    @property
    def training_s(self) -> Range:
        return sum((model.fit_s for model in self.models.values()), NONE)

    @property
    def total_s(self) -> Range:
        return sum((phase.seconds for phase in self.phases), NONE)

    def as_dict(self) -> dict:
        return {"total_seconds": self.total_s, "training_seconds": self.training_s, "models": self.models,
                "phases": {phase.name: phase for phase in self.phases}}


def model_run(name: str, facts: RunFacts, instance: Instance, gpus: dict[str, GPU], link: Link | None,
              ceiling: Range | None = None) -> ModelRun:
    """One torch model on `instance`; `ceiling` the samples per second the data's storage feeds, where it bounds."""
    model = facts.models[name]
    workload = _workload(facts, model, "train")
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
    """The full batches at `rate`, and the last partial batch a step of its own (a host-bound step costs the same
    for fewer samples: its rate by the roofline's ratio of the two batch sizes)."""
    full, last = divmod(round(samples), workload.batch_size)
    seconds = rate.inverse().scaled(full * workload.batch_size)
    if last:
        partial = estimate(workload.at_batch(last), instance.gpu, gpus, instance.vcpus, facts.tf32)
        whole = estimate(workload.at_batch(workload.batch_size), instance.gpu, gpus, instance.vcpus, facts.tf32)
        ratio = partial.samples_per_s.expected / whole.samples_per_s.expected
        seconds += rate.scaled(ratio).inverse().scaled(last)
    return seconds


def _measured_rate(model: dict[str, float], facts: RunFacts, trained: float, fit_s: float) -> float | None:
    """The training rate measured per device: the last epoch's, or on a CPU the fit's average where that is faster
    (a loaded machine slowed the last epoch)."""
    last = model.get("train_samples_per_s") if facts.gpu is None else model.get("measured_train_samples_per_s")
    if not last:
        return None
    return max(last, trained / fit_s) if fit_s > 0 and facts.gpu is None else last


def _speedup(found: Estimate, workload: Workload, gpu: GPU, facts: RunFacts, measured: float | None) -> Range | None:
    """The model's device work on one `gpu` against the run's machine: expected, its training's (estimated rate over
    measured); slow, all host work; fast, the device-only roofline over the measured rate."""
    if not measured:
        return None
    training = found.samples_per_s.scaled(1 / measured)
    slowest = 1 / DEVICE_SLOWDOWN if facts.gpu is None else HOST_SPEED[0]
    return Range(min(training.low, slowest), training.expected,
                 max(training.high, device_only_rate(workload, gpu, facts.tf32) / measured))


def device_seconds(seconds: float, speedup: Range) -> Range:
    return Range(seconds / speedup.high, seconds / speedup.expected, seconds / speedup.low)


def host_seconds(seconds: float) -> Range:
    return Range(seconds / HOST_SPEED[2], seconds / HOST_SPEED[1], seconds / HOST_SPEED[0])


def serving(facts: RunFacts, model: dict[str, float], instance: Instance, gpus: dict[str, GPU]
            ) -> tuple[Range | None, Range | None, str]:
    """Predictions per second on one GPU at the run's batch size, the latency of one in ms, and what bounds them."""
    if math.isnan(model.get("infer_flops_per_sample", math.nan)):
        return None, None, ""
    workload = _workload(facts, model, "serve")
    found = estimate(workload, instance.gpu, gpus, instance.vcpus, facts.tf32)
    single = estimate(workload.at_batch(1), instance.gpu, gpus, instance.vcpus, facts.tf32)
    return found.samples_per_s, single.samples_per_s.inverse().scaled(1000), found.bound


def whole_run(facts: RunFacts, instance: Instance, gpus: dict[str, GPU], link: Link | None,
              ceiling: Range | None = None) -> WholeRun:
    """Every phase of the run on `instance`; a run or workload without phases is its models' steps alone."""
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
        model = models.get(owner, longest) if phase.scales == "device" else None
        if model is not None and model.speedup is not None:
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
