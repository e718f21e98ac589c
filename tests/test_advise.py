"""`usecases advise` as a user runs it: after a smoke run, a table of instances with the whole run's time and cost
(training a part of it) and its bottleneck, the recommendations and the actions, the same as JSON with every phase
and model, and the table and plot logged to the run; the run's facts kept as JSON; a model of one's own from a
workload file; one line for each mistake."""

from __future__ import annotations

import json
import math

import mlflow
import pandas as pd
import pytest
import yaml

from common.advisor.estimate import BOUNDS, MEASURED_SPREAD
from common.advisor.catalog import FOLDER
from tests.cli_helpers import assert_rejected, runs, user_error
from tests.plumbing import PLUMBING
from tests.common.test_renting import kubernetes_objects
from usecases.cli import main


def strict_json(text: str):
    """JSON as other tools read it: NaN and Infinity are not JSON."""
    def refuse(constant):
        raise ValueError(f"{constant} in --format json")
    return json.loads(text, parse_constant=refuse)


def advise(capsys, *args: str) -> str:
    capsys.readouterr()
    assert main(["advise", *args]) == 0
    return capsys.readouterr().out


# The same report for each use case, after a smoke run made smaller (PLUMBING): finance's in the default suite,
# medical's and recsys's in the slow one
@pytest.mark.parametrize("name", [pytest.param("medical", marks=pytest.mark.slow), "finance",
                                  pytest.param("recsys", marks=pytest.mark.slow)])
def test_advise_after_a_smoke_run_prices_every_instance_and_logs_its_table(name, capsys, tmp_path):
    assert main(["run", name, "--preset", "smoke", *PLUMBING[name]]) == 0
    table = advise(capsys, name)
    assert "Every figure below is estimated" in table and "Recommendations (estimated):" in table
    assert "whole run" in table and "of it training" in table
    assert "- run, the cheapest that fits:" in table and "- serve 100 requests/s, cheapest a month:" in table
    report = strict_json(advise(capsys, name, "--format", "json"))
    rows = report["rows"]
    assert len(rows) >= 10 and report["estimated"] is True
    priced = [row for row in rows if row["price_per_hour_usd"] is not None]
    assert len(priced) >= 10 and all(row["run_cost_usd"]["expected"] > 0 for row in priced)
    for row in rows:
        for key in ("run_seconds", "train_seconds", "train_samples_per_s", "serve_samples_per_s", "latency_ms"):
            assert row[key]["low"] <= row[key]["expected"] <= row[key]["high"], (row["instance"], key)
        assert row["train_seconds"]["expected"] < row["run_seconds"]["expected"]
        assert row["bottleneck"] in BOUNDS
        whole = row["whole_run"]
        assert set(whole["phases"]) >= set(report["measured"]["phases"]) | {"start"}, row["instance"]
        assert math.fsum(phase["measured_s"] for phase in whole["phases"].values() if phase["measured_s"] is not None) \
            == pytest.approx(report["measured"]["total_seconds"]), row["instance"]  # each measured second once
        assert all(model["fit_seconds"]["expected"] > 0 for model in whole["models"].values())
    assert report["recommendations"]["train_cheapest"] in table
    (run,) = runs(name)
    artifacts = {item.path for item in mlflow.MlflowClient().list_artifacts(run.info.run_id, "advise")}
    assert artifacts == {"advise/advice.md", "advise/advice.json", "advise/cost_vs_time.png"}
    measured = report["measured"]["models"].values()
    assert all(model["samples_per_epoch"] > 0 and model["params"] > 0 for model in measured)
    assert any(model["train_flops_per_sample"] > 0 for model in measured)  # BPR's gathers count no FLOPs
    assert report["measured"]["phases"] and any(key.startswith("fit/") for key in report["measured"]["phases"])
    assert any(line.startswith("training is ") and "of the run on" in line for line in report["actions"])
    assert_the_facts_are_kept(run, tmp_path)
    assert_the_renting_answer(name, report, capsys, tmp_path)
    if name == "medical":
        assert_a_gpu_run_of_the_preset_calibrates_the_cpu_run(run, capsys)


def assert_the_facts_are_kept(run, tmp_path):
    """`python -m common.tools.keep_facts RUN_ID FILE` keeps the run's facts, as `advise` reads them, with their
    source, and the metrics asked for."""
    from common.advisor.catalog import load_gpus
    from common.advisor.facts import facts_from_run
    from common.tools.keep_facts import main as keep, read_facts

    metric = next(key for key in run.data.metrics if key.startswith("time/"))
    assert keep([run.info.run_id, str(tmp_path / "facts.json"), "--metric", metric, "--note", "a test"]) == 0
    facts, rest = read_facts(tmp_path / "facts.json")
    assert facts == facts_from_run(run, run.data.tags["usecase"], load_gpus())
    assert facts.total_seconds == run.data.metrics["time/total_s"] > 0 and facts.cores == int(run.data.tags["cpu_cores"])
    assert facts.gpu is None and facts.gpu_count == 0 and facts.tf32 is False
    assert facts.precision == run.data.params["runtime.precision"]
    assert rest["source"]["run_id"] == run.info.run_id and rest["source"]["note"] == "a test"
    assert rest["source"]["commit"] and rest["metrics"] == {metric: run.data.metrics[metric]}


