"""MLflow as the team's workbench: a tracking server that takes parallel runs, the registry's champion, REST
serving of it, the comparison by hardware, and a quick failure when the server is down."""

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlflow
import pytest
from arch.data import sp500

from tests.cli_helpers import free_port, mlflow_server, runs, stop, usecases, user_error, wait_until_up

pytestmark = pytest.mark.starts_first(1)  # the default suite's longest files first (tests/conftest.py)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("server")
    with mlflow_server(folder) as uri:
        yield uri, {**os.environ, "MLFLOW_TRACKING_URI": uri, "USECASES_CHECKPOINT_DIR": str(folder / "ck")}


@pytest.fixture(scope="module")
def four_runs(server):
    """Four smoke runs of one preset started at once on this machine, sharing its checkpoint folder (each run keeps
    its checkpoints under its own run id)."""
    uri, env = server

    def one(index: int):
        return usecases("run", "finance", "--preset", "smoke", "--set", "tracking.instance_type=test-box",
                        "--set", "tracking.price_per_hour=2.5", "--set", "data.synthetic.tickers=1",
                        "--set", "train.epochs=3", "--set", "baselines.models=[ewma,har]", env=env)

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, range(4)))
    for result in results:
        assert result.returncode == 0, result.stderr[-2000:]
    return uri, env


@pytest.mark.timeout(600)
def test_four_parallel_runs_all_land_finished(four_runs):
    uri, _ = four_runs
    finished = runs("finance", uri)
    assert len(finished) == 4 and {run.info.status for run in finished} == {"FINISHED"}
    for run in finished:
        seconds = run.data.metrics["time/total_s"]
        assert run.data.metrics["cost"] == pytest.approx(2.5 * seconds / 3600)  # --set tracking.price_per_hour=2.5
        assert run.data.tags["instance_type"] == "test-box"


def test_one_champion_and_challengers_on_the_same_data(four_runs):
    uri, _ = four_runs
    client = mlflow.MlflowClient(uri)
    versions = client.search_model_versions("name = 'gpu-usecases-finance'")
    assert len(versions) == 4
    aliases = [run.data.tags["registry_alias"] for run in runs("finance", uri)]
    assert set(aliases) <= {"champion", "challenger"} and "challenger" in aliases  # equal metrics: the first wins
    registered = client.get_registered_model("gpu-usecases-finance").aliases
    assert "champion" not in registered, "a run on synthetic data moved the champion of real data"
    champion = client.get_model_version_by_alias("gpu-usecases-finance", "champion-synthetic")
    assert champion.tags["primary_metric"] == "qlike_sq" and champion.tags["data_source"].startswith("synthetic")
    champion_run = client.get_run(champion.tags["run_id"])
    assert float(champion.tags["validation_value"]) == pytest.approx(champion_run.data.metrics["primary/val_qlike_sq"])
    assert float(champion.tags["primary_value"]) == pytest.approx(
        champion_run.data.metrics["primary/qlike_sq"])
    assert float(champion.tags["primary_value"]) == pytest.approx(
        champion_run.data.metrics["test/neural/qlike_sq"])


def test_compare_groups_the_runs_by_hardware(four_runs):
    _, env = four_runs
    result = usecases("compare", "finance", "--format", "csv", env=env)
    assert result.returncode == 0, result.stderr
    header, row = result.stdout.strip().splitlines()
    assert header.split(",")[:5] == ["hardware", "instance_type", "precision", "runs", "qlike_sq"]
    assert ",test-box,fp32,4," in row


def test_serve_the_champion_and_refuse_bad_input_with_400(four_runs):
    _, env = four_runs
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "usecases", "serve", "finance", "--port", str(port)], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_up(f"{url}/ping", process)
        days = sp500.load().tail(70).reset_index()
        rows = [{"date": str(day.date()), "ticker": "SPX", "high": high, "low": low, "close": close}
                for day, high, low, close in zip(days["Date"], days["High"], days["Low"], days["Close"])]
        status, answer = post(f"{url}/invocations", {"dataframe_records": rows})
        assert status == 200 and answer["predictions"][0]["variance"] > 0
        for bad in ({"dataframe_records": rows[:5]}, {"dataframe_records": [{"x": 1}]}, {"something": 1}):
            status, answer = post(f"{url}/invocations", bad)
            assert status == 400 and answer["message"]
    finally:
        stop(process)


def post(url: str, payload: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_an_unreachable_server_fails_fast_with_one_line(capsys, monkeypatch):
    """One connection attempt, then one line: MLflow's own client, which would retry for minutes, is never asked."""
    import socket

    import urllib3.util.connection

    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    attempts = []

    def counted(connect):  # urllib's (http.client) and requests' (urllib3) way to open a connection
        def attempt(address, *args, **kwargs):
            attempts.append(address[1])
            return connect(address, *args, **kwargs)
        return attempt

    monkeypatch.setattr(socket, "create_connection", counted(socket.create_connection))
    monkeypatch.setattr(urllib3.util.connection, "create_connection",
                        counted(urllib3.util.connection.create_connection))
    line = user_error(capsys, "run", "finance", "--preset", "smoke")
    assert attempts == [port]
    assert line == f"error: MLFLOW_TRACKING_URI {uri}: the tracking server cannot be reached " \
                   f"([Errno 111] Connection refused)"


def test_serve_without_a_champion_says_so(capsys):
    assert "no champion of 'medical'" in user_error(capsys, "serve", "medical")


def test_usecases_server_serves_the_local_store_and_prints_the_uri(tmp_path, monkeypatch):
    """`usecases server` on a copy of the project layout, so the real mlflow/ folder stays untouched."""
    import shutil

    import usecases

    clone = tmp_path / "clone"
    (clone / "mlflow").mkdir(parents=True)
    shutil.copy(Path(usecases.__file__).parents[1] / "pyproject.toml", clone / "pyproject.toml")
    port = free_port()
    script = (f"import common.tracking.stores as t; from pathlib import Path; t.project_root = lambda: Path({str(clone)!r}); "
              f"from usecases.cli import main; main(['server', '--port', '{port}', '--workers', '1'])")
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                               stderr=subprocess.DEVNULL, start_new_session=True,
                               env={**{key: value for key, value in os.environ.items()
                                       if key != "MLFLOW_TRACKING_URI"},  # the local store, as a fresh shell has it
                                    "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
    try:
        assert f"export MLFLOW_TRACKING_URI=http://127.0.0.1:{port}" in process.stdout.readline() + \
            process.stdout.readline()
        wait_until_up(f"http://127.0.0.1:{port}/health", process)
        assert (clone / "mlflow" / "mlflow.db").is_file() and (clone / "mlflow" / "artifacts").is_dir()
    finally:
        stop(process)
