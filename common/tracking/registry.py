"""The model registry: each run's model is a version of `gpu-usecases-<usecase>` (`-<kind>` for a use case's other
kinds of model, such as a whole-slide model beside an image classifier: a champion never changes kind), and aliases
name the champion of each data set, the champion of the real data trained on last (`champion`) and of the synthetic
data trained on last (`champion-synthetic`), and the latest challenger. Versions compete on their validation value."""

import logging
import math
from dataclasses import dataclass

import mlflow

from common.errors import UserError
from common.tracking.runs import EXPERIMENT_PREFIX, Tracker, is_unique_violation

log = logging.getLogger(__name__)


def registered_name(usecase: str, kind: str = "") -> str:
    """`gpu-usecases-<usecase>`, and `-<kind>` for a use case's other kinds of model (`Served.kind`)."""
    return f"{EXPERIMENT_PREFIX}-{usecase}" + (f"-{kind}" if kind else "")


def data_alias(data_sha256: str) -> str:
    """The alias of the champion on one data set: `champion-` and the first 12 hex digits of its SHA-256."""
    return f"champion-{data_sha256[:12]}"


@dataclass(frozen=True)
class Candidate:
    """A run's model offered to the registry: where it is, the use case and kind of model it is, the primary metric
    and which way is better (`mode`), its value on validation (what competes) and on test (a report), and the data it
    was trained on (a source starting with `synthetic` is synthetic data)."""

    model_uri: str
    usecase: str
    metric: str
    mode: str
    value: float
    data_sha256: str
    test_value: float = math.nan
    data_source: str = ""
    kind: str = ""

    @property
    def synthetic(self) -> bool:
        return self.data_source.startswith("synthetic")


def register_champion(tracker: Tracker, candidate: Candidate) -> str:
    """Register the candidate as a new version of `gpu-usecases-<usecase>` and compare it with the
    models on the same data and primary metric only, by `value`, the metric on validation data (`test_value`, on
    test data, is a report: choosing by it would make the test set a selection set). The best of every version
    registered on this data under this metric on validation (the earlier on a tie; a version chosen by another
    metric, or on test data before selection moved to validation, does not compete) takes the alias
    `champion-<sha12>`; the run's model is the champion when that is it, else the `challenger`.

    `champion` then points at the champion of this run's data, so `usecases serve` serves the best model for the
    data trained on last; a run on `synthetic` data (CI, a quick check) moves `champion-synthetic` instead, never
    `champion`, whose users' ids a synthetic model would answer with its own. Returns champion or challenger; the
    decision and the values go to the run.

    The best is looked up among all the versions, not taken from the alias, and looked up again after the aliases
    are written, so that runs finishing at the same moment agree on the best of them."""
    metric, mode, value, data_sha256 = candidate.metric, candidate.mode, candidate.value, candidate.data_sha256
    client = mlflow.MlflowClient()
    name = registered_name(candidate.usecase, candidate.kind)
    version = str(mlflow.register_model(candidate.model_uri, name).version)
    for key, tag in (("primary_metric", metric), ("validation_value", value), ("primary_value", candidate.test_value),
                     ("data_sha256", data_sha256), ("data_source", candidate.data_source),
                     ("run_id", tracker.run_id)):
        client.set_model_version_tag(name, version, key, str(tag))
    same_data = data_alias(data_sha256)
    before = _version_by_alias(client, name, same_data)
    if before is not None and (before.tags.get("primary_metric") != metric or "validation_value" not in before.tags):
        before = None
    champion_value = _validation_value(before)
    best = _best_on(client, name, data_sha256, metric, mode) or version
    latest = SYNTHETIC_ALIAS if candidate.synthetic else "champion"
    for _ in range(ALIAS_ATTEMPTS):
        _set_alias(client, name, same_data, best)
        if best != version:
            _set_alias(client, name, "challenger", version)
        _set_alias(client, name, latest, best)
        now = _best_on(client, name, data_sha256, metric, mode) or version
        if now == best:  # else a version registered meanwhile is better: write again
            break
        best = now
    alias = "champion" if best == version else "challenger"
    tracker.set_tags({"registry_model": name, "registry_version": version, "registry_alias": alias,
                      "registry_data_alias": same_data,
                      "registry_champion_version": before.version if before else "none"})
    tracker.log_metrics({f"registry/new_val_{metric}": value, f"registry/champion_val_{metric}": champion_value})
    log.info("registry: %s version %s is the %s on its data (validation %s %.4f; champion before: %s)", name,
             version, alias, metric, value, f"{champion_value:.4f}" if before else "none")
    return alias


