"""`usecases advise`: which GPU instance to rent to train and to serve a use case, and what it will cost, from the
workload facts its run logged (`common.training.workload`), the catalogue (`common.advisor.catalog`) and the estimator
(`common.advisor.estimate`). Every figure of another machine is an estimate with its range; this run's own figures are
measured and labelled so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from common.advisor.budget import (INTERRUPTIONS_PER_HOUR, REQUESTS_PER_S, Serving, SpotRun, serving_month, spot_run,
                                   within)
from common.advisor.catalog import GPU, Instance, Link, load_gpus, load_instances, load_links
from common.advisor.estimate import Range, Workload, cpu_seconds, estimate
from common.advisor.facts import RunFacts
from common.advisor.lines import budget_lines, money, placement_lines, scaling_lines, spot_lines
from common.advisor.scaling import Scaling, data_parallel
from common.advisor.storage import Placement, place

DATA_WAIT_ACTION = 0.10  # of a training epoch spent waiting for data
LOW_UTILISATION = 40.0  # percent of the GPU busy
HIGH_MEMORY = 0.90  # of the GPU's memory
CPU_SHARE_ACTION = 0.30  # of a run spent in CPU-side work


def _workload(facts: RunFacts, model: dict[str, float], task: str) -> Workload:
    """One model's training or serving workload; the rate measured on the run's GPU, if any, calibrates it."""
    prefix = "train" if task == "train" else "infer"
    measured = model.get(f"measured_{task}_samples_per_s") if facts.gpu is not None else None
    return Workload(task, model.get(f"{prefix}_flops_per_sample", math.nan),
                    model.get(f"{prefix}_bytes_per_sample", math.nan), facts.precision, int(model.get("batch_size", 1)),
                    ops_per_batch=model.get("train_ops_per_step" if task == "train" else "infer_ops_per_batch", 0.0),
                    weight_bytes=model.get("weight_bytes", 0.0), peak_memory_gb=model.get("peak_memory_gb", math.nan),
                    loader_samples_per_s=model.get("loader_samples_per_s", math.nan),
                    loader_cores=facts.cores,
                    measured_gpu=facts.gpu if measured else None, measured_samples_per_s=measured or None)


@dataclass
class Row:
    """One instance's estimates (every figure a Range, or NaN where the price is unknown)."""

    instance: Instance
    train_seconds: Range | None = None  # on demand, the data's copy included
    epoch_seconds: Range | None = None
    train_cost: Range | None = None
    train_bound: str = ""
    train_per_s: Range | None = None  # of the model that takes the most time, on all the instance's GPUs
    serve_per_s: Range | None = None
    latency_ms: Range | None = None
    serve_cost_per_million: Range | None = None
    memory_share: float = math.nan
    fits: bool = True
    scaling: Scaling | None = None  # the instance's GPUs against one, for that model
    placement: Placement | None = None
    spot: SpotRun | None = None
    serving: Serving | None = None


@dataclass(frozen=True)
class Options:
    """What the user states: the money and time they have, the serving load, the spot interruption rate."""

    budget_usd: float | None = None
    deadline_h: float | None = None
    requests_per_s: float = REQUESTS_PER_S
    interruptions_per_hour: float = INTERRUPTIONS_PER_HOUR


@dataclass(frozen=True)
class Choice:
    """A recommended instance and how it is paid for."""

    row: Row
    spot: bool
    seconds: Range
    cost: Range

    @property
    def pricing(self) -> str:
        return "spot" if self.spot else "on demand"


def advise(facts: RunFacts, instances: list[Instance], gpus: dict[str, GPU], task: str,
           options: Options | None = None) -> list[Row]:
    options, links = options or Options(), load_links()
    rows = []
    for instance in instances:
        row = Row(instance)
        if task in ("train", "both"):
            _train(row, facts, gpus, links, options)
        if task in ("serve", "both"):
            _serve(row, facts, gpus, options)
        rows.append(row)
    return rows


