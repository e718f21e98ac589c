"""MLflow tracking: the local SQLite store by default, one experiment per use case, one run per job.

A run always ends FINISHED, FAILED or KILLED (never RUNNING), and only rank 0 of a DDP job writes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from importlib.metadata import version
from pathlib import Path
from types import ModuleType
from typing import Any

import mlflow

from common.config import flatten
from common.interrupt import Terminated

log = logging.getLogger(__name__)

EXPERIMENT_PREFIX = "gpu-usecases"
SYSTEM_METRICS_INTERVAL_S = 5  # MLflow's 10 s default misses the short smoke runs entirely


def project_root() -> Path:
    """The clone's root when installed in editable mode, else the working directory."""
    root = Path(__file__).resolve().parents[1]
    return root if (root / "pyproject.toml").is_file() else Path.cwd()


def local_store() -> Path:
    return project_root() / "mlflow"


def default_tracking_uri() -> str:
    return f"sqlite:///{local_store() / 'mlflow.db'}"


def tracking_uri() -> str:
    uri = os.environ.get("MLFLOW_TRACKING_URI") or default_tracking_uri()
    if uri == default_tracking_uri():
        local_store().mkdir(parents=True, exist_ok=True)
    return uri


def experiment_name(usecase: str) -> str:
    return f"{EXPERIMENT_PREFIX}-{usecase}"


def ensure_experiment(usecase: str) -> str:
    """The use case's experiment id.

    With a SQLite store, artifacts go to `artifacts/` beside the database file (mlflow/artifacts/ for the
    default store) rather than MLflow's fallback `./mlruns` in whatever folder the run started from.
    """
    uri = tracking_uri()
    mlflow.set_tracking_uri(uri)
    name = experiment_name(usecase)
    experiment = mlflow.get_experiment_by_name(name)
    if experiment is not None:
        return experiment.experiment_id
    artifact_location = None
    if uri.startswith("sqlite:///"):
        database = Path(uri.removeprefix("sqlite:///"))
        artifact_location = (database.parent / "artifacts" / name).as_uri()
    return mlflow.create_experiment(name, artifact_location=artifact_location)


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=project_root(), capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 else "unknown"


def file_sha256(*paths: Path) -> str:
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def metric_name(key: str) -> str:
    """A name MLflow accepts (letters, digits, `_ - . : /` and spaces): `ndcg@10` is logged as `ndcg_at_10`."""
    return re.sub(r"[^\w\-. :/]", "_", key.replace("@", "_at_"))


class Tracker:
    """Logging calls that write on the main rank and do nothing elsewhere."""

    def __init__(self, active: bool, run_id: str | None = None):
        self.active = active
        self.run_id = run_id

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        finite = {metric_name(key): float(value) for key, value in metrics.items()
                  if value is not None and math.isfinite(value)}
        if self.active and finite:
            mlflow.log_metrics(finite, step=step)

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

    def log_pyfunc(self, entry: Path, bundle: dict, *, example, signature, packages: list[str],
                   code: list[ModuleType], metadata: dict | None = None) -> None:
        """Log `model` from code (MLflow's models-from-code): the `entry` script, the `code` packages and `common`,
        and `bundle` saved with torch as the artifact `bundle`; nothing is pickled but tensors and plain data."""
        if not self.active:
            return
        import torch

        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "bundle.pt"
            torch.save(bundle, path)
            mlflow.pyfunc.log_model(
                name="model",
                python_model=str(entry),
                artifacts={"bundle": str(path)},
                signature=signature,
                input_example=example,
                metadata=metadata,
                code_paths=[str(Path(package.__file__).parent) for package in (*code, sys.modules["common"])],
                pip_requirements=[f"{name}=={version(name)}" for name in packages],
            )


@contextmanager
def tracked_run(
    usecase: str,
    config,
    tags: dict[str, Any],
    *,
    is_main: bool = True,
    run_id: str | None = None,
    run_name: str | None = None,
) -> Iterator[Tracker]:
    """One MLflow run around a job; `run_id` reopens an earlier run, as `--resume` does."""
    if not is_main:
        yield Tracker(active=False)
        return
    experiment_id = ensure_experiment(usecase)
    mlflow.set_system_metrics_sampling_interval(SYSTEM_METRICS_INTERVAL_S)
    run = mlflow.start_run(
        run_id=run_id, experiment_id=None if run_id else experiment_id, run_name=run_name, log_system_metrics=True
    )
    tracker = Tracker(active=True, run_id=run.info.run_id)
    try:
        if run_id is None:
            tracker.set_tags({"usecase": usecase, "git_commit": git_commit(), **tags})
            mlflow.log_params(flatten(config))
            tracker.log_dict(config.model_dump(mode="json"), "config.json")
        else:
            tracker.set_tags({"resumed": "true", **tags})
        yield tracker
    except (KeyboardInterrupt, Terminated):
        mlflow.end_run("KILLED")
        raise
    except BaseException:
        mlflow.end_run("FAILED")
        raise
    mlflow.end_run("FINISHED")


def format_table(models: dict[str, dict[str, float]], columns: list[str] | None = None) -> str:
    """Models as rows; by default every metric without a per-series suffix as a column."""
    if columns is None:
        columns = sorted({metric for metrics in models.values() for metric in metrics if "/" not in metric})
    width = max([len("model")] + [len(name) for name in models])
    header = "model".ljust(width) + "".join(f"  {column:>16}" for column in columns)
    lines = [header, "-" * len(header)]
    for name, metrics in models.items():
        cells = "".join(f"  {metrics.get(column, float('nan')):>16.4f}" for column in columns)
        lines.append(name.ljust(width) + cells)
    return "\n".join(lines)


def write_json_atomic(data: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as handle:
        json.dump(data, handle, indent=2, allow_nan=True)
    os.replace(handle.name, path)


def write_summary(
    tracker: Tracker,
    usecase: str,
    preset: str,
    device: str,
    models: dict[str, dict[str, float]],
    path: Path | None = None,
    columns: list[str] | None = None,
) -> dict:
    """Test metrics of every model in the run: as MLflow metrics, summary.json, --summary FILE and a table."""
    summary = {"usecase": usecase, "run_id": tracker.run_id, "preset": preset, "device": device, "models": models}
    for model, metrics in models.items():
        tracker.log_metrics({f"test/{model}/{metric}": value for metric, value in metrics.items()})
    tracker.log_dict(summary, "summary.json")
    if path is not None:
        write_json_atomic(summary, path)
    print(format_table(models, columns), flush=True)
    return summary
