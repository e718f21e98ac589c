"""The contract of a use case, and where use cases are found.

A use case is a Python package whose `__init__.py` declares `USECASE = UseCase.declare(__name__, ...)`. Its
`pipeline` module provides `load_data(config, path) -> (data, tags)` and `run(config, data, job) -> RunResult`, and
an optional `benchmark` module `benchmark(config, data, job) -> models`. `models` maps each model's name to its
metrics; `RunResult.served` names the model `run` logged for serving and its URI (None: nothing to register), and
that model's metrics hold the primary metric on test (`METRIC`, a report) and on validation (`val_METRIC`, by which
the registry picks its champion). Those modules are imported only when a run needs
them, after the DataFrame backend is chosen: declaring a use case imports its config schema and nothing heavier.

A `RunRequest` is what the user asked for (`usecases run` and `bench`, `demo`, `gpu-check`, `bench scale`): built
once, checked once, and passed whole to the runner or written back as the command line of a run in its own process.

Use cases are found in two places: the packages in a folder of use cases (the clone's `usecases/`, where
`usecases new` writes), and the entry-point group `gpu_usecases.usecases` of every installed distribution, so an
installed package registers itself with one line in its pyproject.toml.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import inspect
import pkgutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from common.config import ConfigModel
from common.errors import UserError, one_line

ENTRY_POINT_GROUP = "gpu_usecases.usecases"
DEVICES, FRAMES = ("auto", "cpu", "cuda"), ("auto", "pandas")


@dataclass(frozen=True)
class UseCase:
    name: str
    package: str
    description: str
    config: type[ConfigModel]
    folder: Path
    primary_metric: tuple[str, Literal["min", "max"]]
    summary_columns: Callable[[Any], list[str]] | None = None
    requirements: tuple[str, ...] = ()
    optional_requirements: dict[str, tuple[str, ...]] = field(default_factory=dict)
    has_benchmark: bool = False
    scale: dict[str, int] | None = None  # the config keys `bench scale` multiplies together, and their 1x values
    served_kinds: tuple[str, ...] = ("",)  # the kinds of model it serves, the one `usecases serve` prefers first

    @classmethod
    def declare(cls, package: str, **fields) -> UseCase:
        """For a package's `__init__.py`: its name is the package's last component, its files are beside it, and
        `fields` are this class's own (description, config, primary_metric, ...; a misspelt one is an error).

        `requirements` are what the use case needs beyond common/ (pip specifiers), `optional_requirements` the
        extras it can use when present (an extra's name, its specifiers); `usecases export` writes both. `scale`
        names the size keys of the `scale` preset that `usecases bench scale` multiplies together (the first
        names the size in its table and plot), with their 1x values. `served_kinds` are the kinds of model its runs
        register (`Served.kind`, "" for its main one), in the order `usecases serve` looks for a champion."""
        folder = Path(sys.modules[package].__file__).resolve().parent
        for name in ("requirements", "served_kinds"):
            if name in fields:
                fields[name] = tuple(fields[name])
        return cls(name=package.rsplit(".", 1)[-1], package=package, folder=folder, **fields)

    @property
    def presets_dir(self) -> Path:
        return self.folder / "presets"

    @property
    def readme(self) -> Path:
        return self.folder / "README.md"

    def columns(self, config) -> list[str] | None:
        """The metrics printed at the end of a run (summary.json holds them all); None prints every one."""
        return self.summary_columns(config) if self.summary_columns else None

    def _module(self, name: str):
        return importlib.import_module(f"{self.package}.{name}")

    def load_data(self, config, path: Path | None, client=None):
        """With the run's Dask client, for a `load_data` that takes one (to prepare its data on the cluster)."""
        load = self._module("pipeline").load_data
        if client is not None and "client" in inspect.signature(load).parameters:
            return load(config, path, client=client)
        return load(config, path)

    def large_data(self, config, path: Path | None) -> str | None:
        """Why this data is better prepared on Dask (for `runtime.engine: auto`), from the pipeline's optional
        `large_data(config, path)`; None: it is not, or the use case does not say."""
        judge = getattr(self._module("pipeline"), "large_data", None)
        return judge(config, path) if judge is not None else None

    def run(self, config, data, job):
        return self._module("pipeline").run(config, data, job)

    def server(self):
        """The use case's own server module (its `server.py`, a `ServerPlugin`), or None: `usecases serve` then
        runs MLflow's scoring server."""
        from common.server_plugin import ServerPlugin

        try:
            found = importlib.util.find_spec(f"{self.package}.server")
        except ModuleNotFoundError:  # the package itself is not importable (a declared but absent use case)
            return None
        if found is None:
            return None
        module = self._module("server")
        if not isinstance(module, ServerPlugin):
            raise UserError(f"{self.package}.server is not a server plug-in (common/server_plugin.py: ServerPlugin)")
        return module

    def benchmark(self, config, data, job):
        if not self.has_benchmark:
            raise UserError(f"use case '{self.name}' has no benchmark")
        return self._module("benchmark").benchmark(config, data, job)

    def summary(self) -> str:
        """The README's first paragraph after its title: the experiment's description in the MLflow UI."""
        if not self.readme.is_file():
            return self.description
        paragraphs = [part.strip() for part in self.readme.read_text(encoding="utf-8").split("\n\n")]
        body = [part for part in paragraphs if part and not part.startswith(("#", "|", "```", "<"))]
        return " ".join(body[0].split()) if body else self.description


@dataclass(frozen=True)
class Served:
    """The model a run logged for serving: its name among the run's models, where MLflow keeps it, and its kind
    where the use case serves more than one (each kind its own registered model: a champion never changes kind)."""

    model: str
    uri: str
    kind: str = ""


@dataclass(frozen=True)
class RunResult:
    """What a use case's `run` returns: each model's metrics, and the one logged for serving; the runner registers
    that one (by its primary metric on validation), and nothing when `served` is None."""

    models: dict[str, dict[str, float]]
    served: Served | None = None


@dataclass(frozen=True)
class RunRequest:
    """One run as the user asked for it: which use case and preset, the `--set` overrides, where it runs, its data,
    where its summary goes, and whether it resumes or is the benchmark."""

    usecase: UseCase
    preset: str = "default"
    overrides: tuple[str, ...] = ()
    device: str = "auto"
    frames: str = "auto"
    data: Path | None = None
    summary: Path | None = None
    resume: bool = False
    resume_if_interrupted: bool = False  # continue an interrupted run if there is one, else start (spot, Job restarts)
    bench: bool = False

    def __post_init__(self):
        """What the command line's choices catch, for a request built in code; presets and `--set` are the config's
        to check."""
        object.__setattr__(self, "overrides", tuple(self.overrides))
        if self.device not in DEVICES:
            raise UserError(f"--device {self.device}: expected one of {', '.join(DEVICES)}")
        if self.frames not in FRAMES:
            raise UserError(f"--frames {self.frames}: expected one of {', '.join(FRAMES)}")
        if (self.resume or self.resume_if_interrupted) and self.bench:
            raise UserError(f"use case '{self.usecase.name}': a benchmark cannot be resumed (--resume is for runs)")

    def with_overrides(self, *overrides: str) -> RunRequest:
        """The same request with more `--set` overrides, applied after the ones it has."""
        return replace(self, overrides=(*self.overrides, *overrides))

    def command_line(self) -> list[str]:
        """The `usecases` arguments that make this request, for a run in its own process."""
        arguments = [*(["bench", "run"] if self.bench else ["run"]), self.usecase.name, "--preset", self.preset]
        for option, value, default in (("--device", self.device, "auto"), ("--frames", self.frames, "auto"),
                                       ("--data", self.data, None), ("--summary", self.summary, None)):
            if value != default:
                arguments += [option, str(value)]
        arguments += ["--resume"] if self.resume else []
        return arguments + [item for override in self.overrides for item in ("--set", override)]


@dataclass(frozen=True)
class Found:
    """A use case as discovery saw it, before anything of it is imported: its module and where it came from, or
    why it cannot be used (`error`)."""

    name: str
    module: str
    origin: str
    error: str | None = None

    def load(self) -> UseCase:
        """Import the package and return its declaration, or raise one line saying why not."""
        if self.error is None:
            try:
                return _declared(self.module)
            except Exception as exc:  # a broken plug-in is reported, never allowed to break the others
                reason = f"{type(exc).__name__}: {one_line(exc)}" if str(exc).strip() else type(exc).__name__
                raise UserError(f"use case '{self.name}' ({self.origin}) cannot be loaded: {reason}") from None
        raise UserError(f"use case '{self.name}' ({self.origin}) cannot be used: {self.error}")


def _declared(module_name: str) -> UseCase:
    module = importlib.import_module(module_name)
    declared = getattr(module, "USECASE", None)
    if not isinstance(declared, UseCase):
        raise TypeError(f"{module_name} declares no USECASE = UseCase.declare(__name__, ...)")
    server = declared.folder / "server.py"
    if server.is_file():
        from common.server_plugin import missing_functions

        missing = missing_functions(server)
        if missing:
            raise TypeError(f"{module_name}.server does not define {', '.join(missing)} (common/server_plugin.py)")
    return declared


def _folder_modules(package: str, folder: Path) -> dict[str, str]:
    """Packages in a folder of use cases: every sub-package with a presets/ folder beside its __init__.py."""
    return {info.name: f"{package}.{info.name}" for info in pkgutil.iter_modules([str(folder)])
            if info.ispkg and not info.name.startswith("_") and (folder / info.name / "presets").is_dir()}


def installed_entry_points() -> list:
    return list(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))


