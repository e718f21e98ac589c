"""Starting a project of one's own from a use case: `usecases new` (a renamed copy inside this clone) and `usecases
export` (a standalone project with only that use case). Both write into a hidden folder beside the target and
rename it into place at the end, so that a refusal or an interruption leaves nothing half-made."""

from __future__ import annotations

import datetime
import importlib.util
import json
import keyword
import os
import pkgutil
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from common.errors import UserError
from common.paths import git
from common.usecase import ENTRY_POINT_GROUP, UseCase

TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".txt", ".cfg", ""}
IGNORED = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")
COMMANDS = "run|bench|serve|compare|export|new|list"
# Project files an export takes from the clone as they are (they name no use case).
PROJECT_FILES = ("LICENSE", "Makefile", ".gitignore", ".github/workflows/ci.yml", "mlflow/README.md",
                 "mlflow/docker-compose.yml", "mlflow/Dockerfile.server", "mlflow/.env.example", "mlflow/.dockerignore")
SHARED_PAGES = ("docs", "examples")  # an export copies what its README links there
SHARED_TESTS = ("tests/__init__.py", "tests/conftest.py", "tests/cli_helpers.py", "tests/services.py", "tests/common",
                "tests/cpu_without_bf16")


def clone_root(usecase: UseCase) -> Path:
    root = usecase.folder.parent.parent
    if not (root / "pyproject.toml").is_file() or not (root / "common").is_dir():
        raise UserError(f"use case '{usecase.name}' is installed in {usecase.folder.parent}, not in a clone: "
                        f"run this from a clone of the project")
    return root


def rename_text(text: str, old: str, new: str) -> str:
    """Each reference to use case `old` as a name, not the word in prose ("images" to "scans" keeps "images of")."""
    patterns = [
        (rf"\busecases([./]){old}\b", rf"usecases\g<1>{new}"),
        (rf"\btests([./]){old}\b", rf"tests\g<1>{new}"),
        (rf"\bgpu-usecases-{old}\b", f"gpu-usecases-{new}"),
        (rf"\b({COMMANDS}) {old}\b", rf"\g<1> {new}"),
        (rf"--from {old}\b", f"--from {new}"),
        (rf"([\"']){old}(-benchmark)?\1", rf"\g<1>{new}\g<2>\g<1>"),
    ]
    for pattern, replacement in patterns:
        text = re.sub(pattern, replacement, text)
    return text


def _rewrite_tree(folder: Path, old: str, new: str) -> None:
    for path in folder.rglob("*"):
        if path.is_file() and (path.suffix in TEXT_SUFFIXES or path.name == "MLproject"):
            text = path.read_text(encoding="utf-8")
            renamed = rename_text(text, old, new)
            if renamed != text:
                path.write_text(renamed, encoding="utf-8")


@contextmanager
def _staging(target: Path) -> Iterator[Path]:
    target.parent.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def check_new_name(name: str, taken: set[str], root: Path) -> None:
    if not name.isidentifier() or keyword.iskeyword(name) or name != name.lower():
        raise UserError(f"use case name '{name}': expected a lower-case Python identifier, e.g. derm or churn")
    if name in taken:
        raise UserError(f"use case name '{name}': there is already a use case of that name (see `usecases list`)")
    if importlib.util.find_spec(name) is not None or name in sys.builtin_module_names:
        raise UserError(f"use case name '{name}': it would clash with the installed Python package '{name}'")
    modules = {info.name for info in pkgutil.iter_modules([str(root / "usecases")])} | {"__main__"}
    if name in modules:
        raise UserError(f"use case name '{name}': usecases/{name} is part of the CLI; choose another name")
    for folder in (root / "usecases" / name, root / "tests" / name):
        if folder.exists():
            raise UserError(f"use case name '{name}': {folder} exists already")


