"""Links that open each use case's experiment in the MLflow UI on its Training runs table.

MLflow 3's UI opens an experiment's bare address (`#/experiments/ID`) on its GenAI Overview; the runs table is the
route `#/experiments/ID/runs` of its bundle (`mlflow/server/js/build`), so the links name it."""
from __future__ import annotations

from collections.abc import Iterable

from mlflow import MlflowClient

from common.tracking.runs import EXPERIMENT_PREFIX, experiment_name

DEFAULT_UI_URL = "http://127.0.0.1:5000"  # where `usecases ui` and `usecases server` listen unless told otherwise


def runs_table_url(base_url: str, experiment_id: str) -> str:
    return f"{base_url.rstrip('/')}/#/experiments/{experiment_id}/runs"


def training_runs_links(location: str, usecases: Iterable[str] | None = None,
                        ui_url: str = DEFAULT_UI_URL) -> dict[str, str]:
    """{use case: the URL of its Training runs view} for the use cases with an experiment in the store.

    `location` is a tracking server's URL (http[s]://..., also the UI's address) or a store's URI (sqlite:///...,
    postgresql://...), whose UI is then expected at `ui_url`. Without `usecases`, every `gpu-usecases-NAME`
    experiment of the store is linked; a named use case without an experiment yet (no run) gets no link."""
    is_server = location.startswith(("http://", "https://"))
    base_url = location if is_server else ui_url
    client = MlflowClient(tracking_uri=location)
    if usecases is None:
        prefix = f"{EXPERIMENT_PREFIX}-"
        experiments = {experiment.name.removeprefix(prefix): experiment
                       for experiment in client.search_experiments(filter_string=f"name LIKE '{prefix}%'")}
    else:
        experiments = {name: client.get_experiment_by_name(experiment_name(name)) for name in usecases}
    return {name: runs_table_url(base_url, experiment.experiment_id)
            for name, experiment in sorted(experiments.items()) if experiment is not None}
