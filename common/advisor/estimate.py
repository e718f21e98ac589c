"""Estimated throughput of a workload on a GPU it has not run on, as a range, with the bound that sets it.

A step (a training batch, or a served one) takes the device's time and the host's (`common.advisor.host`). The
device's is a roofline with efficiency ranges: the larger of the work at the precision's peak
(`flops / (peak x compute efficiency)`), the traffic at the memory bandwidth (`bytes / (bandwidth x memory
efficiency)`) and a least time per kernel. The host's is every operator it dispatches, the counted ones and the
optimizer's, at a calibrated cost each. Host and device overlap (the host queues kernels ahead), so a step takes the
larger of the two; a step with host synchronisations drains the queue and takes their sum. The input pipeline caps
the rate at what the loader delivered, scaled by the instance's vCPUs.

Where the workload was measured on a GPU, that measurement is scaled to the other GPU by the ratio of the two step
times (a measured run is always preferred). With only a CPU run, the rate comes from the calibrated efficiencies
alone: wide ranges, and labelled so.

The efficiencies are fitted (`calibrate`) to the published one-GPU results in `catalog/published.csv`, and both
ranges are the out-of-sample error of that fit, leave one model family out (`leave_one_model_out`): each family's
figures are predicted by a calibration that never saw them, and a range spans the largest such error, under and
over (`tests/common/test_advisor.py` recomputes it and checks the constants below). Those published figures are
large batches of few operators: the host's side changes none of them.

    from common.advisor.estimate import Workload, estimate
    from common.advisor.catalog import load_gpus
    gpus = load_gpus()
    w = Workload("train", flops_per_sample=24.6e9, bytes_per_sample=2.4e8, precision="amp", batch_size=256,
                 measured_gpu="V100-SXM2-16GB", measured_samples_per_s=1400)
    estimate(w, gpus["A100-SXM4-80GB"]).samples_per_s   # Range(low, expected, high)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from common.advisor.catalog import GPU
from common.advisor.host import HOST_SECONDS_PER_OP, KERNEL_SECONDS, SYNC_SECONDS

# A GPU with less power per peak TFLOPS than the V100 (T4: 70 W for 65; A100: 400 W for 312) sustains less of its
# peak: the efficiency scales with (its watts per TFLOPS / the V100's) ** exponent, at most 1.
REFERENCE_WATTS_PER_TFLOPS = {"fp32": 300 / 15.7, "tf32": 300 / 125, "tensor": 300 / 125}
KINDS = ("fp32", "tf32", "tensor")  # CUDA-core fp32, TF32 tensor cores, fp16/bf16 tensor cores


@dataclass(frozen=True)
class Calibration:
    """The fitted part of the roofline: the expected fraction of each kind's datasheet peak reached at the V100's
    power per TFLOPS, and the exponent of the power scaling."""

    efficiency: dict[str, float] = field(default_factory=dict)
    power_exponent: float = 0.5


# `calibrate` on every one-GPU figure of catalog/published.csv (DeepLearningExamples' ResNet-50 v1.5 in TensorFlow
# and PyTorch, and NCF), rounded; the test checks these against a fresh fit.
CALIBRATION = Calibration({"fp32": 0.57, "tf32": 0.11, "tensor": 0.17}, 0.66)
# Each range is the envelope of the leave-one-model-out errors (published / expected over every held-out figure of
# both families: the 100 % quantile of the under- and of the over-prediction), rounded outwards to 0.05. Of the
# efficiency, for a rate estimated from a CPU run (a model's own efficiency is unknown there: the shares of the
# peaks NCF and ResNet-50 reach differ by up to 2x, so the range is wide); of a throughput scaled from a measured
# GPU run. A CPU run's range is at least expected x EFFICIENCY_SPREAD, whatever bounds the workload.
EFFICIENCY_SPREAD = (0.35, 3.0)
MEASURED_SPREAD = (0.7, 1.0, 1.5)
COMPUTE_EFFICIENCY = {kind: (value * EFFICIENCY_SPREAD[0], value, min(1.0, value * EFFICIENCY_SPREAD[1]))
                      for kind, value in CALIBRATION.efficiency.items()}
POWER_EXPONENT = CALIBRATION.power_exponent
# Not calibrated: no published figure here is bound by memory bandwidth.
MEMORY_EFFICIENCY = (0.45, 0.65, 0.85)
# What `advise` names as a run's bound: of a model's steps, or the run's other phases.
BOUNDS = ("compute", "memory bandwidth", "host overhead", "input pipeline", "data storage", "other phases")


@dataclass(frozen=True)
class Range:
    """An estimate: low, expected and high."""

    low: float
    expected: float
    high: float

    def scaled(self, factor: float) -> Range:
        return Range(self.low * factor, self.expected * factor, self.high * factor)

    def capped(self, ceiling: float) -> Range:
        return Range(min(self.low, ceiling), min(self.expected, ceiling), min(self.high, ceiling))

    def capped_by(self, ceiling: Range) -> Range:
        """Each bound at most the ceiling's same bound."""
        return Range(min(self.low, ceiling.low), min(self.expected, ceiling.expected), min(self.high, ceiling.high))

    def times(self, other: Range) -> Range:
        """Bound by bound: low with low, high with high (a rate times a speed-up)."""
        return Range(self.low * other.low, self.expected * other.expected, self.high * other.high)

    def inverse(self) -> Range:
        """1/x of each bound, the order kept (a rate's range as a time's)."""
        return Range(1 / self.high, 1 / self.expected, 1 / self.low)

    def plus(self, other: Range) -> Range:
        return Range(self.low + other.low, self.expected + other.expected, self.high + other.high)

    def floored(self, floor: Range) -> Range:
        """Each bound at least the floor's same bound."""
        return Range(max(self.low, floor.low), max(self.expected, floor.expected), max(self.high, floor.high))

    def as_dict(self) -> dict[str, float]:
        return {"low": self.low, "expected": self.expected, "high": self.high}


