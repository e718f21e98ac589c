"""What the CLI hands a use case: where it runs and what the user asked for beyond the config."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.runtime.devices import Runtime
from common.tracking.runs import Tracker


@dataclass
class Job:
    runtime: Runtime
    tracker: Tracker
    checkpoint_dir: Path
    resume: bool = False
    dask: Any = None  # a distributed.Client when runtime.engine is dask
