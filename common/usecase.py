"""The contract of a use case, and where use cases are found. A use case is a package whose `__init__.py` declares
`USECASE = UseCase.declare(__name__, ...)`; its `pipeline` module provides `load_data(config, path) -> (data, tags)` and
`run(config, data, job) -> RunResult`, an optional `benchmark` module `benchmark(config, data, job) -> models`. They are
imported only when a run needs them, after the DataFrame backend is chosen. Use cases are found in a folder of use cases
(the clone's `usecases/`) and in the entry-point group `gpu_usecases.usecases` of the installed distributions."""

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
    requirements: tuple[str, ...] = ()  # pip specifiers beyond common/'s
    optional_requirements: dict[str, tuple[str, ...]] = field(default_factory=dict)
    has_benchmark: bool = False
    scale: dict[str, int] | None = None  # the config keys `bench scale` multiplies together, and their 1x values
    served_kinds: tuple[str, ...] = ("",)  # the kinds of model it serves, the one `usecases serve` prefers first
    reported_metrics: tuple[str, ...] = ()  # each model's test metrics its results page tables beside the primary one
    evidence: tuple[str, str] | None = None  # (a model's test metric, its unit): how many users, days or images

    @classmethod
    def declare(cls, package: str, **fields) -> UseCase:
        """For a package's `__init__.py`: named after the package's last component, its files beside it.
        `requirements` and `optional_requirements` (extra: specifiers) are what `usecases export` writes."""
        folder = Path(sys.modules[package].__file__).resolve().parent
        for name in ("requirements", "served_kinds", "reported_metrics", "evidence"):
            if name in fields:
                fields[name] = tuple(fields[name])
        return cls(name=package.rsplit(".", 1)[-1], package=package, folder=folder, **fields)

    @property
    def presets_dir(self) -> Path:
        return self.folder / "presets"

    @property
    def readme(self) -> Path:
        return self.folder / "README.md"

    def missing(self, extra: str | None = None) -> str | None:
        """Why this use case (or its optional `extra`) cannot run here, in one line naming the pip extra that installs
        its libraries; None where they are installed. A team installs only the extras it runs (pyproject.toml)."""
        specifiers = self.requirements if extra is None else self.optional_requirements[extra]
        absent = missing_distributions(specifiers)
        if not absent:
            return None
        what = f"use case '{self.name}'" + (f" ({extra})" if extra else "")
        extras = f"'.[{extra or self.name}]'"
        return (f"{what} needs {', '.join(absent)}, not installed here: pip install -e {extras} in the clone (make "
                f"install takes every extra)")

    def require(self, extra: str | None = None) -> None:
        if reason := self.missing(extra):
            raise UserError(reason)

    def columns(self, config) -> list[str] | None:
        """The metrics printed at the end of a run; None prints every one."""
        return self.summary_columns(config) if self.summary_columns else None

    def _module(self, name: str):
        return importlib.import_module(f"{self.package}.{name}")

    def load_data(self, config, path: Path | None, client=None):
        """With the run's Dask client, for a `load_data` that takes one."""
        load = self._module("pipeline").load_data
        if client is not None and "client" in inspect.signature(load).parameters:
            return load(config, path, client=client)
        return load(config, path)

    def large_data(self, config, path: Path | None) -> str | None:
        """The pipeline's optional `large_data(config, path)`: why this data is better on Dask, or None."""
        judge = getattr(self._module("pipeline"), "large_data", None)
        return judge(config, path) if judge is not None else None

    def run(self, config, data, job):
        return self._module("pipeline").run(config, data, job)

    def server(self):
        """The use case's `server.py` (a `ServerPlugin`), or None: `usecases serve` then runs MLflow's."""
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


def missing_distributions(specifiers: tuple[str, ...]) -> list[str]:
    """The distributions of pip `specifiers` not installed in this environment (their markers applied): presence,
    not versions, which pip checked when it installed them."""
    from packaging.requirements import Requirement

    absent = []
    for specifier in specifiers:
        requirement = Requirement(specifier)
        if requirement.marker is not None and not requirement.marker.evaluate():
            continue
        try:
            importlib.metadata.distribution(requirement.name)
        except importlib.metadata.PackageNotFoundError:
            absent.append(requirement.name)
    return absent