@dataclass(frozen=True)
class Workload:
    """What one model's training or serving does per sample; per batch, `ops_per_batch` the operators the probe
    counted, `extra_ops` those it did not (the optimizer's and the loop's: slow, expected, fast) and
    `syncs_per_batch` the host synchronisations; `weight_bytes` what every batch reads whatever its size (for batch-1
    latency)."""

    task: str  # train or serve
    flops_per_sample: float
    bytes_per_sample: float
    precision: str  # fp32, tf32, fp16, bf16 or amp
    batch_size: int
    ops_per_batch: float = 0.0
    weight_bytes: float = 0.0
    peak_memory_gb: float = math.nan
    loader_samples_per_s: float = math.nan  # the input pipeline alone, where it runs on the CPU
    loader_cores: int = 0  # the cores it had then
    measured_gpu: str | None = None
    measured_samples_per_s: float | None = None
    extra_ops: tuple[float, float, float] = (0.0, 0.0, 0.0)
    syncs_per_batch: float = 0.0

    def at_batch(self, batch_size: int) -> Workload:
        """The same model at another batch size: the weights' traffic and the operators are per batch."""
        per_sample_rest = self.bytes_per_sample - self.weight_bytes / self.batch_size
        return replace(self, batch_size=batch_size,
                       bytes_per_sample=per_sample_rest + self.weight_bytes / batch_size,
                       measured_gpu=None, measured_samples_per_s=None)


@dataclass(frozen=True)
class Estimate:
    samples_per_s: Range
    bound: str
    precision: str  # what the GPU computes in
    fits: bool
    memory_share: float  # of the GPU's memory, NaN when unknown


def gpu_precision(precision: str, gpu: GPU, tf32: bool = False) -> str:
    """What a run configured with `precision` computes in on `gpu`: mixed precision takes bf16 where the GPU has
    it, else fp16 (T4, V100); fp32 takes TF32 tensor cores when allowed and present."""
    if precision in ("amp", "auto", "auto-gpu", "bf16"):
        return "bf16" if gpu.has("bf16") else "fp16"
    if precision == "fp16":
        return "fp16"
    if precision == "tf32" or tf32:
        return "tf32" if gpu.has("tf32") else "fp32"
    return "fp32"


def kind_of(precision: str) -> str:
    """The calibrated kind a GPU precision computes on."""
    return precision if precision in ("fp32", "tf32") else "tensor"


def power_ratio(gpu: GPU, precision: str) -> float:
    """`gpu`'s watts per peak TFLOPS at `precision` against the V100's, at most 1 (1 where no TDP is published)."""
    if math.isnan(gpu.tdp_w):
        return 1.0
    return min(1.0, gpu.tdp_w / gpu.tflops[precision] / REFERENCE_WATTS_PER_TFLOPS[kind_of(precision)])


def compute_efficiency(gpu: GPU, precision: str, calibration: Calibration | None = None
                       ) -> tuple[float, float, float]:
    """The low, expected and high fraction of `gpu`'s `precision` peak a model reaches (its power per TFLOPS
    against the V100's; no adjustment where the TDP is not published)."""
    calibration = calibration or CALIBRATION
    expected = calibration.efficiency[kind_of(precision)] * power_ratio(gpu, precision) ** calibration.power_exponent
    return expected * EFFICIENCY_SPREAD[0], expected, min(1.0, expected * EFFICIENCY_SPREAD[1])  # never above peak


