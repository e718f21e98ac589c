"""Every use case under `torchrun --nproc_per_node 2` on CPU (gloo), as the README starts several GPUs: one FINISHED
run with world_size 2 that scores as one process does with the same global batch.

Each rank trains on its own batch of `batch_size` rows and DDP averages the gradients, so two ranks take the steps
of one process whose batch is twice as large: that run is the reference. The batches hold other rows, so a trained
model lands where another seed would; the models DDP does not train (baselines, fitted in shares across the ranks)
must score the same to the rounding of a sum."""

from __future__ import annotations

import importlib
import json
import math
import re
import subprocess
import sys

import pytest

from common.config import load_config
from tests.cli_helpers import private_env, runs, usecases

pytestmark = pytest.mark.starts_first(4)  # the default suite's longest files first (tests/conftest.py)

# The batch-size keys of each use case's trained models.
BATCH_KEYS = {"finance": ("train",), "medical": ("train",), "recsys": ("bpr", "lightgcn", "sasrec")}
# The primary metric of each trained model over runtime.seed 0-3, one process with the doubled batch of the smoke
# preset, on 2 CPU cores: its spread (max - min). A DDP run must come within it of that process with seed 0.
# Measured: finance's neural QLIKE 1.4733-1.4784 (DDP 1.4764); recsys's BPR NDCG@10 0.2013-0.2116 (DDP 0.2022),
# LightGCN's 0.2910-0.2975 (DDP 0.2939), SASRec's 0.1249-0.1292 (DDP 0.1252, 2026-12-03); medical's ResNet-18 AUC 0.902-0.947 over seeds 0-1 (DDP 0.907). With the
# preset's own batch, one process lands 0.008 off for finance, outside the spread.
SEED_SPREAD = {"finance": {model: 0.0052 for model in ("neural", "neural_training", "neural_out_of_sample",
                                                      "neural_out_of_sample_evt", "neural_fz")},
               "medical": {"resnet18": 0.045},
               "recsys": {"bpr": 0.0104, "lightgcn": 0.0066, "sasrec": 0.0043}}
# The baselines are fitted in shares of the ranks and must come back whole and equal: two show it (finance's seven
# take a quarter of a run)
FEWER = {"finance": ["--set", "baselines.models=[ewma,gjr_garch_t]"]}
TIMING = re.compile(r"seconds|per_s|_ms$")  # how fast, not what: differs between any two runs
# The ANN index `auto` keeps is whichever reached its recall faster in this run, so its figures follow a timing too
MEASURED_CHOICE = re.compile(r"^ann_")


def doubled_batches(name: str) -> list[str]:
    """`--set` arguments that give one process the global batch of two ranks."""
    usecase = importlib.import_module(f"usecases.{name}")
    config = load_config(usecase.Config, usecase.USECASE.presets_dir, "smoke")
    return [argument for section in BATCH_KEYS[name]
            for argument in ("--set", f"{section}.batch_size={2 * getattr(config, section).batch_size}")]


def same(value: float, other: float) -> bool:
    return (math.isnan(value) and math.isnan(other)) or value == pytest.approx(other, rel=1e-9, abs=1e-12)


# A pair of ranks and the one-process reference take 45 to 60 s a use case: finance's in the default suite (the DDP
# path every use case shares), medical's and recsys's in the slow one, which CI runs too
@pytest.mark.parametrize("name", ["finance", *(pytest.param(name, marks=pytest.mark.slow)
                                               for name in ("medical", "recsys"))])
def test_two_processes_score_as_one_process_with_their_global_batch(tmp_path, name):
    metric, _ = importlib.import_module(f"usecases.{name}").USECASE.primary_metric
    one_thread = {"OMP_NUM_THREADS": "1"}  # as torchrun gives each rank: the baselines' fits round alike
    single_env = {**private_env(tmp_path / "single"), **one_thread}
    single = usecases("run", name, "--preset", "smoke", *FEWER.get(name, []), *doubled_batches(name), "--summary",
                      str(tmp_path / "single.json"), env=single_env)
    assert single.returncode == 0, single.stderr[-2000:]

    env = {**private_env(tmp_path / "ddp"), **one_thread}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
               "usecases", "run", name, "--preset", "smoke", *FEWER.get(name, []), "--summary",
               str(tmp_path / "ddp.json")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    (run,) = runs(name, env["MLFLOW_TRACKING_URI"])
    assert run.info.status == "FINISHED" and run.data.tags["world_size"] == "2"
    assert not (tmp_path / "ddp" / "checkpoints" / name / "smoke" / run.info.run_id).exists()  # nothing to resume

    alone, together = (json.loads((tmp_path / f"{kind}.json").read_text())["models"] for kind in ("single", "ddp"))
    assert set(together) == set(alone)
    trained = SEED_SPREAD[name]
    assert run.data.tags["primary_model"] in together
    for model, metrics in alone.items():
        if model in trained:
            assert abs(together[model][metric] - metrics[metric]) <= trained[model], (model, together[model][metric],
                                                                                     metrics[metric])
            continue
        differing = [key for key, value in metrics.items()
                     if not TIMING.search(key) and not MEASURED_CHOICE.search(key) and not same(value, together[model][key])]
        assert differing == [], (model, differing[:5])
