"""The fits behind the advisor's shipped constants, kept with the tests that check them: the efficiencies
(`estimate.CALIBRATION`) fitted to catalog/published.csv, their leave-one-model-family-out validation, and the host's
cost per operator (`estimate.HOST_SECONDS_PER_OP`) fitted to catalog/host_bound.csv, and DDP's per-GPU efficiency
(`wholerun.SCALING_EFFICIENCY`) fitted to the published 8-GPU figures. Only tests run these: the advisor ships the
constants they produce."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from common.advisor.catalog import GPU, Link
from common.advisor.estimate import KINDS, Calibration, Workload, estimate, gpu_precision, kind_of, power_ratio
from common.advisor.wholerun import data_parallel

FLAT_LATENCY = 1.10  # a published latency within this of the batch-1 latency of its table is host-bound


@dataclass(frozen=True)
class Published:
    """One published result: `family` the model family that leave-one-model-out holds out (ResNet-50 v1.5 in
    either framework is one family), `group` the table, setting, task and precision as run (fp32 code on an A100
    runs TF32), `workload` with its FLOPs as this project measures them, on one `gpu`."""

    family: str
    group: str
    workload: Workload
    gpu: GPU
    tf32: bool
    samples_per_s: float


def calibrate(figures: list[Published], exponents: int = 101) -> Calibration:
    """The efficiencies that fit `figures` (compute-bound workloads): each figure implies a fraction of its peak,
    `samples/s x FLOPs per sample / peak`, modelled as efficiency[kind] x power_ratio ** exponent. The exponent is
    the one in [0, 1] that best fits how a table's figures move across GPUs (least squares of the logs within each
    group and kind, so a model's own speed does not count); each kind's efficiency is then the geometric mean of
    what its figures imply. Raises ValueError where a kind has no figure."""
    rows = []
    for figure in figures:
        precision = gpu_precision(figure.workload.precision, figure.gpu, figure.tf32)
        implied = figure.samples_per_s * figure.workload.flops_per_sample / (figure.gpu.tflops[precision] * 1e12)
        rows.append((figure.group, kind_of(precision), math.log(implied), math.log(power_ratio(figure.gpu, precision))))
    missing = [kind for kind in KINDS if not any(row[1] == kind for row in rows)]
    if missing:
        raise ValueError(f"no published figure computes in {', '.join(missing)}: nothing to calibrate it on")

    def within_groups(exponent: float) -> float:
        by_group: dict[tuple[str, str], list[float]] = {}
        for group, kind, implied, ratio in rows:
            by_group.setdefault((group, kind), []).append(implied - exponent * ratio)
        return sum(sum((value - sum(values) / len(values)) ** 2 for value in values) for values in by_group.values())

    exponent = min((step / (exponents - 1) for step in range(exponents)), key=within_groups)
    efficiency = {}
    for kind in KINDS:
        logs = [implied - exponent * ratio for _, found, implied, ratio in rows if found == kind]
        efficiency[kind] = math.exp(sum(logs) / len(logs))
    return Calibration(efficiency, exponent)


def leave_one_model_out(figures: list[Published], reference_gpu: str, gpus: dict[str, GPU]) -> list[dict]:
    """Every figure predicted by a calibration fitted without its model family: from FLOPs alone ("cpu", as
    `advise` does from a CPU run) and scaled from the same group's figure on `reference_gpu` ("measured", as from a
    GPU run of the model; the reference figure is the input there, never a target). Each row: family, group, gpu,
    path, published, low, expected, high, calibration."""
    rows = []
    for family in sorted({figure.family for figure in figures}):
        calibration = calibrate([figure for figure in figures if figure.family != family])
        held_out = [figure for figure in figures if figure.family == family]
        references = {figure.group: figure for figure in held_out if figure.gpu.name == reference_gpu}
        for figure in held_out:
            predicted = {"cpu": estimate(figure.workload, figure.gpu, tf32=figure.tf32, calibration=calibration)}
            reference = references.get(figure.group)
            if reference is not None and figure is not reference:
                measured = replace(figure.workload, measured_gpu=reference_gpu,
                                   measured_samples_per_s=reference.samples_per_s)
                predicted["measured"] = estimate(measured, figure.gpu, gpus, tf32=figure.tf32,
                                                 calibration=calibration)
            for path, found in predicted.items():
                rows.append({"family": family, "group": figure.group, "gpu": figure.gpu.name, "path": path,
                             "published": figure.samples_per_s, "low": found.samples_per_s.low,
                             "expected": found.samples_per_s.expected, "high": found.samples_per_s.high,
                             "bound": found.bound, "calibration": calibration})
    return rows


@dataclass(frozen=True)
class HostBound:
    """One published latency of a table (`group`: model, GPU and precision), with the operators of its forward
    pass as the probe counts them."""

    group: str
    batch_size: int
    latency_s: float
    ops: float


def flat_part(figures: list[HostBound]) -> list[HostBound]:
    """The figures whose latency is within FLAT_LATENCY of their table's batch-1 latency: there the host, not the GPU,
    sets the time (the GPU's share grows with the batch, the host's does not)."""
    first = {figure.group: figure.latency_s for figure in figures if figure.batch_size == 1}
    return [figure for figure in figures if figure.group in first and
            figure.latency_s <= FLAT_LATENCY * first[figure.group]]


def calibrate_host(figures: list[HostBound]) -> tuple[float, float]:
    """The host's slow and expected seconds per operator: each host-bound figure's latency over its operators, the
    envelope rounded up to 1 µs and the geometric mean."""
    implied = [figure.latency_s / figure.ops for figure in flat_part(figures)]
    if not implied:
        raise ValueError("no host-bound figure to calibrate the host on")
    slow = math.ceil(max(implied) * 1e6 - 1e-9) * 1e-6
    return slow, math.exp(sum(math.log(value) for value in implied) / len(implied))


def scaling_efficiency(figures: list[tuple[float, int, int, float, float, Link]]) -> tuple[float, float, float]:
    """The per-GPU efficiency published figures (one GPU's samples/s, the batch per GPU, the GPUs, their samples/s,
    the gradient bytes, the link) imply over the all-reduce model alone: the envelope rounded outwards to 0.05
    around the geometric mean."""
    implied = []
    for single, batch, gpus, together, gradient_bytes, link in figures:
        alone = data_parallel(batch / single, gradient_bytes, gpus, link, efficiency=(1.0, 1.0, 1.0))
        implied.append(together / single / alone.speedup.expected)
    mean = math.exp(sum(math.log(value) for value in implied) / len(implied))
    return (round(math.floor(min(implied) / 0.05 + 1e-9) * 0.05, 2), round(mean, 2),
            round(min(1.0, math.ceil(max(implied) / 0.05 - 1e-9) * 0.05), 2))