def device_seconds(workload: Workload, gpu: GPU, precision: str, level: int,
                   calibration: Calibration | None = None) -> tuple[float, str]:
    """The device's time for one batch and what bounds it, at `level` (0 slow, 1 expected, 2 fast): the work at the
    peak, the traffic at the bandwidth, each at its efficiency, and a least time per kernel."""
    batch = workload.batch_size
    efficiency = compute_efficiency(gpu, precision, calibration)[level]
    compute = workload.flops_per_sample * batch / (gpu.tflops[precision] * 1e12 * efficiency)
    memory = workload.bytes_per_sample * batch / (gpu.bandwidth_gbs * 1e9 * MEMORY_EFFICIENCY[level])
    kernels = workload.ops_per_batch * KERNEL_SECONDS[level]
    seconds, bound = max((compute, "compute"), (memory, "memory bandwidth"), (kernels, "host overhead"))
    return max(seconds, 1e-12), bound


def host_seconds(workload: Workload, level: int) -> float:
    """The host's time for one batch at `level`: every operator it dispatches (see `common.advisor.host`)."""
    return (workload.ops_per_batch + workload.extra_ops[level]) * HOST_SECONDS_PER_OP[level]


def step_seconds(workload: Workload, device: float, level: int) -> tuple[float, bool]:
    """One batch's time from the device's and the host's, and whether the host bounds it: the host queues kernels
    ahead of the device, so the larger of the two; a synchronisation drains the queue, so with any the sum."""
    host = host_seconds(workload, level)
    if workload.syncs_per_batch > 0:
        return host + device + workload.syncs_per_batch * SYNC_SECONDS[level], host > device
    return max(host, device), host > device


def _batch_seconds(workload: Workload, gpu: GPU, precision: str, level: int,
                   calibration: Calibration | None = None) -> tuple[float, str]:
    """One batch's time and its bound at `level`."""
    device, bound = device_seconds(workload, gpu, precision, level, calibration)
    seconds, host_bound = step_seconds(workload, device, level)
    return seconds, "host overhead" if host_bound else bound


def _peak_seconds(workload: Workload, gpu: GPU, precision: str) -> float:
    """The device's time for one batch at the datasheet's peak and bandwidth: no device is faster."""
    batch = workload.batch_size
    return max(workload.flops_per_sample * batch / (gpu.tflops[precision] * 1e12),
               workload.bytes_per_sample * batch / (gpu.bandwidth_gbs * 1e9),
               workload.ops_per_batch * KERNEL_SECONDS[2], 1e-12)


def estimate(workload: Workload, gpu: GPU, gpus: dict[str, GPU] | None = None, vcpus: int | None = None,
             tf32: bool = False, calibration: Calibration | None = None) -> Estimate:
    """Samples per second of `workload` on one `gpu` (an instance's `vcpus` for the input pipeline's ceiling);
    `gpus` is the catalogue that names the measured GPU; `calibration` another fit than the shipped one."""
    precision = gpu_precision(workload.precision, gpu, tf32)
    seconds = [_batch_seconds(workload, gpu, precision, level, calibration) for level in range(3)]
    bound = seconds[1][1]
    if workload.measured_gpu and workload.measured_samples_per_s and gpus is not None:
        measured = gpus[workload.measured_gpu]
        there = _batch_seconds(workload, measured, gpu_precision(workload.precision, measured, tf32), 1,
                               calibration)[0]
        rate = Range(*(workload.measured_samples_per_s * there / seconds[1][0] * spread
                       for spread in MEASURED_SPREAD))
    else:
        # The device's efficiency levels, widened to at least its expected time / EFFICIENCY_SPREAD whatever bounds
        # it (the leave-one-model-out envelope), but never faster than the datasheet's peak and bandwidth; then the
        # host's levels.
        device = [device_seconds(workload, gpu, precision, level, calibration)[0] for level in range(3)]
        widened = (max(device[0], device[1] / EFFICIENCY_SPREAD[0]), device[1],
                   min(device[2], max(device[1] / EFFICIENCY_SPREAD[1], _peak_seconds(workload, gpu, precision))))
        rate = Range(*(workload.batch_size / step_seconds(workload, widened[level], level)[0] for level in range(3)))
    if workload.loader_cores and not math.isnan(workload.loader_samples_per_s) and vcpus:
        ceiling = workload.loader_samples_per_s * vcpus / workload.loader_cores
        if ceiling < rate.expected:
            bound = "input pipeline"
        rate = rate.capped(ceiling)
    share = workload.peak_memory_gb / gpu.memory_gb if not math.isnan(workload.peak_memory_gb) else math.nan
    return Estimate(rate, bound, precision, not share > 0.95, share)


def device_only_rate(workload: Workload, gpu: GPU, tf32: bool = False) -> float:
    """Samples per second at the datasheet's peak and bandwidth with no host cost: what no run on `gpu` exceeds."""
    precision = gpu_precision(workload.precision, gpu, tf32)
    return workload.batch_size / _peak_seconds(workload, gpu, precision)