def _entry_origin(point) -> str:
    dist = getattr(point, "dist", None)
    return f"entry point of {dist.name} {dist.version}" if dist is not None else "entry point"


def discover(package: str | None = None, folder: Path | None = None) -> dict[str, Found]:
    """Every use case by name, nothing imported yet: the packages in `folder` (the package `package`) and the entry
    points of installed distributions. Where both name the same module the entry point is shown as its origin; two
    different modules under one name are a conflict, reported instead of either being picked in silence."""
    local = _folder_modules(package, folder) if package and folder and folder.is_dir() else {}
    points: dict[str, list] = {}
    for point in installed_entry_points():
        points.setdefault(point.name, []).append(point)
    found: dict[str, Found] = {}
    for name in sorted(set(local) | set(points)):
        modules = {point.value for point in points.get(name, [])} | ({local[name]} if name in local else set())
        origins = [_entry_origin(point) for point in points.get(name, [])]
        if name in local and local[name] not in {point.value for point in points.get(name, [])}:
            location = folder / name
            try:
                location = location.relative_to(Path.cwd())
            except ValueError:
                pass
            origins.append(f"folder {location}")
        origin = " and ".join(dict.fromkeys(origins))
        error = None if len(modules) == 1 else f"the name is taken by {' and '.join(sorted(modules))}; rename one"
        found[name] = Found(name, sorted(modules)[0], origin, error)
    return found


def resolve(name: str, found: dict[str, Found]) -> UseCase:
    """The named use case, imported now, or one line saying why not."""
    if name not in found:
        raise UserError(f"unknown use case '{name}' (available: {', '.join(found) or 'none'})")
    return found[name].load()


def load_all(found: dict[str, Found]) -> dict[str, UseCase | UserError]:
    """Each use case or the one-line error that stops it, for the commands that need them all (list, demo)."""
    loaded: dict[str, UseCase | UserError] = {}
    for name, entry in found.items():
        try:
            loaded[name] = entry.load()
        except UserError as error:
            loaded[name] = error
    return loaded
