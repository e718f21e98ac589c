"""The contract of a use case, and where use cases are found.

A use case is a Python package whose `__init__.py` declares `USECASE = UseCase.declare(__name__, ...)`. Its
`pipeline` module provides `load_data(config, path) -> (data, tags)` and `run(config, data, job) -> models`, and
an optional `benchmark` module `benchmark(config, data, job)`. Those modules are imported only when a run needs
them, after the DataFrame backend is chosen: declaring a use case imports its config schema and nothing heavier.

Use cases are found in two places: the packages in a folder of use cases (the clone's `usecases/`, where
`usecases new` writes), and the entry-point group `gpu_usecases.usecases` of every installed distribution, so an
installed package registers itself with one line in its pyproject.toml.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import pkgutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from common.config import ConfigModel
from common.errors import UserError

ENTRY_POINT_GROUP = "gpu_usecases.usecases"


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

    @classmethod
    def declare(cls, package: str, *, description: str, config: type[ConfigModel],
                primary_metric: tuple[str, Literal["min", "max"]], summary_columns=None,
                requirements: tuple[str, ...] = (), optional_requirements: dict[str, tuple[str, ...]] | None = None,
                has_benchmark: bool = False) -> UseCase:
        """For a package's `__init__.py`: its name is the package's last component, its files are beside it.

        `requirements` are what the use case needs beyond common/ (pip specifiers), `optional_requirements` the
        extras it can use when present (an extra's name, its specifiers); `usecases export` writes both."""
        folder = Path(sys.modules[package].__file__).resolve().parent
        return cls(package.rsplit(".", 1)[-1], package, description, config, folder, primary_metric,
                   summary_columns, tuple(requirements), dict(optional_requirements or {}), has_benchmark)

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

    def load_data(self, config, path: Path | None):
        return self._module("pipeline").load_data(config, path)

    def run(self, config, data, job):
        return self._module("pipeline").run(config, data, job)

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
class Found:
    """A use case as discovery saw it: where it came from and either its declaration or why it cannot load."""

    name: str
    module: str
    origin: str
    usecase: UseCase | None = None
    error: str | None = None


def _declared(module_name: str) -> UseCase:
    module = importlib.import_module(module_name)
    declared = getattr(module, "USECASE", None)
    if not isinstance(declared, UseCase):
        raise TypeError(f"{module_name} declares no USECASE = UseCase.declare(__name__, ...)")
    return declared


def _load(name: str, module: str, origin: str) -> Found:
    try:
        return Found(name, module, origin, usecase=_declared(module))
    except Exception as exc:  # a broken plug-in is reported, never allowed to break the others
        reason = (str(exc).splitlines() or [""])[0]
        return Found(name, module, origin, error=f"{type(exc).__name__}: {reason}")


def _folder_modules(package: str, folder: Path) -> dict[str, str]:
    """Packages in a folder of use cases: every sub-package with a presets/ folder beside its __init__.py."""
    return {info.name: f"{package}.{info.name}" for info in pkgutil.iter_modules([str(folder)])
            if info.ispkg and not info.name.startswith("_") and (folder / info.name / "presets").is_dir()}


def installed_entry_points() -> list:
    return list(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))


def discover(package: str | None = None, folder: Path | None = None) -> dict[str, Found]:
    """Every use case, by name: those in `folder` (the package `package`), then the entry points of installed
    distributions. Where both name the same module, the entry point is shown as its origin."""
    found: dict[str, Found] = {}
    local = _folder_modules(package, folder) if package and folder and folder.is_dir() else {}
    entry_points = {point.name: point for point in installed_entry_points()}
    for name in sorted(set(local) | set(entry_points)):
        point = entry_points.get(name)
        if point is not None and (name not in local or point.value == local[name]):
            dist = point.dist
            origin = f"entry point of {dist.name} {dist.version}" if dist is not None else "entry point"
            found[name] = _load(name, point.value, origin)
        else:
            location = folder / name
            try:
                location = location.relative_to(Path.cwd())
            except ValueError:
                pass
            found[name] = _load(name, local[name], f"folder {location}")
    return found


def resolve(name: str, found: dict[str, Found]) -> UseCase:
    """The named use case, or one line saying why not."""
    if name not in found:
        raise UserError(f"unknown use case '{name}' (available: {', '.join(found) or 'none'})")
    entry = found[name]
    if entry.usecase is None:
        raise UserError(f"use case '{name}' ({entry.origin}) cannot be loaded: {entry.error}")
    return entry.usecase
