"""`usecases advise`: which GPU instance to rent to run and to serve a use case, and what it will cost, from the
workload facts and phases its run logged (`common.advisor.facts`), the catalogue (`common.advisor.catalog`) and the
whole-run model (`common.advisor.wholerun`). Every figure of another machine is an estimate with its range; this
run's own figures are measured and labelled so.
"""

from __future__ import annotations

import math

from common.advisor.budget import serving_month, spot_run, within
from common.advisor.catalog import GPU, Instance, Link, load_links
from common.advisor.estimate import Range
from common.advisor.facts import RunFacts
from common.advisor.formats import duration, money
from common.advisor.lines import budget_lines, placement_lines, scaling_lines, spot_lines
from common.advisor.rows import Choice, Options, Row, choices, priced
from common.advisor.storage import place
from common.advisor.wholerun import ModelRun, WholeRun, serving, whole_run

DATA_WAIT_ACTION = 0.10  # of a training epoch spent waiting for data
LOW_UTILISATION = 40.0  # percent of the GPU busy
HIGH_MEMORY = 0.90  # of the GPU's memory
OTHER_SHARE_ACTION = 0.30  # of a run spent outside the torch models' fits
SHOWN_PHASES = 3  # the longest phases an action names


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
    """The whole run on the row's instance: where its data sits (and whether reading it bounds training), every
    phase, the training part, the cost on demand and on spot."""
    instance = row.instance
    whole = whole_run(facts, instance, gpus, link)
    if whole.models and facts.bytes_per_sample > 0:
        fastest = max(model.samples_per_s.expected for model in whole.models.values())
        row.placement = place(facts.data_bytes / 1e9, fastest, facts.bytes_per_sample, instance)
        if row.placement.bounds:
            whole = whole_run(facts, instance, gpus, link,
                              row.placement.read_gbs.scaled(1e9 / facts.bytes_per_sample))
    copy = row.placement.copy_s if row.placement is not None and row.placement.where in ("memory", "local NVMe") \
        else Range(0, 0, 0)
    copy = Range(0, 0, 0) if math.isnan(copy.expected) else copy
    row.whole, row.train_seconds, row.run_seconds = whole, whole.training_s, whole.total_s.plus(copy)
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
    if every == 0:
        return longest.epoch_s
    fit = longest.fit_s
    return Range(min(every, fit.low), min(every, fit.expected), min(every, fit.high))


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
    rate, row.latency_ms, bound = serving(facts, model, instance, gpus)
    row.serve_per_s = rate.scaled(instance.gpu_count)  # one replica per GPU
    row.serve_cost_per_million = row.serve_per_s.inverse().scaled(1e6 * instance.price_per_hour / 3600)
    row.serving = serving_month(row.serve_per_s, options.requests_per_s, instance.price_per_hour)
    if math.isnan(row.memory_share):
        share = model.get("peak_memory_gb", math.nan) / instance.gpu.memory_gb
        row.memory_share, row.fits = share, not share > 0.95
    row.bound = row.bound or bound


def recommend(rows: list[Row], options: Options | None = None) -> dict[str, Choice | None]:
    """The run: the cheapest that fits, on demand or on spot (where it finishes even at its range's slow end), within
    the budget and the deadline (expected figures), and the fastest within 1.5x of its cost; serving: the cheapest
    month at the stated request rate. Instances without a known price are not recommended."""
    options = options or Options()
    picks: dict[str, Choice | None] = {"train_cheapest": None, "train_fastest": None, "serve_cheapest": None}
    allowed = [choice for choice in choices(rows) if within(choice.seconds.expected, choice.cost.expected,
                                                            options.budget_usd, options.deadline_h)]
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
        here = [row for row in rows if row.instance.gpu.name == facts.gpu and row.run_seconds is not None]
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
        if pick.whole is not None:
            lines += _phase_lines(facts, pick, pick.whole)
        lines += placement_lines(pick) + spot_lines(pick, options) + scaling_lines(rows, pick)
    serve = picks.get("serve_cheapest")
    if serve is not None:
        month = serve.row.serving
        lines.append(f"serving {month.requests_per_s:g} requests/s: {month.replicas.expected:g} x "
                     f"{serve.row.instance.name}, {money(month.month_usd.expected)} a month on demand "
                     f"({money(month.month_usd.low)}-{money(month.month_usd.high)}; estimated)")
    return [line for line in lines if line]


def _phase_lines(facts: RunFacts, pick: Row, whole: WholeRun) -> list[str]:
    """Where the pick's run goes besides training, and the vCPUs its `cores` work needs to stay below the
    training's time."""
    run, training = pick.run_seconds.expected, pick.train_seconds.expected
    others = sorted((phase for phase in whole.phases if not phase.name.startswith("fit/") or phase.model is None),
                    key=lambda phase: -phase.seconds.expected)
    if not others or not run > 0:
        return []
    named = ", ".join(f"{phase.name} {duration(phase.seconds.expected)}" for phase in others[:SHOWN_PHASES])
    lines = [f"training is {100 * training / run:.0f} % of the run on {pick.instance.name} "
             f"({duration(training)} of {duration(run)}); the longest other phases: {named} (estimated)"]
    cores = sum(phase.measured_s for phase in whole.phases if phase.scales == "cores")
    if cores > 0 and (run - training) / run > OTHER_SHARE_ACTION:
        needed = max(1, math.ceil(cores * facts.cores / max(training, 1e-9)))
        advice = (f"an instance with at least {needed} vCPUs keeps it below the training's time"
                  if needed > pick.instance.vcpus else
                  f"its {pick.instance.vcpus} vCPUs suffice (it needs {needed} to stay below the training's time)")
        lines.append(f"CPU work split over the cores ({cores:.2g} s on {facts.cores} cores, measured): {advice}")
    return lines


def _cheaper_alike(rows: list[Row], here: Row) -> Row | None:
    """The cheapest instance whose expected run time is within 10 % of `here`'s."""
    alike = [row for row in rows if row.fits and row.run_seconds is not None and row.instance.gpu_count == 1 and
             row.run_seconds.expected <= 1.1 * here.run_seconds.expected and
             row.instance.price_per_hour < here.instance.price_per_hour]
    return min(alike, key=lambda row: row.instance.price_per_hour) if alike else None
