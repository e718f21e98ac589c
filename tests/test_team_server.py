"""The team's tracking server, really run: `usecases server` on a PostgreSQL cluster of the test's own, with a login
(MLflow's basic-auth app, its users in the same database), two use cases' runs into it at once, the registry's
champion moved by a client and served over REST from the server, the results page written from it, and each mistake
in one line.

The cluster is started as the current user in a temporary folder (as the `postgres` user, or `nobody`, where the tests
run as root: PostgreSQL refuses root); without PostgreSQL's server programs the tests that need it skip in one line
(.ci/run installs them with apt). The tests on the running server take minutes on 2 cores: they are in the slow suite;
those of the mistakes the server refuses before it starts take seconds, in the default one."""

import glob
import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import mlflow
import pytest

from tests.cli_helpers import free_port, in_process, stop, user_error, wait_until_up

DATABASE_PASSWORD = "db-secret-4711"  # the cluster's user `mlflow`
ADMIN_PASSWORD = "admin-secret-4711"  # the server's admin, through MLFLOW_AUTH_ADMIN_PASSWORD only
FINANCE = "gpu-usecases-finance"


def postgres_bin() -> Path | None:
    """The folder of initdb and pg_ctl: on PATH, else Debian's /usr/lib/postgresql/<version>/bin (newest)."""
    initdb = shutil.which("initdb")
    if initdb and shutil.which("pg_ctl"):
        return Path(initdb).parent
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"),
                      key=lambda path: [int(part) if part.isdigit() else 0 for part in Path(path).parts[-3].split(".")])
    return Path(versions[-1]).parent if versions and Path(versions[-1]).with_name("pg_ctl").exists() else None


