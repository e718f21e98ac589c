"""What the advice is made of: one instance's estimates (`Row`), what the user states (`Options`), a way to pay for a
run (`Choice`), and every such way that finishes (`choices`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from common.advisor.budget import INTERRUPTIONS_PER_HOUR, REQUESTS_PER_S, Serving, SpotRun
from common.advisor.catalog import Instance
from common.advisor.estimate import Range
from common.advisor.multigpu import Scaling
from common.advisor.storage import Placement
from common.advisor.wholerun import WholeRun


@dataclass
class Row:
    """One instance's estimates (every figure a Range, or NaN where the price is unknown). The run is the whole
    run, on demand, the data's copy included; training is the torch models' fits, a part of it."""

    instance: Instance
    run_seconds: Range | None = None
    run_cost: Range | None = None
    train_seconds: Range | None = None
    epoch_seconds: Range | None = None  # of the model that trains longest
    bound: str = ""
    train_per_s: Range | None = None  # of the model that trains longest, on all the instance's GPUs
    serve_per_s: Range | None = None
    latency_ms: Range | None = None
    serve_cost_per_million: Range | None = None
    memory_share: float = math.nan
    fits: bool = True
    scaling: Scaling | None = None  # the instance's GPUs against one, for that model
    placement: Placement | None = None
    spot: SpotRun | None = None
    serving: Serving | None = None
    whole: WholeRun | None = None


@dataclass(frozen=True)
class Options:
    """What the user states: the money and time they have, the serving load, the spot interruption rate."""

    budget_usd: float | None = None
    deadline_h: float | None = None
    requests_per_s: float = REQUESTS_PER_S
    interruptions_per_hour: float = INTERRUPTIONS_PER_HOUR


@dataclass(frozen=True)
class Choice:
    """A recommended instance and how it is paid for: the whole run's time and cost."""

    row: Row
    spot: bool
    seconds: Range
    cost: Range

    @property
    def pricing(self) -> str:
        return "spot" if self.spot else "on demand"


def priced(rows: list[Row]) -> list[Row]:
    """The rows that can be recommended: the run fits the GPU's memory and the price is known."""
    return [row for row in rows if row.fits and not math.isnan(row.instance.price_per_hour)]


def choices(rows: list[Row]) -> list[Choice]:
    """Every way to pay for a run that fits: on demand, and on spot where it finishes even at the slow end of its
    range."""
    found = priced(rows)
    return ([Choice(row, False, row.run_seconds, row.run_cost) for row in found if row.run_cost is not None] +
            [Choice(row, True, row.spot.seconds, row.spot.cost) for row in found
             if row.spot is not None and math.isfinite(row.spot.seconds.high)])
