"""The CLI's contract: help everywhere, exit 2 and one line for user mistakes, no run left RUNNING."""

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import mlflow
import psutil
import pytest
import torch

from common import runner
from common.errors import DataUnavailable
from tests.cli_helpers import in_process, runs, user_error
from tests.common.test_registry import register as register_model
from common.tracking import server
from usecases import cli


@pytest.mark.parametrize("args", [["--help"], ["run", "--help"], ["list", "--help"], ["ui", "--help"],
                                  ["demo", "--help"]])
def test_help(capsys, args):
    result = in_process(capsys, *args)
    assert result.returncode == 0 and "usage: usecases" in result.stdout


def test_list_names_every_use_case_with_its_presets(capsys):
    result = in_process(capsys, "list")
    assert result.returncode == 0
    lines = {line.split()[0]: line for line in result.stdout.splitlines() if line.strip()}
    assert {"finance", "medical", "recsys"} <= set(lines)
    assert "[presets: default, full, million, scale, smoke]" in lines["recsys"]


def test_unknown_use_case(capsys):
    assert "unknown use case 'weather'" in user_error(capsys, "run", "weather")


def test_unknown_config_key(capsys):
    assert "unknown config key 'train.epoch'" in user_error(capsys, "run", "finance", "--preset", "smoke",
                                                            "--set", "train.epoch=3")


def test_wrong_type(capsys):
    assert "config key 'train.epochs'" in user_error(capsys, "run", "finance", "--preset", "smoke",
                                                     "--set", "train.epochs=many")


def test_unknown_preset(capsys):
    assert "no such preset" in user_error(capsys, "run", "finance", "--preset", "huge")


def test_missing_data_path(capsys, tmp_path):
    assert "no such file or folder" in user_error(capsys, "run", "finance", "--data", str(tmp_path / "nope.csv"))


def test_usage_mistakes_are_one_line_too(capsys):
    assert "argument --device: invalid choice: 'tpu'" in user_error(capsys, "run", "finance", "--device", "tpu")
    assert "invalid choice: 'bogus'" in user_error(capsys, "bogus")


def test_an_unwritable_summary_path_is_refused_before_the_run(capsys, tmp_path):
    assert "--summary" in user_error(capsys, "run", "finance", "--preset", "smoke", "--summary",
                                     str(tmp_path / "no" / "s.json"))


def test_a_test_start_that_is_no_date(capsys):
    assert "config key 'evaluation.test_start'" in user_error(capsys, "run", "finance", "--preset", "smoke",
                                                              "--set", "evaluation.test_start=notadate")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu(capsys):
    assert "no CUDA GPU" in user_error(capsys, "run", "finance", "--preset", "smoke", "--device", "cuda")


def test_resume_without_a_checkpoint(capsys):
    assert "no interrupted run" in user_error(capsys, "run", "finance", "--preset", "smoke", "--resume")


def test_user_errors_leave_no_run_behind(capsys):
    user_error(capsys, "run", "finance", "--preset", "smoke", "--set", "train.epoch=3")
    assert "days before the test window" in user_error(capsys, "run", "finance", "--preset", "smoke",
                                                       "--set", "evaluation.test_fraction=0.9")
    assert [run.info.status for run in runs("finance")] == []


def test_ui_serves_the_store_on_loopback_only(tmp_path):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "usecases", "ui", "--port", str(port)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True,
                              env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})  # quick to start
    try:
        deadline, status = time.monotonic() + 90, None
        while time.monotonic() < deadline and server.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                    status = response.status
                    break
            except OSError:
                time.sleep(0.5)
        assert status == 200
        # one worker for one person's store: MLflow's default four took 13 s to start on 2 cores, one 5 s
        assert len(psutil.Process(server.pid).children(recursive=True)) < 4
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        output = server.communicate(timeout=30)[0]
    assert f"http://127.0.0.1:{port}" in output and "0.0.0.0" not in output.split("To allow connections")[0]


