"""Links that open each use case's experiment in the MLflow UI on its Training runs table: MLflow 3's UI opens an
experiment's bare address (`#/experiments/ID`) on its GenAI Overview, so the links name the route `.../runs`."""
from __future__ import annotations

from collections.abc import Iterable

from mlflow import MlflowClient

from common.tracking.runs import EXPERIMENT_PREFIX, experiment_name

DEFAULT_UI_URL = "http://127.0.0.1:5000"  # where `usecases ui` and `usecases server` listen unless told otherwise


def training_runs_links(location: str, usecases: Iterable[str] | None = None,
                        ui_url: str = DEFAULT_UI_URL) -> dict[str, str]:
    """{use case: its Training runs URL} for the use cases (all without `usecases`) with an experiment in the store at
    `location`, a tracking server's URL (also the UI's) or a store's URI (its UI then expected at `ui_url`)."""
    base_url = location if location.startswith(("http://", "https://")) else ui_url
    client = MlflowClient(tracking_uri=location)
    if usecases is None:
        prefix = f"{EXPERIMENT_PREFIX}-"
        experiments = {experiment.name.removeprefix(prefix): experiment
                       for experiment in client.search_experiments(filter_string=f"name LIKE '{prefix}%'")}
    else:
        experiments = {name: client.get_experiment_by_name(experiment_name(name)) for name in usecases}
    return {name: f"{base_url.rstrip('/')}/#/experiments/{experiment.experiment_id}/runs"
            for name, experiment in sorted(experiments.items()) if experiment is not None}