def _train(row: Row, facts: RunFacts, gpus: dict[str, GPU], links: dict[str, Link], options: Options) -> None:
    instance = row.instance
    fitted = []  # (model, its rate on all the instance's GPUs, bound, scaling, memory share, fits)
    for name, model in facts.models.items():
        if "train_flops_per_sample" not in model:
            continue
        workload = _workload(facts, model, "train")
        found = estimate(workload, instance.gpu, gpus, instance.vcpus, facts.tf32)
        scaling = data_parallel(workload.batch_size / found.samples_per_s.expected, model.get("weight_bytes", 0.0),
                                instance.gpu_count, links.get(instance.interconnect))
        fitted.append((name, model, found.samples_per_s.times(scaling.speedup), found.bound, scaling,
                       found.memory_share, found.fits))
    if fitted and facts.bytes_per_sample > 0:
        fastest = max(rate.expected for _, _, rate, *_ in fitted)
        row.placement = place(facts.data_bytes / 1e9, fastest, facts.bytes_per_sample, instance)
    epoch, run, longest = Range(0, 0, 0), Range(0, 0, 0), None
    for name, model, rate, bound, scaling, _, _ in fitted:
        if row.placement is not None and row.placement.bounds:
            rate, bound = rate.capped_by(row.placement.read_gbs.scaled(1e9 / facts.bytes_per_sample)), "data storage"
        samples = model.get("samples_per_epoch", model.get("batch_size", 1))
        epoch = epoch.plus(rate.inverse().scaled(samples))
        run = run.plus(rate.inverse().scaled(model.get("trained_samples") or samples * model.get("epochs_run", 1)))
        if longest is None or samples / rate.expected > longest[0]:
            longest = (samples / rate.expected, name, rate, bound, scaling)
    cpu = Range(0, 0, 0)
    for part in facts.cpu_parts.values():
        cpu = cpu.plus(cpu_seconds(part.get("seconds", 0.0), bool(part.get("parallel")), facts.cores,
                                   instance.vcpus))
    copy = row.placement.copy_s if row.placement is not None and row.placement.where in ("memory", "local NVMe") \
        else Range(0, 0, 0)
    copy = Range(0, 0, 0) if math.isnan(copy.expected) else copy
    row.epoch_seconds, row.train_seconds = epoch, run.plus(cpu).plus(copy)
    if longest is not None:
        _, name, row.train_per_s, bound, row.scaling = longest
        row.train_bound = "CPU-side work" if cpu.expected > run.expected else bound
        row.spot = spot_run(row.train_seconds, epoch, facts.checkpoint_every.get(name), instance.spot_price_per_hour,
                            copy, options.interruptions_per_hour)
    row.train_cost = row.train_seconds.scaled(instance.price_per_hour / 3600)
    if fitted:
        row.memory_share = max(share for *_, share, _ in fitted)
        row.fits = all(fits for *_, fits in fitted)


def served_model(facts: RunFacts) -> dict[str, float] | None:
    """The model serving runs: the torch model with the most inference FLOPs per sample."""
    served = [model for model in facts.models.values() if not math.isnan(model.get("infer_flops_per_sample",
                                                                                   math.nan))]
    return max(served, key=lambda model: model["infer_flops_per_sample"]) if served else None


def _serve(row: Row, facts: RunFacts, gpus: dict[str, GPU], options: Options) -> None:
    model = served_model(facts)
    if model is None:
        return
    instance = row.instance
    workload = _workload(facts, model, "serve")
    found = estimate(workload, instance.gpu, gpus, instance.vcpus, facts.tf32)
    single = estimate(workload.at_batch(1), instance.gpu, gpus, instance.vcpus, facts.tf32)
    row.serve_per_s = found.samples_per_s.scaled(instance.gpu_count)  # one replica per GPU
    row.latency_ms = single.samples_per_s.inverse().scaled(1000)
    row.serve_cost_per_million = row.serve_per_s.inverse().scaled(1e6 * instance.price_per_hour / 3600)
    row.serving = serving_month(row.serve_per_s, options.requests_per_s, instance.price_per_hour)
    if math.isnan(row.memory_share):
        row.memory_share, row.fits = found.memory_share, found.fits
    if not row.train_bound:
        row.train_bound = found.bound


def recommend(rows: list[Row], options: Options | None = None) -> dict[str, Choice | None]:
    """Training: the cheapest run that fits, on demand or on spot (where it finishes even at its range's slow end),
    within the budget and the deadline (expected figures), and the fastest within 1.5x of its cost; serving: the
    cheapest month at the stated request rate.
    Instances without a known price are not recommended."""
    options = options or Options()
    priced = _priced(rows)
    picks: dict[str, Choice | None] = {"train_cheapest": None, "train_fastest": None, "serve_cheapest": None}
    allowed = [choice for choice in choices(rows) if within(choice.seconds.expected, choice.cost.expected,
                                                            options.budget_usd, options.deadline_h)]
    if allowed:
        cheapest = min(allowed, key=lambda choice: (choice.cost.expected, choice.seconds.expected))
        near = [choice for choice in allowed if choice.cost.expected <= 1.5 * cheapest.cost.expected]
        picks["train_cheapest"] = cheapest
        picks["train_fastest"] = min(near, key=lambda choice: choice.seconds.expected)
    served = [row for row in priced if row.serving is not None]
    if served:
        row = min(served, key=lambda row: (row.serving.month_usd.expected, row.serve_cost_per_million.expected))
        picks["serve_cheapest"] = Choice(row, False, Range(0, 0, 0), row.serving.month_usd)
    return picks


def _priced(rows: list[Row]) -> list[Row]:
    return [row for row in rows if row.fits and not math.isnan(row.instance.price_per_hour)]


