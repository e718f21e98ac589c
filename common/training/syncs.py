"""Host synchronisations, counted on any device.

On a GPU, an operator whose result the host must read before it can go on (a Python number from a tensor, the size
of a boolean mask's selection, a data-dependent shape) stalls the host until every kernel queued before it has run:
the queue drains, and the next step's launches start from empty. One such operator in a training step can cost more
than the step's kernels on a fast GPU. `HostSyncs` counts them as operators are dispatched, so a test on a CPU (where
nothing waits) shows what a GPU would have to wait for.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# Operators whose output the host needs before it can return: a scalar read, or an output shape that depends on the
# values (nonzero and everything that selects by a mask or counts).
SYNCING = {
    aten._local_scalar_dense.default,  # .item(), float(t), bool(t), `if t:`
    aten.is_nonzero.default,
    aten.equal.default,
    aten.nonzero.default,
    aten.argwhere.default,
    aten.masked_select.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
    aten.repeat_interleave.Tensor,  # the output length is the sum of the repeats
    aten.bincount.default,
}
# Indexing with a boolean mask finds the mask's true positions first (a nonzero).
MASK_INDEXED = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}


def _masked(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8) for index in indices)


class HostSyncs(TorchDispatchMode):
    """Counts the operators that make the host wait for the device (see the module docstring), by name in `by_name`.

        with HostSyncs() as syncs:
            loss = step(model, batch)
            loss.backward()
        assert syncs.count == 0, syncs.by_name
    """

    def __init__(self):
        super().__init__()
        self.by_name: Counter[str] = Counter()

    @property
    def count(self) -> int:
        return sum(self.by_name.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in SYNCING or (func in MASK_INDEXED and _masked(args)):
            output_size = kwargs.get("output_size") if func is aten.repeat_interleave.Tensor else None
            if output_size is None:
                self.by_name[str(func.overloadpacket.__name__)] += 1
        return func(*args, **kwargs)


def steady_step_syncs(loss: Callable[[], torch.Tensor], optimizer: torch.optim.Optimizer,
                      before_step: Callable[[], object] = lambda: None) -> HostSyncs:
    """The host synchronisations of a training step (`loss()`, its backward, `before_step()` such as clipping, the
    optimiser's step), counted on the second step: the first makes what is made once (the optimiser's state)."""

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss().backward()
        before_step()
        optimizer.step()

    step()
    with HostSyncs() as syncs:
        step()
    return syncs
