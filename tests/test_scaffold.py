"""`usecases new` and `usecases export`, as a user runs them: in a copy of the clone (so this one stays as it is),
then the new or exported use case's smoke run and tests. The slow variants run every copied test and `make test` in
a fresh virtual environment of the export."""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from common.tools.scaffold import rename_text
from tests.cli_helpers import runs
from tests.plumbing import PLUMBING

pytestmark = pytest.mark.starts_first(5)  # the default suite's longest files first (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[1]
USECASES = ("finance", "medical", "recsys")
# Every copy runs the same scaffold code; each copy's `new` run and every export's run (25 to 40 s each) are in the
# slow suite, which CI runs on every landing; the default suite checks what `new` and `export` write.
IN_SLOW_SUITE = [pytest.param(name, marks=pytest.mark.slow) for name in USECASES]
FAST_TESTS = {"finance": "test_features.py", "medical": "test_models.py", "recsys": "test_models.py"}
# Every copy is made by the same renaming: each runs one test file and collects all of its tests (an import the
# renaming broke fails there); the recsys export runs all of its own in a fresh venv
# (test_make_test_passes_in_a_fresh_venv_of_an_export), where finance's copy ran them all again for 3 minutes
EXPORT_SMOKE_RUNS = [pytest.param(name, marks=pytest.mark.slow) for name in USECASES if name != "recsys"]


def copy_clone(target: Path) -> Path:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache", "mlflow.db", "artifacts")
    for name in ("common", "usecases", "tests", "mlflow", ".github", ".ci"):
        shutil.copytree(ROOT / name, target / name, ignore=ignore)
    for name in ("pyproject.toml", "Makefile", ".gitignore", "README.md"):
        shutil.copy2(ROOT / name, target / name)
    return target


def in_folder(folder: Path, *args: str, timeout: int = 600,
              python: str = sys.executable) -> subprocess.CompletedProcess:
    """`python ARGS` in `folder`, whose own `usecases` and `common` come first on the path."""
    env = {**os.environ, "PYTHONPATH": str(folder), "PYTHONUNBUFFERED": "1"}
    return subprocess.run([python, *args], cwd=folder, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    return copy_clone(tmp_path_factory.mktemp("clone") / "project")


def test_rename_touches_names_not_prose():
    text = ('from usecases.medical.data import x\nusecases("run", "medical")\n`usecases run medical` logs to '
            "gpu-usecases-medical; see tests/medical\nmedical images are hard\n")
    assert rename_text(text, "medical", "derm") == (
        'from usecases.derm.data import x\nusecases("run", "derm")\n`usecases run derm` logs to '
        "gpu-usecases-derm; see tests/derm\nmedical images are hard\n")


BAD_NAMES = {"2fast": "lower-case Python identifier", "Derm": "lower-case Python identifier",
             "class": "lower-case Python identifier", "finance": "already a use case", "json": "clash",
             "cli": "part of the CLI"}


@pytest.fixture(scope="module")
def bad_names(clone) -> tuple[dict[str, list], list[str], list[str]]:
    """`usecases new NAME --from medical` for each bad name, in one interpreter of the clone (not one each): each
    name's exit code and stderr, and the clone's use cases before and after."""
    code = ("import contextlib, io, json\nfrom usecases.cli import main\nanswers = {}\n"
            f"for name in {list(BAD_NAMES)!r}:\n"
            "    err = io.StringIO()\n"
            "    with contextlib.redirect_stderr(err):\n"
            "        answers[name] = [main(['new', name, '--from', 'medical']), err.getvalue()]\n"
            "print(json.dumps(answers))")
    before = sorted(path.name for path in (clone / "usecases").iterdir())
    result = in_folder(clone, "-c", code)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1]), before, sorted(
        path.name for path in (clone / "usecases").iterdir())


@pytest.mark.parametrize(("name", "reason"), BAD_NAMES.items())
def test_new_refuses_a_bad_name_in_one_line_and_writes_nothing(clone, bad_names, name, reason):
    answers, before, after = bad_names
    code, stderr = answers[name]
    assert code == 2 and reason in stderr and len(stderr.strip().splitlines()) == 1, stderr
    assert after == before
    assert not (clone / "tests" / name).exists() or name in USECASES


