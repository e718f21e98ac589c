"""Shared test setup: GPU tests skip without a GPU; every test tracks into its own temporary store."""

import shutil

import pytest
import torch


# A slow test's real-data run takes 10 minutes alone on 2 cores and twice that beside another on the second xdist
# worker: the 600 s of pyproject.toml are for the default suite.
SLOW_TEST_TIMEOUT_S = 3600


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "slow" in item.keywords and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(SLOW_TEST_TIMEOUT_S))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def empty_store(tmp_path_factory):
    """An MLflow store whose tables exist: creating them (alembic's migrations) takes seconds, copying a file not."""
    import mlflow

    path = tmp_path_factory.mktemp("store") / "mlflow.db"
    mlflow.MlflowClient(f"sqlite:///{path}").search_experiments()
    return path


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
