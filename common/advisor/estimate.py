"""Estimated throughput of a workload on a GPU it has not run on, as a range with the bound that sets it
(docs/advisor.md, "How it estimates a step").

A step takes the device's time, a roofline with efficiency ranges, and the host's, every operator it dispatches at a
calibrated cost each: the larger of the two (the host queues kernels ahead), or their sum where the step synchronises.
A rate measured on a GPU is scaled to the other GPU by the ratio of the two step times; from a CPU run alone the range
is wide, and says so. The efficiencies are fitted to `catalog/published.csv`, the host's cost per operator to
`catalog/host_bound.csv`; each range is the envelope of the leave-one-model-family-out errors, and
`tests/common/test_advisor.py` recomputes the fitted and counted constants."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from common.advisor.catalog import GPU

# Levels everywhere here: (slow, expected, fast). The host's seconds per eager operator: the envelope and geometric
# mean of the published host-bound latencies over their operators (45-49 µs on a 2021 DGX-1); the fast end assumed for
# a newer host and PyTorch (5-25 µs a dispatch).
HOST_SECONDS_PER_OP = (50e-6, 46e-6, 20e-6)
# A training step's operators beside the counted forward and backward, where the run logged no
# `optimizer_ops_per_step`: Adam's foreach step and zero_grad (17 for 2 parameter tensors, 137 for ResNet-18's 62,
# counted) and the loop's 4, the geometric mean expected.
LOOP_OPS = 4
OPTIMIZER_OPS = (137 + LOOP_OPS, round(math.sqrt((17 + LOOP_OPS) * (137 + LOOP_OPS))), 17 + LOOP_OPS)
INFER_LOOP_OPS = (20, 8, 4)  # a served batch's loop: its slice, the answer's copy back (assumed)
SYNC_SECONDS = (50e-6, 20e-6, 10e-6)  # a synchronisation's round trip once the queue is empty (assumed)
KERNEL_SECONDS = (5e-6, 3e-6, 2e-6)  # a kernel's least time on the device, launch to completion (assumed)
# Tiny operators can take this much longer on a GPU's host than eager on a CPU (about 15 µs an operator, assumed).
DEVICE_SLOWDOWN = HOST_SECONDS_PER_OP[0] / 15e-6
HOST_SPEED = (1 / 1.3, 1.0, 1.4)  # another machine's host on single-core work against the run's (assumed)
# What a GPU run spends once that a CPU run does not: the CUDA context, cuBLAS and cuDNN, cuDNN's benchmark of each
# shape (1-4 s for the context alone: pytorch/pytorch#39005 and #22583; assumed).
GPU_STARTUP_S = (10.0, 4.0, 1.5)
# The command before the run's clock starts: 2.9-3.6 s measured on the README's machine, up to 8 s where a CUDA build
# of torch loads its libraries.
PROCESS_START_S = (8.0, 3.5, 2.5)

# A GPU with less power per peak TFLOPS than the V100 sustains less of its peak: the efficiency scales with (its watts
# per TFLOPS / the V100's) ** exponent, at most 1.
REFERENCE_WATTS_PER_TFLOPS = {"fp32": 300 / 15.7, "tf32": 300 / 125, "tensor": 300 / 125}
KINDS = ("fp32", "tf32", "tensor")  # CUDA-core fp32, TF32 tensor cores, fp16/bf16 tensor cores


@dataclass(frozen=True)
class Calibration:
    """The expected fraction of each kind's peak reached at the V100's power per TFLOPS, and the power exponent."""

    efficiency: dict[str, float] = field(default_factory=dict)
    power_exponent: float = 0.5


# `calibrate` on every one-GPU figure of catalog/published.csv, rounded. The spreads are the leave-one-model-out
# envelopes rounded outwards to 0.05: of the device's time from a CPU run (wide: NCF and ResNet-50 reach shares of
# their peaks 2x apart), and of a rate scaled from a measured GPU run.
CALIBRATION = Calibration({"fp32": 0.57, "tf32": 0.11, "tensor": 0.17}, 0.66)
EFFICIENCY_SPREAD = (0.35, 3.0)
MEASURED_SPREAD = (0.7, 1.0, 1.5)
COMPUTE_EFFICIENCY = {kind: (value * EFFICIENCY_SPREAD[0], value, min(1.0, value * EFFICIENCY_SPREAD[1]))
                      for kind, value in CALIBRATION.efficiency.items()}
MEMORY_EFFICIENCY = (0.45, 0.65, 0.85)  # not calibrated: no published figure here is bound by memory bandwidth
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

    def capped_by(self, ceiling: Range) -> Range:
        return Range(min(self.low, ceiling.low), min(self.expected, ceiling.expected), min(self.high, ceiling.high))

    def floored(self, floor: Range) -> Range:
        return Range(max(self.low, floor.low), max(self.expected, floor.expected), max(self.high, floor.high))

    def times(self, other: Range) -> Range:
        """Low with low, high with high (a rate times a speed-up)."""
        return Range(self.low * other.low, self.expected * other.expected, self.high * other.high)

    def inverse(self) -> Range:
        """A rate's range as a time's: 1/x of each bound, the order kept."""
        return Range(1 / self.high, 1 / self.expected, 1 / self.low)

    def __add__(self, other: Range) -> Range:
        return Range(self.low + other.low, self.expected + other.expected, self.high + other.high)


@dataclass(frozen=True)
class Workload:
    """One model's training or serving step; `extra_ops` are the operators the probe did not count (slow, expected,
    fast), `weight_bytes` what every batch reads whatever its size."""

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
        """The same model at another batch size, unmeasured: the weights' traffic and the operators are per batch."""
        per_sample_rest = self.bytes_per_sample - self.weight_bytes / self.batch_size
        return replace(self, batch_size=batch_size, bytes_per_sample=per_sample_rest + self.weight_bytes / batch_size,
                       measured_gpu=None, measured_samples_per_s=None)


