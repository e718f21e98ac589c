"""The registry's champion and challenger aliases, against a throwaway SQLite store, including runs that register
at the same moment."""

from __future__ import annotations

import os

import mlflow

from common.tracking import registry
from common.tracking.runs import Tracker


class Constant(mlflow.pyfunc.PythonModel):
    def predict(self, context, model_input: list[str], params=None) -> list[str]:
        return model_input


def register(usecase: str, value: float, data: str, metric: str = "auc", test_value: float = 0.5,
             source: str = "real", kind: str = "") -> tuple[str, str]:
    """Register a model whose primary metric is `value` on validation data and `test_value` on test data."""
    with mlflow.start_run(nested=mlflow.active_run() is not None) as run:
        # requirements given: MLflow's inference of them would take seconds a model
        info = mlflow.pyfunc.log_model(name="model", python_model=Constant(), pip_requirements=["mlflow"])
        tracker = Tracker(active=True, run_id=run.info.run_id)
        alias = registry.register_champion(tracker, registry.Candidate(info.model_uri, usecase, metric, "max", value,
                                                                       data, test_value, source, kind))
    return alias, mlflow.MlflowClient().get_registered_model(registry.registered_name(usecase, kind)).aliases


def test_champions_are_compared_on_the_same_data_only_and_champion_follows_the_last_data():
    mlflow.set_tracking_uri(os.environ["MLFLOW_TRACKING_URI"])
    a, b = "a" * 64, "b" * 64
    assert register("registry", 0.80, a)[0] == "champion"
    alias, aliases = register("registry", 0.70, b)  # worse than A's, but on other data: B's first model
    assert alias == "champion" and aliases["champion"] == aliases[f"champion-{'b' * 12}"] == 2
    alias, aliases = register("registry", 0.75, a)  # worse than A's champion: a challenger there
    assert alias == "challenger" and aliases["challenger"] == 3
    assert aliases[f"champion-{'a' * 12}"] == aliases["champion"] == 1  # champion: the best on the data just used
    alias, aliases = register("registry", 0.90, a)
    assert alias == "champion" and aliases["champion"] == aliases[f"champion-{'a' * 12}"] == 4
    assert aliases[f"champion-{'b' * 12}"] == 2


def test_a_champion_chosen_by_another_primary_metric_does_not_compete():
    """A use case that changes its primary metric compares the new runs with each other, not with a value of the
    old metric."""
    mlflow.set_tracking_uri(os.environ["MLFLOW_TRACKING_URI"])
    a = "c" * 64
    assert register("switched", 0.95, a, metric="old_score")[0] == "champion"
    alias, aliases = register("switched", 0.60, a)
    assert alias == "champion" and aliases["champion"] == 2
    assert register("switched", 0.50, a)[0] == "challenger"


def test_versions_compete_on_validation_and_the_test_value_is_a_report():
    mlflow.set_tracking_uri(os.environ["MLFLOW_TRACKING_URI"])
    a = "d" * 64
    assert register("selection", 0.80, a, test_value=0.70)[0] == "champion"
    alias, aliases = register("selection", 0.75, a, test_value=0.99)  # better on test, worse on validation
    assert alias == "challenger" and aliases["champion"] == 1
    champion = mlflow.MlflowClient().get_model_version_by_alias("gpu-usecases-selection", "champion")
    assert (champion.tags["validation_value"], champion.tags["primary_value"]) == ("0.8", "0.7")


def test_a_version_selected_on_test_data_before_does_not_compete():
    mlflow.set_tracking_uri(os.environ["MLFLOW_TRACKING_URI"])
    a = "e" * 64
    register("legacy", 0.99, a)
    client = mlflow.MlflowClient()
    client.delete_model_version_tag("gpu-usecases-legacy", "1", "validation_value")  # as registered before
    assert register("legacy", 0.60, a)[0] == "champion"


