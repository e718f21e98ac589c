"""Shared test setup: GPU tests skip without a GPU; every test tracks into its own temporary store."""

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

pytest_plugins = ["tests.services"]  # which service-backed tests ran and which skipped


# A slow test's real-data run takes 10 minutes alone on 2 cores and twice that beside another on the second xdist
# worker: the 600 s of pyproject.toml are for the default suite.
SLOW_TEST_TIMEOUT_S = 3600


def pytest_configure(config):
    """Under pytest-xdist, each worker and every run it starts get their share of the cores: two workers whose runs
    each wake a thread per core put four spinning OpenMP threads on two cores, and those wait on each other (the
    slow suite's longest real-data run took four times its time alone). A thread count the user set is kept."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers < 2:
        return
    from threadpoolctl import threadpool_limits

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1  # macOS: none
    share = str(max(1, cores // workers))
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(name, share)
    threads = int(os.environ["OMP_NUM_THREADS"])
    torch.set_num_threads(threads)
    threadpool_limits(threads)


def pytest_collection_modifyitems(config, items):
    items.sort(key=_start_rank)  # stable: the rest keep their order
    for item in items:
        if "slow" in item.keywords and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(SLOW_TEST_TIMEOUT_S))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _start_rank(item) -> float:
    """Files go to the xdist workers whole (--dist loadfile: a module fixture is made once) and each worker takes the
    next file when it is free, so the longest files (real runs in their fixtures) are marked `starts_first(N)`, N = 1
    the longest, and start at once instead of leaving one worker alone at the end."""
    marker = item.get_closest_marker("starts_first")
    return float("inf") if marker is None else (marker.args[0] if marker.args else 0)


@pytest.fixture(scope="session", autouse=True)
def contained_temporary_files():
    """What the libraries leave in the temporary folder (MLflow copies a model there on every load and never removes
    it: 450 MB for the million preset's) and what the servers a test starts write there go to a folder of this
    process's, removed when the session ends or, where it was killed, by the next session. Short, beside the system's
    temporary folder, not in pytest's: Chromium's socket path there must stay under 108 characters."""
    from common.serving.pyfunc import process_scratch

    folder = process_scratch("usecases-tests-")
    folder.chmod(0o755)  # tests that drop to an unprivileged user reach their folders through it
    before = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"], tempfile.tempdir = str(folder), str(folder)
    yield
    if before[0] is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = before[0]
    tempfile.tempdir = before[1]
    for path in folder.iterdir():  # multiprocessing's own folder it removes itself at exit, failing if it is gone
        if path.name.startswith("pymp-"):
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        folder.rmdir()  # else the next session's sweep removes it


@pytest.fixture
def open_folder():
    """A folder any user can reach (pytest's own are root's only), removed afterwards."""
    folder = Path(tempfile.mkdtemp())
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder)


@pytest.fixture(scope="session")
def empty_store():
    """An MLflow store whose tables exist, made once a process (tests/cli_helpers.py): each test copies it."""
    from tests.cli_helpers import empty_store_file

    return empty_store_file()


@pytest.fixture(autouse=True)
def isolated_store(tmp_path, tmp_path_factory, monkeypatch, empty_store):
    """Keep the project's own mlflow/ store and checkpoints/ untouched by tests: each test has its own store (in a
    folder of its own, so tmp_path holds only what the test writes), started from a copy of the empty one."""
    store = tmp_path_factory.mktemp("store") / "mlflow.db"
    shutil.copy(empty_store, store)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{store}")
    monkeypatch.setenv("USECASES_CHECKPOINT_DIR", str(tmp_path / "checkpoints"))
    monkeypatch.setenv("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    yield
    import mlflow

    while mlflow.active_run() is not None:
        mlflow.end_run()


@pytest.fixture(scope="session")
def smoke_runs(tmp_path_factory):
    """`smoke_runs(NAME)`: the use case's smoke run, made once a session when first asked for (tests/cli_helpers.py's
    `smoke_run`); tests read it and never write to its store."""
    from tests.cli_helpers import smoke_run

    made = {}

    def made_once(usecase: str):
        if usecase not in made:
            made[usecase] = smoke_run(tmp_path_factory, usecase)
        return made[usecase]

    return made_once


@pytest.fixture(scope="module")
def dask_client():
    """A two-worker Dask cluster in this process (threads: starts in a second), for the engine-equality tests."""
    distributed = pytest.importorskip("distributed")
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=":0") as \
            cluster, distributed.Client(cluster) as client:
        yield client
