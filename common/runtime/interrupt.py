"""Stopping on Ctrl-C or SIGTERM at a safe point, so checkpoints, runs and database connections close cleanly.

An exception raised straight from a signal handler can land inside a lock held by SQLAlchemy or MLflow's
system-metrics thread and deadlock the shutdown. So the first signal only records the request, and the job
raises at its next `stop_point()` (every training step, every baseline refit); a second signal stops at once.
Under DDP the ranks agree once per epoch (see common/training/loop.py), so none is left waiting in a collective.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager

_requested: int | None = None
_deferred = 0


class Terminated(BaseException):
    """The job was asked to stop by SIGTERM (as KeyboardInterrupt is for Ctrl-C)."""


def _exception_for(signum: int) -> BaseException:
    return KeyboardInterrupt() if signum == signal.SIGINT else Terminated(f"signal {signum}")


def _handler(signum: int, frame) -> None:
    global _requested
    if _requested is not None:
        raise _exception_for(signum)
    _requested = signum
    print(f"{signal.Signals(signum).name}: stopping at the next safe point (send it again to stop at once)",
          file=sys.stderr, flush=True)


def stop_on_signals() -> None:
    global _requested
    _requested = None
    signal.signal(signal.SIGINT, _handler)
    signal.signal(signal.SIGTERM, _handler)


def stop_requested() -> bool:
    return _requested is not None


def stop_point() -> None:
    """Raise KeyboardInterrupt or Terminated here if a stop was requested (and stops are not deferred)."""
    if _requested is not None and not _deferred:
        raise _exception_for(_requested)


@contextmanager
def stops_deferred(active: bool = True) -> Iterator[None]:
    """Within the block `stop_point()` does nothing: for work that each DDP rank does alone before a collective,
    after which the ranks agree to stop together. A rank that stopped alone would leave the others waiting in the
    collective (for an hour, or until gloo reports a lost peer and the run looks FAILED)."""
    global _deferred
    _deferred += active
    try:
        yield
    finally:
        _deferred -= active
