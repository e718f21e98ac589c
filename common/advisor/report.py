"""The `usecases advise` command: find the run, estimate the whole run on every instance (pure: `advice`), print
the report (a table, Markdown, or JSON with every phase and model), and, at the edge, log it with a cost-against-time
plot to the advised run and write the pick's launch files."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from common.advisor.advise import Choice, Options, Row, advise, recommend
from common.advisor.catalog import load_catalogue
from common.advisor.facts import RunFacts, calibrated, facts_from_file, facts_from_run, json_safe
from common.advisor.words import actions, render
from common.errors import UserError


@dataclass(frozen=True)
class AdviseRequest:
    """What `usecases advise` was asked: a use case's run (the latest, or `run_id`) or a `workload` file."""

    usecase: str | None = None
    run_id: str | None = None
    task: str = "both"
    catalog: Path | None = None
    output: str = "table"
    workload: Path | None = None
    options: Options = field(default_factory=Options)
    data_gb: float | None = None
    launch: Path | None = None
    tracking: str | None = None


def advise_command(request: AdviseRequest) -> str:
    """The report as printed; a run's report is logged to it as `advise/advice.{md,json}` and
    `advise/cost_vs_time.png`, and with `launch` the recommended training instance's launch files are written."""
    gpus, instances = load_catalogue(request.catalog)
    facts, source = _facts(request, gpus)
    report, rows, picks, todo = advice(facts, source, instances, gpus, request)
    if request.launch is not None:
        report["launch"] = _launch(request.launch, facts, picks, request.tracking)
    text = (json.dumps(json_safe(report), indent=2, allow_nan=False) if request.output == "json" else
            render(report, rows, picks, todo, markdown=request.output == "markdown"))
    if request.launch is not None and request.output != "json":
        text += "\n\nLaunch files:\n" + "\n".join(f"- {line}" for line in report["launch"]["lines"])
    if facts.run_id is not None:
        from common.tracking.advice import log_advice

        log_advice(facts.run_id, {"advice.md": render(report, rows, picks, todo, markdown=True) + "\n",
                                  "advice.json": json.dumps(json_safe(report), indent=2, allow_nan=False)},
                   *_points(rows))
    return text


def _facts(request: AdviseRequest, gpus) -> tuple[RunFacts, str]:
    """What the estimates start from, and how the report names it: the workload file, or the run (its GPU rates
    from the latest GPU run of its preset where it ran on a CPU), scaled to `data_gb`."""
    if request.workload is not None:
        facts = facts_from_file(request.workload, gpus)
        source = f"workload {request.workload} (times and costs per 1M samples)"
    else:
        from common.tracking.advice import advised_run, gpu_run

        usecase = request.usecase
        run = advised_run(usecase, request.run_id)
        facts = facts_from_run(run, usecase, gpus)
        source = f"run {run.info.run_id} of {usecase}, measured on " + (
            f"{facts.gpu_count} x {facts.gpu}" if facts.gpu else f"a CPU ({facts.cores} cores)")
        if facts.gpu is None:
            reference = gpu_run(run)
            if reference is not None:
                facts = calibrated(facts, facts_from_run(reference, usecase, gpus))
                source += f", its GPU rates from run {reference.info.run_id} on {facts.rates_gpu}"
    if request.data_gb is not None:
        facts = facts.scaled_to(request.data_gb)
        source += f", scaled to a {request.data_gb:g} GB data set"
    return facts, source


def advice(facts: RunFacts, source: str, instances, gpus, request: AdviseRequest):
    """The estimates on every instance, the picks, the actions and their report: pure (no file, no MLflow call)."""
    options = request.options
    task = facts.task if request.workload is not None else request.task
    rows = advise(facts, instances, gpus, task, options)
    picks = recommend(rows, options)
    todo = actions(facts, rows, picks, options)
    report = {"source": source, "task": task, "estimated": True, "rows": [_as_dict(row, task) for row in rows],
              "recommendations": {key: (choice.row.instance.name if choice else None) for key, choice in picks.items()},
              "pricing": {key: choice.pricing for key, choice in picks.items() if choice is not None},
              "stated": {"budget_usd": options.budget_usd, "deadline_h": options.deadline_h,
                         "requests_per_s": options.requests_per_s,
                         "spot_interruptions_per_hour": options.interruptions_per_hour},
              "actions": todo, "measured": _measured(facts)}
    return report, rows, picks, todo


