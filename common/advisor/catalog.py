"""The GPU, instance and interconnect catalogue `usecases advise` prices runs with: `catalog/*.csv` beside this
module, each row with its sources and as-of date, or a user's own instances (`--catalog FILE`, the columns after
`as_of` optional). An empty cell stays unknown: it is never filled in."""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from common.errors import UserError, one_line

FOLDER = Path(__file__).with_name("catalog")
GPU_COLUMNS = ("gpu", "aliases", "memory_gb", "bandwidth_gbs", "fp32_tflops", "tf32_tflops", "fp16_tflops",
               "bf16_tflops", "tdp_w", "compute_capability", "source", "as_of")
INSTANCE_COLUMNS = ("provider", "instance", "gpu", "gpu_count", "vcpus", "ram_gb", "price_per_hour_usd", "region",
                    "source", "as_of")
# What the renting question needs beyond compute; a user's catalogue may leave them out (unknown).
HARDWARE_COLUMNS = ("spot_price_per_hour_usd", "network_gbps", "local_nvme_count", "local_nvme_gb", "disk_gbs",
                    "interconnect", "hardware_source", "hardware_as_of")
PRECISIONS = ("fp32", "tf32", "fp16", "bf16")
NOISE = {"nvidia", "tesla", "geforce", "gpu", "sxm", "sxm2", "sxm4", "sxm5", "hbm3", "hbm2e", "hbm3e", "nvl"}


@dataclass(frozen=True)
class GPU:
    name: str
    memory_gb: float
    bandwidth_gbs: float
    tflops: dict[str, float]  # peak dense TFLOPS by precision; NaN where the GPU has no such mode
    tdp_w: float
    source: str
    aliases: tuple[str, ...] = ()  # as nvidia-smi prints the name
    compute_capability: float = math.nan  # CUDA's: which CUDA majors' builds run on it

    @property
    def cuda_major(self) -> int:
        """The newest CUDA major whose torch and RAPIDS builds run on this GPU: CUDA 13 needs Turing (7.5) or
        newer (https://docs.nvidia.com/cuda/cuda-toolkit-release-notes/ , 13.0: Maxwell, Pascal and Volta dropped)."""
        return 12 if self.compute_capability < 7.5 else 13

    def has(self, precision: str) -> bool:
        return not math.isnan(self.tflops.get(precision, math.nan))


@dataclass(frozen=True)
class Instance:
    provider: str
    name: str
    gpu: GPU
    gpu_count: int
    vcpus: int
    ram_gb: float
    price_per_hour: float  # NaN: unknown
    region: str
    source: str
    as_of: str
    spot_price_per_hour: float = math.nan
    network_gbps: float = math.nan
    nvme_count: float = math.nan  # local NVMe drives; 0: none
    nvme_gb: float = math.nan  # each
    disk_gbs: float = math.nan  # the default network disk's throughput, GB/s
    interconnect: str = ""  # between its GPUs (or the one GPU's link): pcie3..5, nvlink2..4
    hardware_source: str = ""

    @property
    def nvme_total_gb(self) -> float:
        return self.nvme_count * self.nvme_gb if self.nvme_count else (0.0 if self.nvme_count == 0 else math.nan)


@dataclass(frozen=True)
class Link:
    """A GPU interconnect: its bandwidth per GPU in one direction, what a ring all-reduce is paced by."""

    name: str
    gbs_per_gpu: float
    source: str


def _read(path: Path, columns: tuple[str, ...], what: str) -> pd.DataFrame:
    try:
        table = pd.read_csv(path, dtype=str, keep_default_na=False)
    except (OSError, ValueError, pd.errors.ParserError) as exc:
        raise UserError(f"{path}: cannot be read as a {what} CSV ({one_line(exc)})") from None
    missing = [name for name in columns if name not in table.columns]
    if missing:
        raise UserError(f"{path}: missing column '{missing[0]}' (the {what} CSV has the columns {', '.join(columns)})")
    return table


def _number(table: pd.DataFrame, column: str, path: Path, required: bool) -> pd.Series:
    values = pd.to_numeric(table[column].str.strip().replace("", math.nan), errors="coerce")
    bad = (values.isna() & (table[column].str.strip() != "")) | (values < 0)
    if required:
        bad |= values.isna()
    if bad.any():
        row = int(bad.to_numpy().nonzero()[0][0])
        raise UserError(f"{path}: column '{column}', row {row + 1}: expected a non-negative number, got "
                        f"'{table[column].iloc[row]}' (rows counted from 1 at the line after the header)")
    return values


