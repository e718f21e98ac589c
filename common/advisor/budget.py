"""Money over time: a training run on spot instances with its interruptions, serving for a month at a request rate,
and the filters a budget and a deadline put on the answer.

A spot run is interrupted at a stated rate (interruptions per hour of running; providers publish buckets, such as
AWS's Spot Instance Advisor's monthly frequencies, not a figure per hour, so the rate is the user's to state). Each
interruption loses the work since the last checkpoint (on average half of the time between checkpoints: a fit saves
every `checkpoint_every_s` seconds, or never if it is shorter; half the run where the interval is unknown) and a
restart: a new instance, the setup, the data copied again and the checkpoint loaded.
The run's time then solves `T = work + rate x T x (lost + restart)`, which has no answer (the run never finishes)
once an interruption costs more than the mean time between them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from common.advisor.estimate import Range

INTERRUPTIONS_PER_HOUR = 0.05  # the default stated rate: one in 20 hours of running
RESTART_S = (240.0, 480.0, 900.0)  # a new instance, its setup, the checkpoint loaded: assumed, low-high
HOURS_PER_MONTH = 730.0
REQUESTS_PER_S = 100.0  # the default serving load a monthly cost is stated at


@dataclass(frozen=True)
class SpotRun:
    seconds: Range  # the whole run with its interruptions and restarts (inf: it never finishes)
    cost: Range
    interruptions: float  # expected
    lost_s: float  # work lost per interruption, expected
    between_s: float  # expected seconds between checkpoints (the whole run where none is known)

    def saving(self, on_demand: Range) -> float:
        """The expected saving over on demand, a share (negative: spot costs more)."""
        return 1 - self.cost.expected / on_demand.expected if on_demand.expected > 0 else math.nan

    def as_dict(self, on_demand: Range | None = None) -> dict:
        return {"seconds": self.seconds.as_dict(), "cost_usd": self.cost.as_dict(),
                "interruptions": self.interruptions, "lost_per_interruption_s": self.lost_s,
                "between_checkpoints_s": self.between_s,
                **({"saving": self.saving(on_demand)} if on_demand is not None else {})}


def spot_run(work: Range, between: Range | None, spot_price: float, copy_s: Range,
             per_hour: float = INTERRUPTIONS_PER_HOUR) -> SpotRun | None:
    """`work` seconds of a run on spot at `spot_price` a hour, a checkpoint every `between` seconds (None: none
    known, so an interruption loses half the run); None where there is no spot price."""
    if not spot_price >= 0:
        return None
    rate = per_hour / 3600
    between = between or work
    levels = []
    for seconds, every, restart, copy in zip((work.low, work.expected, work.high),
                                             (between.low, between.expected, between.high), RESTART_S,
                                             (copy_s.low, copy_s.expected, copy_s.high)):
        lost = min(every, seconds) / 2
        per_interruption = lost + restart + (0.0 if math.isnan(copy) else copy)
        levels.append((seconds / (1 - rate * per_interruption) if rate * per_interruption < 1 else math.inf, lost))
    seconds = Range(*(total for total, _ in levels))
    return SpotRun(seconds, seconds.scaled(spot_price / 3600), rate * seconds.expected, levels[1][1],
                   min(between.expected, work.expected))


@dataclass(frozen=True)
class Serving:
    requests_per_s: float
    replicas: Range  # instances
    month_usd: Range

    def as_dict(self) -> dict:
        return {"requests_per_s": self.requests_per_s, "replicas": self.replicas.as_dict(),
                "month_usd": self.month_usd.as_dict()}


def serving_month(samples_per_s: Range, requests_per_s: float, price: float) -> Serving:
    """Instances to serve `requests_per_s` (each a prediction) at `samples_per_s` each, and their month on demand."""
    replicas = Range(*(max(1, math.ceil(requests_per_s / rate)) if rate > 0 else math.inf
                       for rate in (samples_per_s.high, samples_per_s.expected, samples_per_s.low)))
    return Serving(requests_per_s, replicas, replicas.scaled(price * HOURS_PER_MONTH))


def within(seconds: float, cost: float, budget_usd: float | None, deadline_h: float | None) -> bool:
    """The expected time and cost meet the deadline and the budget, where given."""
    return ((budget_usd is None or cost <= budget_usd) and
            (deadline_h is None or seconds <= deadline_h * 3600))