def _cluster_user() -> pwd.struct_passwd | None:
    """Who runs the cluster: this user, or where that is root (which PostgreSQL refuses) `postgres` or `nobody`."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        try:
            return pwd.getpwnam(name)
        except KeyError:
            continue
    pytest.skip("running as root without a `postgres` or `nobody` user to run PostgreSQL as")


@pytest.fixture(scope="module")
def postgres():
    """A throwaway PostgreSQL cluster on 127.0.0.1 and a free port, with a password login (scram-sha-256) for the
    user `mlflow` and a database `mlflow`; yields postgresql://mlflow:PASSWORD@127.0.0.1:PORT (no database)."""
    folder_bin = postgres_bin()
    if folder_bin is None:
        pytest.skip("PostgreSQL is not installed (no initdb and pg_ctl on PATH or in /usr/lib/postgresql/*/bin); "
                    ".ci/run installs it with apt")
    owner = _cluster_user()
    as_owner = {} if owner is None else {"user": owner.pw_uid, "group": owner.pw_gid}
    # not under pytest's folder (nor a private $TMPDIR), which the cluster's user may not enter
    folder = Path(tempfile.mkdtemp(prefix="usecases-pg-", dir="/tmp" if owner is not None else None))
    (folder / "password").write_text(DATABASE_PASSWORD + "\n")
    if owner is not None:
        for path in (folder, folder / "password"):
            os.chown(path, owner.pw_uid, owner.pw_gid)
    data, port = folder / "data", free_port()

    def run(*command: str) -> None:
        done = subprocess.run(command, cwd=folder, capture_output=True, text=True, timeout=120, **as_owner)
        assert done.returncode == 0, f"{command[0]} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"

    try:
        run(str(folder_bin / "initdb"), "-D", str(data), "-U", "mlflow", f"--pwfile={folder / 'password'}",
            "--auth=scram-sha-256", "-E", "UTF8", "--no-sync")
        run(str(folder_bin / "pg_ctl"), "-D", str(data), "-l", str(folder / "postgres.log"), "-w", "-t", "60",
            "-o", f"-c listen_addresses=127.0.0.1 -p {port} -c unix_socket_directories={folder} -c fsync=off "
                  f"-c full_page_writes=off -c synchronous_commit=off", "start")
        import sqlalchemy

        server = f"postgresql://mlflow:{DATABASE_PASSWORD}@127.0.0.1:{port}"
        engine = sqlalchemy.create_engine(f"{server}/postgres", isolation_level="AUTOCOMMIT")
        with engine.connect() as connection:
            connection.execute(sqlalchemy.text("CREATE DATABASE mlflow"))
        engine.dispose()
        yield server
    finally:
        if (data / "postmaster.pid").exists():
            subprocess.run([str(folder_bin / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"], cwd=folder,
                           capture_output=True, timeout=60, **as_owner)
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def team_server(postgres, tmp_path_factory):
    """`usecases server --backend-store-uri postgresql://... --auth` as a user starts it (one worker, no job runner:
    quick to start on 2 cores); yields its URL, what it printed, and the environment of a client logged in as the
    admin."""
    folder = tmp_path_factory.mktemp("team")
    port = free_port()
    env = {key: value for key, value in os.environ.items()
           if key not in ("MLFLOW_TRACKING_URI", "MLFLOW_AUTH_CONFIG_PATH", "MLFLOW_AUTH_ADMIN_USERNAME")}
    env.update({"MLFLOW_AUTH_ADMIN_PASSWORD": ADMIN_PASSWORD, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
                "XDG_CACHE_HOME": str(folder / "cache"), "PYTHONUNBUFFERED": "1"})
    log = folder / "server.log"
    with log.open("w") as output:
        process = subprocess.Popen(
            [sys.executable, "-m", "usecases", "server", "--backend-store-uri", f"{postgres}/mlflow",
             "--artifacts-destination", str(folder / "artifacts"), "--auth", "--port", str(port), "--workers", "1"],
            stdout=output, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_up(f"{url}/health", process, seconds=300)
        client = {**os.environ, "MLFLOW_TRACKING_URI": url, "MLFLOW_TRACKING_USERNAME": "admin",
                  "MLFLOW_TRACKING_PASSWORD": ADMIN_PASSWORD, "USECASES_CHECKPOINT_DIR": str(folder / "ck"),
                  "PYTHONUNBUFFERED": "1"}
        yield url, log.read_text(), client
    finally:
        stop(process)


SMALLER = {"finance": ["--set", "baselines.models=[ewma,gjr_garch_t]", "--set", "train.epochs=5"],
           "recsys": ["--set", "models=[pop,bpr]", "--set", "evaluation.replay=false"]}


@pytest.fixture(scope="module")
def two_runs(team_server):
    """finance's and recsys's smoke runs started at the same moment, each a client of the server with the login
    (with `SMALLER`: what is tested is what reaches the server, not the models)."""
    url, _, client = team_server
    started = time.monotonic()
    processes = {name: subprocess.Popen([sys.executable, "-m", "usecases", "run", name, "--preset", "smoke",
                                         *SMALLER[name]],
                                        env=client, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for name in ("finance", "recsys")}
    results = {name: process.communicate(timeout=900) for name, process in processes.items()}
    for name, process in processes.items():
        assert process.returncode == 0, f"{name}: exit {process.returncode}\n{results[name][1][-3000:]}"
    return url, client, time.monotonic() - started


@pytest.fixture
def logged_in(team_server, monkeypatch):
    """This process as a client of the server, logged in as the admin."""
    url, _, client = team_server
    for key in ("MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        monkeypatch.setenv(key, client[key])
    mlflow.set_tracking_uri(url)
    return mlflow.MlflowClient(url)


@pytest.mark.slow
def test_the_server_says_where_to_track_and_hides_the_database_password(team_server, postgres):
    _, printed, _ = team_server
    first = printed.splitlines()[0]
    assert first.startswith("MLflow tracking server on http://127.0.0.1:") and "login required" in first
    assert f"store: postgresql://mlflow:***@{postgres.rsplit('@', 1)[1]}/mlflow" in first
    assert DATABASE_PASSWORD not in printed and ADMIN_PASSWORD not in printed


@pytest.mark.slow
def test_a_client_without_the_login_is_refused(team_server):
    url, _, _ = team_server
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"{url}/api/2.0/mlflow/experiments/search?max_results=1", timeout=30)
    assert refused.value.code == 401


@pytest.mark.slow
def test_two_use_cases_run_at_once_into_postgresql(two_runs, logged_in):
    _, _, seconds = two_runs
    for name in ("finance", "recsys"):
        experiment = logged_in.get_experiment_by_name(f"gpu-usecases-{name}")
        found = logged_in.search_runs([experiment.experiment_id])
        assert [run.info.status for run in found] == ["FINISHED"], name
        assert found[0].data.metrics, f"{name}: no metric reached the database"
        assert found[0].info.artifact_uri.startswith("mlflow-artifacts:"), "artifacts are not proxied by the server"
    print(f"two smoke runs at once through the server: {seconds:.0f} s")


@pytest.mark.slow
def test_the_champion_moves_and_is_served_from_the_server(two_runs, logged_in, tmp_path):
    """A client moves finance's champion to a new version; `usecases serve finance`, pointed at the server with the
    login, serves that version and answers a request."""
    from arch.data import sp500

    _, client_env, _ = two_runs
    alias = "champion-synthetic"  # a smoke run's data is synthetic: it never moves `champion`
    before = logged_in.get_model_version_by_alias(FINANCE, alias)
    moved = mlflow.register_model(before.source, FINANCE, tags=before.tags)  # the same model, a new version
    logged_in.set_registered_model_alias(FINANCE, alias, moved.version)
    assert logged_in.get_model_version_by_alias(FINANCE, alias).version == moved.version != before.version

    port, said = free_port(), tmp_path / "serve.log"
    with said.open("w") as output:
        process = subprocess.Popen([sys.executable, "-m", "usecases", "serve", "finance", "--port", str(port)],
                                   env=client_env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_up(f"{url}/ping", process, seconds=300)
        days = sp500.load().tail(70).reset_index()
        rows = [{"date": str(day.date()), "ticker": "SPX", "high": high, "low": low, "close": close}
                for day, high, low, close in zip(days["Date"], days["High"], days["Low"], days["Close"])]
        request = urllib.request.Request(f"{url}/invocations", data=json.dumps({"dataframe_records": rows}).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            assert response.status == 200 and json.loads(response.read())["predictions"][0]["variance"] > 0
    finally:
        stop(process)
    first = said.read_text().splitlines()[0]
    assert f"version {moved.version}, models:/{FINANCE}@{alias})" in first, first


@pytest.mark.slow
def test_the_results_page_is_written_from_the_server(two_runs, tmp_path):
    """`usecases report` as a client with the login: the team's runs, read over HTTP from PostgreSQL, on its page."""
    _, client_env, _ = two_runs
    result = subprocess.run([sys.executable, "-m", "usecases", "report", "finance", "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=300, env=client_env)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = json.loads((tmp_path / "finance.local.json").read_text())["rows"]  # the team's rows, beside the project's
    assert [(row["kind"], row["preset"]) for row in rows] == [("run", "smoke")]
    assert f"| {rows[0]['cpu_model']} |" in (tmp_path / "finance.md").read_text()


@pytest.mark.slow
def test_a_wrong_login_is_one_line(team_server, monkeypatch, capsys):
    url, _, _ = team_server
    monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "admin")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "not-the-password")
    for command in (("run", "finance", "--preset", "smoke"), ("serve", "finance")):
        line = user_error(capsys, *command)
        assert f"MLFLOW_TRACKING_URI {url}" in line and "MLFLOW_TRACKING_PASSWORD" in line, line


def _never_exec(monkeypatch):
    def refused(*args):
        raise AssertionError("usecases server started mlflow server on a database it could not use")
    monkeypatch.setattr(os, "execv", refused)


def test_a_wrong_database_password_is_one_line(postgres, monkeypatch, capsys, tmp_path):
    _never_exec(monkeypatch)
    where = postgres.rsplit("@", 1)[1]
    line = user_error(capsys, "server", "--backend-store-uri", f"postgresql://mlflow:wrong-password@{where}/mlflow",
                      "--artifacts-destination", str(tmp_path / "artifacts"), "--auth")
    assert line == (f"error: --backend-store-uri postgresql://mlflow:***@{where}/mlflow: cannot use the database at "
                    f"{where} (password authentication failed for user \"mlflow\")")


def test_an_unreachable_database_is_one_line(monkeypatch, capsys, tmp_path):
    """One connection attempt, with a timeout (a host that never answers is given up in seconds, not the system's
    minutes), then one line."""
    import psycopg

    _never_exec(monkeypatch)
    port = free_port()  # nothing listens there
    attempts = []

    def connect(*args, **kwargs):
        attempts.append((kwargs.get("port"), kwargs.get("connect_timeout")))
        return real_connect(*args, **kwargs)

    real_connect = psycopg.connect
    monkeypatch.setattr(psycopg, "connect", connect)
    line = user_error(capsys, "server", "--backend-store-uri", f"postgresql://mlflow:secret@127.0.0.1:{port}/mlflow",
                      "--artifacts-destination", str(tmp_path / "artifacts"))
    assert len(attempts) == 1, attempts
    (attempt_port, timeout_s), = attempts
    assert attempt_port == port and timeout_s is not None and 0 < float(timeout_s) <= 15, attempts
    assert line == (f"error: --backend-store-uri postgresql://mlflow:***@127.0.0.1:{port}/mlflow: cannot use the "
                    f"database at 127.0.0.1:{port} (Connection refused)")


def test_auth_configures_mlflows_basic_auth_app(monkeypatch, capsys, tmp_path):
    """--auth: MLflow's basic-auth app, its users in the store's own database unless told otherwise, its
    configuration readable by this user only, and the admin's password from the environment alone."""
    from mlflow.server.auth.config import read_auth_config

    store = os.environ["MLFLOW_TRACKING_URI"]  # tests/conftest.py's SQLite store
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("MLFLOW_AUTH_CONFIG_PATH", raising=False)
    monkeypatch.delenv("MLFLOW_AUTH_ADMIN_PASSWORD", raising=False)
    executed = []
    monkeypatch.setattr(os, "execv", lambda path, argv: executed.append((argv, dict(os.environ))))
    line = user_error(capsys, "server", "--auth")
    assert "set MLFLOW_AUTH_ADMIN_PASSWORD to the password of the admin user 'admin'" in line and not executed
    monkeypatch.setenv("MLFLOW_AUTH_ADMIN_PASSWORD", "short")
    assert "needs at least 12 characters" in user_error(capsys, "server", "--auth")
    assert "go with --auth" in user_error(capsys, "server", "--default-permission", "EDIT")

    monkeypatch.setenv("MLFLOW_AUTH_ADMIN_PASSWORD", ADMIN_PASSWORD)
    done = in_process(capsys, "server", "--auth", "--default-permission", "EDIT", "--port", "5077", "--workers", "2")
    assert done.returncode is None and not done.stderr, done.stderr  # execv replaced the process
    (argv, env), = executed
    assert argv[argv.index("--app-name") + 1] == "basic-auth" and argv[argv.index("--workers") + 1] == "2"
    assert "MLFLOW_TRACKING_USERNAME=admin" in done.stdout and ADMIN_PASSWORD not in done.stdout
    config = Path(env["MLFLOW_AUTH_CONFIG_PATH"])
    assert config == tmp_path / "cache" / "gpu-usecases" / "server" / "auth-5077.ini"
    assert stat.S_IMODE(config.stat().st_mode) == 0o600
    assert env["MLFLOW_FLASK_SERVER_SECRET_KEY"] and env["MLFLOW_AUTH_ADMIN_PASSWORD"] == ADMIN_PASSWORD
    monkeypatch.setenv("MLFLOW_AUTH_CONFIG_PATH", str(config))
    read = read_auth_config()  # as MLflow's server reads it
    assert (read.database_uri, read.default_permission, read.admin_username) == (store, "EDIT", "admin")

    monkeypatch.delenv("MLFLOW_AUTH_CONFIG_PATH")
    unreachable = "postgresql://mlflow:secret@127.0.0.1:1/users"
    line = user_error(capsys, "server", "--auth", "--auth-database-uri", unreachable)
    assert line.startswith("error: --auth-database-uri postgresql://mlflow:***@127.0.0.1:1/users: cannot use")
    users = f"sqlite:///{tmp_path}/users%41.db"  # a % (as in a URL-encoded password) is special in the file
    executed.clear()
    in_process(capsys, "server", "--auth", "--auth-database-uri", users, "--port", "5077")
    (_, env), = executed
    monkeypatch.setenv("MLFLOW_AUTH_CONFIG_PATH", env["MLFLOW_AUTH_CONFIG_PATH"])
    assert read_auth_config().database_uri == users
