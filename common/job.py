"""What the CLI hands a use case: where it runs and what the user asked for beyond the config."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.paths import write_json_atomic
from common.runtime.devices import Runtime
from common.runtime.phases import Phases
from common.tracking.runs import Tracker


@dataclass
class Job:
    runtime: Runtime
    tracker: Tracker
    checkpoint_dir: Path
    resume: bool = False
    dask: Any = None  # a distributed.Client when runtime.engine is dask
    phases: Phases = field(default_factory=Phases)
    summary: Path | None = None  # --summary FILE: each model's metrics are written there as soon as it is done
    finished: dict[str, dict[str, float]] = field(default_factory=dict)

    def phase(self, name: str, scales: str = "device"):
        """`with job.phase("fit/ease", "cores"): ...` (`common.runtime.phases`)."""
        return self.phases(name, scales)

    def model_done(self, name: str, metrics: dict[str, float]) -> None:
        """Into the --summary file (marked partial) at once: a run stopped early (by `gpu-check`) still leaves them."""
        self.finished[name] = dict(metrics)
        if self.summary is not None and self.runtime.is_main:
            write_json_atomic({"partial": True, "run_id": self.tracker.run_id, "models": self.finished}, self.summary)
