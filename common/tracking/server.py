"""The team's tracking server (`usecases server`): the `mlflow server` command, its database and MLflow's basic-auth
app checked first, so that a wrong address or password is one line here rather than a traceback of every worker."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

from common.errors import UserError
from common.tracking.stores import server_stores


@dataclass(frozen=True)
class ServerRequest:
    host: str = "127.0.0.1"
    port: int = 5000
    backend_store_uri: str | None = None
    artifacts_destination: str | None = None
    workers: int | None = None
    auth: bool = False
    auth_database_uri: str | None = None
    default_permission: str | None = None


def server_command(request: ServerRequest) -> tuple[list[str], str]:
    """The `mlflow server` command line, and the lines that tell a team how to track into it."""
    store, artifacts = server_stores(request.backend_store_uri, request.artifacts_destination)
    if not request.auth and (request.auth_database_uri or request.default_permission):
        raise UserError("--auth-database-uri and --default-permission go with --auth")
    if request.workers is not None and request.workers < 1:
        raise UserError(f"--workers {request.workers}: expected at least 1")
    check_database(store, "--backend-store-uri" if request.backend_store_uri else "MLFLOW_TRACKING_URI")
    command = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", store, "--artifacts-destination",
               str(artifacts), "--serve-artifacts", "--host", request.host, "--port", str(request.port)]
    if request.workers:
        command += ["--workers", str(request.workers)]
    login = ""
    if request.auth:
        username = basic_auth(store, request.auth_database_uri, request.default_permission, request.port)
        command += ["--app-name", "basic-auth"]
        login = f" MLFLOW_TRACKING_USERNAME={username} MLFLOW_TRACKING_PASSWORD=<your password>"
    address = f"http://{request.host}:{request.port}"
    return command, (f"MLflow tracking server on {address} (store: {without_password(store)}, artifacts: "
                     f"{artifacts}{', login required' if request.auth else ''})\n"
                     f"Track into it from any shell with: export MLFLOW_TRACKING_URI={address}{login}")


AUTH_PASSWORD_MIN_LENGTH = 12  # MLflow's rule for every password of its basic-auth app


def basic_auth(store: str, auth_database_uri: str | None, default_permission: str | None, port: int) -> str:
    """Set up MLflow's basic-auth app and check its database; the admin's user name. MLFLOW_AUTH_ADMIN_PASSWORD only
    matters on the first start, which creates the admin; the config (the database's password) is written 0600."""
    import configparser
    import importlib.util
    import secrets
    import tempfile

    from common.paths import cache_dir

    if importlib.util.find_spec("flask_wtf") is None:
        raise UserError("--auth needs MLflow's basic-auth app: pip install 'gpu-usecases[team]' (or 'mlflow[auth]')")
    username = os.environ.get("MLFLOW_AUTH_ADMIN_USERNAME") or "admin"
    own_config = os.environ.get("MLFLOW_AUTH_CONFIG_PATH")
    if own_config:
        if auth_database_uri or default_permission:
            raise UserError(f"MLFLOW_AUTH_CONFIG_PATH {own_config} is read instead of --auth-database-uri and "
                            f"--default-permission: give one or the other")
        config = configparser.ConfigParser()
        if not config.read(own_config) or not config.has_option("mlflow", "database_uri"):
            raise UserError(f"MLFLOW_AUTH_CONFIG_PATH {own_config}: not an MLflow basic-auth configuration (no "
                            f"[mlflow] database_uri)")
        database = config["mlflow"]["database_uri"]
        username = os.environ.get("MLFLOW_AUTH_ADMIN_USERNAME") or config["mlflow"].get("admin_username") or "admin"
        source = f"MLFLOW_AUTH_CONFIG_PATH {own_config}: database_uri"
    else:
        database = auth_database_uri or store
        source = "--auth-database-uri" if auth_database_uri else "--backend-store-uri (the users of --auth)"
    if database != store:
        check_database(database, source)
    password = os.environ.get("MLFLOW_AUTH_ADMIN_PASSWORD")
    if not password and not _has_user(database, username):
        raise UserError(f"--auth: set MLFLOW_AUTH_ADMIN_PASSWORD to the password of the admin user '{username}', "
                        f"created on this first start (at least {AUTH_PASSWORD_MIN_LENGTH} characters)")
    if password and len(password) < AUTH_PASSWORD_MIN_LENGTH:
        raise UserError(f"MLFLOW_AUTH_ADMIN_PASSWORD: the admin's password needs at least "
                        f"{AUTH_PASSWORD_MIN_LENGTH} characters, it has {len(password)}")
    if not own_config:
        settings = {"default_permission": default_permission or "READ", "database_uri": database,
                    "admin_username": username,
                    "authorization_function": "mlflow.server.auth:authenticate_request_basic_auth"}
        folder = cache_dir("server")
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        descriptor, written = tempfile.mkstemp(dir=folder, prefix=f".auth-{port}-", suffix=".ini")  # mode 0600
        with os.fdopen(descriptor, "w") as file:
            # MLflow reads it with interpolation, where a % (of a URL-encoded password) is written %%
            file.write("[mlflow]\n" + "".join(f"{key} = {value.replace('%', '%%')}\n"
                                                for key, value in settings.items()))
        path = folder / f"auth-{port}.ini"
        os.replace(written, path)
        os.environ["MLFLOW_AUTH_CONFIG_PATH"] = str(path)
    # The key of the auth app's forms (CSRF): one for all the workers of this server, which inherit it.
    os.environ.setdefault("MLFLOW_FLASK_SERVER_SECRET_KEY", secrets.token_hex(32))
    return username


def without_password(uri: str) -> str:
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError
    try:
        return make_url(uri).render_as_string(hide_password=True)
    except (ArgumentError, ValueError):
        return uri


def _database_engine(uri: str, source: str):
    """An engine on `uri` that gives up on an unreachable host within seconds, or a one-line error."""
    import sqlalchemy
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError
    from sqlalchemy.pool import NullPool
    try:
        url = sqlalchemy.engine.make_url(uri)
    except (ArgumentError, ValueError):
        raise UserError(f"{source} {uri}: not a database URI (e.g. postgresql://user@host:5432/mlflow)") from None
    connect_args = {"connect_timeout": 5} if url.get_backend_name() in ("postgresql", "mysql") else {}
    try:
        return url, sqlalchemy.create_engine(url, connect_args=connect_args, poolclass=NullPool)
    except (ImportError, NoSuchModuleError) as exc:
        shown = url.render_as_string(hide_password=True)
        raise UserError(f"{source} {shown}: no driver for this database here ({exc}); for PostgreSQL: "
                        f"pip install 'gpu-usecases[team]'") from None


def check_database(uri: str, source: str) -> None:
    """An unreachable host, a wrong password or a missing database: one line naming the host and port, and why."""
    if uri.startswith("sqlite:"):
        return  # a file, made if missing
    from sqlalchemy import text
    from sqlalchemy.exc import DBAPIError
    url, engine = _database_engine(uri, source)
    try:
        with engine.connect() as connection:
            connection.execute(text("SELECT 1"))
    except DBAPIError as exc:
        port = url.port or {"postgresql": 5432, "mysql": 3306}.get(url.get_backend_name(), "")
        where = f"{url.host or 'localhost'}:{port}"
        raise UserError(f"{source} {url.render_as_string(hide_password=True)}: cannot use the database at {where} "
                        f"({_database_reason(exc)})") from None
    finally:
        engine.dispose()


def _database_reason(exc) -> str:
    """What the database's driver said, in one line: 'password authentication failed for user "mlflow"'."""
    import re
    said = " ".join(str(getattr(exc, "orig", None) or exc).split("\n")[0].split())
    said = re.sub(r"^(connection failed: )?connection to server at [^,]+, port \d+ failed: ", "", said)
    return re.sub(r"^FATAL: +", "", said).strip() or type(exc).__name__


def _has_user(uri: str, username: str) -> bool:
    """Whether the basic-auth app's database already holds `username` (its admin, made on the first start)."""
    from sqlalchemy import text
    from sqlalchemy.exc import SQLAlchemyError
    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).is_file():
        return False
    _, engine = _database_engine(uri, "--auth-database-uri")
    try:
        with engine.connect() as connection:
            return connection.execute(text("SELECT 1 FROM users WHERE username = :name"),
                                      {"name": username}).first() is not None
    except SQLAlchemyError:  # no users table yet
        return False
    finally:
        engine.dispose()