def _launch(folder: Path, facts: RunFacts, picks: dict[str, Choice | None], tracking: str | None) -> dict:
    from common.deploy.launch import write_launch_files

    choice = picks.get("train_cheapest")
    if choice is None:
        raise UserError("--launch: no instance is recommended for training (see the lines above: a budget, a "
                        "deadline, or no priced instance that fits), so there is nothing to launch")
    if facts.usecase is None:
        raise UserError("--launch needs a use case's run, not --workload: the launch files run `usecases run`")
    return write_launch_files(folder, facts, choice, tracking)


def _as_dict(row: Row, task: str) -> dict:
    """One instance's figures; `samples_per_s` is the training rate for --task train, else the serving rate."""
    instance = row.instance
    return {"provider": instance.provider, "instance": instance.name, "gpu": instance.gpu.name,
            "gpu_count": instance.gpu_count, "vcpus": instance.vcpus, "ram_gb": instance.ram_gb,
            "region": instance.region, "price_per_hour_usd": instance.price_per_hour,
            "spot_price_per_hour_usd": instance.spot_price_per_hour, "price_source": instance.source,
            "price_as_of": instance.as_of, "network_gbps": instance.network_gbps,
            "local_nvme": {"count": instance.nvme_count, "gb_each": instance.nvme_gb},
            "disk_gbs": instance.disk_gbs, "interconnect": instance.interconnect or None,
            "hardware_source": instance.hardware_source, "run_seconds": row.run_seconds, "run_cost_usd": row.run_cost,
            "train_seconds": row.train_seconds, "epoch_seconds": row.epoch_seconds, "bottleneck": row.bound,
            "train_samples_per_s": row.train_per_s, "serve_samples_per_s": row.serve_per_s,
            "samples_per_s": row.train_per_s if task == "train" else row.serve_per_s, "latency_ms": row.latency_ms,
            "serve_cost_per_million_usd": row.serve_cost_per_million, "memory_share": row.memory_share,
            "fits": row.fits, "scaling": row.scaling, "data": row.placement,
            "spot": row.spot.as_dict(row.run_cost) if row.spot else None, "serving_month": row.serving,
            "whole_run": row.whole}


def _measured(facts: RunFacts) -> dict:
    """This run's own figures, which are measurements, not estimates."""
    kept = ("train_samples_per_s", "data_wait_share", "loader_samples_per_s", "peak_memory_gb", "samples_per_epoch",
            "epochs_run", "train_flops_per_sample", "infer_flops_per_sample", "params", "weight_bytes",
            "train_ops_per_step", "host_syncs_per_step")
    return {"models": {name: {key: value for key, value in model.items() if key in kept}
                       for name, model in facts.models.items()},
            "phases": facts.phases, "total_seconds": facts.total_seconds, "cores": facts.cores, "gpu": facts.gpu,
            "data_bytes": facts.data_bytes, "data_samples": facts.data_samples,
            "checkpoint_every_s": facts.checkpoint_every_s}


def _points(rows: list[Row]) -> tuple[list[tuple], list[tuple]]:
    """The plot's (minutes, cost, label) of each priced instance that fits: on demand, and on spot where it ends."""
    on_demand = [(row.run_seconds.expected / 60, row.run_cost.expected, row.instance.name) for row in rows
                 if row.run_cost is not None and not math.isnan(row.run_cost.expected) and row.fits]
    spot = [(row.spot.seconds.expected / 60, row.spot.cost.expected, f"{row.instance.name} (spot)") for row in rows
            if row.spot is not None and row.fits and math.isfinite(row.spot.seconds.expected)]
    return on_demand, spot