def test_new_refuses_an_unknown_source(clone):
    result = in_folder(clone, "-m", "usecases", "new", "churn", "--from", "nothing")
    assert result.returncode == 2 and "unknown use case 'nothing'" in result.stderr
    assert not (clone / "usecases" / "churn").exists() and not (clone / "tests" / "churn").exists()


@pytest.mark.parametrize("source", IN_SLOW_SUITE)
def test_a_use_case_made_by_new_runs_and_passes_its_tests(clone, source):
    name = f"my{source}"
    result = in_folder(clone, "-m", "usecases", "new", name, "--from", source)
    assert result.returncode == 0, result.stderr
    package, tests = clone / "usecases" / name, clone / "tests" / name
    assert (package / "presets" / "smoke.yaml").is_file() and (tests / "__init__.py").is_file()
    code = "\n".join(path.read_text() for path in [*package.rglob("*.py"), *tests.rglob("*.py")])
    assert f"usecases.{source}" not in code and f'"{source}"' not in code
    extras = tomllib.loads((clone / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert f'{name} = "usecases.{name}"' in (clone / "pyproject.toml").read_text()
    (everything,) = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["all"]
    (taken,) = extras["all"]  # the clone is shared: the copies made before this one are in `all` too
    assert extras[name] == extras[source] and taken.startswith(everything[:-1]) and taken.endswith(f",{name}]")
    assert f"\n{name} " in in_folder(clone, "-m", "usecases", "list").stdout
    run = in_folder(clone, "-m", "usecases", "run", name, "--preset", "smoke", *PLUMBING[source])
    assert run.returncode == 0, run.stderr[-2000:]
    (finished,) = runs(name)
    assert finished.info.status == "FINISHED" and finished.data.tags["registry_model"] == f"gpu-usecases-{name}"
    assert not runs(source)
    tested = in_folder(clone, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                       f"tests/{name}/{FAST_TESTS[source]}", timeout=1800)
    assert tested.returncode == 0, tested.stdout[-3000:]
    collected = in_folder(clone, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only", f"tests/{name}")
    assert collected.returncode == 0 and " error" not in collected.stdout, collected.stdout[-2000:]


def imported(path: Path, depth: int = 0) -> set[str]:
    """Absolute module names, and `..x` for relative imports that climb out of the use case's package (a module
    `depth` folders below it may climb that many levels and stay inside)."""
    tree = ast.parse(path.read_text())
    names = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            names.add("." * max(node.level - depth, min(node.level, 1)) + (node.module or ""))
    return names


@pytest.mark.parametrize("name", USECASES)
def test_no_use_case_imports_another(name):
    others = [f"usecases.{other}" for other in USECASES if other != name]
    package = ROOT / "usecases" / name
    for path in package.rglob("*.py"):
        depth = len(path.relative_to(package).parts) - 1  # slides/mil.py may import ..evaluate
        crossing = {module for module in imported(path, depth)
                    if module.startswith("..") or any(module == o or module.startswith(o + ".") for o in others)}
        assert not crossing, path


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("exports")
    made = {}
    for name in USECASES:
        result = subprocess.run([sys.executable, "-m", "usecases", "export", name, str(folder / name)],
                                capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert result.returncode == 0, result.stderr
        made[name] = folder / name
    return made


@pytest.mark.parametrize("name", USECASES)
def test_an_export_holds_that_use_case_only(exports, name):
    export = exports[name]
    for required in ("LICENSE", "pyproject.toml", "Makefile", ".ci/run", ".github/workflows/ci.yml", "README.md",
                     "UPSTREAM.json", "mlflow/README.md", "common/runner.py", "usecases/cli/__init__.py",
                     f"usecases/{name}/presets/smoke.yaml", "tests/conftest.py", "tests/cli_helpers.py",
                     "tests/services.py", f"tests/{name}/__init__.py", "tests/common/test_training.py"):
        assert (export / required).is_file(), required
    others = [other for other in USECASES if other != name]
    pattern = re.compile("|".join(others), re.IGNORECASE)
    mentions = [str(path) for path in export.rglob("*.py") if pattern.search(path.read_text())]
    assert mentions == []
    assert sorted(path.name for path in (export / "usecases").iterdir() if (path / "presets").is_dir()) == [name]
    assert (export / "usecases" / "cli" / "bench.py").is_file()
    assert not (export / "mlflow" / "__init__.py").exists()


def test_an_export_needs_only_its_own_dependencies(exports):
    def dependencies(name: str) -> set[str]:
        project = tomllib.loads((exports[name] / "pyproject.toml").read_text())["project"]
        specifiers = project["dependencies"] + [spec for specs in project["optional-dependencies"].values()
                                                for spec in specs]
        assert list(project["entry-points"]["gpu_usecases.usecases"]) == [name]
        return {re.split(r"[<>=!~; \[]", spec)[0] for spec in specifiers}

    assert "arch" in dependencies("finance") and {"torchvision", "pydicom", "implicit"}.isdisjoint(dependencies("finance"))
    assert {"torchvision", "pydicom"} <= dependencies("medical") and {"arch", "implicit"}.isdisjoint(dependencies("medical"))
    assert "implicit" in dependencies("recsys") and {"arch", "torchvision", "pydicom"}.isdisjoint(dependencies("recsys"))
    assert "mlflow" in dependencies("recsys") and "pytest" in dependencies("recsys")
    assert {"faiss-cpu", "openslide-python", "pydicom"}.isdisjoint(dependencies("finance"))
    assert "faiss-cpu" in dependencies("recsys") and "openslide-python" in dependencies("medical")
    for name in USECASES:  # `all` names the export's own extras, as the Makefile installs it
        extras = tomllib.loads((exports[name] / "pyproject.toml").read_text())["project"]["optional-dependencies"]
        (everything,) = extras["all"]
        taken = re.fullmatch(rf"gpu-usecases-{name}\[([\w,]+)\]", everything).group(1).split(",")
        assert set(taken) == set(extras) - {"all", "dev", "cuda12", "cuda13"} and "dask" in taken, name
        assert ("slides" in taken) == (name == "medical") and "finance" not in extras, name


def assert_the_export_runs_its_own_code(export: Path, name: str, python: str = sys.executable) -> None:
    modules = ["common.runner", "common.tools.scaffold", "common.tracking.runs", "usecases.cli", f"usecases.{name}.pipeline",
               f"usecases.{name}.serving"]
    code = f"import importlib; print('\\n'.join(importlib.import_module(m).__file__ for m in {modules!r}))"
    files = in_folder(export, "-c", code, python=python).stdout.split()
    assert len(files) == len(modules) and all(Path(file).is_relative_to(export) for file in files), files
    listed = {line.split()[0]: line
              for line in in_folder(export, "-m", "usecases", "list", python=python).stdout.splitlines()}
    assert "[presets:" in listed[name]  # the others listed here are the entry points of this clone's install


@pytest.mark.parametrize("name", EXPORT_SMOKE_RUNS)  # 35 to 40 s each, as `new`'s runs above
def test_an_export_runs_its_smoke_preset_and_its_tests(exports, name):
    export = exports[name]
    assert_the_export_runs_its_own_code(export, name)
    run = in_folder(export, "-m", "usecases", "run", name, "--preset", "smoke", *PLUMBING[name])
    assert run.returncode == 0, run.stderr[-2000:]
    tested = in_folder(export, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"tests/{name}/{FAST_TESTS[name]}",
                       "tests/common/test_config.py")
    assert tested.returncode == 0, tested.stdout[-2000:]


def export(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "usecases", "export", *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)


def test_export_refuses_a_non_empty_folder_unless_forced_and_then_replaces_what_it_writes(tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    result = export("recsys", str(tmp_path))
    assert result.returncode == 2 and "not empty" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert sorted(path.name for path in tmp_path.iterdir()) == ["keep.txt"]
    assert export("medical", str(tmp_path), "--force").returncode == 0
    assert export("recsys", str(tmp_path), "--force").returncode == 0  # over an earlier export: nothing of it left
    assert sorted(path.name for path in (tmp_path / "usecases").iterdir() if (path / "presets").is_dir()) == ["recsys"]
    assert not (tmp_path / "tests" / "medical").exists() and (tmp_path / "keep.txt").read_text() == "mine"


@pytest.mark.parametrize("where", ["inside", "around"])
def test_export_refuses_a_folder_that_overlaps_the_clone(clone, where):
    """In the copy of the clone, so that a broken check could only write into a temporary folder."""
    folder = clone / "exported" if where == "inside" else clone.parent
    before = sorted(path.name for path in clone.parent.iterdir())
    result = in_folder(clone, "-m", "usecases", "export", "recsys", str(folder), "--force")
    assert result.returncode == 2 and "overlaps the clone" in result.stderr
    assert not (clone / "exported").exists() and sorted(path.name for path in clone.parent.iterdir()) == before


@pytest.mark.slow
def test_make_test_passes_in_a_fresh_venv_of_an_export(tmp_path):
    """As a user does: export, then the export's own `make test`, which creates .venv and installs the project; its
    tests run the recsys smoke preset (tests/recsys/test_end_to_end.py), and the venv runs the export's own code."""
    export = tmp_path / "recsys-project"
    assert subprocess.run([sys.executable, "-m", "usecases", "export", "recsys", str(export)], cwd=ROOT,
                          timeout=120).returncode == 0
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    try:
        result = subprocess.run(["make", "test", f"PYTHON={shutil.which('python3') or 'python3'}"], cwd=export,
                                capture_output=True, text=True, timeout=3600, env=env)
        failed = [line for line in result.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
        assert result.returncode == 0, "\n".join([*failed, result.stdout[-3000:]])  # which test, then its output
        assert_the_export_runs_its_own_code(export, "recsys", str(export / ".venv" / "bin" / "python"))
    finally:
        shutil.rmtree(export / ".venv", ignore_errors=True)  # 7 GB: pytest keeps three runs' folders


def test_new_gives_the_use_case_its_extra_and_adds_it_to_all(tmp_path):
    from common.tools.scaffold import register_entry_point, register_extra

    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text((ROOT / "pyproject.toml").read_text())
    register_entry_point(pyproject, "derm", "usecases.derm")  # as `new` does first: a `derm = ...` line elsewhere
    register_extra(pyproject, "derm", ("pydicom>=3.0", "uvloop>=0.19; sys_platform != 'win32'"))
    register_extra(pyproject, "derm", ("pydicom>=9",))  # a second time changes nothing
    extras = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]
    assert extras["derm"] == ["pydicom>=3.0", "uvloop>=0.19; sys_platform != 'win32'"]
    assert extras["all"][0].endswith(",team,derm]") and extras["finance"] == ["arch>=7.0"]


def test_each_use_case_is_an_extra_that_installs_what_it_declares():
    """A use case's `requirements` (what `export` keeps and `usecases run` checks) are its extra of the same name, its
    optional ones extras of theirs, and `all` takes every one: a team installs one use case, `make install` all."""
    import importlib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (everything,) = extras["all"]
    taken = set(re.fullmatch(r"gpu-usecases\[([\w,]+)\]", everything).group(1).split(","))
    for name in USECASES:
        declared = importlib.import_module(f"usecases.{name}").USECASE
        assert set(declared.requirements) == set(extras[name]), name
        for extra, specifiers in declared.optional_requirements.items():
            assert set(specifiers) <= set(extras[extra]), (name, extra)
            assert extra in taken, extra
        assert name in taken, name


@pytest.mark.parametrize("name", USECASES)
def test_an_exports_readme_links_resolve_to_the_pages_and_examples_it_carries(exports, name):
    """The use case's guide becomes the export's README: its links re-aimed from usecases/NAME/ to the root, and the
    docs/ pages and examples/ files it links to or names carried along."""
    readme = exports[name] / "README.md"
    targets = re.findall(r"\]\(((?!https?:|#)[^)#\s]+)", readme.read_text())
    assert any(target.startswith("docs/results/") for target in targets)
    missing = [target for target in targets if not (exports[name] / target).exists()]
    assert missing == []
    assert [found for found in re.findall(r"\bexamples/[\w./-]+", readme.read_text())
            if not (exports[name] / found.rstrip(".")).exists()] == []
