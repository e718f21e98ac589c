"""The `usecases advise` command: find the run, estimate the whole run on every instance, print the table (text,
Markdown or JSON: the JSON with every phase and model) with the recommendations and actions, and log the table and a
cost-against-time plot to the advised run."""

from __future__ import annotations

import json
import math
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from common.advisor.advise import actions, advise, recommend
from common.advisor.catalog import load_catalogue
from common.advisor.estimate import Range
from common.advisor.facts import RunFacts, calibrated, facts_from_file, facts_from_run
from common.advisor.formats import duration, json_safe, money, span
from common.advisor.lines import SPOT_MATTERS
from common.advisor.rows import Choice, Options, Row
from common.tabular import render_table
from common.errors import UserError

ESTIMATED = "estimated: low-high (expected)"


@dataclass(frozen=True)
class AdviseRequest:
    """What `usecases advise` was asked: a use case's run (the latest, or `run_id`) or a `workload` file, the task,
    a catalogue of one's own, the output format, the limits and stated load (`options`), a data set size to scale
    to, and where to write the pick's launch files (with the tracking server they log to)."""

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
    """The report as printed. The estimates are pure (`advice`); the effects are here, at the edge: a run's report
    is logged to it as `advise/advice.{md,json}` and `advise/cost_vs_time.png`, and with `launch` the recommended
    training instance's launch files are written there."""
    gpus, instances = load_catalogue(request.catalog)
    facts, source = _facts(request, gpus)
    report, rows, picks, todo = advice(facts, source, instances, gpus, request)
    if request.launch is not None:
        report["launch"] = _launch(request.launch, facts, picks, request.tracking)
    text = (json.dumps(json_safe(report), indent=2, allow_nan=False) if request.output == "json" else
            _render(report, rows, picks, todo, markdown=request.output == "markdown"))
    if request.launch is not None and request.output != "json":
        text += "\n\nLaunch files:\n" + "\n".join(f"- {line}" for line in report["launch"]["lines"])
    if facts.run_id is not None:
        _log_to_run(facts.run_id, report, rows, picks, todo)
    return text


def _facts(request: AdviseRequest, gpus) -> tuple[RunFacts, str]:
    """What the estimates start from, and how the report names it: the workload file, or the run (its GPU rates
    from the latest GPU run of its preset where it ran on a CPU), scaled to `data_gb`."""
    if request.workload is not None:
        facts = facts_from_file(request.workload, gpus)
        source = f"workload {request.workload} (times and costs per 1M samples)"
    else:
        usecase = request.usecase
        run = _find_run(usecase, request.run_id)
        facts = facts_from_run(run, usecase, gpus)
        source = f"run {run.info.run_id} of {usecase}, measured on " + (
            f"{facts.gpu_count} x {facts.gpu}" if facts.gpu else f"a CPU ({facts.cores} cores)")
        if facts.gpu is None:
            reference = _gpu_run(run)
            if reference is not None:
                facts = calibrated(facts, facts_from_run(reference, usecase, gpus))
                source += f", its GPU rates from run {reference.info.run_id} on {facts.rates_gpu}"
    if request.data_gb is not None:
        facts = facts.scaled_to(request.data_gb)
        source += f", scaled to a {request.data_gb:g} GB data set"
    return facts, source


def advice(facts: RunFacts, source: str, instances, gpus, request: AdviseRequest):
    """The estimates on every instance, the picks and what the measurements call for, and the report of them:
    computed only (no file written, no call to MLflow)."""
    options = request.options
    task = facts.task if request.workload is not None else request.task
    rows = advise(facts, instances, gpus, task, options)
    picks = recommend(rows, options)
    todo = actions(facts, rows, picks, options)
    report = {"source": source, "task": task, "estimated": True, "rows": [_as_dict(row, task) for row in rows],
              "recommendations": {key: (choice.row.instance.name if choice else None) for key, choice in
                                  picks.items()},
              "pricing": {key: choice.pricing for key, choice in picks.items() if choice is not None},
              "stated": {"budget_usd": options.budget_usd, "deadline_h": options.deadline_h,
                         "requests_per_s": options.requests_per_s,
                         "spot_interruptions_per_hour": options.interruptions_per_hour},
              "actions": todo, "measured": _measured(facts)}
    return report, rows, picks, todo


def _launch(folder: Path, facts: RunFacts, picks: dict[str, Choice | None], tracking: str | None) -> dict:
    from common.advisor.launch import write_launch_files

    choice = picks.get("train_cheapest")
    if choice is None:
        raise UserError("--launch: no instance is recommended for training (see the lines above: a budget, a "
                        "deadline, or no priced instance that fits), so there is nothing to launch")
    if facts.usecase is None:
        raise UserError("--launch needs a use case's run, not --workload: the launch files run `usecases run`")
    return write_launch_files(folder, facts, choice, tracking)


