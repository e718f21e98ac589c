"""The advice in words: its figures written out (money, durations, ranges, without exponents), what the
measurements call for (`actions`: the data's place, spot, several GPUs, a budget's effect, each line with its
figures and saying they are estimated) and the table of instances (`render`)."""

from __future__ import annotations

import math
from collections.abc import Callable

from common.advisor.advise import RESTART_S, Choice, Options, Placement, Row, choices
from common.advisor.catalog import Instance, load_links
from common.advisor.estimate import Range
from common.advisor.facts import RunFacts
from common.advisor.wholerun import WholeRun, data_parallel
from common.tabular import render_table

DATA_WAIT_ACTION = 0.10  # of a training epoch spent waiting for data
LOW_UTILISATION = 40.0  # percent of the GPU busy
HIGH_MEMORY = 0.90  # of the GPU's memory
OTHER_SHARE_ACTION = 0.30  # of a run spent outside the torch models' fits
SPOT_MATTERS = 0.20  # a saving worth a column
ESTIMATED = "estimated: low-high (expected)"
HEADER = ["instance", "cloud", "GPUs", "vCPUs", "$/h", "whole run", "cost per run", "of it training", "epoch",
          "bound", "serving", "latency ms (batch 1)", "$ per 1M predictions", "GPU memory"]
FIXED_COLUMNS = 10  # the optional columns go after these


def figure(value: float) -> str:
    """Two significant digits, without an exponent for large values (150, not 1.5e+02)."""
    return f"{value:,.0f}" if value >= 100 else f"{value:.2g}"


def money(value: float) -> str:
    if math.isnan(value):
        return "price unknown"
    if math.isinf(value):
        return "never finishes"
    return f"${value:.3g}" if value < 100 else f"${value:,.0f}"


def duration(seconds: float) -> str:
    if math.isnan(seconds):
        return "?"
    if math.isinf(seconds):
        return "never"
    for unit, size in (("h", 3600), ("min", 60), ("s", 1)):
        if seconds >= size:
            return f"{seconds / size:.3g} {unit}"
    return f"{seconds * 1000:.3g} ms"


def span(value: Range | None, show) -> str:
    """Expected (low-high), each bound shown by `show`; "-" where there is no figure."""
    return "-" if value is None else f"{show(value.expected)} ({show(value.low)}-{show(value.high)})"


def speedup(value: Range) -> str:
    return f"{figure(value.low)}-{figure(value.high)}x (expected {figure(value.expected)}x)"


def _rate(gbs: float) -> str:
    return f"{figure(gbs)} GB/s" if gbs >= 0.1 else f"{figure(1000 * gbs)} MB/s"


def _minutes(seconds: float) -> str:
    return f"{figure(seconds / 60)} min" if seconds >= 60 else f"{figure(seconds)} s"


def placement_line(placement: Placement, instance: Instance) -> str:
    """Where the data should sit on `instance`, each figure with its unit ("reads 1.9 GB/s of input; ...")."""
    data = f"{placement.data_gb:,.0f}" if placement.data_gb >= 100 else f"{placement.data_gb:.3g}"
    need = f"training at the estimated rate reads {_rate(placement.needed_gbs)} of input"
    disk = (f"this instance's network disk gives {_rate(placement.default_disk_gbs)}"
            if placement.default_disk_gbs > 0 else "its network disk's throughput is not in the catalogue")
    copy = placement.copy_s
    copy = (f"{_minutes(copy.expected)} ({_minutes(copy.low)}-{_minutes(copy.high)})" if math.isfinite(copy.expected)
            else "copy time unknown (the catalogue lacks its network)")
    if placement.where == "memory":
        return (f"{need}; {disk}: load the {data} GB data set into memory first (it takes "
                f"{100 * placement.data_gb / instance.ram_gb:.0f} % of {instance.ram_gb:g} GB RAM), {copy}")
    if placement.where == "local NVMe":
        return (f"{need}; {disk}: copy the {data} GB data set to local NVMe first ({instance.nvme_count:g} x "
                f"{instance.nvme_gb:g} GB, about {_rate(placement.read_gbs.expected)} to read), {copy}")
    if placement.where == "network disk" and math.isnan(placement.read_gbs.expected):
        return f"{need}; neither its network disk's throughput nor its network's is in the catalogue"
    if placement.where == "network disk" and not placement.bounds:
        return f"{need}; {disk}: it keeps up, train from it as the data is (no copy)"
    bound = (f": reading caps training at {100 * placement.read_gbs.expected / placement.needed_gbs:.0f} % of "
             "the GPU's rate; shard the data or pick an instance with local NVMe" if placement.bounds else "")
    return (f"{need}; the {data} GB data set is read from {placement.where} at "
            f"{_rate(placement.read_gbs.expected)}{bound}")


