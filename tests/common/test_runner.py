"""The runner: a run is registered when what its use case's `run` returns names a served model, and only then; the
request it is given is one object, checked once, that writes itself back as the `usecases` command line."""

from __future__ import annotations

import importlib
import sys
import textwrap

import mlflow
import pytest

from common import runner, usecase
from common.errors import UserError
from common.usecase import RunRequest

PLUGIN = '''
from common.config import ConfigModel, RuntimeConfig, TrackingConfig
from common.usecase import UseCase


class Config(ConfigModel):
    runtime: RuntimeConfig = RuntimeConfig()
    tracking: TrackingConfig = TrackingConfig()
    returns: str = "served"


USECASE = UseCase.declare(__name__, description="a plug-in for the runner's tests", config=Config,
                          primary_metric=("score", "max"))
'''

PIPELINE = '''
import time

import mlflow

from common.usecase import RunResult, Served


class Constant(mlflow.pyfunc.PythonModel):
    def predict(self, context, model_input: list[str], params=None) -> list[str]:
        return model_input


def load_data(config, path):
    return None, {"data_source": "test:runner", "data_sha256": "1" * 64}


def run(config, data, job):
    models = {"best": {"score": 0.7, "val_score": 0.8}, "other": {"score": 0.6, "val_score": 0.5}}
    with job.phase("fit/best", "device"):
        time.sleep(0.1)  # long enough to be in the phase line
        job.model_done("best", models["best"])
        if job.summary is not None:
            assert '"partial": true' in job.summary.read_text()  # written as soon as the model was done
    if config.returns == "dict":
        return models
    if config.returns == "unserved":
        return RunResult(models)
    info = mlflow.pyfunc.log_model(name="model", python_model=Constant(), pip_requirements=["mlflow"])
    return RunResult(models, Served("best" if config.returns == "served" else "missing", info.model_uri))
'''


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """The use case `runnercases.scored`, importable, whose `run` returns what its `returns` key says."""
    package = tmp_path / "src" / "runnercases" / "scored"
    (package / "presets").mkdir(parents=True)
    (package.parent / "__init__.py").write_text("")
    (package / "__init__.py").write_text(PLUGIN)
    (package / "pipeline.py").write_text(PIPELINE)
    (package / "presets" / "smoke.yaml").write_text(textwrap.dedent("runtime: {cpu_threads: 1}\n"))
    monkeypatch.syspath_prepend(str(package.parent.parent))
    monkeypatch.setattr(usecase, "installed_entry_points", lambda: [])
    yield importlib.import_module("runnercases.scored").USECASE
    for name in [module for module in sys.modules if module.startswith("runnercases")]:
        del sys.modules[name]


def versions(name: str) -> list:
    return mlflow.MlflowClient().search_model_versions(f"name='gpu-usecases-{name}'")


def test_a_run_that_names_its_served_model_is_registered_by_that_models_validation_value(plugin):
    result = runner.run_usecase(RunRequest(plugin, "smoke", device="cpu"))
    (version,) = versions("scored")
    assert version.run_id == result["run_id"] and version.tags["validation_value"] == "0.8"
    run = mlflow.get_run(result["run_id"])
    assert run.data.tags["primary_model"] == "best" and run.data.tags["registry_alias"] == "champion"
    assert run.data.metrics["primary/val_score"] == 0.8 and run.data.metrics["primary/score"] == 0.7


def test_a_run_that_serves_nothing_is_not_registered(plugin):
    result = runner.run_usecase(RunRequest(plugin, "smoke", ["returns=unserved"], device="cpu"))
    assert mlflow.get_run(result["run_id"]).info.status == "FINISHED"
    assert mlflow.MlflowClient().search_registered_models() == []
    assert "registry_model" not in mlflow.get_run(result["run_id"]).data.tags


@pytest.mark.parametrize(("returns", "error", "words"), [
    ("dict", TypeError, "run() returned a dict; expected RunResult"),
    ("misnamed", KeyError, "the served model 'missing' is not among the run's models (best, other)")])
def test_a_run_that_returns_the_wrong_thing_fails_saying_what(plugin, returns, error, words):
    with pytest.raises(error) as failed:
        runner.run_usecase(RunRequest(plugin, "smoke", [f"returns={returns}"], device="cpu"))
    assert words in str(failed.value)
    assert mlflow.search_runs(search_all_experiments=True)["status"].tolist() == ["FAILED"]


@pytest.mark.parametrize(("fields", "words"), [({"device": "tpu"}, "--device tpu: expected one of auto, cpu, cuda"),
                                               ({"frames": "polars"}, "--frames polars: expected one of auto, pandas"),
                                               ({"resume": True, "bench": True}, "a benchmark cannot be resumed")])
def test_a_request_with_a_bad_field_is_one_line(plugin, fields, words):
    with pytest.raises(UserError) as refused:
        RunRequest(plugin, **fields)
    assert words in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize("bench", [False, True])
def test_a_request_written_as_a_command_line_is_read_back_as_the_same_request(plugin, tmp_path, bench):
    from usecases import cli

    request = RunRequest(plugin, "smoke", ["a=1", "b.c=[1, 2]"], "cpu", "pandas", tmp_path / "data.csv",
                         tmp_path / "summary.json", resume=not bench, bench=bench)
    args = cli.parser().parse_args(request.command_line())
    assert (args.command, args.name, args.preset, args.overrides, args.device, args.frames, args.data,
            args.summary, getattr(args, "resume", False)) == \
        ("bench" if bench else "run", "scored", "smoke", ["a=1", "b.c=[1, 2]"], "cpu", "pandas",
         tmp_path / "data.csv", tmp_path / "summary.json", not bench)
    assert RunRequest(plugin).command_line() == ["run", "scored", "--preset", "default"]
    assert request.with_overrides("d=4").overrides == ("a=1", "b.c=[1, 2]", "d=4")


def test_the_demo_runs_each_use_case_on_its_default_preset_and_falls_back_to_synthetic_data(plugin, monkeypatch):
    from common.errors import DataUnavailable

    requests = []

    def run_usecase(request):
        requests.append(request)
        if len(requests) == 1:
            raise DataUnavailable("no copy here")

    monkeypatch.setattr(runner, "run_usecase", run_usecase)
    runner.run_demo([plugin], device="cpu", frames="pandas")
    assert [request.overrides for request in requests] == [(), ("data.source=synthetic",)]
    assert {(request.preset, request.device, request.frames) for request in requests} == {("default", "cpu", "pandas")}



def test_a_run_says_where_its_time_went_and_how_it_took_determinism(plugin, capsys, tmp_path):
    summary = tmp_path / "summary.json"
    runner.run_usecase(RunRequest(plugin, "smoke", device="cpu", summary=summary))
    printed = capsys.readouterr().out.splitlines()
    assert printed[-1].startswith("time: ") and " in all — " in printed[-1] and "fit/best" in printed[-1]
    assert printed[-1].count("%") >= 2 and printed[-1].endswith("%)")
    (run,) = mlflow.search_runs(experiment_names=["gpu-usecases-scored"], output_format="list")
    assert {"time/data_s", "time/fit/best_s", "time/logging_s", "time/total_s"} <= set(run.data.metrics)
    assert run.data.tags["time_phases"] == '{"data": "serial", "fit/best": "device", "logging": "serial"}'
    assert (run.data.tags["deterministic"], run.data.tags["cudnn_benchmark"]) == ("true", "false"), \
        "runtime.deterministic auto is deterministic on a CPU"
    assert '"partial"' not in summary.read_text(), "the run's own summary replaces the partial one"
