"""The links to each use case's Training runs view: the experiment ids of the store, the UI's runs-table route."""
import os
from pathlib import Path

import mlflow

from common.tracking.links import DEFAULT_UI_URL, training_runs_links
from common.tracking.runs import ensure_experiment


def test_a_store_uri_links_each_experiment_to_its_runs_table_on_the_ui_address():
    uri = os.environ["MLFLOW_TRACKING_URI"]
    ids = {name: ensure_experiment(name) for name in ("alpha", "beta")}
    mlflow.MlflowClient(uri).create_experiment("someone-else")  # not one of ours: never linked

    assert training_runs_links(uri) == {name: f"{DEFAULT_UI_URL}/#/experiments/{ids[name]}/runs" for name in ids}
    assert training_runs_links(uri, ui_url="http://127.0.0.1:5007/") == {
        name: f"http://127.0.0.1:5007/#/experiments/{ids[name]}/runs" for name in ids}


def test_named_use_cases_without_an_experiment_get_no_link():
    uri = os.environ["MLFLOW_TRACKING_URI"]
    alpha = ensure_experiment("alpha")
    assert training_runs_links(uri, ["alpha", "never-run"]) == {
        "alpha": f"{DEFAULT_UI_URL}/#/experiments/{alpha}/runs"}


def test_the_runs_table_route_is_in_the_installed_mlflow_ui():
    """The link's route is the UI bundle's runs tab; an MLflow upgrade that renames it fails here, not in a user's
    browser."""
    bundle = Path(mlflow.__file__).parent / "server" / "js" / "build" / "static" / "js"
    assert any('"/experiments/:experimentId/runs"' in path.read_text(errors="ignore")
               for path in bundle.glob("*.js")), f"no runs-table route in {bundle}"