def actions(facts: RunFacts, rows: list[Row], picks: dict[str, Choice | None], options: Options | None = None
            ) -> list[str]:
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
    lines += _budget_lines(rows, picks, options)
    choice = picks.get("train_cheapest")
    if choice is not None:
        pick = choice.row
        if pick.memory_share > HIGH_MEMORY:
            lines.append(f"peak memory {100 * pick.memory_share:.0f} % of the {pick.instance.gpu.name}'s (estimated):"
                         " the next larger GPU or a smaller batch")
        if pick.whole is not None:
            lines += _phase_lines(facts, pick, pick.whole)
        if pick.placement is not None:
            lines.append(f"data on {pick.instance.name}: {placement_line(pick.placement, pick.instance)} (estimated)")
        lines += _spot_lines(pick, options) + _scaling_lines(rows, pick)
    serve = picks.get("serve_cheapest")
    if serve is not None:
        month = serve.row.serving
        lines.append(f"serving {month.requests_per_s:g} requests/s: {month.replicas.expected:g} x "
                     f"{serve.row.instance.name}, {money(month.month_usd.expected)} a month on demand "
                     f"({money(month.month_usd.low)}-{money(month.month_usd.high)}; estimated)")
    return lines


def _phase_lines(facts: RunFacts, pick: Row, whole: WholeRun) -> list[str]:
    """The pick's run besides training, and the vCPUs its `cores` work needs to stay below the training's time."""
    run, training = pick.run_seconds.expected, pick.train_seconds.expected
    others = sorted((phase for phase in whole.phases if not phase.name.startswith("fit/") or phase.model is None),
                    key=lambda phase: -phase.seconds.expected)
    if not others or not run > 0:
        return []
    named = ", ".join(f"{phase.name} {duration(phase.seconds.expected)}" for phase in others[:3])
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
    """The cheapest one-GPU instance whose expected run time is within 10 % of `here`'s."""
    alike = [row for row in rows if row.fits and row.run_seconds is not None and row.instance.gpu_count == 1 and
             row.run_seconds.expected <= 1.1 * here.run_seconds.expected and
             row.instance.price_per_hour < here.instance.price_per_hour]
    return min(alike, key=lambda row: row.instance.price_per_hour) if alike else None


def _spot_lines(pick: Row, options: Options) -> list[str]:
    """Spot against on demand for the pick: the saving, and what the interruptions cost at the stated rate."""
    spot, name = pick.spot, pick.instance.name
    if spot is None:
        return [f"spot: no spot price for {name} in the catalogue"]
    if math.isinf(spot.seconds.expected):
        return [f"spot on {name}: at {options.interruptions_per_hour:g} interruptions an hour a restart and the "
                "work since the last checkpoint take longer than the time between interruptions: it would never "
                "finish; checkpoint more often (train.checkpoint_every_s) or run on demand"]
    checkpoints = ("half the time between its checkpoints, at most a fit's length"
                   if spot.between_s < pick.run_seconds.expected else "no checkpoint interval known: half the run")
    saving = spot.saving(pick.run_cost)
    return [f"spot on {name}: {span(spot.cost, money)} a run against {money(pick.run_cost.expected)} on demand "
            f"({100 * abs(saving):.0f} % {'less' if saving >= 0 else 'more'}), with {spot.interruptions:.2g} expected "
            f"interruptions at {options.interruptions_per_hour:g} an hour, each losing {duration(spot.lost_s)} of work "
            f"({checkpoints}) and a {RESTART_S[0] / 60:.0f}-{RESTART_S[2] / 60:.0f} min restart (estimated)"]


def _milliseconds(seconds: float) -> str:
    return f"{figure(1000 * seconds)} ms"


