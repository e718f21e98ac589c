"""Where the data set should sit on an instance, and whether reading it would bound training there.

From the run's data (`data_bytes` as stored and `data_samples`, the run's tags) and the estimated training rate:
training reads `rate x bytes per sample` each second. Where the default network disk keeps up, the data stays there;
else, best first: memory (the page cache) where the data takes at most half the instance's RAM, loaded once; local
NVMe where it fits, copied once from object storage over the instance's network; else the network disk or object
storage read as it trains, whichever is faster.
The catalogue gives RAM, NVMe drives, the network's Gbit/s and the default disk's GB/s; a drive's read speed and the
share of the network a copy reaches are assumed ranges (cloud instance stores publish IOPS, not throughput).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from common.advisor.catalog import Instance
from common.advisor.estimate import Range
from common.advisor.formats import figure

MEMORY_SHARE = 0.5  # of the RAM the page cache may hold: the rest is the process's, its loader workers' and the OS's
NVME_SHARE = 0.9  # of the local drives a copy may fill
NVME_GBS_PER_DRIVE = (0.5, 1.5, 3.0)  # assumed sequential reads of one instance-store NVMe drive
NETWORK_EFFICIENCY = (0.3, 0.5, 0.8)  # assumed share of the NIC a parallel copy from object storage reaches
MATTERS_GB = 1.0  # below this a data set's placement changes nothing worth a line


@dataclass(frozen=True)
class Placement:
    """Where the data goes on one instance and what that costs: `read_gbs` what training can read there (inf from
    memory), `copy_s` the one-off copy before training (and after each spot restart), `needed_gbs` what training at
    the estimated rate reads."""

    where: str  # memory, local NVMe, network disk, object storage
    data_gb: float
    needed_gbs: float
    read_gbs: Range
    copy_s: Range
    default_disk_gbs: float

    @property
    def bounds(self) -> bool:
        """Reading caps training's rate even at the place chosen."""
        return self.needed_gbs > self.read_gbs.expected

    @property
    def matters(self) -> bool:
        """Worth a column and a line: the default disk would bound training, or the data must be copied first."""
        return self.data_gb >= MATTERS_GB and (self.bounds or self.needed_gbs > _or_zero(self.default_disk_gbs) or
                                               self.where in ("memory", "local NVMe"))

    def line(self, instance: Instance) -> str:
        """The advice in words, each figure with its unit ("needs 1.9 GB/s of input; ...")."""
        need = f"training at the estimated rate reads {_rate(self.needed_gbs)} of input"
        disk = (f"this instance's network disk gives {_rate(self.default_disk_gbs)}" if self.default_disk_gbs > 0
                else "its network disk's throughput is not in the catalogue")
        copy = (f"{_minutes(self.copy_s.expected)} ({_minutes(self.copy_s.low)}-{_minutes(self.copy_s.high)})"
                if math.isfinite(self.copy_s.expected) else "copy time unknown (the catalogue lacks its network)")
        if self.where == "memory":
            return (f"{need}; {disk}: load the {_gb(self.data_gb)} GB data set into memory first (it takes "
                    f"{100 * self.data_gb / instance.ram_gb:.0f} % of {instance.ram_gb:g} GB RAM), {copy}")
        if self.where == "local NVMe":
            return (f"{need}; {disk}: copy the {_gb(self.data_gb)} GB data set to local NVMe first "
                    f"({instance.nvme_count:g} x {instance.nvme_gb:g} GB, about {_rate(self.read_gbs.expected)} "
                    f"to read), {copy}")
        if self.where == "network disk" and math.isnan(self.read_gbs.expected):
            return f"{need}; neither its network disk's throughput nor its network's is in the catalogue"
        if self.where == "network disk" and not self.bounds:
            return f"{need}; {disk}: it keeps up, train from it as the data is (no copy)"
        bound = (f": reading caps training at {100 * self.read_gbs.expected / self.needed_gbs:.0f} % of the GPU's "
                 "rate; shard the data or pick an instance with local NVMe" if self.bounds else "")
        return (f"{need}; the {_gb(self.data_gb)} GB data set is read from {self.where} at "
                f"{_rate(self.read_gbs.expected)}{bound}")

    def as_dict(self) -> dict:
        return {"where": self.where, "data_gb": self.data_gb, "needed_gbs": self.needed_gbs,
                "read_gbs": self.read_gbs.as_dict(), "copy_s": self.copy_s.as_dict(),
                "default_disk_gbs": None if math.isnan(self.default_disk_gbs) else self.default_disk_gbs,
                "bounds": self.bounds, "matters": self.matters}


def _gb(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def _or_zero(value: float) -> float:
    return 0.0 if math.isnan(value) else value


def _rate(gbs: float) -> str:
    return f"{figure(gbs)} GB/s" if gbs >= 0.1 else f"{figure(1000 * gbs)} MB/s"


def _minutes(seconds: float) -> str:
    return f"{figure(seconds / 60)} min" if seconds >= 60 else f"{figure(seconds)} s"


def place(data_gb: float, samples_per_s: float, bytes_per_sample: float, instance: Instance) -> Placement:
    """The best place for `data_gb` on `instance` when training reads `samples_per_s` x `bytes_per_sample`."""
    needed = samples_per_s * bytes_per_sample / 1e9
    network = Range(*(instance.network_gbps / 8 * share for share in NETWORK_EFFICIENCY)) if \
        instance.network_gbps > 0 else None
    copy = network.inverse().scaled(data_gb) if network is not None else Range(math.nan, math.nan, math.nan)
    none = Range(0.0, 0.0, 0.0)
    disk = Range(instance.disk_gbs, instance.disk_gbs, instance.disk_gbs) if instance.disk_gbs > 0 else None
    if disk is not None and needed <= disk.expected:  # the default disk keeps up: nothing to copy
        return Placement("network disk", data_gb, needed, disk, none, instance.disk_gbs)
    if instance.ram_gb > 0 and data_gb <= MEMORY_SHARE * instance.ram_gb:
        return Placement("memory", data_gb, needed, Range(math.inf, math.inf, math.inf), copy, instance.disk_gbs)
    if instance.nvme_total_gb > 0 and data_gb <= NVME_SHARE * instance.nvme_total_gb:
        drives = Range(*(instance.nvme_count * speed for speed in NVME_GBS_PER_DRIVE))
        return Placement("local NVMe", data_gb, needed, drives, copy, instance.disk_gbs)
    if network is not None and (disk is None or network.expected > disk.expected):
        return Placement("object storage", data_gb, needed, network, none, instance.disk_gbs)
    return Placement("network disk", data_gb, needed, disk or Range(math.nan, math.nan, math.nan), none,
                     instance.disk_gbs)
