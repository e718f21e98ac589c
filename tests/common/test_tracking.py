"""`tracked_run` and `write_summary` against a throwaway SQLite store in tmp_path.

Every run must end FINISHED, FAILED or KILLED, and only the main rank may write.
"""

from __future__ import annotations

import json
import math

import mlflow
import pytest

from common.config import ConfigModel, flatten
from common.runner import write_summary
from common.runtime.interrupt import Terminated
from common.tracking.runs import Tracker, experiment_name, git_commit, tracked_run

USECASE = "unit"


class Train(ConfigModel):
    epochs: int = 3
    sizes: list[int] = [4, 8]
    clip: float | None = None


class Config(ConfigModel):
    name: str = "demo"
    train: Train = Train()


@pytest.fixture
def client(tmp_path, monkeypatch):
    """A client on a store of this test only; no run may outlive the test."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    yield mlflow.MlflowClient(tracking_uri=uri)
    while mlflow.active_run() is not None:
        mlflow.end_run()
    mlflow.set_tracking_uri(None)


def status(client, run_id):
    return client.get_run(run_id).info.status


def download(run_id, artifact, tmp_path):
    path = mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path=artifact, dst_path=str(tmp_path / "dl"))
    with open(path) as handle:
        return json.load(handle)


def all_runs(client):
    experiments = [experiment.experiment_id for experiment in client.search_experiments()]
    return client.search_runs(experiments) if experiments else []


def test_new_run_has_tags_params_and_config(client, tmp_path):
    config = Config(train=Train(clip=0.5))
    with tracked_run(USECASE, config, {"preset": "smoke", "world_size": 1}, run_name="unit-smoke") as tracker:
        assert mlflow.active_run().info.run_id == tracker.run_id
    run = client.get_run(tracker.run_id)
    assert run.info.artifact_uri.startswith((tmp_path / "artifacts").as_uri()), "must not write the project's store"
    assert client.get_experiment(run.info.experiment_id).name == experiment_name(USECASE)
    assert run.info.run_name == "unit-smoke"
    tags = run.data.tags
    assert tags["usecase"] == USECASE and tags["git_commit"] == git_commit()
    assert tags["preset"] == "smoke" and tags["world_size"] == "1"
    assert run.data.params == {key: str(value) for key, value in flatten(config).items()}
    assert run.data.params["train.clip"] == "0.5" and run.data.params["train.sizes"] == "[4, 8]"
    assert download(tracker.run_id, "config.json", tmp_path) == config.model_dump(mode="json")


def test_normal_exit_finishes_the_run(client):
    with tracked_run(USECASE, Config(), {}) as tracker:
        pass
    assert status(client, tracker.run_id) == "FINISHED"
    assert mlflow.active_run() is None


def test_exception_fails_the_run_and_propagates(client):
    with pytest.raises(ValueError, match="boom"):
        with tracked_run(USECASE, Config(), {}) as tracker:
            raise ValueError("boom")
    assert status(client, tracker.run_id) == "FAILED"
    assert mlflow.active_run() is None


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, Terminated])
def test_interrupt_kills_the_run_and_propagates(client, interrupt):
    with pytest.raises(interrupt):
        with tracked_run(USECASE, Config(), {}) as tracker:
            raise interrupt()
    assert status(client, tracker.run_id) == "KILLED"
    assert mlflow.active_run() is None


def test_other_ranks_get_a_silent_tracker(client):
    """Rank > 0 must neither create a run nor start one implicitly through a logging call."""
    with tracked_run(USECASE, Config(), {"preset": "smoke"}, is_main=False) as tracker:
        assert not tracker.active and tracker.run_id is None
        tracker.log_metrics({"loss": 1.0}, step=0)
        tracker.set_tags({"a": 1})
        tracker.log_dict({"a": 1}, "a.json")
        tracker.log_text("hello", "a.txt")
        assert mlflow.active_run() is None
    assert client.get_experiment_by_name(experiment_name(USECASE)) is None
    assert all_runs(client) == []


def test_reopening_by_run_id_continues_the_same_run(client):
    """As `--resume` does after Ctrl-C: same run, its metrics continued, and FINISHED at the end."""
    config = Config()
    with pytest.raises(KeyboardInterrupt):
        with tracked_run(USECASE, config, {"preset": "smoke"}, run_name="unit-smoke") as first:
            first.log_metrics({"train/loss": 2.0}, step=0)
            raise KeyboardInterrupt
    with tracked_run(USECASE, config, {"preset": "smoke"}, run_id=first.run_id, run_name="unit-smoke") as second:
        assert second.run_id == first.run_id
        second.log_metrics({"train/loss": 1.0}, step=1)
    run = client.get_run(first.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags["resumed"] == "true" and run.data.tags["usecase"] == USECASE
    assert run.data.params == {key: str(value) for key, value in flatten(config).items()}
    history = client.get_metric_history(first.run_id, "train/loss")
    assert sorted((metric.step, metric.value) for metric in history) == [(0, 2.0), (1, 1.0)]
    assert [run.info.run_id for run in all_runs(client)] == [first.run_id]


def test_write_summary_artifact_file_and_metrics(client, tmp_path):
    models = {"har": {"qlike": 0.25, "mse": 1.5}, "lstm": {"qlike": 0.2, "mse": float("nan")}}
    target = tmp_path / "out" / "summary.json"
    with tracked_run(USECASE, Config(), {}) as tracker:
        returned = write_summary(tracker, USECASE, "smoke", "cpu", models, target)
    expected_keys = {"usecase", "run_id", "preset", "device", "models"}
    written = json.loads(target.read_text())
    assert set(written) == expected_keys
    assert (written["usecase"], written["run_id"], written["preset"], written["device"]) == (
        USECASE, tracker.run_id, "smoke", "cpu")
    assert written["models"]["har"] == models["har"] and math.isnan(written["models"]["lstm"]["mse"])
    assert set(returned) == expected_keys and returned["run_id"] == tracker.run_id
    artifact = download(tracker.run_id, "summary.json", tmp_path)
    assert set(artifact) == expected_keys and artifact["models"]["har"] == models["har"]
    assert list(tmp_path.joinpath("out").iterdir()) == [target], "no temporary file left beside the summary"
    metrics = client.get_run(tracker.run_id).data.metrics
    assert metrics == {"test/har/qlike": 0.25, "test/har/mse": 1.5, "test/lstm/qlike": 0.2}


def test_write_summary_prints_a_table(capsys):
    write_summary(Tracker(active=False), USECASE, "smoke", "cpu", {"har": {"qlike": 0.25}})
    out = capsys.readouterr().out
    assert "qlike" in out and "0.2500" in out and "har" in out


def test_log_metrics_drops_nan_and_none(client):
    with tracked_run(USECASE, Config(), {}) as tracker:
        tracker.log_metrics({"val/loss": 0.5, "val/nan": float("nan"), "val/none": None}, step=3)
    run = client.get_run(tracker.run_id)
    assert run.data.metrics == {"val/loss": 0.5}
    assert [metric.step for metric in client.get_metric_history(tracker.run_id, "val/loss")] == [3]


def test_a_dataset_two_runs_insert_at_once_is_linked_on_the_second_try(monkeypatch):
    from common.tracking import runs as tracking

    calls = []

    def log_input(dataset, context):
        calls.append(dataset.digest)
        if len(calls) == 1:
            raise mlflow.exceptions.MlflowException("(sqlite3.IntegrityError) UNIQUE constraint failed: datasets")

    monkeypatch.setattr(tracking.mlflow, "log_input", log_input)
    tracking.log_dataset({"data_source": "synthetic:seed=1", "data_sha256": "b" * 64})
    assert calls == ["b" * 12] * 2
