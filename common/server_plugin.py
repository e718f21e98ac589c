"""A use case's own server (`usecases serve`, `bench serve`): its package's `server.py`, a `ServerPlugin`, started with
one `ServerSettings`, checked once where the command is given and handed to every worker process as one JSON value in
the environment (`SETTINGS_VARIABLE`), so that a worker uvicorn's supervisor restarts reads what the first one read."""

from __future__ import annotations

import ast
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from common.errors import UserError

SETTINGS_VARIABLE = "USECASES_SERVE_SETTINGS"
DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class ServerSettings:
    """Everything a use case's own server is started with; `announce` is printed once the server's dependencies
    are checked, before the port is bound; `batch_ms` None lets the server choose (micro-batching on a GPU)."""

    model_uri: str
    host: str = "127.0.0.1"
    port: int = 5001
    workers: int = 1
    events: str | None = None
    device: str = "auto"
    batch_ms: float | None = None
    retrieval: str | None = None
    ann_index: str | None = None
    announce: str | None = None

    def __post_init__(self):
        if self.workers < 1:
            raise UserError(f"--workers must be at least 1, got {self.workers}")
        if self.batch_ms is not None and self.batch_ms < 0:
            raise UserError(f"--batch-ms must be at least 0, got {self.batch_ms:g}")
        if self.device not in DEVICES:
            raise UserError(f"--device {self.device}: expected one of {', '.join(DEVICES)}")
        if self.ann_index is not None:
            object.__setattr__(self, "ann_index", str(self.ann_index))

    def to_environment(self) -> None:
        """Hand these settings to the worker processes, which inherit the environment."""
        os.environ[SETTINGS_VARIABLE] = json.dumps(asdict(self))

    @classmethod
    def from_environment(cls) -> ServerSettings:
        return cls(**json.loads(os.environ[SETTINGS_VARIABLE]))


@runtime_checkable
class ServerPlugin(Protocol):
    """What a use case's `server.py` provides; optionally `RETRIEVALS`, the modes its `--retrieval` takes (none: one
    way), and `FLEET_EVENTS`, the event store a fleet's pods share (`usecases advise NAME --serve --launch`)."""

    def serve(self, settings: ServerSettings) -> int:
        """Serve until stopped; the exit code. An unusable dependency is a UserError before the port is bound."""

    def default_events(self, tracking_uri: str) -> str:
        """Where events are kept when `--events` is not given, beside the tracking store."""

    def bench_requests(self, loaded, count: int, seed: int) -> list[dict]:
        """`count` request bodies (MLflow's JSON scoring input) for the pyfunc model `loaded`, for `bench serve`."""


def check_retrieval(plugin: ServerPlugin, modes: list[str]) -> None:
    """Each of `modes` one the plug-in declares in `RETRIEVALS`; a one-line error where not."""
    known = getattr(plugin, "RETRIEVALS", ())
    for mode in modes:
        if mode not in known:
            raise UserError(f"--retrieval {mode}: expected one of {', '.join(known)}" if known else
                            f"--retrieval {mode}: this use case's server serves one way only")


PLUGIN_FUNCTIONS = tuple(name for name in vars(ServerPlugin) if not name.startswith("_"))


def missing_functions(server_file: Path) -> list[str]:
    """The `ServerPlugin` functions a server module lacks, read from its source (discovery imports no use case)."""
    tree = ast.parse(server_file.read_text(encoding="utf-8"), filename=str(server_file))
    defined = {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
    return [name for name in PLUGIN_FUNCTIONS if name not in defined]
