"""Where runs are tracked (the local SQLite store, else MLFLOW_TRACKING_URI's), what `usecases server` serves, and a
server that cannot be reached or refuses the login, said in one line before any work starts."""

from __future__ import annotations

import os
import urllib.request
from pathlib import Path

from common.errors import UserError
from common.paths import project_root


def local_store() -> Path:
    return project_root() / "mlflow"


def default_tracking_uri() -> str:
    return f"sqlite:///{local_store() / 'mlflow.db'}"


def tracking_uri() -> str:
    uri = os.environ.get("MLFLOW_TRACKING_URI") or default_tracking_uri()
    if uri == default_tracking_uri():
        local_store().mkdir(parents=True, exist_ok=True)
    return uri


def server_stores(backend_store_uri: str | None, artifacts_destination: str | None) -> tuple[str, str]:
    """The store named by --backend-store-uri, else by MLFLOW_TRACKING_URI, else the local one; artifacts in
    --artifacts-destination, else beside a SQLite store (where runs tracked straight into it put them)."""
    store = backend_store_uri or os.environ.get("MLFLOW_TRACKING_URI") or default_tracking_uri()
    source = "--backend-store-uri" if backend_store_uri else "MLFLOW_TRACKING_URI"
    if store.startswith(("http://", "https://")):
        raise UserError(f"{source} {store} is a tracking server, not a store: a server serves a database "
                        f"(pass --backend-store-uri sqlite:///PATH or postgresql://..., or unset MLFLOW_TRACKING_URI)")
    if artifacts_destination is None:
        if not store.startswith("sqlite:///"):
            raise UserError(f"{source} {store}: say where the server keeps artifacts with --artifacts-destination "
                            f"(a folder, or s3://bucket/path)")
        artifacts_destination = str(Path(store.removeprefix("sqlite:///")).parent / "artifacts")
    if "://" not in artifacts_destination:
        Path(artifacts_destination).mkdir(parents=True, exist_ok=True)
    if store.startswith("sqlite:///"):
        Path(store.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    return store, artifacts_destination


def check_reachable(uri: str, timeout_s: float = 5.0) -> None:
    """Fail in seconds, before any training, when a tracking server cannot be reached (MLflow would retry for
    minutes) or refuses the login (401 to a client without the right one): one line instead of MLflow's traceback."""
    if not uri.startswith(("http://", "https://")):
        return
    try:
        with urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=timeout_s) as response:
            response.read()
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise UserError(f"MLFLOW_TRACKING_URI {uri}: the tracking server cannot be reached ({reason})") from None
    from mlflow.utils.credentials import get_default_host_creds
    from mlflow.utils.rest_utils import http_request
    try:
        response = http_request(get_default_host_creds(uri), "/api/2.0/mlflow/experiments/search", "GET",
                                max_retries=0, timeout=timeout_s, params={"max_results": 1})
    except Exception:  # anything else is MLflow's to report, on its first call
        return
    if response.status_code == 401:
        user = os.environ.get("MLFLOW_TRACKING_USERNAME")
        who = f"the login of MLFLOW_TRACKING_USERNAME={user}" if user else "a client without a login"
        raise UserError(f"MLFLOW_TRACKING_URI {uri}: the tracking server refused {who} (401: set "
                        f"MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD to a user of the server)")
