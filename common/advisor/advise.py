"""Which GPU instance to rent to run and to serve a use case, and what it costs: each instance's whole run
(`wholerun`), where its data sits, its spot run and a month of serving (`advise`), and the picks (`recommend`). Pure
estimates, each a range (docs/advisor.md, "Measured and estimated")."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from common.advisor.catalog import GPU, Instance, Link, load_links
from common.advisor.estimate import Range
from common.advisor.facts import RunFacts
from common.advisor.wholerun import ModelRun, Scaling, WholeRun, serving, whole_run

INTERRUPTIONS_PER_HOUR = 0.05  # the default stated spot interruption rate: one in 20 hours of running
RESTART_S = (240.0, 480.0, 900.0)  # a spot restart: a new instance, its setup, the checkpoint loaded (assumed)
HOURS_PER_MONTH = 730.0
REQUESTS_PER_S = 100.0  # the default serving load a monthly cost is stated at
MEMORY_SHARE = 0.5  # of the RAM the page cache may hold: the rest is the process's, its loader workers' and the OS's
NVME_SHARE = 0.9  # of the local drives a copy may fill
NVME_GBS_PER_DRIVE = (0.5, 1.5, 3.0)  # an instance-store NVMe drive's sequential reads (assumed: clouds publish IOPS)
NETWORK_EFFICIENCY = (0.3, 0.5, 0.8)  # the share of the NIC a parallel copy from object storage reaches (assumed)


@dataclass(frozen=True)
class Options:
    """What the user states: the money and time they have, the serving load, the spot interruption rate."""

    budget_usd: float | None = None
    deadline_h: float | None = None
    requests_per_s: float = REQUESTS_PER_S
    interruptions_per_hour: float = INTERRUPTIONS_PER_HOUR


@dataclass(frozen=True)
class Placement:
    """Where the data goes on one instance; `copy_s` is paid before training and after each spot restart."""

    where: str  # memory, local NVMe, network disk, object storage
    data_gb: float
    needed_gbs: float
    read_gbs: Range
    copy_s: Range
    default_disk_gbs: float

    @property
    def bounds(self) -> bool:
        """Reading caps training's rate even at the place chosen."""
        return self.needed_gbs > self.read_gbs.expected

    @property
    def matters(self) -> bool:
        """Worth a column and a line: the default disk would bound training, or the data (1 GB or more) is copied."""
        disk = 0.0 if math.isnan(self.default_disk_gbs) else self.default_disk_gbs
        return self.data_gb >= 1.0 and (self.bounds or self.needed_gbs > disk or self.where in ("memory", "local NVMe"))

    def as_dict(self) -> dict:
        return {**asdict(self), "bounds": self.bounds, "matters": self.matters}


def place(data_gb: float, samples_per_s: float, bytes_per_sample: float, instance: Instance) -> Placement:
    """The default network disk where it keeps up, else memory, else local NVMe (copied over the network), else
    whichever of the network disk and object storage reads faster."""
    needed = samples_per_s * bytes_per_sample / 1e9
    unknown, none = Range(math.nan, math.nan, math.nan), Range(0.0, 0.0, 0.0)
    network = Range(*(instance.network_gbps / 8 * share for share in NETWORK_EFFICIENCY)) if \
        instance.network_gbps > 0 else None
    copy = network.inverse().scaled(data_gb) if network is not None else unknown
    disk = Range(instance.disk_gbs, instance.disk_gbs, instance.disk_gbs) if instance.disk_gbs > 0 else None
    if disk is not None and needed <= disk.expected:
        return Placement("network disk", data_gb, needed, disk, none, instance.disk_gbs)
    if instance.ram_gb > 0 and data_gb <= MEMORY_SHARE * instance.ram_gb:
        return Placement("memory", data_gb, needed, Range(math.inf, math.inf, math.inf), copy, instance.disk_gbs)
    if instance.nvme_total_gb > 0 and data_gb <= NVME_SHARE * instance.nvme_total_gb:
        drives = Range(*(instance.nvme_count * speed for speed in NVME_GBS_PER_DRIVE))
        return Placement("local NVMe", data_gb, needed, drives, copy, instance.disk_gbs)
    if network is not None and (disk is None or network.expected > disk.expected):
        return Placement("object storage", data_gb, needed, network, none, instance.disk_gbs)
    return Placement("network disk", data_gb, needed, disk or unknown, none, instance.disk_gbs)


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
        return {"seconds": self.seconds, "cost_usd": self.cost, "interruptions": self.interruptions,
                "lost_per_interruption_s": self.lost_s, "between_checkpoints_s": self.between_s,
                **({"saving": self.saving(on_demand)} if on_demand is not None else {})}


def spot_run(work: Range, between: Range | None, spot_price: float, copy_s: Range,
             per_hour: float = INTERRUPTIONS_PER_HOUR) -> SpotRun | None:
    """`work` seconds on spot at `spot_price` an hour, `per_hour` interruptions each losing half the time between
    checkpoints (`between`; None: half the run) and a restart with the data's copy: the time solves
    `T = work + rate x T x (lost + restart)`, infinite where an interruption costs more than the time between them.
    None where there is no spot price."""
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

def serving_month(samples_per_s: Range, requests_per_s: float, price: float) -> Serving:
    """Instances to serve `requests_per_s` (each a prediction) at `samples_per_s` each, and their month on demand."""
    replicas = Range(*(max(1, math.ceil(requests_per_s / rate)) if rate > 0 else math.inf
                       for rate in (samples_per_s.high, samples_per_s.expected, samples_per_s.low)))
    return Serving(requests_per_s, replicas, replicas.scaled(price * HOURS_PER_MONTH))