@dataclass(frozen=True)
class Estimate:
    samples_per_s: Range
    bound: str
    precision: str  # what the GPU computes in
    fits: bool
    memory_share: float  # of the GPU's memory, NaN when unknown


def gpu_precision(precision: str, gpu: GPU, tf32: bool = False) -> str:
    """What a run configured with `precision` computes in on `gpu`: mixed precision in bf16 where the GPU has it,
    else fp16 (T4, V100); fp32 on TF32 tensor cores when allowed and present."""
    if precision in ("amp", "auto", "auto-gpu", "bf16"):
        return "bf16" if gpu.has("bf16") else "fp16"
    if precision == "fp16":
        return "fp16"
    return "tf32" if (precision == "tf32" or tf32) and gpu.has("tf32") else "fp32"


def kind_of(precision: str) -> str:
    return precision if precision in ("fp32", "tf32") else "tensor"


def power_ratio(gpu: GPU, precision: str) -> float:
    """`gpu`'s watts per peak TFLOPS at `precision` against the V100's, at most 1 (1 where no TDP is published)."""
    if math.isnan(gpu.tdp_w):
        return 1.0
    return min(1.0, gpu.tdp_w / gpu.tflops[precision] / REFERENCE_WATTS_PER_TFLOPS[kind_of(precision)])


def device_seconds(workload: Workload, gpu: GPU, precision: str, level: int,
                   calibration: Calibration | None = None) -> tuple[float, str]:
    """The device's time for one batch at `level` and what bounds it: the work at the peak, the traffic at the
    bandwidth, each at its efficiency (never above peak), and a least time per kernel."""
    calibration = calibration or CALIBRATION
    expected = calibration.efficiency[kind_of(precision)] * power_ratio(gpu, precision) ** calibration.power_exponent
    efficiency = (expected * EFFICIENCY_SPREAD[0], expected, min(1.0, expected * EFFICIENCY_SPREAD[1]))[level]
    batch = workload.batch_size
    compute = workload.flops_per_sample * batch / (gpu.tflops[precision] * 1e12 * efficiency)
    memory = workload.bytes_per_sample * batch / (gpu.bandwidth_gbs * 1e9 * MEMORY_EFFICIENCY[level])
    kernels = workload.ops_per_batch * KERNEL_SECONDS[level]
    seconds, bound = max((compute, "compute"), (memory, "memory bandwidth"), (kernels, "host overhead"))
    return max(seconds, 1e-12), bound


def step_seconds(workload: Workload, device: float, level: int) -> tuple[float, bool]:
    """One batch's time from the device's and the host's, and whether the host bounds it."""
    host = (workload.ops_per_batch + workload.extra_ops[level]) * HOST_SECONDS_PER_OP[level]
    if workload.syncs_per_batch > 0:
        return host + device + workload.syncs_per_batch * SYNC_SECONDS[level], host > device
    return max(host, device), host > device


def _batch_seconds(workload: Workload, gpu: GPU, precision: str, level: int,
                   calibration: Calibration | None = None) -> tuple[float, str]:
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
    """Samples per second of `workload` on one `gpu`, the input pipeline capped by the instance's `vcpus`."""
    precision = gpu_precision(workload.precision, gpu, tf32)
    seconds = [_batch_seconds(workload, gpu, precision, level, calibration) for level in range(3)]
    bound = seconds[1][1]
    if workload.measured_gpu and workload.measured_samples_per_s and gpus is not None:
        measured = gpus[workload.measured_gpu]
        there = _batch_seconds(workload, measured, gpu_precision(workload.precision, measured, tf32), 1, calibration)[0]
        rate = Range(*(workload.measured_samples_per_s * there / seconds[1][0] * spread for spread in MEASURED_SPREAD))
    else:
        # The device's levels widened to at least its expected time over EFFICIENCY_SPREAD, never faster than the
        # datasheet's peak; then the host's levels.
        device = [device_seconds(workload, gpu, precision, level, calibration)[0] for level in range(3)]
        widened = (max(device[0], device[1] / EFFICIENCY_SPREAD[0]), device[1],
                   min(device[2], max(device[1] / EFFICIENCY_SPREAD[1], _peak_seconds(workload, gpu, precision))))
        rate = Range(*(workload.batch_size / step_seconds(workload, widened[level], level)[0] for level in range(3)))
    if workload.loader_cores and not math.isnan(workload.loader_samples_per_s) and vcpus:
        ceiling = workload.loader_samples_per_s * vcpus / workload.loader_cores
        if ceiling < rate.expected:
            bound = "input pipeline"
        rate = rate.capped_by(Range(ceiling, ceiling, ceiling))
    share = workload.peak_memory_gb / gpu.memory_gb if not math.isnan(workload.peak_memory_gb) else math.nan
    return Estimate(rate, bound, precision, not share > 0.95, share)


def device_only_rate(workload: Workload, gpu: GPU, tf32: bool = False) -> float:
    """Samples per second at the datasheet's peak and bandwidth with no host cost: what no run on `gpu` exceeds."""
    return workload.batch_size / _peak_seconds(workload, gpu, gpu_precision(workload.precision, gpu, tf32))