def _find_run(usecase: str | None, run_id: str | None):
    import mlflow

    from common.tracking.runs import experiment_name
    from common.tracking.stores import tracking_uri

    mlflow.set_tracking_uri(tracking_uri())
    client = mlflow.MlflowClient()
    if run_id is not None:
        try:
            return client.get_run(run_id)
        except mlflow.exceptions.MlflowException:
            raise UserError(f"--run {run_id}: no such run in {tracking_uri()}") from None
    experiment = client.get_experiment_by_name(experiment_name(usecase))
    runs = [] if experiment is None else client.search_runs(
        [experiment.experiment_id], "attributes.status = 'FINISHED' and tags.preset != 'scale'",
        order_by=["attributes.start_time DESC"], max_results=20)
    runs = [run for run in runs if any(key.startswith("model/") for key in run.data.metrics)] or runs
    if not runs:
        raise UserError(f"no finished run of '{usecase}' in {tracking_uri()}: run `usecases run {usecase} --preset "
                        "smoke` first")
    return runs[0]


def _gpu_run(run):
    """The latest finished run of the same use case and preset measured on a GPU, with workload facts: a measured
    GPU rate is always preferred to the roofline alone."""
    import mlflow

    query = (f"attributes.status = 'FINISHED' and tags.device = 'cuda' and tags.preset = "
             f"'{run.data.tags.get('preset', '')}'")
    found = mlflow.MlflowClient().search_runs([run.info.experiment_id], query, order_by=["attributes.start_time DESC"],
                                              max_results=20)
    return next((other for other in found if any(key.startswith("model/") for key in other.data.metrics)), None)


def _as_dict(row: Row, task: str) -> dict:
    """One instance's figures; `samples_per_s` is the training rate for --task train, else the serving rate;
    `whole_run` every phase and every model of the run there."""
    instance = row.instance

    def rng(value: Range | None):
        return None if value is None else {key: _clean(number) for key, number in value.as_dict().items()}

    return {"provider": instance.provider, "instance": instance.name, "gpu": instance.gpu.name,
            "gpu_count": instance.gpu_count, "vcpus": instance.vcpus, "ram_gb": _clean(instance.ram_gb),
            "region": instance.region, "price_per_hour_usd": _clean(instance.price_per_hour),
            "spot_price_per_hour_usd": _clean(instance.spot_price_per_hour), "price_source": instance.source,
            "price_as_of": instance.as_of, "network_gbps": _clean(instance.network_gbps),
            "local_nvme": {"count": _clean(instance.nvme_count), "gb_each": _clean(instance.nvme_gb)},
            "disk_gbs": _clean(instance.disk_gbs), "interconnect": instance.interconnect or None,
            "hardware_source": instance.hardware_source, "run_seconds": rng(row.run_seconds),
            "run_cost_usd": rng(row.run_cost), "train_seconds": rng(row.train_seconds),
            "epoch_seconds": rng(row.epoch_seconds), "bottleneck": row.bound,
            "train_samples_per_s": rng(row.train_per_s),
            "serve_samples_per_s": rng(row.serve_per_s),
            "samples_per_s": rng(row.train_per_s if task == "train" else row.serve_per_s),
            "latency_ms": rng(row.latency_ms),
            "serve_cost_per_million_usd": rng(row.serve_cost_per_million),
            "memory_share": _clean(row.memory_share), "fits": row.fits,
            "scaling": row.scaling.as_dict() if row.scaling else None,
            "data": row.placement.as_dict() if row.placement else None,
            "spot": row.spot.as_dict(row.run_cost) if row.spot else None,
            "serving_month": row.serving.as_dict() if row.serving else None,
            "whole_run": row.whole.as_dict() if row.whole else None}


def _clean(value: float):
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else value


def _measured(facts: RunFacts) -> dict:
    """This run's own figures, which are measurements, not estimates."""
    return {"models": {name: {key: value for key, value in model.items() if key in (
        "train_samples_per_s", "data_wait_share", "loader_samples_per_s", "peak_memory_gb", "samples_per_epoch",
        "epochs_run", "train_flops_per_sample", "infer_flops_per_sample", "params", "weight_bytes",
        "train_ops_per_step", "host_syncs_per_step")} for name, model
        in facts.models.items()},
        "phases": {name: {"seconds": phase.seconds, "scales": phase.scales} for name, phase in facts.phases.items()},
        "total_seconds": _clean(facts.total_seconds), "cores": facts.cores, "gpu": facts.gpu,
        "data_bytes": _clean(facts.data_bytes), "data_samples": _clean(facts.data_samples),
        "checkpoint_every_s": facts.checkpoint_every_s}


