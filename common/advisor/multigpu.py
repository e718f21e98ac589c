"""Several GPUs, honestly: the speed-up of data-parallel training (DDP) over one GPU of the same kind, as a range,
from one GPU's step time, the gradients' bytes and what links the GPUs (their interconnect within a machine, the
instances' network between machines).

Per step every GPU computes its own batch in `step_s` (one GPU's estimated step); DDP then all-reduces the gradients
as a ring (each GPU sends and receives 2 (n-1)/n of the gradient bytes over its link), in buckets that overlap the
backward pass (about two thirds of a step). What is not hidden, plus DDP's fixed cost per step (its hooks, the
buckets' copies, the collectives' latency), lengthens the step. What else a job of n GPUs loses (stragglers, one
input pipeline per GPU, synchronisation) is a per-GPU efficiency, fitted to the published 8-GPU scaling of
DeepLearningExamples' ResNet-50 v1.5 (catalog/published.csv: 6.7x to 7.8x on 8 GPUs, where the all-reduce alone
would cost under 2 % of a step); `tests/common/test_advisor.py` recomputes it and checks every published 8-GPU
figure lies in its predicted range. The link efficiency, overlap and per-step cost are assumed, not fitted: no
published figure here is bound by them, so they set the range's width for small, fast steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from common.advisor.catalog import Link, load_links
from common.advisor.estimate import Range

# Fitted: the geometric mean and the envelope (rounded outwards to 0.05) of published 8-GPU speed-up / (8 x what the
# all-reduce model alone predicts) over DeepLearningExamples' six ResNet-50 training figures (`scaling_efficiency`).
SCALING_EFFICIENCY = (0.80, 0.91, 1.0)
# Assumed (low, expected, high): the share of a link's nominal bandwidth NCCL's ring reaches (nccl-tests report
# 70-85 % as bus bandwidth on NVLink and PCIe), the share of the backward pass the transfer hides behind, DDP's
# fixed cost per step, and each extra hop's latency between machines.
LINK_EFFICIENCY = (0.5, 0.7, 0.85)
OVERLAP = (0.0, 0.5, 0.9)
STEP_OVERHEAD_S = (500e-6, 200e-6, 50e-6)
NETWORK_HOP_S = (200e-6, 100e-6, 30e-6)
BACKWARD_SHARE = 2 / 3
UNKNOWN_LINK = "pcie3"  # taken where the catalogue does not say: the slowest link a GPU server has


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
        return {"gpus": self.gpus, "nodes": self.nodes, "speedup": self.speedup.as_dict(),
                "all_reduce_ms": self.all_reduce_s.scaled(1000).as_dict(), "step_ms": 1000 * self.step_s,
                "gradient_bytes": self.gradient_bytes,
                "paced_by": self.paced_by}


def _ring_seconds(members: int, gradient_bytes: float, gbs: float, efficiency: float) -> float:
    return 2 * (members - 1) / members * gradient_bytes / (gbs * 1e9 * efficiency) if members > 1 else 0.0


def data_parallel(step_s: float, gradient_bytes: float, gpus_per_node: int, link: Link | None, nodes: int = 1,
                  network_gbps: float = math.nan, efficiency: tuple[float, float, float] = SCALING_EFFICIENCY
                  ) -> Scaling | None:
    """The scaling of `gpus_per_node` x `nodes` GPUs; None for several machines whose network is unknown."""
    gpus = gpus_per_node * nodes
    if gpus <= 1:
        return Scaling(gpus, nodes, Range(1.0, 1.0, 1.0), Range(0.0, 0.0, 0.0), step_s, "", gradient_bytes)
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


def scaling_efficiency(figures: list[tuple[float, int, int, float, float, Link]]) -> tuple[float, float, float]:
    """The per-GPU efficiency published multi-GPU figures imply: each figure is (one GPU's samples/s, the batch per
    GPU, the GPUs, their samples/s, the gradient bytes, the link), its efficiency the published speed-up over what
    the all-reduce model alone (efficiency 1) expects; returns the envelope rounded outwards to 0.05 around the
    geometric mean."""
    implied = []
    for single, batch, gpus, together, gradient_bytes, link in figures:
        alone = data_parallel(batch / single, gradient_bytes, gpus, link, efficiency=(1.0, 1.0, 1.0))
        implied.append(together / single / alone.speedup.expected)
    mean = math.exp(sum(math.log(value) for value in implied) / len(implied))
    return (round(math.floor(min(implied) / 0.05 + 1e-9) * 0.05, 2), round(mean, 2),
            round(min(1.0, math.ceil(max(implied) / 0.05 - 1e-9) * 0.05), 2))
