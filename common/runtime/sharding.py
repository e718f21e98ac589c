"""Work split across the ranks of a DDP job and put back together, so that evaluation and per-series fits are done
once in all rather than once on every rank; and what rank 0 alone computes, handed to every rank. Without DDP (or
`runtime=None`) a rank's share is everything."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from common.errors import UserError
from common.runtime.devices import Runtime


def share_bounds(count: int, world_size: int) -> list[tuple[int, int]]:
    """Contiguous, near-equal [start, stop) blocks of range(count), one per rank, in rank order."""
    edges = np.linspace(0, count, world_size + 1).round().astype(int)
    return list(zip(edges[:-1].tolist(), edges[1:].tolist()))


def _distributed(runtime: Runtime | None) -> bool:
    return runtime is not None and runtime.distributed


def my_share(count: int, runtime: Runtime | None) -> slice:
    if not _distributed(runtime):
        return slice(0, count)
    return slice(*share_bounds(count, runtime.world_size)[runtime.rank])


def all_reduce_sum(tensor: torch.Tensor, runtime: Runtime | None) -> torch.Tensor:
    if _distributed(runtime):
        dist.all_reduce(tensor)
    return tensor


def all_reduce_max(value: float, runtime: Runtime | None) -> float:
    if not _distributed(runtime):
        return value
    tensor = torch.tensor([value], dtype=torch.float64, device=runtime.device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.item()


def gather_rows(part: torch.Tensor, count: int, runtime: Runtime | None) -> torch.Tensor:
    """Every rank's block (`my_share(count)` rows of one tensor) concatenated in rank order, on every rank."""
    if not _distributed(runtime):
        return part
    bounds = share_bounds(count, runtime.world_size)
    longest = max(stop - start for start, stop in bounds)
    padded = torch.zeros((longest, *part.shape[1:]), dtype=part.dtype, device=runtime.device)
    padded[:len(part)] = part.to(runtime.device)
    gathered = [torch.empty_like(padded) for _ in bounds]
    dist.all_gather(gathered, padded)
    return torch.cat([block[:stop - start] for block, (start, stop) in zip(gathered, bounds)])


def shared_predictions(predict: Callable[[slice], np.ndarray], count: int, runtime: Runtime | None) -> np.ndarray:
    """`predict(rows)` for every row of range(count), each rank predicting its own block. With fewer rows than
    ranks every rank predicts all of them (a block may not be empty: its trailing shape would be unknown)."""
    if not _distributed(runtime) or count < runtime.world_size:
        return predict(slice(0, count))
    part = torch.from_numpy(np.ascontiguousarray(predict(my_share(count, runtime))))
    return gather_rows(part, count, runtime).cpu().numpy()


def gather_objects(value: Any, runtime: Runtime | None) -> list[Any] | None:
    """Every rank's `value` (a DataFrame of forecasts, say) in rank order on rank 0, None elsewhere."""
    if not _distributed(runtime):
        return [value]
    gathered = [None] * runtime.world_size if runtime.is_main else None
    dist.gather_object(value, gathered, dst=0)
    return gathered


def on_main(runtime: Runtime | None, compute: Callable[[], Any]) -> Any:
    """`compute()` on rank 0, its value on every rank of a DDP job. Whatever rank 0 raises is raised on every rank
    (a UserError as itself, anything else as a RuntimeError naming it), so no rank is left in the broadcast."""
    if not _distributed(runtime):
        return compute()
    shared: list[Any] = [None]
    failure = None
    if runtime.is_main:
        try:
            shared[0] = ("value", compute())
        except BaseException as exc:
            failure = exc
            shared[0] = ("user" if isinstance(exc, UserError) else "error", f"{type(exc).__name__}: {exc}")
    dist.broadcast_object_list(shared, src=0)
    if failure is not None:
        raise failure
    kind, value = shared[0]
    if kind == "user":
        raise UserError(value.removeprefix("UserError: "))
    if kind == "error":
        raise RuntimeError(f"rank 0 failed: {value}")
    return value