ALIAS_ATTEMPTS = 5
SYNTHETIC_ALIAS = "champion-synthetic"  # the champion of the synthetic data trained on last


def _best_on(client, name: str, data_sha256: str, metric: str, mode: str) -> str | None:
    """The version with the best validation value among those registered on this data under this primary metric
    (NaN last, the earliest on a tie)."""
    versions = [found for found in client.search_model_versions(f"name='{name}'")
                if found.tags.get("data_sha256") == data_sha256 and found.tags.get("primary_metric") == metric
                and "validation_value" in found.tags]

    def rank(found) -> tuple:
        value = _validation_value(found)
        return math.isnan(value), -value if mode == "max" else value, int(found.version)

    return str(min(versions, key=rank).version) if versions else None


def _version_by_alias(client, name: str, alias: str):
    from mlflow.exceptions import MlflowException

    try:
        return client.get_model_version_by_alias(name, alias)
    except MlflowException as exc:
        if "not found" not in str(exc):  # only a missing alias means no champion; an unreachable store is an error
            raise
        return None


def _validation_value(model_version) -> float:
    return float(model_version.tags.get("validation_value", "nan")) if model_version else math.nan


def served_champion(client, usecase: str, data_sha256: str | None = None, kinds: tuple[str, ...] = ("",)):
    """The version `usecases serve` serves (its `name` says which registered model), and the alias it found it by:
    the champion on the given data, whatever its kind; else, kind by kind in `kinds`' order, the champion of the real
    data trained on last, else (before any run on real data) that of the synthetic data; None when there is none."""
    aliases = [data_alias(data_sha256)] if data_sha256 else ["champion", SYNTHETIC_ALIAS]
    for kind in kinds:
        for alias in aliases:
            found = _version_by_alias(client, registered_name(usecase, kind), alias)
            if found is not None:
                return found, alias
    return None


def _set_alias(client, name: str, alias: str, version) -> None:
    """Set an alias; two processes inserting the same new alias at once make the store refuse the second, and set
    again it is an update."""
    from mlflow.exceptions import MlflowException

    try:
        client.set_registered_model_alias(name, alias, version)
    except MlflowException as exc:
        if not is_unique_violation(exc):
            raise
        client.set_registered_model_alias(name, alias, version)


def served_model(usecase, model_uri: str | None, data_sha256: str | None = None) -> tuple[str, str]:
    """The model `usecases serve` serves (`model_uri`, else the use case's champion on the data trained on last or
    on `data_sha256`), and how to name it in one line; the tracking store is checked first."""
    from common.tracking.stores import check_reachable, tracking_uri

    uri = tracking_uri()
    check_reachable(uri)
    mlflow.set_tracking_uri(uri)
    if model_uri is not None:
        return model_uri, model_uri
    if data_sha256 is not None and len(data_sha256) < 12:
        raise UserError(f"--data-sha256 {data_sha256}: give at least its first 12 hex digits")
    found = served_champion(mlflow.MlflowClient(), usecase.name, data_sha256, usecase.served_kinds)
    if found is None:
        on = f" on data {data_sha256[:12]}" if data_sha256 else ""
        raise UserError(f"no champion of '{usecase.name}'{on} in {uri} yet (run `usecases run {usecase.name}` "
                        f"first, or pass --model-uri)")
    version, alias = found
    model_uri = f"models:/{version.name}@{alias}"
    source = version.tags.get("data_source") or "data"
    fallback = "no run on real data has registered a model yet; " if alias == SYNTHETIC_ALIAS else ""
    return model_uri, (f"the champion of '{usecase.name}' on {source} ({fallback}data "
                       f"{version.tags.get('data_sha256', '?')[:12]}, version {version.version}, {model_uri})")
