"""Running the CLI as a user does: a separate process, with a private MLflow store and checkpoint folder."""

import os
import subprocess
import sys

import mlflow


def private_env(folder) -> dict[str, str]:
    """For module-scoped runs, which start before the per-test store of tests/conftest.py exists."""
    return {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{folder / 'mlflow.db'}",
            "USECASES_CHECKPOINT_DIR": str(folder / "checkpoints")}


def usecases(*args, timeout=300, env=None):
    env = {**(env or os.environ), "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "usecases", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def runs(usecase="finance", uri=None):
    mlflow.set_tracking_uri(uri or os.environ["MLFLOW_TRACKING_URI"])
    experiment = mlflow.get_experiment_by_name(f"gpu-usecases-{usecase}")
    if experiment is None:
        return []
    return mlflow.MlflowClient().search_runs([experiment.experiment_id])