def assert_the_renting_answer(name, report, capsys, tmp_path):
    """For the recommended instance: spot with its interruptions, the multi-GPU speed-up as a range, the month of
    serving; a large data set's place on the instance; the budget and the deadline; the launch files."""
    rows = {row["instance"]: row for row in report["rows"]}
    pick = rows[report["recommendations"]["train_cheapest"]]
    assert report["measured"]["data_bytes"] > 0
    assert 0 < pick["spot"]["cost_usd"]["expected"] < pick["run_cost_usd"]["expected"]
    assert any(line.startswith("spot on ") and "interruptions at 0.05 an hour" in line for line in report["actions"])
    assert any(("2 GPUs (" in line or " x " in line) and "with DDP" in line and "x (expected" in line
               for line in report["actions"]), report["actions"]
    assert rows["p4d.24xlarge"]["scaling"]["gpus"] == 8 and rows["p4d.24xlarge"]["scaling"]["paced_by"] == "nvlink3"
    assert any(line.startswith("serving 100 requests/s: ") and "a month" in line for line in report["actions"])
    big = strict_json(advise(capsys, name, "--data-gb", "2000", "--format", "json"))
    big_pick = next(row for row in big["rows"] if row["instance"] == big["recommendations"]["train_cheapest"])
    assert big_pick["data"]["data_gb"] == pytest.approx(2000) and big_pick["data"]["where"]
    data_line = next(line for line in big["actions"] if line.startswith(f"data on {big_pick['instance']}: "))
    assert f"reads {big_pick['data']['needed_gbs'] * 1000:.2g} MB/s of input" in data_line or \
        f"reads {big_pick['data']['needed_gbs']:.2g} GB/s of input" in data_line, data_line
    assert ("data from" in advise(capsys, name, "--data-gb", "2000")) == any(
        row["data"]["matters"] for row in big["rows"] if row["data"])
    cheapest = big_pick["spot"]["cost_usd"]["expected"] if big["pricing"]["train_cheapest"] == "spot" else \
        big_pick["run_cost_usd"]["expected"]
    budget = strict_json(advise(capsys, name, "--data-gb", "2000", "--budget", f"{cheapest / 2}", "--format", "json"))
    assert budget["recommendations"]["train_cheapest"] is None
    assert any(line.startswith("no instance trains within $") for line in budget["actions"])
    hours = (big_pick["spot"]["seconds"]["expected"] if big["pricing"]["train_cheapest"] == "spot" else
             big_pick["run_seconds"]["expected"]) / 3600
    rushed = strict_json(advise(capsys, name, "--data-gb", "2000", "--deadline", f"{hours / 3}", "--format", "json"))
    assert rushed["recommendations"]["train_cheapest"] not in (None, big["recommendations"]["train_cheapest"])
    assert "spot cost per run" in advise(capsys, name)  # spot saves over 20 % somewhere: its column is shown
    table = pd.read_csv(FOLDER / "instances.csv", dtype=str, keep_default_na=False)
    table.iloc[:, :10].to_csv(tmp_path / "on-demand.csv", index=False)  # a catalogue of on-demand prices only
    assert "spot cost per run" not in advise(capsys, name, "--catalog", str(tmp_path / "on-demand.csv"))
    (tmp_path / "a-file").write_text("")
    assert f"--launch {tmp_path / 'a-file'}: cannot be made a folder" in user_error(
        capsys, "advise", name, "--launch", str(tmp_path / "a-file"))
    out = tmp_path / "launch"
    printed = advise(capsys, name, "--launch", str(out))
    assert f"{out / 'sky-task.yaml'}: SkyPilot task" in printed
    task = yaml.safe_load((out / "sky-task.yaml").read_text())
    assert f"usecases run {name} --preset smoke --resume-if-interrupted" in task["run"]
    _, job = kubernetes_objects(list(yaml.safe_load_all((out / "k8s-job.yaml").read_text())))
    assert f"usecases run {name} --preset smoke" in job.spec.template.spec.containers[0].command[-1]