def test_a_run_on_synthetic_data_never_moves_the_champion_of_real_data():
    """A smoke run (CI, a quick check) after a real-data run: `champion` stays on the real data's model, and the
    synthetic model is the champion of its own data and `champion-synthetic`."""
    mlflow.set_tracking_uri(os.environ["MLFLOW_TRACKING_URI"])
    client = mlflow.MlflowClient()
    assert registry.served_champion(client, "synthetic-after") is None
    register("synthetic-after", 0.5, "f" * 64, source="synthetic")
    version, alias = registry.served_champion(client, "synthetic-after")  # before any real data: the synthetic one
    assert (int(version.version), alias) == (1, "champion-synthetic")
    register("synthetic-after", 0.7, "1" * 64, source="ml-latest-small")
    alias, aliases = register("synthetic-after", 0.9, "2" * 64, source="synthetic")
    assert alias == "champion" and aliases["champion"] == 2 and aliases["champion-synthetic"] == 3
    assert aliases[f"champion-{'2' * 12}"] == 3
    version, alias = registry.served_champion(client, "synthetic-after")
    assert (int(version.version), version.tags["data_source"], alias) == (2, "ml-latest-small", "champion")


def _racing(monkeypatch, usecase: str, rival_value: float):
    """Make another run register and set its aliases just after this run first sets the data alias, as a run
    finishing at the same moment does."""
    set_alias = registry._set_alias

    def racing(client, name, alias, version):
        set_alias(client, name, alias, version)
        if alias.startswith("champion-") and not racing.done:
            racing.done = True
            monkeypatch.setattr(registry, "_set_alias", set_alias)
            register(usecase, rival_value, "a" * 64)

    racing.done = False
    monkeypatch.setattr(registry, "_set_alias", racing)


def test_a_better_run_registered_at_the_same_moment_becomes_the_champion(monkeypatch):
    mlflow.set_tracking_uri(os.environ["MLFLOW_TRACKING_URI"])
    _racing(monkeypatch, "race-better", rival_value=0.95)
    alias, aliases = register("race-better", 0.80, "a" * 64)  # version 1; version 2 (0.95) registers meanwhile
    assert alias == "challenger"
    assert aliases[f"champion-{'a' * 12}"] == aliases["champion"] == 2 and aliases["challenger"] == 1


def test_a_worse_run_that_takes_the_alias_at_the_same_moment_gives_it_back(monkeypatch):
    mlflow.set_tracking_uri(os.environ["MLFLOW_TRACKING_URI"])
    _racing(monkeypatch, "race-worse", rival_value=0.60)
    alias, aliases = register("race-worse", 0.80, "a" * 64)  # version 2 (0.60) overwrites the alias meanwhile
    assert alias == "champion"
    assert aliases[f"champion-{'a' * 12}"] == aliases["champion"] == 1


def test_an_alias_two_runs_insert_at_once_is_set_on_the_second_try(monkeypatch):
    client = mlflow.MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    calls = []

    def set_registered_model_alias(name, alias, version):
        calls.append((name, alias, version))
        if len(calls) == 1:
            raise mlflow.exceptions.MlflowException(
                "(sqlite3.IntegrityError) UNIQUE constraint failed: registered_model_aliases.workspace")

    monkeypatch.setattr(client, "set_registered_model_alias", set_registered_model_alias)
    registry._set_alias(client, "gpu-usecases-x", "champion", 3)
    assert calls == [("gpu-usecases-x", "champion", 3)] * 2


def test_each_kind_of_model_has_its_own_champion_and_serve_prefers_the_first_kind():
    """A use case serving two kinds of model (images, then whole slides): each kind is its own registered
    model, so a slide model trained last never becomes the champion an image client is served; `usecases serve`
    takes the first kind's champion, the next kind's where the first has none, and any kind's by its data."""
    mlflow.set_tracking_uri(os.environ["MLFLOW_TRACKING_URI"])
    client = mlflow.MlflowClient()
    kinds = ("", "slides")
    register("two-kinds", 0.8, "3" * 64, source="synthetic", kind="slides")
    version, alias = registry.served_champion(client, "two-kinds", kinds=kinds)  # no image model yet: the slides'
    assert (version.name, alias) == ("gpu-usecases-two-kinds-slides", "champion-synthetic")
    register("two-kinds", 0.7, "4" * 64, source="synthetic")
    register("two-kinds", 0.9, "5" * 64, source="real slides", kind="slides")  # trained last, real data
    version, alias = registry.served_champion(client, "two-kinds", kinds=kinds)
    assert (version.name, alias) == ("gpu-usecases-two-kinds", "champion-synthetic")
    version, alias = registry.served_champion(client, "two-kinds", "5" * 12, kinds=kinds)
    assert (version.name, alias) == ("gpu-usecases-two-kinds-slides", f"champion-{'5' * 12}")
    assert "champion" not in client.get_registered_model("gpu-usecases-two-kinds").aliases