@dataclass(frozen=True)
class Served:
    """The model a run logged for serving; `kind` where it serves several (each its own registered model)."""

    model: str
    uri: str
    kind: str = ""


@dataclass(frozen=True)
class RunResult:
    """Each model's test metrics, and the one logged for serving (None: nothing to register); that model's hold the
    primary metric on test (`METRIC`, a report) and on validation (`val_METRIC`, which picks the champion)."""

    models: dict[str, dict[str, float]]
    served: Served | None = None
    capped: bool = False  # stopped at its time cap: the models it measured by then (common/runner.py)


@dataclass(frozen=True)
class RunRequest:
    """One run as the user asked for it (`usecases run`, `bench`, `demo`, `gpu-check`, `bench scale`): checked
    once, passed whole to the runner or written back as the command line of a run in its own process."""

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
        """What the command line's choices catch, for a request built in code."""
        object.__setattr__(self, "overrides", tuple(self.overrides))
        if self.device not in DEVICES:
            raise UserError(f"--device {self.device}: expected one of {', '.join(DEVICES)}")
        if self.frames not in FRAMES:
            raise UserError(f"--frames {self.frames}: expected one of {', '.join(FRAMES)}")
        if (self.resume or self.resume_if_interrupted) and self.bench:
            raise UserError(f"use case '{self.usecase.name}': a benchmark cannot be resumed (--resume is for runs)")

    def with_overrides(self, *overrides: str) -> RunRequest:
        return replace(self, overrides=(*self.overrides, *overrides))

    def command_line(self) -> list[str]:
        arguments = [*(["bench", "run"] if self.bench else ["run"]), self.usecase.name, "--preset", self.preset]
        for option, value, default in (("--device", self.device, "auto"), ("--frames", self.frames, "auto"),
                                       ("--data", self.data, None), ("--summary", self.summary, None)):
            if value != default:
                arguments += [option, str(value)]
        arguments += ["--resume"] if self.resume else []
        return arguments + [item for override in self.overrides for item in ("--set", override)]


@dataclass(frozen=True)
class Found:
    """A use case as discovery saw it, nothing imported yet; `error` says why it cannot be used."""

    name: str
    module: str
    origin: str
    error: str | None = None

    def load(self) -> UseCase:
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


def installed_entry_points() -> list:
    return list(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))


def discover(package: str | None = None, folder: Path | None = None) -> dict[str, Found]:
    """Every use case by name: the packages in `folder` (the package `package`) and the installed entry points.
    Two different modules under one name are a conflict, reported rather than either picked in silence."""
    local = {}
    if package and folder and folder.is_dir():  # every sub-package with a presets/ folder beside its __init__.py
        local = {info.name: f"{package}.{info.name}" for info in pkgutil.iter_modules([str(folder)])
                 if info.ispkg and not info.name.startswith("_") and (folder / info.name / "presets").is_dir()}
    points: dict[str, list] = {}
    for point in installed_entry_points():
        points.setdefault(point.name, []).append(point)
    found: dict[str, Found] = {}
    for name in sorted(set(local) | set(points)):
        modules = {point.value for point in points.get(name, [])} | ({local[name]} if name in local else set())
        origins = [f"entry point of {point.dist.name} {point.dist.version}" if getattr(point, "dist", None) is not None
                   else "entry point" for point in points.get(name, [])]
        if name in local and local[name] not in {point.value for point in points.get(name, [])}:
            location = folder / name
            location = location.relative_to(Path.cwd()) if location.is_relative_to(Path.cwd()) else location
            origins.append(f"folder {location}")
        origin = " and ".join(dict.fromkeys(origins))
        error = None if len(modules) == 1 else f"the name is taken by {' and '.join(sorted(modules))}; rename one"
        found[name] = Found(name, sorted(modules)[0], origin, error)
    return found


def resolve(name: str, found: dict[str, Found]) -> UseCase:
    if name not in found:
        raise UserError(f"unknown use case '{name}' (available: {', '.join(found) or 'none'})")
    return found[name].load()


def load_all(found: dict[str, Found]) -> dict[str, UseCase | UserError]:
    """Each use case or the one-line error that stops it (`usecases list`, `demo`)."""
    loaded: dict[str, UseCase | UserError] = {}
    for name, entry in found.items():
        try:
            loaded[name] = entry.load()
        except UserError as error:
            loaded[name] = error
    return loaded