def _scaling_lines(rows: list[Row], pick: Row) -> list[str]:
    """The pick's GPUs together (or two of its GPU), two of its machines, and one bigger GPU against several."""
    lines = []
    scaling, gpu, instance = pick.scaling, pick.instance.gpu, pick.instance
    if scaling is not None and scaling.gpus > 1:
        lines.append(f"{scaling.gpus} x {gpu.name} on {instance.name}: {speedup(scaling.speedup)} over one with DDP "
                     f"({_milliseconds(scaling.step_s)} a step, {_milliseconds(scaling.all_reduce_s.expected)} to "
                     f"all-reduce the gradients over {scaling.paced_by}; estimated)")
    elif scaling is not None:
        link = next((row.instance.interconnect for row in rows if row.instance.gpu.name == gpu.name and
                     row.instance.gpu_count > 1 and row.instance.interconnect), "") or instance.interconnect
        two = data_parallel(scaling.step_s, scaling.gradient_bytes, 2, load_links().get(link))
        lines.append(f"2 GPUs ({gpu.name}, {two.paced_by}): {speedup(two.speedup)} with DDP at this step time "
                     f"({_milliseconds(scaling.step_s)} a step, {_milliseconds(two.all_reduce_s.expected)} to "
                     "all-reduce the gradients; estimated)")
    if scaling is not None and instance.network_gbps > 0:
        nodes = data_parallel(scaling.step_s, scaling.gradient_bytes, instance.gpu_count,
                              load_links().get(instance.interconnect), 2, instance.network_gbps)
        slower = " (slower than one)" if nodes.speedup.expected < 1 else ""
        lines.append(f"2 machines ({2 * instance.gpu_count} x {gpu.name}): {speedup(nodes.speedup)} over one "
                     f"GPU{slower}, the gradients all-reduced in {_milliseconds(nodes.all_reduce_s.expected)} over "
                     f"the {nodes.paced_by} (estimated)")
    return lines + _bigger_or_several(rows)


def _bigger_or_several(rows: list[Row]) -> list[str]:
    """The cheapest multi-GPU run against the cheapest single-GPU run at least as fast (else the fastest)."""
    priced = [row for row in rows if row.fits and row.run_cost is not None and
              not math.isnan(row.instance.price_per_hour)]
    several = [row for row in priced if row.instance.gpu_count > 1]
    single = [row for row in priced if row.instance.gpu_count == 1]
    if not several or not single:
        return []
    many = min(several, key=lambda row: row.run_cost.expected)
    as_fast = [row for row in single if row.run_seconds.expected <= many.run_seconds.expected]
    one = min(as_fast, key=lambda row: row.run_cost.expected) if as_fast else \
        min(single, key=lambda row: row.run_seconds.expected)
    faster = one.run_seconds.expected <= many.run_seconds.expected
    cheaper = one.run_cost.expected <= many.run_cost.expected
    verdict = ("one GPU beats several: faster and cheaper" if faster and cheaper else
               "several GPUs beat one: faster and cheaper" if not faster and not cheaper else
               "one GPU is cheaper, several are faster" if cheaper else "one GPU is faster, several are cheaper")
    which = "the cheapest one GPU as fast" if as_fast else "the fastest one GPU"
    return [f"{verdict}: {which}, {_what(one)}, against {_what(many)} (estimated)"]


def _what(row: Row) -> str:
    return (f"{row.instance.gpu_count} x {row.instance.gpu.name} ({row.instance.name}) runs it in "
            f"{duration(row.run_seconds.expected)} for {money(row.run_cost.expected)}")


def _budget_lines(rows: list[Row], picks: dict[str, Choice | None], options: Options) -> list[str]:
    """What the budget and the deadline did: the pick they left, or why none is left."""
    if options.budget_usd is None and options.deadline_h is None:
        return []
    limits = " and ".join(part for part in (
        f"${options.budget_usd:g}" if options.budget_usd is not None else "",
        f"{options.deadline_h:g} h" if options.deadline_h is not None else "") if part)
    if picks.get("train_cheapest") is not None:
        choice = picks["train_cheapest"]
        return [f"within {limits}: {choice.row.instance.name} ({choice.pricing}) is the cheapest run that fits "
                "(expected figures; estimated)"]
    every = choices(rows)
    if not every:
        return []
    cheap = min(every, key=lambda choice: choice.cost.expected)
    fast = min(every, key=lambda choice: choice.seconds.expected)
    return [f"no instance trains within {limits}: the cheapest run is {cheap.row.instance.name} on {cheap.pricing} "
            f"({money(cheap.cost.expected)}, {duration(cheap.seconds.expected)}), the fastest {fast.row.instance.name} "
            f"on {fast.pricing} ({duration(fast.seconds.expected)}, {money(fast.cost.expected)}) (estimated)"]