def load_gpus() -> dict[str, GPU]:
    path = FOLDER / "gpus.csv"
    table = _read(path, GPU_COLUMNS, "GPU catalogue")
    numbers = {column: _number(table, column, path, column in ("memory_gb", "bandwidth_gbs"))
               for column in GPU_COLUMNS if column.endswith(("_gb", "_gbs", "_tflops", "_w", "_capability"))}
    return {table["gpu"].iloc[row]: GPU(
        table["gpu"].iloc[row], float(numbers["memory_gb"].iloc[row]), float(numbers["bandwidth_gbs"].iloc[row]),
        {precision: float(numbers[f"{precision}_tflops"].iloc[row]) for precision in PRECISIONS},
        float(numbers["tdp_w"].iloc[row]), table["source"].iloc[row],
        tuple(alias.strip() for alias in table["aliases"].iloc[row].split("|") if alias.strip()),
        float(numbers["compute_capability"].iloc[row])) for row in range(len(table))}


def load_instances(gpus: dict[str, GPU], path: Path | None = None) -> list[Instance]:
    """The shipped instances, or a user's file of the same columns; a GPU is named as `match_gpu` reads it."""
    path = path or FOLDER / "instances.csv"
    table = _read(path, INSTANCE_COLUMNS, "instance catalogue")
    for column in HARDWARE_COLUMNS:
        if column not in table.columns:
            table[column] = ""
    numbers = {column: _number(table, column, path, column in ("gpu_count", "vcpus"))
               for column in ("gpu_count", "vcpus", "ram_gb", "price_per_hour_usd", *HARDWARE_COLUMNS[:5])}
    links = load_links()
    unknown = ~table["interconnect"].str.strip().isin(["", *links])
    if unknown.any():
        row = int(unknown.to_numpy().nonzero()[0][0])
        raise UserError(f"{path}: column 'interconnect', row {row + 1}: expected one of {', '.join(links)} or empty, "
                        f"got '{table['interconnect'].iloc[row]}'")
    instances = []
    for row in range(len(table)):
        try:
            gpu = gpus[match_gpu(table["gpu"].iloc[row], gpus)]
        except UserError as problem:
            raise UserError(f"{path}: column 'gpu', row {row + 1}: {problem}") from None
        instances.append(Instance(table["provider"].iloc[row], table["instance"].iloc[row], gpu,
                                  int(numbers["gpu_count"].iloc[row]), int(numbers["vcpus"].iloc[row]),
                                  float(numbers["ram_gb"].iloc[row]), float(numbers["price_per_hour_usd"].iloc[row]),
                                  table["region"].iloc[row], table["source"].iloc[row], table["as_of"].iloc[row],
                                  *(float(numbers[column].iloc[row]) for column in HARDWARE_COLUMNS[:5]),
                                  table["interconnect"].iloc[row].strip(), table["hardware_source"].iloc[row]))
    return instances


def load_catalogue(instances: Path | None = None) -> tuple[dict[str, GPU], list[Instance]]:
    """The GPUs and the instances (the shipped ones, or a user's file)."""
    gpus = load_gpus()
    return gpus, load_instances(gpus, instances)


@functools.cache
def load_links() -> dict[str, Link]:
    """The links' bandwidths, read once: every instance and every scaling figure looks its link up here."""
    path = FOLDER / "interconnects.csv"
    table = _read(path, ("interconnect", "gbs_per_gpu", "source"), "interconnect catalogue")
    bandwidth = _number(table, "gbs_per_gpu", path, True)
    return {table["interconnect"].iloc[row]: Link(table["interconnect"].iloc[row], float(bandwidth.iloc[row]),
                                                  table["source"].iloc[row]) for row in range(len(table))}


def _normal(name: str) -> str:
    return " ".join(re.sub(r"[^a-z0-9]+", " ", name.lower()).split())


def match_gpu(name: str, gpus: dict[str, GPU]) -> str:
    """The catalogue's GPU for a name as a user or `nvidia-smi` writes it ("V100", "Tesla V100-SXM2-16GB",
    "NVIDIA A100 80GB PCIe"): the model number must match; memory size and PCIe pick among its variants, and the
    first variant listed is taken when the name does not say."""
    normal = _normal(name)
    for gpu in gpus.values():
        if normal in {_normal(alias) for alias in (gpu.name, *gpu.aliases)}:
            return gpu.name
    tokens = set(normal.split()) - NOISE
    models = [gpu for gpu in gpus if _normal(gpu).split()[0] in tokens]
    if not models:
        raise UserError(f"unknown GPU '{name}' (known: {', '.join(gpus)})")
    sizes = {int(found.group(1)) for token in tokens if (found := re.fullmatch(r"(\d+)gb?", token))}
    models = [gpu for gpu in models if round(gpus[gpu].memory_gb) in sizes] or models
    pcie = "pcie" in tokens
    return next((gpu for gpu in models if ("pcie" in _normal(gpu).split()) == pcie), models[0])