@dataclass
class Row:
    """One instance's estimates: the whole run on demand, the data's copy included, training a part of it."""

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
    """Every way to pay for a run that fits: on demand, and on spot where it finishes even at its range's slow end."""
    found = priced(rows)
    return ([Choice(row, False, row.run_seconds, row.run_cost) for row in found if row.run_cost is not None] +
            [Choice(row, True, row.spot.seconds, row.spot.cost) for row in found
             if row.spot is not None and math.isfinite(row.spot.seconds.high)])


def advise(facts: RunFacts, instances: list[Instance], gpus: dict[str, GPU], task: str,
           options: Options | None = None) -> list[Row]:
    options, links = options or Options(), load_links()
    rows = []
    for instance in instances:
        row = Row(instance)
        if task in ("train", "both"):
            _run(row, facts, gpus, links.get(instance.interconnect), options)
        if task in ("serve", "both"):
            _serve(row, facts, gpus, options)
        rows.append(row)
    return rows


def _run(row: Row, facts: RunFacts, gpus: dict[str, GPU], link: Link | None, options: Options) -> None:
    """The whole run on the row's instance, its data read where it sits, and its cost on demand and on spot."""
    instance = row.instance
    whole = whole_run(facts, instance, gpus, link)
    if whole.models and facts.bytes_per_sample > 0:
        fastest = max(model.samples_per_s.expected for model in whole.models.values())
        row.placement = place(facts.data_bytes / 1e9, fastest, facts.bytes_per_sample, instance)
        if row.placement.bounds:
            whole = whole_run(facts, instance, gpus, link, row.placement.read_gbs.scaled(1e9 / facts.bytes_per_sample))
    copy = row.placement.copy_s if row.placement is not None and row.placement.where in ("memory", "local NVMe") \
        else Range(0, 0, 0)
    copy = Range(0, 0, 0) if math.isnan(copy.expected) else copy
    row.whole, row.train_seconds, row.run_seconds = whole, whole.training_s, whole.total_s + copy
    row.run_cost = row.run_seconds.scaled(instance.price_per_hour / 3600)
    longest = max(whole.models.values(), key=lambda model: model.fit_s.expected, default=None)
    if longest is not None:
        row.epoch_seconds, row.train_per_s, row.scaling = longest.epoch_s, longest.samples_per_s, longest.scaling
        row.memory_share = max(model.memory_share for model in whole.models.values())
        row.fits = all(model.fits for model in whole.models.values())
    outside = row.run_seconds.expected - row.train_seconds.expected
    row.bound = "other phases" if longest is None or outside > row.train_seconds.expected else longest.bound
    row.spot = spot_run(row.run_seconds, _between_checkpoints(facts, longest), instance.spot_price_per_hour, copy,
                        options.interruptions_per_hour)


def _between_checkpoints(facts: RunFacts, longest: ModelRun | None) -> Range | None:
    """Seconds between the checkpoints of the longest fit: `checkpoint_every_s`, at most the fit's length (a fit
    shorter writes none); 0 saves after every epoch; None where the interval is unknown."""
    every = facts.checkpoint_every_s.get(longest.name) if longest is not None else None
    if every is None:
        return None
    return longest.epoch_s if every == 0 else Range(every, every, every).capped_by(longest.fit_s)


def _serve(row: Row, facts: RunFacts, gpus: dict[str, GPU], options: Options) -> None:
    """Serving on the row's instance: one replica per GPU of the torch model with the most inference FLOPs."""
    served = [model for model in facts.models.values() if not math.isnan(model.get("infer_flops_per_sample", math.nan))]
    if not served:
        return
    model = max(served, key=lambda model: model["infer_flops_per_sample"])
    instance = row.instance
    rate, row.latency_ms, bound = serving(facts, model, instance, gpus)
    row.serve_per_s = rate.scaled(instance.gpu_count)
    row.serve_cost_per_million = row.serve_per_s.inverse().scaled(1e6 * instance.price_per_hour / 3600)
    row.serving = serving_month(row.serve_per_s, options.requests_per_s, instance.price_per_hour)
    if math.isnan(row.memory_share):
        share = model.get("peak_memory_gb", math.nan) / instance.gpu.memory_gb
        row.memory_share, row.fits = share, not share > 0.95
    row.bound = row.bound or bound


def recommend(rows: list[Row], options: Options | None = None) -> dict[str, Choice | None]:
    """The cheapest run that fits the budget and the deadline (expected figures), the fastest within 1.5x of its
    cost, and the cheapest month of serving; an instance without a price is never recommended."""
    options = options or Options()
    picks: dict[str, Choice | None] = {"train_cheapest": None, "train_fastest": None, "serve_cheapest": None}
    allowed = [choice for choice in choices(rows)
               if (options.budget_usd is None or choice.cost.expected <= options.budget_usd) and
               (options.deadline_h is None or choice.seconds.expected <= options.deadline_h * 3600)]
    if allowed:
        cheapest = min(allowed, key=lambda choice: (choice.cost.expected, choice.seconds.expected))
        near = [choice for choice in allowed if choice.cost.expected <= 1.5 * cheapest.cost.expected]
        picks["train_cheapest"] = cheapest
        picks["train_fastest"] = min(near, key=lambda choice: choice.seconds.expected)
    served = [row for row in priced(rows) if row.serving is not None]
    if served:
        row = min(served, key=lambda row: (row.serving.month_usd.expected, row.serve_cost_per_million.expected))
        picks["serve_cheapest"] = Choice(row, False, Range(0, 0, 0), row.serving.month_usd)
    return picks
