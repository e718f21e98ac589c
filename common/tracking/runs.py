"""MLflow tracking: one experiment per use case, one run per job, ended FINISHED, FAILED or KILLED (a process killed
outright cannot end its run: the next start of that preset does, `lifecycle.py`); only rank 0 of a DDP job writes."""

from __future__ import annotations

import logging
import math
import os
import re
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mlflow

from common.config import flatten
from common.errors import UserError
from common.runtime.interrupt import Terminated
from common.tracking.lifecycle import heartbeat, process_tags
from common.tracking.stores import tracking_uri
from common.paths import git, project_root

log = logging.getLogger(__name__)

EXPERIMENT_PREFIX = "gpu-usecases"
# Without a kind, MLflow 3's UI opens an experiment on its GenAI pages (traces, tokens); these are model training.
EXPERIMENT_KIND_TAG, EXPERIMENT_KIND = "mlflow.experimentKind", "custom_model_development"
SYSTEM_METRICS_INTERVAL_S = 2  # MLflow's 10 s default misses the short smoke runs (3 s of tracked time) entirely


def experiment_name(usecase: str) -> str:
    return f"{EXPERIMENT_PREFIX}-{usecase}"


def ensure_experiment(usecase: str, description: str | None = None) -> str:
    """The use case's experiment id, tagged as model training and described. With a SQLite store, artifacts go to
    `artifacts/` beside the database rather than MLflow's `./mlruns` in whatever folder the run started from."""
    uri = tracking_uri()
    mlflow.set_tracking_uri(uri)
    name = experiment_name(usecase)
    tags = {EXPERIMENT_KIND_TAG: EXPERIMENT_KIND, **({"mlflow.note.content": description} if description else {})}
    experiment = mlflow.get_experiment_by_name(name)
    if experiment is None:
        artifact_location = (Path(uri.removeprefix("sqlite:///")).parent / "artifacts" / name).as_uri() \
            if uri.startswith("sqlite:///") else None
        try:
            return mlflow.create_experiment(name, artifact_location=artifact_location, tags=tags)
        except mlflow.exceptions.MlflowException:  # another run created it in the meantime
            experiment = mlflow.get_experiment_by_name(name)
            if experiment is None:
                raise
    client = mlflow.MlflowClient()
    for key, value in tags.items():  # experiments made before these tags existed get them; a description written
        if key not in experiment.tags:  # in the UI is the user's and stays
            client.set_experiment_tag(experiment.experiment_id, key, value)
    return experiment.experiment_id


def git_commit() -> str:
    return git(project_root(), "rev-parse", "HEAD") or "unknown"


def git_dirty() -> str:
    """Whether tracked files differ from the commit: a run of uncommitted code does not claim the commit's results."""
    return str(bool(git(project_root(), "status", "--porcelain", "--untracked-files=no"))).lower()


def metric_name(key: str) -> str:
    """A name MLflow accepts (letters, digits, `_ - . : /` and spaces): `ndcg@10` is logged as `ndcg_at_10`."""
    return re.sub(r"[^\w\-. :/]", "_", key.replace("@", "_at_"))


FLUSH_EVERY_S = 30  # metrics wait in memory at most this long before they are written
MAX_BATCH = 1000  # MLflow's limit of metrics per log_batch call


class Tracker:
    """Writes on the main rank only; metrics in batches, at most FLUSH_EVERY_S after they were logged: a call per metric
    per epoch to a remote store would cost more than a small model's epoch."""

    def __init__(self, active: bool, run_id: str | None = None):
        self.active, self.run_id = active, run_id
        self.pending: list = []
        self.last_flush = time.monotonic()

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        if not self.active:
            return
        from mlflow.entities import Metric
        now = int(time.time() * 1000)
        self.pending += [Metric(metric_name(key), float(value), now, step or 0) for key, value in metrics.items()
                         if value is not None and math.isfinite(value)]
        if len(self.pending) >= MAX_BATCH or time.monotonic() - self.last_flush >= FLUSH_EVERY_S:
            self.flush()

    def flush(self) -> None:
        if self.active and self.pending:
            client = mlflow.MlflowClient()
            for first in range(0, len(self.pending), MAX_BATCH):
                client.log_batch(self.run_id, metrics=self.pending[first:first + MAX_BATCH])
        self.pending, self.last_flush = [], time.monotonic()

    def set_tags(self, tags: dict[str, Any]) -> None:
        if self.active:
            mlflow.set_tags({key: str(value) for key, value in tags.items()})

    def log_dict(self, data: dict, artifact_file: str) -> None:
        if self.active:
            mlflow.log_dict(data, artifact_file)

    def log_figure(self, figure, artifact_file: str) -> None:
        if self.active:
            mlflow.log_figure(figure, artifact_file)

    def log_text(self, text: str, artifact_file: str) -> None:
        if self.active:
            mlflow.log_text(text, artifact_file)


