"""Peak resident memory of a run's whole process tree (this process, Dask workers, DataLoader workers), sampled in
a background thread: what decides whether a run fits a machine, and what `usecases bench scale` compares."""

from __future__ import annotations

import threading

import psutil

SAMPLE_EVERY_S = 0.25


def tree_rss_bytes(process: psutil.Process | None = None) -> int:
    """Resident memory of a process and every process below it (gone ones count as 0)."""
    process = process or psutil.Process()
    total = 0
    for member in [process, *process.children(recursive=True)]:
        try:
            total += member.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return total


class PeakMemory:
    """`with PeakMemory() as peak:` ... `peak.bytes`: the largest tree RSS seen while it ran."""

    def __init__(self, every_s: float = SAMPLE_EVERY_S):
        self.every_s = every_s
        self.bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="peak-memory", daemon=True)

    def _sample(self) -> None:
        while True:
            self.bytes = max(self.bytes, tree_rss_bytes())
            if self._stop.wait(self.every_s):
                return

    @property
    def gigabytes(self) -> float:
        return self.bytes / 2**30

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.bytes = max(self.bytes, tree_rss_bytes())