def new_usecase(source: UseCase, name: str, taken: set[str]) -> list[Path]:
    """Copy `source` as use case `name` (usecases/NAME, tests/NAME), references renamed, its entry point registered."""
    root = clone_root(source)
    check_new_name(name, taken, root)
    package, tests = root / "usecases" / name, root / "tests" / name
    source_tests = root / "tests" / source.name
    with _staging(package) as staged_package, _staging(tests) as staged_tests:
        shutil.copytree(source.folder, staged_package, ignore=IGNORED, dirs_exist_ok=True)
        _rewrite_tree(staged_package, source.name, name)
        _retitle_readme(staged_package / "README.md", source.name, name)
        if source_tests.is_dir():
            shutil.copytree(source_tests, staged_tests, ignore=IGNORED, dirs_exist_ok=True)
            _rewrite_tree(staged_tests, source.name, name)
        try:
            staged_package.rename(package)
            created = [package]
            if source_tests.is_dir():
                staged_tests.rename(tests)
                created.append(tests)
            register_entry_point(root / "pyproject.toml", name, f"usecases.{name}")
            register_extra(root / "pyproject.toml", name, source.requirements)
        except BaseException:  # interrupted between the renames: take back what was moved
            shutil.rmtree(package, ignore_errors=True)
            shutil.rmtree(tests, ignore_errors=True)
            raise
    return created


def _retitle_readme(readme: Path, old: str, new: str) -> None:
    if not readme.is_file():
        return
    lines = readme.read_text(encoding="utf-8").splitlines(keepends=True)
    if lines and lines[0].startswith("# "):
        lines[0] = f"# {new} (started from the {old} use case): {lines[0][2:].split(': ', 1)[-1]}"
    readme.write_text("".join(lines), encoding="utf-8")


def register_entry_point(pyproject: Path, name: str, module: str) -> None:
    """Add `name = "module"` to the entry-point table, so that an installed copy finds it too."""
    if not pyproject.is_file():
        return
    text = pyproject.read_text(encoding="utf-8")
    header = f'[project.entry-points."{ENTRY_POINT_GROUP}"]\n'
    line = f'{name} = "{module}"\n'
    if line in text:
        return
    text = text.replace(header, header + line) if header in text else f"{text.rstrip()}\n\n{header}{line}"
    pyproject.write_text(text, encoding="utf-8")


def register_extra(pyproject: Path, name: str, specifiers: tuple[str, ...]) -> None:
    """Give use case `name` its extra (the libraries its package declares) and add it to `all`, so that the
    `pip install -e '.[NAME]'` a run without them names installs them."""
    if not pyproject.is_file():
        return
    text = pyproject.read_text(encoding="utf-8")
    everything = re.search(r'^all = \["([\w.-]+)\[([\w,]+)\]"\]$', text, re.M)
    if everything is None or name in tomllib.loads(text)["project"].get("optional-dependencies", {}):
        return  # the entry point's line is `NAME = ...` too, in another table
    project, extras = everything.groups()
    lines = f"{name} = {json.dumps(list(specifiers))}\nall = {json.dumps([f'{project}[{extras},{name}]'])}"
    pyproject.write_text(text[:everything.start()] + lines + text[everything.end():], encoding="utf-8")


def _requirement_name(specifier: str) -> str:
    return re.split(r"[\s<>=!~;\[]", specifier.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _owned_elsewhere(usecase: UseCase, others: list[UseCase], common: Path) -> set[str]:
    """Requirements that only other use cases need: never one that common/ itself imports."""
    def names(case: UseCase) -> set[str]:
        specifiers = [*case.requirements, *(s for group in case.optional_requirements.values() for s in group)]
        return {_requirement_name(specifier) for specifier in specifiers}

    elsewhere = set().union(*(names(other) for other in others)) if others else set()
    return elsewhere - names(usecase) - _imported_distributions(common)


def _imported_distributions(folder: Path) -> set[str]:
    """The distributions whose top-level modules the code in `folder` imports (`yaml` is PyYAML's)."""
    import ast
    import importlib.metadata
    modules = set()
    for path in folder.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                modules.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules.add(node.module.split(".")[0])
    providers = importlib.metadata.packages_distributions()
    return {_requirement_name(dist) for module in modules for dist in providers.get(module, [])}


def _with(required: tuple[str, ...], specifiers: list[str]) -> list[str]:
    """`specifiers`, plus each of `required` that names a package they do not have."""
    present = {_requirement_name(spec) for spec in specifiers}
    return specifiers + [spec for spec in required if _requirement_name(spec) not in present]


def _toml_key(key: str) -> str:
    return key if re.fullmatch(r"[\w-]+", key, re.ASCII) else json.dumps(key)


def _toml_value(value) -> str:
    """A TOML string, number or boolean is written as JSON writes it; a long list one item a line."""
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items()) + " }"
    if isinstance(value, list):
        items = [_toml_value(item) for item in value]
        line = "[" + ", ".join(items) + "]"
        return line if len(line) <= 100 else "[\n" + "".join(f"    {item},\n" for item in items) + "]"
    return json.dumps(value)


