"""The model registry: each run's model is a version of `gpu-usecases-<usecase>[-<kind>]`, and aliases name the
champion of each data set, of the real data trained on last (`champion`), of the synthetic data trained on last
(`champion-synthetic`), and the latest challenger. Versions compete on their validation value."""

import logging
import math
from dataclasses import dataclass

import mlflow
from mlflow.exceptions import MlflowException

from common.errors import UserError
from common.tracking.runs import EXPERIMENT_PREFIX, Tracker, again_if_raced

log = logging.getLogger(__name__)


def registered_name(usecase: str, kind: str = "") -> str:
    """`-<kind>` for a use case's other kinds of model (`Served.kind`): a champion never changes kind."""
    return f"{EXPERIMENT_PREFIX}-{usecase}" + (f"-{kind}" if kind else "")


def data_alias(data_sha256: str) -> str:
    return f"champion-{data_sha256[:12]}"


@dataclass(frozen=True)
class Candidate:
    """A model offered to the registry: `value` its validation primary metric (what competes), `test_value` on test."""

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
    """Register the candidate as a new version; the best of the versions on its data and primary metric by validation
    value (by test, the test set would become a selection set; the earlier on a tie) takes `champion-<sha12>` and
    `champion` (`champion-synthetic` on synthetic data). Returns champion or challenger. The best is looked up again
    after the aliases are written, so that runs finishing at the same moment agree on it."""
    metric, mode, value, data_sha256 = candidate.metric, candidate.mode, candidate.value, candidate.data_sha256
    client = mlflow.MlflowClient()
    name = registered_name(candidate.usecase, candidate.kind)
    tags = {"primary_metric": metric, "validation_value": value, "primary_value": candidate.test_value,
            "data_sha256": data_sha256, "data_source": candidate.data_source, "run_id": tracker.run_id}
    registered = mlflow.register_model(candidate.model_uri, name, tags={key: str(tag) for key, tag in tags.items()})
    version = str(registered.version)
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
    """The best version by validation value on this data under this primary metric (NaN last, earliest on a tie)."""
    versions = [found for found in client.search_model_versions(f"name='{name}'")
                if found.tags.get("data_sha256") == data_sha256 and found.tags.get("primary_metric") == metric
                and "validation_value" in found.tags]

    def rank(found) -> tuple:
        value = _validation_value(found)
        return math.isnan(value), -value if mode == "max" else value, int(found.version)

    return str(min(versions, key=rank).version) if versions else None


def _version_by_alias(client, name: str, alias: str):
    try:
        return client.get_model_version_by_alias(name, alias)
    except MlflowException as exc:
        if "not found" not in str(exc):  # only a missing alias means no champion; an unreachable store is an error
            raise
        return None


def _validation_value(model_version) -> float:
    return float(model_version.tags.get("validation_value", "nan")) if model_version else math.nan


def served_champion(client, usecase: str, data_sha256: str | None = None, kinds: tuple[str, ...] = ("",)):
    """The version `usecases serve` serves and the alias it found it by: the champion on the given data; else, kind
    by kind, the champion of the real data trained on last, else that of the synthetic data; None when there is none."""
    aliases = [data_alias(data_sha256)] if data_sha256 else ["champion", SYNTHETIC_ALIAS]
    for kind in kinds:
        for alias in aliases:
            found = _version_by_alias(client, registered_name(usecase, kind), alias)
            if found is not None:
                return found, alias
    return None


def _set_alias(client, name: str, alias: str, version) -> None:
    """Two processes inserting one new alias at once make the store refuse the second: an update when set again."""
    again_if_raced(client.set_registered_model_alias, name, alias, version)


def served_model(usecase, model_uri: str | None, data_sha256: str | None = None) -> tuple[str, str]:
    """The model `usecases serve` serves (`model_uri`, else the use case's champion), and its name in one line."""
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