def assert_a_gpu_run_of_the_preset_calibrates_the_cpu_run(cpu_run, capsys):
    """A run of the same preset measured on an A100 (logged here by hand: no GPU on this machine) gives the CPU
    run's estimates their GPU rate and input pipeline: the A100's training rate is then the measured one, within its
    0.7x-1.5x range (MEASURED_SPREAD, the leave-one-model-out envelope)."""
    client = mlflow.MlflowClient()
    facts = {key: value for key, value in cpu_run.data.metrics.items() if key.startswith("model/")}
    name = next(key.split("/")[1] for key in facts)
    gpu_run = client.create_run(cpu_run.info.experiment_id, tags={"device": "cuda", "preset": "smoke",
                                                                    "gpu_name": "NVIDIA A100-SXM4-80GB",
                                                                    "world_size": "1", "cpu_cores": "8"})
    measured_there = {f"model/{name}/train_samples_per_s": 20_000.0, f"model/{name}/loader_samples_per_s": 1e6}
    for key, value in {**facts, **measured_there}.items():
        client.log_metric(gpu_run.info.run_id, key, value)
    client.set_terminated(gpu_run.info.run_id)
    report = strict_json(advise(capsys, "medical", "--run", cpu_run.info.run_id, "--format", "json"))
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
    report = strict_json(advise(capsys, "--workload", str(workload), "--format", "json"))
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
    (tmp_path / "t.json").write_text(json.dumps({"task": "train", "flops_per_sample": 1e9, "bytes_per_sample": 1e6,
                                                 "precision": "amp", "batch_size": 8, "checkpoint_every_s": -2}))
    assert_rejected(capsys, "medical", "advise", "--workload", str(tmp_path / "t.json"),
                    names=("t.json", "checkpoint_every_s must be a number of seconds, 0 or more (got -2)"))
    (tmp_path / "t.json").write_text(json.dumps({"task": "train", "flops_per_sample": 1e9, "bytes_per_sample": 1e6,
                                                 "precision": "amp", "batch_size": 8}))
    assert_rejected(capsys, "medical", "advise", "--workload", str(tmp_path / "t.json"), "--data-gb", "40",
                    names=("--data-gb", "the workload file gives no data_gb"))
    assert_rejected(capsys, "medical", "advise", "medical", "--budget", "lots", names=("--budget", "'lots'"))
    assert_rejected(capsys, "medical", "advise", "medical", "--deadline", "0", names=("--deadline", "positive"))


SKYPILOT_CHECK = """
import sys, yaml, sky
from sky.utils import common_utils, schemas
task = yaml.safe_load(open(sys.argv[1]))
common_utils.validate_schema(task, schemas.get_task_schema(), "Invalid task YAML: ")
resources = {key: value for key, value in task["resources"].items() if key not in ("infra", "instance_type")}
loaded = sky.Task.from_yaml_config({**task, "resources": resources})
print("loaded", loaded.run.strip(), sorted(loaded.envs), list(loaded.resources)[0].use_spot)
"""


@pytest.mark.slow  # installs SkyPilot (about 90 s) into its own environment: its pins clash with this project's
def test_the_launched_skypilot_task_loads_in_skypilot(tmp_path, capsys):
    """SkyPilot's own schema and task loader read the task offline; the instance type and region are checked
    against its online catalogue at launch, so the loader reads the rest without them."""
    import subprocess
    import sys

    venv = tmp_path / "sky"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    install = subprocess.run([str(venv / "bin" / "pip"), "install", "--quiet", "skypilot"], capture_output=True,
                             text=True)
    if install.returncode != 0:
        pytest.skip(f"SkyPilot cannot be installed here: {install.stderr.strip().splitlines()[-1:]}")
    assert main(["run", "finance", "--preset", "smoke"]) == 0
    advise(capsys, "finance", "--launch", str(tmp_path / "out"))
    task = tmp_path / "out" / "sky-task.yaml"
    check = subprocess.run([str(venv / "bin" / "python"), "-c", SKYPILOT_CHECK, str(task)], capture_output=True,
                           text=True, env={"HOME": str(tmp_path), "PATH": "/usr/bin:/bin"}, timeout=300)
    assert check.returncode == 0, check.stderr[-2000:]
    assert "loaded .venv/bin/usecases run finance --preset smoke --resume-if-interrupted" in check.stdout
    assert "MLFLOW_TRACKING_URI" in check.stdout


def test_the_estimates_write_no_file_and_call_no_mlflow(tmp_path, monkeypatch):
    """`advice` only computes: every writer of files and every MLflow call fails here, and the folder it runs in
    stays as it was; `advise_command` then writes the run's report and the launch files, at the edge."""
    import builtins

    from common.advisor.catalog import load_catalogue
    from common.advisor.facts import facts_from_file
    from common.advisor.report import AdviseRequest, advice

    workload = tmp_path / "w.json"
    workload.write_text(json.dumps({"task": "train", "flops_per_sample": 24.3e9, "bytes_per_sample": 3.3e8,
                                    "precision": "amp", "batch_size": 256}))
    gpus, instances = load_catalogue(None)
    facts = facts_from_file(workload, gpus)
    monkeypatch.chdir(tmp_path)
    opened = builtins.open

    def read_only(file, mode="r", *args, **kwargs):
        assert not set(mode) & set("wax+"), f"advice wrote {file}"
        return opened(file, mode, *args, **kwargs)

    def no_mlflow(*args, **kwargs):
        raise AssertionError("advice called MLflow")

    monkeypatch.setattr(builtins, "open", read_only)
    for name in ("start_run", "log_artifact", "log_artifacts", "log_metrics", "log_dict", "set_tags", "log_figure"):
        monkeypatch.setattr(mlflow, name, no_mlflow)
    monkeypatch.setattr(mlflow.MlflowClient, "__init__", no_mlflow)
    report, rows, picks, todo = advice(facts, "a workload", instances, gpus, AdviseRequest(workload=workload))
    assert rows and report["rows"] and report["recommendations"] and todo is not None
    assert sorted(path.name for path in tmp_path.iterdir()) == ["w.json"]
