"""The MLflow side of `usecases advise`, at the command's edge: the runs it advises on (a use case's latest run with
workload facts, a GPU run of its preset that measured its rates, a serving bench run), the samples a model trained
on, and the report logged back to the advised run with its cost-against-time plot. The estimates (common/advisor)
never call MLflow."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import mlflow

from common.errors import UserError
from common.tracking.runs import experiment_name
from common.tracking.stores import tracking_uri

BENCH_METRIC = re.compile(r"serve/(?P<server>.+)/c(?P<level>\d+)/(?P<name>requests_per_s|p50_ms|p99_ms|errors)")


def tracked_runs(run_id: str | None, experiments: list[str], query: str) -> list:
    """The run `run_id` (one line where there is none), else the newest 20 finished runs `query` finds."""
    mlflow.set_tracking_uri(tracking_uri())
    client = mlflow.MlflowClient()
    if run_id is not None:
        try:
            return [client.get_run(run_id)]
        except mlflow.exceptions.MlflowException:
            raise UserError(f"--run {run_id}: no such run in {tracking_uri()}") from None
    ids = [found.experiment_id for name in experiments if (found := client.get_experiment_by_name(name))]
    return _latest(client, ids, query) if ids else []


def _latest(client, experiment_ids: list[str], query: str) -> list:
    return client.search_runs(experiment_ids, f"attributes.status = 'FINISHED' and {query}",
                              order_by=["attributes.start_time DESC"], max_results=20)


def _has_facts(run) -> bool:
    return any(key.startswith("model/") for key in run.data.metrics)


def advised_run(usecase: str, run_id: str | None):
    """The run asked for, else the latest with workload facts (else the latest) of the use case."""
    runs = tracked_runs(run_id, [experiment_name(usecase)], "tags.preset != 'scale'")
    runs = [run for run in runs if _has_facts(run)] or runs
    if not runs:
        raise UserError(f"no finished run of '{usecase}' in {tracking_uri()}: run `usecases run {usecase} --preset "
                        "smoke` first")
    return runs[0]


def gpu_run(run):
    """The latest GPU run of the same preset with workload facts: a measured GPU rate beats the roofline alone."""
    found = _latest(mlflow.MlflowClient(), [run.info.experiment_id],
                    f"tags.device = 'cuda' and tags.preset = '{run.data.tags.get('preset', '')}'")
    return next((other for other in found if _has_facts(other)), None)


def bench_run(usecase: str, run_id: str | None):
    """The serving bench run: `run_id`, else the newest finished `preset=serve` run of experiment NAME-serve."""
    names = list(dict.fromkeys((experiment_name(f"{usecase}-serve"), f"{usecase}-serve")))  # as tracked, or named
    found = [run for run in tracked_runs(run_id, names, "tags.preset = 'serve'")
             if any(BENCH_METRIC.fullmatch(key) for key in run.data.metrics)]
    if found:
        return found[0]
    if run_id is not None:
        raise UserError(f"--run {run_id}: not a serving bench run (no serve/SERVER/cN/requests_per_s metrics): "
                        f"run `usecases bench serve {usecase}`")
    raise UserError(f"no serving bench run of '{usecase}' in {tracking_uri()}: run `usecases bench serve {usecase}` "
                    "first")


def trained_samples(run_id: str, name: str) -> float:
    """Every sample a model trained on: each fit (a refit, an ensemble member) logs its epochs' samples once."""
    client = mlflow.MlflowClient()
    per_epoch = client.get_metric_history(run_id, f"model/{name}/samples_per_epoch")
    epochs = client.get_metric_history(run_id, f"model/{name}/epochs_run")
    return float(sum(samples.value * run.value for samples, run in zip(per_epoch, epochs)))


def log_advice(run_id: str, texts: dict[str, str], on_demand: list[tuple], spot: list[tuple]) -> None:
    """The report's `texts` (file name: text) and the plot of the (minutes, cost, label) points, as `advise/`."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder)
        for name, text in texts.items():
            (out / name).write_text(text)
        _plot(on_demand, spot, out / "cost_vs_time.png")
        client = mlflow.MlflowClient()
        for path in sorted(out.iterdir()):
            client.log_artifact(run_id, str(path), "advise")


def _plot(on_demand: list[tuple], spot: list[tuple], path: Path) -> None:
    """Cost per run against its time for every priced instance, the Pareto front joined and labelled."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 5))
    both = on_demand + spot
    front = sorted((point for point in both if not any(other[0] <= point[0] and other[1] <= point[1] and
                                                       other != point for other in both)), key=lambda point: point[0])
    axis.scatter([point[0] for point in on_demand], [point[1] for point in on_demand], color="0.6",
                 label="instance, on demand")
    axis.scatter([point[0] for point in spot], [point[1] for point in spot], color="tab:blue", marker="v",
                 label="instance, spot (with interruptions)")
    axis.plot([point[0] for point in front], [point[1] for point in front], "o-", color="tab:red", label="Pareto front")
    for minutes, cost, label in front:
        axis.annotate(label, (minutes, cost), fontsize=7, xytext=(4, 4), textcoords="offset points")
    if on_demand:
        axis.set_xscale("log")
        axis.set_yscale("log")
    axis.set_xlabel("whole run, minutes (estimated)")
    axis.set_ylabel("cost per run, USD (estimated)")
    axis.grid(True, which="both", alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
