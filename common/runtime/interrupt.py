"""Stopping on Ctrl-C or SIGTERM at a safe point, so that checkpoints, runs and database connections close cleanly: an
exception raised from a signal handler can land inside a lock of SQLAlchemy's or MLflow's threads and deadlock the
shutdown. The first signal only records the request, raised at the next `stop_point()`; a second stops at once."""

from __future__ import annotations

import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager

_requested: int | None = None
_deferred = 0


class Terminated(BaseException):
    """SIGTERM's KeyboardInterrupt."""


class Capped(Terminated):
    """SIGUSR1: the run's time cap (`gpu-check` sends it). Caught around a run's models, the run ends FINISHED with the
    models it measured and a `capped` tag; anywhere else it stops as SIGTERM does."""


CAP_SIGNAL = getattr(signal, "SIGUSR1", None)  # none on Windows


def _exception_for(signum: int) -> BaseException:
    if signum == CAP_SIGNAL:
        return Capped(f"signal {signum}: the time cap")
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
    for signum in (signal.SIGINT, signal.SIGTERM, CAP_SIGNAL):
        if signum is not None:
            signal.signal(signum, _handler)


def stop_handled() -> None:
    """The request was acted on (a capped run finished with what it measured): later safe points go on."""
    global _requested
    _requested = None


def stop_requested() -> bool:
    return _requested is not None


def stop_point() -> None:
    if _requested is not None and not _deferred:
        raise _exception_for(_requested)


@contextmanager
def stops_deferred(active: bool = True) -> Iterator[None]:
    """Within the block `stop_point()` does nothing: for work each DDP rank does alone before a collective, after
    which the ranks agree to stop together (a rank that stopped alone would leave the others waiting in it)."""
    global _deferred
    _deferred += active
    try:
        yield
    finally:
        _deferred -= active