def test_demo_falls_back_to_synthetic_data_when_a_data_set_is_missing(monkeypatch, capsys):
    from common.tracking.runs import ensure_experiment

    calls = []

    def fake_run(request):
        calls.append(list(request.overrides))
        if not request.overrides:
            raise DataUnavailable("no copy of the data set here")

    monkeypatch.setattr(runner, "run_usecase", fake_run)
    monkeypatch.setattr(cli, "stop_on_signals", lambda: None)
    finance = ensure_experiment("finance")
    assert cli.main(["demo", "--device", "cpu"]) == 0
    assert calls[:2] == [[], ["data.source=synthetic"]]
    # MLflow 3 opens an experiment's own page on its GenAI Overview: the demo ends with the runs table's address
    assert f"finance: http://127.0.0.1:5000/#/experiments/{finance}/runs" in capsys.readouterr().out


def test_the_cli_imports_no_pandas_before_choosing_the_dataframe_backend():
    code = "import sys, usecases.cli, common.runtime.devices, common.runtime.process; sys.exit('pandas' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def interrupted_state(params_change=None, data_sha256=None):
    """A KILLED smoke run and the run.json it left, with one thing changed since."""
    import json
    from pathlib import Path

    import mlflow

    from common.config import flatten, load_config
    from common.tracking.runs import ensure_experiment
    from usecases import finance
    from usecases.finance.pipeline import load_data

    config = load_config(finance.Config, finance.USECASE.presets_dir, "smoke")
    _, data_tags = load_data(config, None)
    params = {**flatten(config), **(params_change or {})}
    experiment_id = ensure_experiment("finance")  # first: it points MLflow at this test's store
    client = mlflow.MlflowClient()
    run_id = client.create_run(experiment_id, tags={"preset": "smoke"}).info.run_id
    client.set_terminated(run_id, "KILLED")
    folder = Path(os.environ["USECASES_CHECKPOINT_DIR"]) / "finance" / "smoke" / run_id
    folder.mkdir(parents=True)
    data = {**data_tags, "data_sha256": data_sha256 or data_tags["data_sha256"]}
    (folder / "run.json").write_text(json.dumps({"run_id": run_id, "params": params, "data": data}))


def test_resume_refuses_a_changed_config(capsys):
    interrupted_state({"train.epochs": 99})
    assert "config key 'train.epochs' is 15 now but was 99" in user_error(capsys, "run", "finance", "--preset",
                                                                          "smoke", "--resume")


def test_resume_refuses_changed_data(capsys):
    interrupted_state(data_sha256="f" * 64)
    assert "the data (synthetic:seed=7" in user_error(capsys, "run", "finance", "--preset", "smoke", "--resume")


@pytest.mark.parametrize(("old", "new"), [
    (["bench", "recsys", "--serve", "--seconds", "5"], "is now `usecases bench serve recsys --seconds 5`"),
    (["bench", "medical", "--preset", "smoke"], "is now `usecases bench run medical --preset smoke`"),
    (["bench", "finance", "--scale"], "is now `usecases bench scale finance`")])
def test_a_bench_spelled_the_old_way_names_the_new_one(capsys, old, new):
    result = in_process(capsys, *old)
    assert result.returncode == 2 and new in result.stderr and len(result.stderr.splitlines()) == 1


def test_a_use_case_without_a_benchmark_says_so(capsys):
    result = in_process(capsys, "bench", "run", "finance", "--preset", "smoke")
    assert result.returncode == 2 and "use case 'finance' has no benchmark" in result.stderr


def test_serve_for_given_data_names_what_is_missing(capsys):
    short = in_process(capsys, "serve", "finance", "--data-sha256", "abc")
    assert short.returncode == 2 and "at least its first 12 hex digits" in short.stderr
    unknown = in_process(capsys, "serve", "finance", "--data-sha256", "0123456789abcdef")
    assert unknown.returncode == 2 and "no champion of 'finance' on data 0123456789ab" in unknown.stderr


