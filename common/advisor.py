"""Estimated throughput of a workload on a GPU it has not run on, as a range, with the bound that sets it.

The model is a roofline with efficiency ranges. Per batch, the GPU's time is the larger of the work at the
precision's peak (`flops / (peak x compute efficiency)`) and the traffic at the memory bandwidth
(`bytes / (bandwidth x memory efficiency)`); the host's is one launch per operator (`ops x launch time`); a step
takes the larger of the two, since launches run ahead of the GPU. The input pipeline caps the rate at what the
loader delivered, scaled by the instance's vCPUs; CPU-side work (`cpu_seconds`) is added to a run's time.

Where the workload was measured on a GPU, that measurement is scaled to the other GPU by the ratio of the two
roofline times (a measured run is always preferred), and the range is the spread of that ratio's error on the
published cross-GPU results in `catalog/published.csv` (`tests/common/test_advisor.py` checks it). With only a
CPU run, the range spans the efficiency ranges below: wide, and labelled so.

    from common.advisor import Workload, estimate
    from common.catalog import load_gpus
    gpus = load_gpus()
    w = Workload("train", flops_per_sample=24.6e9, bytes_per_sample=2.4e8, precision="amp", batch_size=256,
                 measured_gpu="V100-SXM2-16GB", measured_samples_per_s=1400)
    estimate(w, gpus["A100-SXM4-80GB"]).samples_per_s   # Range(low, expected, high)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from common.catalog import GPU

# Fractions of the datasheet peak that real training and inference reach (low, expected, high) on a GPU with the
# V100's power per TFLOPS; CUDA-core fp32 gets far more of its peak than the tensor cores do of theirs. Calibrated
# on DeepLearningExamples' ResNet-50 results (catalog/published.csv): V100 fp32 57-66 %, mixed precision 22-25 %.
# TF32 convolutions get less of theirs than fp16/bf16 (A100 ResNet-50: 13-15 %).
COMPUTE_EFFICIENCY = {"fp32": (0.35, 0.6, 0.8), "tf32": (0.07, 0.14, 0.3), "tensor": (0.1, 0.23, 0.45)}
MEMORY_EFFICIENCY = (0.45, 0.65, 0.85)
# A GPU with less power per peak TFLOPS than the V100 (T4: 70 W for 65; A100: 400 W for 312) sustains less of its
# peak: the efficiency scales with the square root of that ratio (the T4's and A100's ResNet-50 results fit 0.3-0.9).
REFERENCE_WATTS_PER_TFLOPS = {"fp32": 300 / 15.7, "tf32": 300 / 125, "tensor": 300 / 125}
POWER_EXPONENT = 0.5
LAUNCH_SECONDS = (15e-6, 8e-6, 4e-6)  # per operator, eager PyTorch: slow host, typical, fast host
MEASURED_SPREAD = (0.6, 1.0, 1.35)  # of a throughput scaled from a measured GPU run
DDP_EFFICIENCY = (0.75, 0.9, 0.95)  # per GPU, data parallel on one machine
BOUNDS = ("compute", "memory bandwidth", "launch overhead", "input pipeline", "CPU-side work")  # what `advise` names


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

    def inverse(self) -> Range:
        """1/x of each bound, the order kept (a rate's range as a time's)."""
        return Range(1 / self.high, 1 / self.expected, 1 / self.low)

    def plus(self, other: Range) -> Range:
        return Range(self.low + other.low, self.expected + other.expected, self.high + other.high)

    def as_dict(self) -> dict[str, float]:
        return {"low": self.low, "expected": self.expected, "high": self.high}


@dataclass(frozen=True)
class Workload:
    """What one model's training or serving does per sample; `ops_per_batch` the operators of one batch;
    `weight_bytes` what every batch reads whatever its size (for batch-1 latency)."""

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


def compute_efficiency(gpu: GPU, precision: str) -> tuple[float, float, float]:
    """The low, expected and high fraction of `gpu`'s `precision` peak a model reaches (its power per TFLOPS
    against the V100's; no adjustment where the TDP is not published)."""
    kind = precision if precision in ("fp32", "tf32") else "tensor"
    factor = 1.0
    if not math.isnan(gpu.tdp_w):
        factor = min(1.0, gpu.tdp_w / gpu.tflops[precision] / REFERENCE_WATTS_PER_TFLOPS[kind]) ** POWER_EXPONENT
    low, expected, high = COMPUTE_EFFICIENCY[kind]
    return low * factor, expected * factor, high * factor


def _batch_seconds(workload: Workload, gpu: GPU, precision: str, level: int) -> tuple[float, str]:
    """One batch's time and its bound at efficiency `level` (0 low, 1 expected, 2 high)."""
    batch = workload.batch_size
    efficiency = compute_efficiency(gpu, precision)[level]
    compute = workload.flops_per_sample * batch / (gpu.tflops[precision] * 1e12 * efficiency)
    memory = workload.bytes_per_sample * batch / (gpu.bandwidth_gbs * 1e9 * MEMORY_EFFICIENCY[level])
    launch = workload.ops_per_batch * LAUNCH_SECONDS[level]
    seconds, bound = max((compute, "compute"), (memory, "memory bandwidth"), (launch, "launch overhead"))
    return max(seconds, 1e-12), bound


def estimate(workload: Workload, gpu: GPU, gpus: dict[str, GPU] | None = None, vcpus: int | None = None,
             tf32: bool = False) -> Estimate:
    """Samples per second of `workload` on one `gpu` (an instance's `vcpus` for the input pipeline's ceiling);
    `gpus` is the catalogue that names the measured GPU."""
    precision = gpu_precision(workload.precision, gpu, tf32)
    seconds = [_batch_seconds(workload, gpu, precision, level) for level in range(3)]
    bound = seconds[1][1]
    if workload.measured_gpu and workload.measured_samples_per_s and gpus is not None:
        measured = gpus[workload.measured_gpu]
        there = _batch_seconds(workload, measured, gpu_precision(workload.precision, measured, tf32), 1)[0]
        rate = Range(*(workload.measured_samples_per_s * there / seconds[1][0] * spread
                       for spread in MEASURED_SPREAD))
    else:
        rate = Range(*(workload.batch_size / batch_seconds for batch_seconds, _ in seconds))
    if workload.loader_cores and not math.isnan(workload.loader_samples_per_s) and vcpus:
        ceiling = workload.loader_samples_per_s * vcpus / workload.loader_cores
        if ceiling < rate.expected:
            bound = "input pipeline"
        rate = rate.capped(ceiling)
    share = workload.peak_memory_gb / gpu.memory_gb if not math.isnan(workload.peak_memory_gb) else math.nan
    return Estimate(rate, bound, precision, not share > 0.95, share)


def data_parallel(rate: Range, gpus: int) -> Range:
    """The rate of `gpus` GPUs training data-parallel on one machine."""
    if gpus <= 1:
        return rate
    return Range(*(value * gpus * efficiency for value, efficiency in zip((rate.low, rate.expected, rate.high),
                                                                           DDP_EFFICIENCY)))


def cpu_seconds(seconds: float, parallel: bool, measured_cores: int, vcpus: int) -> Range:
    """A CPU-side part's seconds on an instance: a parallel part shares its work among the vCPUs (at most as well
    as it did among the measured cores); a serial one takes what it took. Hosts differ: ±30 %."""
    expected = seconds * measured_cores / vcpus if parallel and vcpus else seconds
    return Range(expected * 0.7, expected, expected * 1.3)
