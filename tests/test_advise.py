"""`usecases advise` as a user runs it: after a smoke run, a table of instances with time, cost and bottleneck, the
recommendations and the actions, the same as JSON, and the table and plot logged to the run; a model of one's own
from a workload file; one line for each mistake."""

from __future__ import annotations

import json

import mlflow
import pandas as pd
import pytest

from common.advisor.estimate import BOUNDS, MEASURED_SPREAD
from common.advisor.catalog import FOLDER
from tests.cli_helpers import assert_rejected, runs
from usecases.cli import main


def advise(capsys, *args: str) -> str:
    capsys.readouterr()
    assert main(["advise", *args]) == 0
    return capsys.readouterr().out


# medical's smoke run takes 35 s on 2 cores: in the slow suite; finance and recsys run the same report in the default
@pytest.mark.parametrize("name", [pytest.param("medical", marks=pytest.mark.slow), "finance", "recsys"])
def test_advise_after_a_smoke_run_prices_every_instance_and_logs_its_table(name, capsys):
    assert main(["run", name, "--preset", "smoke"]) == 0
    table = advise(capsys, name)
    assert "Every figure below is estimated" in table and "Recommendations (estimated):" in table
    assert "- train, cheapest run that fits:" in table and "- serve, cheapest per 1M predictions:" in table
    report = json.loads(advise(capsys, name, "--format", "json"))
    rows = report["rows"]
    assert len(rows) >= 10 and report["estimated"] is True
    priced = [row for row in rows if row["price_per_hour_usd"] is not None]
    assert len(priced) >= 10 and all(row["train_cost_usd"]["expected"] > 0 for row in priced)
    for row in rows:
        for key in ("train_seconds", "train_samples_per_s", "serve_samples_per_s", "latency_ms"):
            assert row[key]["low"] <= row[key]["expected"] <= row[key]["high"], (row["instance"], key)
        assert row["bottleneck"] in BOUNDS
    assert report["recommendations"]["train_cheapest"] in table
    (run,) = runs(name)
    artifacts = {item.path for item in mlflow.MlflowClient().list_artifacts(run.info.run_id, "advise")}
    assert artifacts == {"advise/advice.md", "advise/advice.json", "advise/cost_vs_time.png"}
    measured = report["measured"]["models"].values()
    assert all(model["samples_per_epoch"] > 0 and model["params"] > 0 for model in measured)
    assert any(model["train_flops_per_sample"] > 0 for model in measured)  # BPR's gathers count no FLOPs
    if name in ("finance", "recsys"):  # the GARCH fits and the CPU baselines: more vCPUs shorten them
        assert report["measured"]["cpu_parts_seconds"]
        assert any("vCPUs" in line for line in report["actions"]), (report["actions"], report["measured"])
    if name == "medical":
        assert_a_gpu_run_of_the_preset_calibrates_the_cpu_run(run, capsys)


def assert_a_gpu_run_of_the_preset_calibrates_the_cpu_run(cpu_run, capsys):
    """A run of the same preset measured on an A100 (logged here by hand: no GPU on this machine) gives the CPU
    run's estimates their GPU rate: the A100's training rate is then the measured one, within its 0.7x-1.5x range
    (MEASURED_SPREAD, the leave-one-model-out envelope)."""
    client = mlflow.MlflowClient()
    facts = {key: value for key, value in cpu_run.data.metrics.items() if key.startswith("model/")}
    name = next(key.split("/")[1] for key in facts)
    gpu_run = client.create_run(cpu_run.info.experiment_id, tags={"device": "cuda", "preset": "smoke",
                                                                    "gpu_name": "NVIDIA A100-SXM4-80GB",
                                                                    "world_size": "1", "cpu_cores": "8"})
    for key, value in {**facts, f"model/{name}/train_samples_per_s": 20_000.0}.items():
        client.log_metric(gpu_run.info.run_id, key, value)
    client.set_terminated(gpu_run.info.run_id)
    report = json.loads(advise(capsys, "medical", "--run", cpu_run.info.run_id, "--format", "json"))
    assert f"its GPU rates from run {gpu_run.info.run_id} on A100-80GB-SXM" in report["source"]
    a100 = next(row for row in report["rows"] if row["instance"] == "a2-ultragpu-1g")
    epoch = facts[f"model/{name}/samples_per_epoch"] / 20_000
    low, high = a100["epoch_seconds"]["low"], a100["epoch_seconds"]["high"]
    assert low <= epoch <= high <= MEASURED_SPREAD[2] / MEASURED_SPREAD[0] * 1.01 * low, json.dumps(a100)


def test_a_workload_file_measured_on_a_v100_gives_a_range_that_holds_the_published_a100(tmp_path, capsys):
    """ResNet-50 v1.5 mixed-precision training as DeepLearningExamples publishes it: 1,200 images/s measured on a
    V100-16GB; its table gives 2,470 on one A100-80GB SXM (catalog/published.csv)."""
    workload = tmp_path / "w.json"
    workload.write_text(json.dumps({"task": "train", "flops_per_sample": 24.3e9, "bytes_per_sample": 3.3e8,
                                    "precision": "amp", "batch_size": 256,
                                    "measured": {"gpu": "Tesla V100-SXM2-16GB", "samples_per_s": 1200}}))
    report = json.loads(advise(capsys, "--workload", str(workload), "--format", "json"))
    one_a100 = next(row for row in report["rows"] if row["instance"] == "a2-ultragpu-1g")
    assert one_a100["gpu"] == "A100-80GB-SXM" and one_a100["gpu_count"] == 1
    assert one_a100["samples_per_s"]["low"] <= 2470 <= one_a100["samples_per_s"]["high"]
    assert one_a100["samples_per_s"] == one_a100["train_samples_per_s"]
    assert "Recommendations" in advise(capsys, "--workload", str(workload))


def test_no_run_a_bad_catalogue_or_a_bad_workload_is_one_line(capsys, tmp_path):
    assert_rejected(capsys, "medical", "advise", "medical", names=("no finished run of 'medical'",
                                                                   "usecases run medical --preset smoke"))
    table = pd.read_csv(FOLDER / "instances.csv", dtype=str, keep_default_na=False)
    table.drop(columns="price_per_hour_usd").to_csv(tmp_path / "mine.csv", index=False)
    assert_rejected(capsys, "medical", "advise", "medical", "--catalog", str(tmp_path / "mine.csv"),
                    names=("mine.csv", "missing column 'price_per_hour_usd'"))
    (tmp_path / "w.json").write_text(json.dumps({"task": "train", "flops_per_sample": 1e9}))
    assert_rejected(capsys, "medical", "advise", "--workload", str(tmp_path / "w.json"),
                    names=("w.json", "missing key 'bytes_per_sample'"))
    (tmp_path / "g.json").write_text(json.dumps({"task": "serve", "flops_per_sample": 1e9, "bytes_per_sample": 1e6,
                                                 "precision": "amp", "batch_size": 8,
                                                 "measured": {"gpu": "RTX 9090", "samples_per_s": 10}}))
    assert_rejected(capsys, "medical", "advise", "--workload", str(tmp_path / "g.json"),
                    names=("unknown GPU 'RTX 9090'", "known: T4"))