def test_serve_names_the_data_whose_champion_it_serves(monkeypatch, capsys):
    """`usecases serve` after a real-data run and then a smoke run serves the real data's champion, and says so."""
    mlflow.set_tracking_uri(os.environ["MLFLOW_TRACKING_URI"])
    register_model("recsys", 0.3, "3" * 64, source="ml-latest-small")
    register_model("recsys", 0.9, "4" * 64, source="synthetic")
    served = []
    monkeypatch.setattr(os, "execve", lambda path, args, env: served.append(args))
    cli.main(["serve", "recsys", "--mlflow"])
    first = capsys.readouterr().out.splitlines()[0]
    assert "on ml-latest-small (data 333333333333, version 1" in first
    assert served[0][served[0].index("-m", 2) + 1] == "models:/gpu-usecases-recsys@champion"


def test_serve_runs_a_use_cases_own_server_with_a_worker_per_core(monkeypatch, capsys):
    from usecases.recsys import server

    mlflow.set_tracking_uri(os.environ["MLFLOW_TRACKING_URI"])
    register_model("recsys", 0.3, "3" * 64, source="ml-latest-small")
    started = []
    monkeypatch.setattr(server, "serve", lambda settings: started.append(settings) or 0)
    assert cli.main(["serve", "recsys", "--port", "5009"]) == 0
    (settings,) = started
    assert (settings.device, settings.batch_ms) == ("auto", None)  # the server decides: 2 ms on a GPU, off on the CPU
    assert (settings.model_uri, settings.host, settings.port) == ("models:/gpu-usecases-recsys@champion", "127.0.0.1",
                                                                  5009)
    workers, announce = settings.workers, settings.announce
    assert workers == len(os.sched_getaffinity(0)) and settings.events.endswith("recsys-events.db")
    assert "with %d worker(s)" % workers in announce, "said by the server once its store is checked"
    assert "Serving" not in capsys.readouterr().out
    assert cli.main(["serve", "finance", "--workers", "2"]) == 2  # MLflow's server: one line, no traceback
    assert "--workers, --events, --device, --batch-ms, --retrieval and --ann-index need the use case's own server" in capsys.readouterr().err


def server_command(monkeypatch, *args):
    """The `mlflow server` command line `usecases server ARGS` would exec."""
    executed = []
    monkeypatch.setattr(os, "execv", lambda path, argv: executed.append(argv))
    monkeypatch.setattr(server, "check_database", lambda uri, source: None)  # tests/test_team_server.py checks it
    cli.main(["server", *args])
    (argv,) = executed
    options = {flag: value for flag, value in zip(argv, argv[1:]) if flag.startswith("--")}
    return options | {"argv": argv}


def test_server_serves_the_store_mlflow_tracking_uri_names(monkeypatch):
    from pathlib import Path

    served = server_command(monkeypatch)
    store = os.environ["MLFLOW_TRACKING_URI"]
    assert served["--backend-store-uri"] == store
    assert served["--artifacts-destination"] == str(Path(store.removeprefix("sqlite:///")).parent / "artifacts")
    assert "--serve-artifacts" in served["argv"] and served["--host"] == "127.0.0.1"


def test_server_takes_a_store_and_an_artifact_destination(monkeypatch):
    served = server_command(monkeypatch, "--backend-store-uri", "postgresql://mlflow@db/mlflow",
                            "--artifacts-destination", "s3://bucket/mlflow")
    assert served["--backend-store-uri"] == "postgresql://mlflow@db/mlflow"
    assert served["--artifacts-destination"] == "s3://bucket/mlflow"


def test_server_refuses_what_it_cannot_serve(monkeypatch, capsys):
    assert cli.main(["server", "--backend-store-uri", "postgresql://mlflow@db/mlflow"]) == 2
    assert "say where the server keeps artifacts with --artifacts-destination" in capsys.readouterr().err
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    assert cli.main(["server"]) == 2
    assert "MLFLOW_TRACKING_URI http://127.0.0.1:5000 is a tracking server, not a store" in capsys.readouterr().err