def export_pyproject(usecase: UseCase, others: list[UseCase], source: Path) -> str:
    """The clone's pyproject.toml with only what `usecase` and common/ need, and only its entry point."""
    project = tomllib.loads(source.read_text(encoding="utf-8"))
    drop = _owned_elsewhere(usecase, others, source.parent / "common")
    keep = _with(usecase.requirements,
                 [spec for spec in project["project"]["dependencies"] if _requirement_name(spec) not in drop])
    name = project["project"]["name"]
    usecase_extras = {usecase.name, *(other.name for other in others), "all"}  # the clone's, rebuilt below
    extras = {extra: kept for extra, specs in project["project"].get("optional-dependencies", {}).items()
              if extra not in usecase_extras
              and (kept := [spec for spec in specs if _requirement_name(spec) not in drop | {name}])}
    for extra, specs in usecase.optional_requirements.items():
        extras[extra] = _with(specs, extras.get(extra, []))
    taken = [extra for extra in extras if extra != "dev" and not extra.startswith("cuda")]
    extras["all"] = [f"{name}-{usecase.name}[{','.join(taken)}]"] if taken else []
    tables = {
        "build-system": {key: project["build-system"][key] for key in ("requires", "build-backend")},
        "project": {"name": f"{name}-{usecase.name}", "version": "0.1.0",
                    "description": usecase.description, "readme": "README.md",
                    "requires-python": project["project"].get("requires-python", ">=3.10"),
                    "license": project["project"].get("license", "Apache-2.0"), "dependencies": keep},
        "project.optional-dependencies": extras,
        "project.scripts": project["project"].get("scripts", {}),
        f'project.entry-points."{ENTRY_POINT_GROUP}"': {usecase.name: usecase.package},
        "tool.setuptools.packages.find": {"include": ["common*", "usecases*"]},
        "tool.setuptools.package-data": {"*": ["presets/*.yaml", "README.md", "MLproject"]},
        "tool.pytest.ini_options": project.get("tool", {}).get("pytest", {}).get("ini_options", {}),
    }
    return "\n".join(f"[{name}]\n" + "".join(f"{_toml_key(key)} = {_toml_value(value)}\n"
                                              for key, value in table.items()) for name, table in tables.items())


LINK = re.compile(r"\]\((?!https?:|#|mailto:)([^)#\s]+)(#[^)\s]*)?\)")
EXAMPLE_PATH = re.compile(r"\bexamples/[\w.-]+")


def _linked_pages(readme: Path, root: Path) -> list[Path]:
    """The clone's pages and example files the use case's README links to or names, relative to the clone."""
    text = readme.read_text(encoding="utf-8") if readme.is_file() else ""
    wanted = {(readme.parent / target).resolve() for target, _ in LINK.findall(text)}
    wanted |= {root / found for found in EXAMPLE_PATH.findall(text)}
    root = root.resolve()
    return sorted(path.relative_to(root) for path in wanted
                  if path.exists() and path.is_relative_to(root) and path.relative_to(root).parts[0] in SHARED_PAGES)


def _rebased_links(text: str, written_in: str) -> str:
    """The README of `written_in` (`usecases/NAME`) as the export's root README: its relative links re-aimed."""
    def rebased(match: re.Match) -> str:
        target = os.path.normpath(os.path.join(written_in, match.group(1)))
        return f"]({target}{match.group(2) or ''})"
    return LINK.sub(rebased, text)


