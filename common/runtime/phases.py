"""Where a run's time goes: its phases, logged as `time/<phase>_s`, each saying how it scales (`device` work runs on
the run's device, `cores` work is split over the cores, `serial` work runs on one core whatever the machine), so that
`usecases advise` can tell which parts a GPU, more cores or neither would shorten. A nested phase counts alone."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

SCALES = ("device", "cores", "serial")
TAG = "time_phases"  # the run's tag: {phase: how it scales}, as JSON
SHOWN_FROM_S = 0.05


@dataclass
class Phase:
    seconds: float = 0.0
    scales: str = "serial"


class Phases:
    """A run's phases in the order they first ran; calling it times one: `with phases("fit/ease", "cores"):`."""

    def __init__(self, device: torch.device | None = None):
        self.device = device
        self.phases: dict[str, Phase] = {}
        self._inner: list[float] = []  # per open phase, the seconds of the phases inside it

    @contextmanager
    def __call__(self, name: str, scales: str = "device") -> Iterator[None]:
        if scales not in SCALES:
            raise ValueError(f"phase {name!r}: scales must be one of {', '.join(SCALES)}, got {scales!r}")
        if name in ("total", "other") or not name or name.endswith("/"):
            raise ValueError(f"phase name {name!r} is reserved or empty")
        phase = self.phases.setdefault(name, Phase(scales=scales))
        self._synchronise()
        started = time.perf_counter()
        self._inner.append(0.0)
        try:
            yield
        finally:
            self._synchronise()
            elapsed = time.perf_counter() - started
            phase.seconds += elapsed - self._inner.pop()
            if self._inner:
                self._inner[-1] += elapsed

    def _synchronise(self) -> None:
        """A phase ends when its device work does (kernels run after the host queued them)."""
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def metrics(self) -> dict[str, float]:
        return {f"time/{name}_s": phase.seconds for name, phase in self.phases.items()}

    def tags(self) -> dict[str, str]:
        return {TAG: json.dumps({name: phase.scales for name, phase in self.phases.items()})}

    def line(self, total_s: float) -> str:
        """`time: 142 s — fit/sasrec 40 s (28 %), ...` largest first, then `other`; under SHOWN_FROM_S left out."""
        parts = sorted(self.phases.items(), key=lambda item: -item[1].seconds)
        other = max(total_s - sum(phase.seconds for phase in self.phases.values()), 0.0)
        shown = [(name, phase.seconds) for name, phase in parts if phase.seconds >= SHOWN_FROM_S] + [("other", other)]
        return f"time: {_seconds(total_s)} in all — " + ", ".join(
            f"{name} {_seconds(seconds)} ({100 * seconds / total_s:.0f} %)" if total_s > 0 else f"{name} {seconds}"
            for name, seconds in shown)


def _seconds(value: float) -> str:
    return f"{value:.0f} s" if value >= 10 else f"{value:.1f} s"