def choices(rows: list[Row]) -> list[Choice]:
    """Every way to pay for a training run that fits: on demand, and on spot where it finishes even at the slow end
    of its range."""
    priced = _priced(rows)
    return ([Choice(row, False, row.train_seconds, row.train_cost) for row in priced if row.train_cost is not None] +
            [Choice(row, True, row.spot.seconds, row.spot.cost) for row in priced
             if row.spot is not None and math.isfinite(row.spot.seconds.high)])


def actions(facts: RunFacts, rows: list[Row], picks: dict[str, Choice | None],
            options: Options | None = None) -> list[str]:
    """What the measurements call for, each with its number."""
    options = options or Options()
    lines = []
    for name, model in facts.models.items():
        wait = model.get("data_wait_share", 0.0)
        if wait > DATA_WAIT_ACTION:
            lines.append(f"{name}: data-wait share {100 * wait:.0f} % (measured): add loader workers "
                         "(train.workers) or keep the data on the device (data.in_memory)")
    if facts.gpu is not None and not math.isnan(facts.gpu_utilisation) and facts.gpu_utilisation < LOW_UTILISATION:
        here = [row for row in rows if row.instance.gpu.name == facts.gpu and row.train_seconds is not None]
        cheaper = _cheaper_alike(rows, here[0]) if here else None
        lines.append(f"GPU utilisation {facts.gpu_utilisation:.0f} % on {facts.gpu} (measured)" +
                     (f": {cheaper.instance.gpu.name} ({cheaper.instance.name}) gives about the same time at "
                      f"{cheaper.instance.price_per_hour / here[0].instance.price_per_hour:.0%} of the price "
                      "(estimated)" if cheaper else ": a smaller GPU would do"))
    lines += budget_lines(rows, picks, options)
    choice = picks.get("train_cheapest")
    if choice is not None:
        pick = choice.row
        if pick.memory_share > HIGH_MEMORY:
            lines.append(f"peak memory {100 * pick.memory_share:.0f} % of the {pick.instance.gpu.name}'s (estimated):"
                         " the next larger GPU or a smaller batch")
        if pick.train_seconds is not None and facts.cpu_parts:
            share, vcpus = _cpu_share(facts, pick), _vcpus_to_match(facts, pick)
            advice = (f"an instance with at least {vcpus} vCPUs keeps it below the GPU's time"
                      if share > CPU_SHARE_ACTION and vcpus > pick.instance.vcpus else
                      f"its {pick.instance.vcpus} vCPUs suffice (it needs {vcpus} to stay below the GPU's time)")
            lines.append(f"CPU-side work ({', '.join(facts.cpu_parts)}: {_seconds(facts)} s on {facts.cores} cores, "
                         f"measured) is {100 * share:.0f} % of the run on {pick.instance.name} (estimated): "
                         f"{advice}")
        lines += placement_lines(pick) + spot_lines(pick, options) + scaling_lines(rows, pick)
    serve = picks.get("serve_cheapest")
    if serve is not None:
        serving = serve.row.serving
        lines.append(f"serving {serving.requests_per_s:g} requests/s: {serving.replicas.expected:g} x "
                     f"{serve.row.instance.name}, {money(serving.month_usd.expected)} a month on demand "
                     f"({money(serving.month_usd.low)}-{money(serving.month_usd.high)}; estimated)")
    return [line for line in lines if line]


def _cheaper_alike(rows: list[Row], here: Row) -> Row | None:
    """The cheapest instance whose expected training time is within 10 % of `here`'s."""
    alike = [row for row in rows if row.fits and row.train_seconds is not None and row.instance.gpu_count == 1 and
             row.train_seconds.expected <= 1.1 * here.train_seconds.expected and
             row.instance.price_per_hour < here.instance.price_per_hour]
    return min(alike, key=lambda row: row.instance.price_per_hour) if alike else None


def _cpu_share(facts: RunFacts, row: Row) -> float:
    cpu = sum(cpu_seconds(part.get("seconds", 0.0), bool(part.get("parallel")), facts.cores,
                          row.instance.vcpus).expected for part in facts.cpu_parts.values())
    return cpu / row.train_seconds.expected if row.train_seconds.expected else 0.0


def _seconds(facts: RunFacts) -> str:
    return f"{sum(part.get('seconds', 0.0) for part in facts.cpu_parts.values()):.2g}"


def _vcpus_to_match(facts: RunFacts, row: Row) -> int:
    """The vCPUs at which the parallel CPU-side parts take no longer than the GPU's share of the run."""
    gpu_seconds = row.train_seconds.expected * (1 - _cpu_share(facts, row))
    parallel = sum(part.get("seconds", 0.0) for part in facts.cpu_parts.values() if part.get("parallel"))
    return max(1, math.ceil(parallel * facts.cores / max(gpu_seconds, 1e-9)))


def load_catalogue(catalog: Path | None) -> tuple[dict[str, GPU], list[Instance]]:
    gpus = load_gpus()
    return gpus, load_instances(gpus, catalog)