def log_dataset(tags: dict[str, Any], context: str = "training") -> None:
    """The run's data as an MLflow dataset input, from the data tags of `load_data`: `data_source`, `data_sha256`, and
    optionally `data_path` and `data_schema` (`name:type` pairs separated by commas)."""
    from mlflow.data.code_dataset_source import CodeDatasetSource
    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.types import ColSpec, Schema
    path = tags.get("data_path")
    if path:
        with warnings.catch_warnings():  # "file:" is registered twice inside MLflow; either is the same source
            warnings.filterwarnings("ignore", message="The specified dataset source can be interpreted")
            source = resolve_dataset_source(Path(path).resolve().as_uri())
    else:
        source = CodeDatasetSource({"source": str(tags["data_source"])})
    schema = None
    if tags.get("data_schema"):
        schema = Schema([ColSpec(kind, name) for name, kind in
                         (pair.split(":") for pair in str(tags["data_schema"]).split(","))])
    dataset = MetaDataset(source, name=str(tags["data_source"]), digest=str(tags["data_sha256"])[:12], schema=schema)
    # Runs started together on the same data each insert the experiment's new dataset; the store keeps the first and
    # refuses the others. Logged again, it is found and linked.
    again_if_raced(mlflow.log_input, dataset, context=context)


UNIQUE_VIOLATIONS = ("unique constraint", "duplicate entry", "duplicate key")  # SQLite, MySQL, PostgreSQL


def again_if_raced(call, *args, **kwargs) -> None:
    """`call`, and once more where the store refused a row that another process inserted a moment before."""
    try:
        call(*args, **kwargs)
    except mlflow.exceptions.MlflowException as exc:
        if not any(words in str(exc).lower() for words in UNIQUE_VIOLATIONS):
            raise
        call(*args, **kwargs)


def check_project_run(usecase: str, experiment_id: str, resuming: bool) -> None:
    """Under `mlflow run`, `mlflow.start_run()` continues MLFLOW_RUN_ID's run whatever its experiment: ours."""
    env_run_id = os.environ.get("MLFLOW_RUN_ID")
    if not env_run_id:
        return
    if resuming:
        raise UserError("--resume cannot be used under `mlflow run` (MLFLOW_RUN_ID is set)")
    env_experiment = mlflow.get_run(env_run_id).info.experiment_id
    if env_experiment != experiment_id:
        name = experiment_name(usecase)
        raise UserError(f"MLFLOW_RUN_ID {env_run_id} is a run of experiment {env_experiment}, not of {name}: "
                        f"start `mlflow run` with --experiment-name {name}")


@contextmanager
def tracked_run(usecase: str, config, tags: dict[str, Any], *, is_main: bool = True, run_id: str | None = None,
                run_name: str | None = None, description: str | None = None) -> Iterator[Tracker]:
    """One MLflow run around a job; `run_id` reopens an earlier run, as `--resume` does."""
    if not is_main:
        yield Tracker(active=False)
        return
    experiment_id = ensure_experiment(usecase, description)
    check_project_run(usecase, experiment_id, resuming=run_id is not None)
    mlflow.set_system_metrics_sampling_interval(
        float(os.environ.get("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", SYSTEM_METRICS_INTERVAL_S)))
    run = mlflow.start_run(run_id=run_id, experiment_id=None if run_id else experiment_id, run_name=run_name,
                           log_system_metrics=True)
    tracker = Tracker(active=True, run_id=run.info.run_id)
    tags = {**tags, **process_tags()}
    try:
        if run_id is None:
            tracker.set_tags({"usecase": usecase, "git_commit": git_commit(), "git_dirty": git_dirty(), **tags})
            mlflow.log_params(flatten(config))
            tracker.log_dict(config.model_dump(mode="json"), "config.json")
            if "data_sha256" in tags and "data_source" in tags:
                log_dataset(tags)
        else:
            tracker.set_tags({"resumed": "true", **tags})
        with heartbeat(tracker.run_id):
            try:
                yield tracker
            finally:
                tracker.flush()  # what a stopped or failed run measured is kept too
    except (KeyboardInterrupt, Terminated):
        mlflow.end_run("KILLED")
        raise
    except BaseException:
        mlflow.end_run("FAILED")
        raise
    mlflow.end_run("FINISHED")