def _export_readme(usecase: UseCase, origin: dict) -> str:
    body = usecase.readme.read_text(encoding="utf-8") if usecase.readme.is_file() else f"# {usecase.name}\n"
    body = _rebased_links(body, f"usecases/{usecase.name}")
    title, _, rest = body.partition("\n")
    return (f"{title}\n\n"
            f"A project of its own, exported from gpu-usecases ({usecase.name} use case, commit "
            f"{origin['commit'][:12]}; see `UPSTREAM.json` to compare with upstream later).\n\n"
            "```bash\nmake demo    # creates .venv, installs the project, runs the use case on its default data\n"
            "make test    # creates .venv if needed, runs the test suite\n```\n\n"
            f"The code is in `usecases/{usecase.name}/` (its own README follows), the shared core in `common/`, "
            f"the tests in `tests/`, the local MLflow store in `mlflow/` (`.venv/bin/usecases ui` to browse it).\n"
            f"{rest}")


CI_SCRIPT = """#!/usr/bin/env bash
# CI entry point: the README's second command, on a clean checkout.
set -euo pipefail
cd "$(dirname "$0")/.."
make test
"""


def export_usecase(usecase: UseCase, others: list[UseCase], folder: Path, force: bool = False) -> Path:
    """Write `folder` as a standalone project of `usecase`: common/, the use case, its tests and the shared test
    helpers, a pyproject.toml with only what they need, Makefile, CI, README, mlflow/ and UPSTREAM.json; with
    `force`, into a non-empty folder, entry by entry."""
    root = clone_root(usecase)
    folder = folder.expanduser().resolve()
    if folder.exists() and not folder.is_dir():
        raise UserError(f"export {usecase.name} {folder}: not a folder")
    if folder.exists() and any(folder.iterdir()) and not force:
        raise UserError(f"export {usecase.name} {folder}: the folder is not empty (choose another, or --force)")
    if folder == root or root in folder.parents or folder in root.parents:
        raise UserError(f"export {usecase.name} {folder}: it overlaps the clone itself; choose a folder outside it")
    origin = {"usecase": usecase.name, "source": str(root), "commit": git(root, "rev-parse", "HEAD") or "unknown",
              "remote": git(root, "remote", "get-url", "origin"),
              "uncommitted_changes": bool(git(root, "status", "--porcelain")),
              "exported_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    with _staging(folder) as staged:
        for relative in ("common", "usecases/__init__.py", "usecases/__main__.py", "usecases/cli", *SHARED_TESTS,
                         f"tests/{usecase.name}", *PROJECT_FILES, *_linked_pages(usecase.readme, root)):
            _copy(root / relative, staged / relative)
        shutil.copytree(usecase.folder, staged / "usecases" / usecase.name, ignore=IGNORED)
        for other in others:  # the shared docs' examples name the other use cases: point them at this one
            _rewrite_tree(staged / "mlflow", other.name, usecase.name)
        (staged / ".ci").mkdir()
        (staged / ".ci" / "run").write_text(CI_SCRIPT)
        (staged / ".ci" / "run").chmod(0o755)
        (staged / "pyproject.toml").write_text(export_pyproject(usecase, others, root / "pyproject.toml"))
        (staged / "README.md").write_text(_export_readme(usecase, origin), encoding="utf-8")
        (staged / "UPSTREAM.json").write_text(json.dumps(origin, indent=2) + "\n")
        if folder.exists():
            _replace_entries(staged, folder)
        else:
            staged.rename(folder)
    return folder


def _replace_entries(staged: Path, folder: Path) -> None:
    """Each top-level entry written replaces the one there whole (none of an earlier export left); the rest stays."""
    for entry in sorted(staged.iterdir()):
        target = folder / entry.name
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        elif target.exists() or target.is_symlink():
            target.unlink()
        os.replace(entry, target)


def _copy(source: Path, target: Path) -> None:
    if source.is_dir():
        shutil.copytree(source, target, ignore=IGNORED, dirs_exist_ok=True)
    elif source.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target)
