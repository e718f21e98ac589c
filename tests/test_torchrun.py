"""Every use case under `torchrun --nproc_per_node 2` on CPU (gloo), as the README starts several GPUs: one FINISHED
run with world_size 2, whose served model scores within 15 % of the single-process run of the same preset."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys

import pytest

from tests.cli_helpers import private_env, runs, usecases

TOLERANCE = 0.15  # DDP shards each batch over the ranks, so the optimiser takes other steps: close, not equal


# medical's two smoke runs take a minute: in the slow suite; finance and recsys run both DDP paths in the default one
@pytest.mark.parametrize("name", ["finance", pytest.param("medical", marks=pytest.mark.slow), "recsys"])
def test_two_processes_give_one_finished_run_that_scores_like_one_process(tmp_path, name):
    metric, _ = importlib.import_module(f"usecases.{name}").USECASE.primary_metric
    single_env = private_env(tmp_path / "single")
    single = usecases("run", name, "--preset", "smoke", "--summary", str(tmp_path / "single.json"), env=single_env)
    assert single.returncode == 0, single.stderr[-2000:]

    env = {**private_env(tmp_path / "ddp"), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
               "usecases", "run", name, "--preset", "smoke", "--summary", str(tmp_path / "ddp.json")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    (run,) = runs(name, env["MLFLOW_TRACKING_URI"])
    assert run.info.status == "FINISHED" and run.data.tags["world_size"] == "2"

    alone, together = (json.loads((tmp_path / f"{kind}.json").read_text()) for kind in ("single", "ddp"))
    assert set(together["models"]) == set(alone["models"])
    served = run.data.tags["primary_model"]
    assert together["models"][served][metric] == pytest.approx(alone["models"][served][metric], rel=TOLERANCE)
    assert not (tmp_path / "ddp" / "checkpoints" / name / "smoke" / run.info.run_id).exists()  # nothing to resume
