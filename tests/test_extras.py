"""Installs of some use cases only: each use case is an extra of pyproject.toml, and a command that needs one not
installed stops in one line naming the `pip install` that adds it (the slow test installs the finance extra alone,
from a wheelhouse, with no package index)."""
from __future__ import annotations

import importlib
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common import runner
from common.errors import UserError
from common.usecase import discover, resolve
from tests.cli_helpers import assert_rejected, private_env, user_error
from tests.plumbing import PLUMBING

ROOT = Path(__file__).resolve().parents[1]


def without_distributions(monkeypatch, *names: str) -> None:
    """This environment as a pip install that left out NAMES (an install of some extras only)."""
    import importlib.metadata

    real = importlib.metadata.distribution

    def distribution(name):
        if name in names:
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "distribution", distribution)


def test_a_use_case_without_its_extra_is_one_line_naming_the_extra_and_leaves_no_run(monkeypatch, capsys):
    without_distributions(monkeypatch, "pydicom", "medmnist")
    for command in (("run", "medical", "--preset", "smoke"), ("bench", "run", "medical", "--preset", "smoke")):
        line = assert_rejected(capsys, "medical", *command, names=("pydicom, medmnist", "pip install -e '.[medical]'"))
        assert "finance" not in line and "slides" not in line
    assert "pip install -e '.[medical]'" in user_error(capsys, "serve", "medical")
    assert resolve("finance", discover("usecases", ROOT / "usecases")).missing() is None


def test_the_demo_skips_a_use_case_without_its_extra_in_one_line(monkeypatch, capsys):
    without_distributions(monkeypatch, "arch")
    finance = resolve("finance", discover("usecases", ROOT / "usecases"))
    runner.run_demo([finance])
    assert capsys.readouterr().out.splitlines()[-1].startswith(
        "finance: skipped: use case 'finance' needs arch, not installed here: pip install -e '.[finance]'")
    import mlflow
    assert mlflow.MlflowClient().search_experiments(filter_string="name LIKE 'gpu-usecases-finance%'") == []


def test_the_slide_modules_without_the_slides_extra_are_one_line_and_the_image_classifier_needs_none(monkeypatch):
    """Importing any slide module checks the `slides` extra (usecases/medical/slides/__init__.py); the medical
    pipeline imports them only for a slides run."""
    without_distributions(monkeypatch, "openslide-python", "zarr")
    reloaded = ("usecases.medical.slides", "usecases.medical.pipeline", "usecases.medical.benchmark")
    for name in [name for name in sys.modules if name.startswith(reloaded)]:
        monkeypatch.delitem(sys.modules, name)
    importlib.import_module("usecases.medical.pipeline")
    importlib.import_module("usecases.medical.benchmark")
    assert not [name for name in sys.modules if name.startswith("usecases.medical.slides")]
    with pytest.raises(UserError, match=r"^use case 'medical' \(slides\) needs openslide-python, zarr, not installed "
                                        r"here: pip install -e '\.\[slides\]'"):
        importlib.import_module("usecases.medical.slides.data")


def test_a_wheelhouse_asks_for_the_extras_it_is_given_and_what_they_name_and_the_build_backend():
    from common.tools.wheelhouse import requirements

    names = lambda specifiers: {re.split(r"[<>=!~; \[]", spec)[0] for spec in specifiers}  # noqa: E731
    finance = names(requirements(ROOT / "pyproject.toml", ["finance"]))
    assert {"torch", "mlflow", "arch", "setuptools"} <= finance
    assert finance.isdisjoint({"openslide-python", "faiss-cpu", "pydicom", "torchvision", "pytest"})
    everything = names(requirements(ROOT / "pyproject.toml", ["all", "dev"]))  # `all` names the project's own extras
    assert {"arch", "pydicom", "openslide-python", "faiss-cpu", "implicit", "redis", "psycopg", "pytest"} <= everything
    assert "gpu-usecases" not in everything
    with pytest.raises(SystemExit, match=r"^error: EXTRAS: 'finanse' is not an extra of .*pyproject.toml \(it has: "):
        requirements(ROOT / "pyproject.toml", ["finanse"])


