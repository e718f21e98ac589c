"""A server that follows its registered alias: started on `models:/NAME@ALIAS` (the `champion`), each worker asks the
registry every `FOLLOW_S` which version the alias names, loads a new one beside the one it serves, and swaps it in
between two requests (the requests in flight finish on the old one: none is dropped). Every answer names the version
it came from (`X-Model-Version: NAME/VERSION`); `/version` keeps MLflow's meaning (its own version)."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable
from typing import Any, NamedTuple

log = logging.getLogger(__name__)

FOLLOW_S = 10.0  # how often a worker asks the registry where its alias points
VERSION_HEADER = "X-Model-Version"
ALIASED = re.compile(r"^models:/(?P<name>[^/@]+)@(?P<alias>[^/@]+)$")
NUMBERED = re.compile(r"^models:/(?P<name>[^/@]+)/(?P<version>\d+)$")


class ServedVersion(NamedTuple):
    """What a server serves: the registered model's name and version (None for a run's model), the URI that loads
    exactly that version, and the alias it follows (None: it serves what it was started on)."""

    name: str | None
    version: str | None
    uri: str
    alias: str | None = None

    @property
    def header(self) -> str:
        return f"{self.name}/{self.version}" if self.name else self.uri


def resolve_version(model_uri: str) -> ServedVersion:
    """The version `model_uri` names now: an alias looked up in the registry, a number as it is."""
    if aliased := ALIASED.match(model_uri):
        from mlflow import MlflowClient

        name, alias = aliased["name"], aliased["alias"]
        version = str(MlflowClient().get_model_version_by_alias(name, alias).version)
        return ServedVersion(name, version, f"models:/{name}/{version}", alias)
    if numbered := NUMBERED.match(model_uri):
        return ServedVersion(numbered["name"], numbered["version"], model_uri)
    return ServedVersion(None, None, model_uri)


async def follow_alias(current: ServedVersion, load: Callable[[str], Any],
                       swap: Callable[[Any, ServedVersion], None], every_s: float = FOLLOW_S) -> None:
    """Until cancelled: where the alias of `current` moves, `load` the new version's URI (in a thread, the requests
    go on meanwhile) and `swap` it in. A registry that cannot be reached, or a version that cannot be loaded, is
    logged and tried again at the next look; the server keeps serving what it has."""
    if current.alias is None:
        return
    aliased = f"models:/{current.name}@{current.alias}"
    while True:
        await asyncio.sleep(every_s)
        try:
            named = await asyncio.to_thread(resolve_version, aliased)
            if named.version == current.version:
                continue
            model = await asyncio.to_thread(load, named.uri)
        except Exception as error:  # noqa: BLE001 - whatever the registry or the load raise, keep serving
            log.warning("%s: staying on version %s: %s", aliased, current.version, str(error).splitlines()[0][:200])
            continue
        swap(model, named)
        log.warning("%s: now serving version %s (was %s)", aliased, named.version, current.version)
        current = named