HEADER = ["instance", "cloud", "GPUs", "vCPUs", "$/h", "whole run", "cost per run", "of it training", "epoch",
          "bound", "serving", "latency ms (batch 1)", "$ per 1M predictions", "GPU memory"]
FIXED_COLUMNS = 10  # the optional columns go after these


def _optional_columns(rows: list[Row]) -> dict[str, Callable[[Row], str]]:
    """The renting columns, only where they matter: spot where it saves over 20 % on some instance, the data's
    place where the default disk would bound training or the data must be copied, the network where the data comes
    over it, the GPUs' scaling where an instance has several."""
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
            *(show(row) for show in extra.values()),
            span(row.serve_per_s, lambda value: f"{value:,.0f}/s"),
            span(row.latency_ms, lambda value: f"{value:.2g}"),
            span(row.serve_cost_per_million, money), memory + ("" if row.fits else " (does not fit)")]


def _render(report: dict, rows: list[Row], picks: dict[str, Choice | None], todo: list[str], markdown: bool) -> str:
    extra = _optional_columns(rows)
    header = HEADER[:FIXED_COLUMNS] + list(extra) + HEADER[FIXED_COLUMNS:]
    cells = [_cells(row, extra) for row in sorted(rows, key=_order)]
    lines = [f"Advice for {report['source']}. Every figure below is {ESTIMATED}, on-demand prices (spot where "
             "marked) as each row's source dates them. A whole run is every phase the run logged, training one of "
             "them; --format json has each phase and model, and the measured figures under 'measured'."]
    lines += ["", render_table(cells, header, markdown=markdown)]
    lines += ["", "Recommendations (estimated):"]
    requests = report["stated"]["requests_per_s"]
    names = {"train_cheapest": "run, the cheapest that fits", "train_fastest": "run, the fastest within 1.5x of that "
             "cost", "serve_cheapest": f"serve {requests:g} requests/s, cheapest a month"}
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


def _order(row: Row) -> tuple:
    cost = row.run_cost.expected if row.run_cost is not None else (
        row.serve_cost_per_million.expected if row.serve_cost_per_million is not None else math.nan)
    return (math.isnan(cost), cost)


def _log_to_run(run_id: str, report: dict, rows: list[Row], picks: dict, todo: list[str]) -> None:
    import mlflow

    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder)
        (out / "advice.md").write_text(_render(report, rows, picks, todo, markdown=True) + "\n")
        (out / "advice.json").write_text(json.dumps(json_safe(report), indent=2, allow_nan=False))
        _plot(rows, out / "cost_vs_time.png")
        client = mlflow.MlflowClient()
        for path in sorted(out.iterdir()):
            client.log_artifact(run_id, str(path), "advise")


def _plot(rows: list[Row], path: Path) -> None:
    """Cost per run against its time (the whole run), for every priced instance, the Pareto front (no instance both
    faster and cheaper) joined and labelled."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    points = [(row.run_seconds.expected / 60, row.run_cost.expected, row) for row in rows
              if row.run_cost is not None and not math.isnan(row.run_cost.expected) and row.fits]
    spot = [(row.spot.seconds.expected / 60, row.spot.cost.expected, row) for row in rows
            if row.spot is not None and row.fits and math.isfinite(row.spot.seconds.expected)]
    figure, axis = plt.subplots(figsize=(8, 5))
    both = points + spot
    front = [point for point in both if not any(other[0] <= point[0] and other[1] <= point[1] and other != point
                                                for other in both)]
    axis.scatter([point[0] for point in points], [point[1] for point in points], color="0.6",
                 label="instance, on demand")
    axis.scatter([point[0] for point in spot], [point[1] for point in spot], color="tab:blue", marker="v",
                 label="instance, spot (with interruptions)")
    front.sort(key=lambda point: point[0])
    axis.plot([point[0] for point in front], [point[1] for point in front], "o-", color="tab:red",
              label="Pareto front")
    for minutes, cost, row in front:
        label = row.instance.name + (" (spot)" if (minutes, cost, row) in spot else "")
        axis.annotate(label, (minutes, cost), fontsize=7, xytext=(4, 4), textcoords="offset points")
    if points:
        axis.set_xscale("log")
        axis.set_yscale("log")
    axis.set_xlabel("whole run, minutes (estimated)")
    axis.set_ylabel("cost per run, USD (estimated)")
    axis.grid(True, which="both", alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