def test_a_carried_wheelhouse_is_checked_and_a_missing_or_changed_wheel_named(tmp_path):
    from common.tools.wheelhouse import check, write_lock

    for name in ("torch-2.14.1+cu130-cp311-cp311-manylinux_2_28_x86_64.whl", "Arch-7.2.0-1-cp311-cp311-linux.whl",
                 "typing_extensions-4.15.0-py3-none-any.whl"):
        (tmp_path / name).write_bytes(name.encode())
    write_lock(tmp_path, ["finance"])
    lock = (tmp_path / "requirements.lock").read_text().splitlines()
    assert lock[1:] == [f"arch==7.2.0 --hash=sha256:{digest(tmp_path, 'Arch-7.2.0-1-cp311-cp311-linux.whl')}",
                        f"torch==2.14.1+cu130 --hash=sha256:"
                        f"{digest(tmp_path, 'torch-2.14.1+cu130-cp311-cp311-manylinux_2_28_x86_64.whl')}",
                        f"typing-extensions==4.15.0 --hash=sha256:"
                        f"{digest(tmp_path, 'typing_extensions-4.15.0-py3-none-any.whl')}"]
    assert "torch==2.14.1+cu130" in (tmp_path / "constraints.txt").read_text().splitlines()
    check(tmp_path)
    (tmp_path / "Arch-7.2.0-1-cp311-cp311-linux.whl").write_bytes(b"cut short")
    with pytest.raises(SystemExit, match=r"Arch-7.2.0-1-cp311-cp311-linux.whl: its sha256 is not the one .*line 1"):
        check(tmp_path)
    (tmp_path / "Arch-7.2.0-1-cp311-cp311-linux.whl").unlink()
    with pytest.raises(SystemExit, match=r"line 1: Arch-7.2.0-1-cp311-cp311-linux.whl is missing from the folder"):
        check(tmp_path)


def digest(folder: Path, name: str) -> str:
    import hashlib
    return hashlib.sha256((folder / name).read_bytes()).hexdigest()


@pytest.mark.slow
@pytest.mark.starts_first(4)
@pytest.mark.timeout(1800)
def test_the_finance_extra_alone_installs_from_a_wheelhouse_with_no_index_and_runs(tmp_path):
    """As a team whose GPU server has no package index: `make wheelhouse EXTRAS=finance` where there is one, then in a
    copy of the clone, with none of this machine's pip settings and no index, `make install WHEELS=DIR
    EXTRAS=finance`: the venv holds no OpenSlide, FAISS or pydicom, finance's smoke preset runs, and a medical run or a
    recsys server stops in one line naming its extra. The sizes and times are printed for the closing note."""
    from tests.test_scaffold import copy_clone

    wheels, clone = tmp_path / "wheels", copy_clone(tmp_path / "clone")
    python = shutil.which("python3") or "python3"
    started = time.monotonic()
    built = subprocess.run(["make", "wheelhouse", f"WHEELS={wheels}", "EXTRAS=finance", f"PYTHON={python}"], cwd=clone,
                           capture_output=True, text=True, timeout=1200)
    assert built.returncode == 0, built.stderr[-3000:]
    print(f"wheelhouse: {time.monotonic() - started:.0f} s, {folder_gb(wheels):.1f} GB")
    lock = (wheels / "requirements.lock").read_text()
    assert re.search(r"^torch==\S+ --hash=sha256:[0-9a-f]{64}$", lock, re.M) and "\narch==" in lock
    offline = {key: value for key, value in os.environ.items()
               if not key.startswith("PIP_") and key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    offline |= {"PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1"}
    started = time.monotonic()
    try:
        installed = subprocess.run(["make", "install", f"WHEELS={wheels}", "EXTRAS=finance", f"PYTHON={python}"],
                                   cwd=clone, capture_output=True, text=True, timeout=1200, env=offline)
        assert installed.returncode == 0, installed.stderr[-3000:]
        print(f"install from it: {time.monotonic() - started:.0f} s, venv {folder_gb(clone / '.venv'):.1f} GB")
        shutil.rmtree(wheels)
        venv = clone / ".venv" / "bin"
        found = subprocess.run([venv / "python", "-c", "import importlib.util as u; print(*[m for m in ('openslide', "
                                "'faiss', 'pydicom', 'torchvision', 'pytest') if u.find_spec(m)])"],
                               capture_output=True, text=True, cwd=tmp_path)
        assert found.returncode == 0 and found.stdout.split() == [], found.stdout + found.stderr
        env = {**private_env(tmp_path / "runs"), "PATH": f"{venv}{os.pathsep}{os.environ['PATH']}"}
        env.pop("PYTHONPATH", None)
        smoke = subprocess.run([venv / "usecases", "run", "finance", "--preset", "smoke", *PLUMBING["finance"]],
                               capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
        assert smoke.returncode == 0, smoke.stderr[-3000:]
        for command, extra in ((["run", "medical", "--preset", "smoke"], "medical"), (["serve", "recsys"], "recsys")):
            stopped = subprocess.run([venv / "usecases", *command], capture_output=True, text=True, timeout=300,
                                     env=env, cwd=tmp_path)
            assert stopped.returncode == 2 and stopped.stderr.count("\n") == 1, stopped.stderr[-2000:]
            assert f"pip install -e '.[{extra}]'" in stopped.stderr, stopped.stderr
    finally:
        shutil.rmtree(clone / ".venv", ignore_errors=True)  # 6 GB: pytest keeps three runs' folders


def folder_gb(folder: Path) -> float:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file() and not path.is_symlink()) / 2**30
