"""The model registry: each run's model is a version of `gpu-usecases-<usecase>`, and aliases name the champion
of each data set, the champion of the data trained on last, and the latest challenger."""

import logging
import math

import mlflow

from common.tracking import EXPERIMENT_PREFIX, Tracker

log = logging.getLogger(__name__)


def registered_name(usecase: str) -> str:
    return f"{EXPERIMENT_PREFIX}-{usecase}"


def data_alias(data_sha256: str) -> str:
    """The alias of the champion on one data set: `champion-` and the first 12 hex digits of its SHA-256."""
    return f"champion-{data_sha256[:12]}"


def register_champion(tracker: Tracker, usecase: str, metric: str, mode: str, value: float,
                      data_sha256: str) -> str:
    """Register the run's model as a new version of `gpu-usecases-<usecase>` and compare it with the champion on the
    same data only (the version aliased `champion-<sha12>`): it takes that alias when it is better or the first,
    else it is the `challenger`. `champion` then points at the champion of this run's data, so `usecases serve`
    serves the best model for the data trained on last, and `--data-sha256` any other. Returns champion or
    challenger; the decision and both values go to the run."""
    client = mlflow.MlflowClient()
    name = registered_name(usecase)
    version = mlflow.register_model(tracker.model_uri, name).version
    for key, tag in (("primary_metric", metric), ("primary_value", value), ("data_sha256", data_sha256),
                     ("run_id", tracker.run_id)):
        client.set_model_version_tag(name, version, key, str(tag))
    same_data = data_alias(data_sha256)
    before = _version_by_alias(client, name, same_data)
    champion_value = _primary_value(before)
    holder = before
    for _ in range(_ALIAS_ATTEMPTS):
        if holder is not None and (str(holder.version) == str(version)
                                   or not _better(value, _primary_value(holder), mode)):
            break
        # Runs finishing together on the same data each read the old champion and set the alias, and the last write
        # wins: read it back, and compare again with whichever version took it in between.
        _set_alias(client, name, same_data, version)
        holder = _version_by_alias(client, name, same_data)
    won = holder is None or str(holder.version) == str(version)
    alias = "champion" if won else "challenger"
    if not won:
        _set_alias(client, name, "challenger", version)
    _set_alias(client, name, "champion", version if won else holder.version)
    tracker.set_tags({"registry_model": name, "registry_version": version, "registry_alias": alias,
                      "registry_data_alias": same_data,
                      "registry_champion_version": before.version if before else "none"})
    tracker.log_metrics({f"registry/new_{metric}": value, f"registry/champion_{metric}": champion_value})
    log.info("registry: %s version %s is the %s on its data (%s %.4f; champion before: %s)", name, version, alias,
             metric, value, f"{champion_value:.4f}" if before else "none")
    return alias


_ALIAS_ATTEMPTS = 5


def _version_by_alias(client, name: str, alias: str):
    from mlflow.exceptions import MlflowException

    try:
        return client.get_model_version_by_alias(name, alias)
    except MlflowException:
        return None


def _primary_value(model_version) -> float:
    return float(model_version.tags.get("primary_value", "nan")) if model_version else math.nan


def _better(value: float, other: float, mode: str) -> bool:
    return value < other if mode == "min" else value > other


def _set_alias(client, name: str, alias: str, version) -> None:
    """Set an alias; two processes inserting the same new alias at once make the store refuse the second (UNIQUE
    constraint), and set again it is an update."""
    from mlflow.exceptions import MlflowException

    try:
        client.set_registered_model_alias(name, alias, version)
    except MlflowException as exc:
        if "UNIQUE constraint" not in str(exc):
            raise
        client.set_registered_model_alias(name, alias, version)