def _optional_columns(rows: list[Row]) -> dict[str, Callable[[Row], str]]:
    """The renting columns, only where they matter on some instance."""
    columns = {}
    if any(row.spot is not None and row.run_cost is not None and row.spot.saving(row.run_cost) > SPOT_MATTERS
           for row in rows):
        columns["spot cost per run"] = lambda row: span(row.spot.cost, money) if row.spot else "-"
    if any(row.placement is not None and row.placement.matters for row in rows):
        columns["data from"] = lambda row: (
            "-" if row.placement is None else
            f"{row.placement.where}{' (bound)' if row.placement.bounds else ''}" +
            (f", copy {duration(row.placement.copy_s.expected)}" if row.placement.where in ("memory", "local NVMe")
             and math.isfinite(row.placement.copy_s.expected) else ""))
    if any(row.placement is not None and row.placement.matters and row.placement.where != "network disk"
           for row in rows):  # the data comes over the network: a copy, or read from object storage
        columns["network"] = lambda row: ("?" if math.isnan(row.instance.network_gbps) else
                                          f"{row.instance.network_gbps:g} Gbit/s")
    if any(row.scaling is not None and row.scaling.gpus > 1 for row in rows):
        columns["DDP speed-up"] = lambda row: (
            f"{row.scaling.speedup.expected:.2g}x ({row.scaling.speedup.low:.2g}-{row.scaling.speedup.high:.2g})"
            if row.scaling is not None and row.scaling.gpus > 1 else "-")
    return columns


def _cells(row: Row, extra: dict) -> list[str]:
    instance = row.instance
    memory = "?" if math.isnan(row.memory_share) else f"{100 * row.memory_share:.0f} %"
    return [instance.name, instance.provider, f"{instance.gpu_count} x {instance.gpu.name}", str(instance.vcpus),
            money(instance.price_per_hour), span(row.run_seconds, duration), span(row.run_cost, money),
            span(row.train_seconds, duration), span(row.epoch_seconds, duration), row.bound or "-",
            *(show(row) for show in extra.values()), span(row.serve_per_s, lambda value: f"{value:,.0f}/s"),
            span(row.latency_ms, lambda value: f"{value:.2g}"), span(row.serve_cost_per_million, money),
            memory + ("" if row.fits else " (does not fit)")]


def _order(row: Row) -> tuple:
    cost = row.run_cost.expected if row.run_cost is not None else (
        row.serve_cost_per_million.expected if row.serve_cost_per_million is not None else math.nan)
    return (math.isnan(cost), cost)


def render(report: dict, rows: list[Row], picks: dict[str, Choice | None], todo: list[str], markdown: bool) -> str:
    """The report as a table of instances, the recommendations and the actions."""
    extra = _optional_columns(rows)
    header = HEADER[:FIXED_COLUMNS] + list(extra) + HEADER[FIXED_COLUMNS:]
    cells = [_cells(row, extra) for row in sorted(rows, key=_order)]
    lines = [f"Advice for {report['source']}. Every figure below is {ESTIMATED}, on-demand prices (spot where "
             "marked) as each row's source dates them. A whole run is every phase the run logged, training one of "
             "them; --format json has each phase and model, and the measured figures under 'measured'.", "",
             render_table(cells, header, markdown=markdown), "", "Recommendations (estimated):"]
    names = {"train_cheapest": "run, the cheapest that fits", "train_fastest": "run, the fastest within 1.5x of that "
             "cost", "serve_cheapest": f"serve {report['stated']['requests_per_s']:g} requests/s, cheapest a month"}
    for key, label in names.items():
        choice = picks.get(key)
        if choice is None:
            continue
        row = choice.row
        if key.startswith("train"):
            training = row.train_seconds.expected if row.train_seconds is not None else math.nan
            detail = (f"{duration(choice.seconds.expected)} a run ({duration(training)} of it training), "
                      f"{money(choice.cost.expected)} ({choice.pricing})")
        else:
            detail = (f"{row.serving.replicas.expected:g} instance(s), {money(row.serving.month_usd.expected)} a "
                      f"month; {row.serve_per_s.expected:,.0f} predictions/s each, "
                      f"{money(row.serve_cost_per_million.expected)} per 1M")
        lines.append(f"- {label}: {row.instance.name} ({row.instance.gpu_count} x {row.instance.gpu.name}, "
                     f"{row.instance.provider} {row.instance.region}): {detail}")
    if todo:
        lines += ["", "Actions:"] + [f"- {line}" for line in todo]
    return "\n".join(lines)
