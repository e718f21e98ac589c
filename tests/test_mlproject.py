"""`mlflow run usecases/NAME`: each use case is an MLflow Project whose entry point is the CLI.

`mlflow run` creates the run itself and hands it to the command in MLFLOW_RUN_ID; `mlflow.start_run()` in
`common.tracking.tracked_run` then continues that run, in whatever experiment `mlflow run` put it. Hence
`--experiment-name gpu-usecases-NAME` on the command line (see mlflow/README.md).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.projects._project_spec import load_project

from tests.cli_helpers import runs

pytestmark = pytest.mark.starts_first(11)  # its `mlflow run` tests first in the slow suite (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[1]


def mlflow_run(usecase: str, *extra: str, cwd: Path) -> subprocess.CompletedProcess:
    """`mlflow run` as a user starts it from an activated virtualenv: the entry point's `python` is this one."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    return subprocess.run(
        [sys.executable, "-m", "mlflow", "run", str(ROOT / "usecases" / usecase), "-P", "preset=smoke",
         "--env-manager", "local", *extra],
        cwd=cwd, capture_output=True, text=True, timeout=300, env=env, check=False)


@pytest.mark.parametrize("usecase", ["finance", "medical", "recsys"])
def test_mlproject_runs_the_cli_with_a_preset(usecase, tmp_path):
    project = load_project(ROOT / "usecases" / usecase)
    assert project.name == f"gpu-usecases-{usecase}"
    entry = project.get_entry_point("main")
    assert entry.parameters["preset"].default == "smoke"
    assert entry.compute_command({"preset": "default"}, str(tmp_path)) == \
        f"python -m usecases run {usecase} --preset default"


@pytest.mark.slow  # a whole smoke run under `mlflow run` (about 27 s): in the slow suite, which CI runs too
def test_mlflow_run_finance_smoke_is_one_finished_run_of_the_experiment(tmp_path):
    result = mlflow_run("finance", "--experiment-name", "gpu-usecases-finance", cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    finished = runs("finance")
    assert [run.info.status for run in finished] == ["FINISHED"]
    run = finished[0]
    assert run.data.tags["mlflow.source.type"] == "PROJECT"  # the run `mlflow run` created, not a second one
    assert run.data.tags["usecase"] == "finance" and run.data.tags["preset"] == "smoke"
    assert run.info.run_name == "finance-smoke"
    assert "test/neural/qlike_parkinson" in run.data.metrics


@pytest.mark.slow  # `mlflow run` starts in about 11 s: beside the run above
def test_mlflow_run_without_the_experiment_name_is_refused(tmp_path):
    result = mlflow_run("finance", cwd=tmp_path)
    assert result.returncode != 0
    assert "--experiment-name gpu-usecases-finance" in result.stderr
    assert runs("finance") == []
