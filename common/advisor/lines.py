"""The renting advice in words: the data's place, spot against on demand, several GPUs against one bigger, and what a
budget or a deadline left out. Each line carries its figures and says they are estimated."""

from __future__ import annotations

import math

from common.advisor.budget import RESTART_S
from common.advisor.catalog import load_links
from common.advisor.formats import duration, milliseconds, money, span, speedup
from common.advisor.rows import Choice, Options, Row, choices
from common.advisor.multigpu import data_parallel

SPOT_MATTERS = 0.20  # a saving worth a column


def placement_lines(pick: Row) -> list[str]:
    placement = pick.placement
    if placement is None:
        return []
    return [f"data on {pick.instance.name}: {placement.line(pick.instance)} (estimated)"]


def spot_lines(pick: Row, options: Options) -> list[str]:
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
    compared = f"{100 * abs(saving):.0f} % {'less' if saving >= 0 else 'more'}"
    return [f"spot on {name}: {span(spot.cost, money)} a run against {money(pick.run_cost.expected)} on "
            f"demand ({compared}), with {spot.interruptions:.2g} expected "
            f"interruptions at {options.interruptions_per_hour:g} an hour, each losing {duration(spot.lost_s)} of "
            f"work ({checkpoints}) and a {RESTART_S[0] / 60:.0f}-{RESTART_S[2] / 60:.0f} min restart (estimated)"]


def scaling_lines(rows: list[Row], pick: Row) -> list[str]:
    """The pick's GPUs together (or two of its GPU), two of its machines, and one bigger GPU against several."""
    lines = []
    scaling, gpu = pick.scaling, pick.instance.gpu
    if scaling is not None and scaling.gpus > 1:
        lines.append(f"{scaling.gpus} x {gpu.name} on {pick.instance.name}: {speedup(scaling.speedup)} over one "
                     f"with DDP ({milliseconds(scaling.step_s)} a step, {milliseconds(scaling.all_reduce_s.expected)} "
                     f"to all-reduce the gradients over {scaling.paced_by}; estimated)")
    elif scaling is not None:
        link = _link_of_several(rows, gpu.name) or pick.instance.interconnect
        two = data_parallel(scaling.step_s, scaling.gradient_bytes, 2, load_links().get(link))
        lines.append(f"2 GPUs ({gpu.name}, {two.paced_by}): {speedup(two.speedup)} with DDP at this step time "
                     f"({milliseconds(scaling.step_s)} a step, {milliseconds(two.all_reduce_s.expected)} to all-reduce "
                     "the gradients; estimated)")
    if scaling is not None and pick.instance.network_gbps > 0:
        nodes = data_parallel(scaling.step_s, scaling.gradient_bytes, pick.instance.gpu_count,
                              load_links().get(pick.instance.interconnect), 2, pick.instance.network_gbps)
        slower = " (slower than one)" if nodes.speedup.expected < 1 else ""
        lines.append(f"2 machines ({2 * pick.instance.gpu_count} x {gpu.name}): {speedup(nodes.speedup)} over one "
                     f"GPU{slower}, the gradients all-reduced in {milliseconds(nodes.all_reduce_s.expected)} over the "
                     f"{nodes.paced_by} (estimated)")
    return lines + _bigger_or_several(rows)


def _bigger_or_several(rows: list[Row]) -> list[str]:
    """One GPU against several: the cheapest multi-GPU run against the cheapest single-GPU run at least as fast
    (else the fastest single GPU), so that a bigger GPU is weighed against several smaller ones."""
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


def _link_of_several(rows: list[Row], gpu: str) -> str:
    """How the catalogue's multi-GPU instances of this GPU link their GPUs."""
    return next((row.instance.interconnect for row in rows if row.instance.gpu.name == gpu and
                 row.instance.gpu_count > 1 and row.instance.interconnect), "")


def budget_lines(rows: list[Row], picks: dict[str, Choice | None], options: Options) -> list[str]:
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
            f"({money(cheap.cost.expected)}, {duration(cheap.seconds.expected)}), the fastest "
            f"{fast.row.instance.name} on {fast.pricing} ({duration(fast.seconds.expected)}, "
            f"{money(fast.cost.expected)}) (estimated)"]
