"""`usecases ui`, `server`, `compare` and `report`: the runs in the MLflow UI, a tracking server for a team, a use
case's runs by hardware, and its results page."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from common.errors import UserError
from usecases.cli import options
from usecases.cli.options import EXIT_OK


def register(commands) -> None:
    ui = options.add_command(commands, "ui", ui_command, help="open the MLflow UI on the local store",
                             description="Start the MLflow UI on the tracking store, on 127.0.0.1 only, one worker.")
    ui.add_argument("--port", type=int, default=5000, help="port on 127.0.0.1 (default: 5000)")
    _register_server(commands)

    compare = options.add_command(commands, "compare", compare_command, help="compare a use case's runs by hardware",
                                  description="The finished runs of a use case grouped by hardware, instance type "
                                              "and precision, with the primary metric, throughput, wall time and "
                                              "cost (when --set tracking.price_per_hour was given), best first.")
    compare.add_argument("name", help="use case (see `usecases list`)")
    compare.add_argument("--format", default="table", choices=["table", "markdown", "csv"], dest="output_format")

    report = options.add_command(commands, "report", report_command,
                                 help="write a use case's results page, docs/results/NAME.md, from the store",
                                 description="Merge the store's newest finished run per machine, preset and data set "
                                             "into docs/results/NAME.local.json, the project's own rows beside those "
                                             "of NAME.json that it pulls (with --upstream: into NAME.json), and render "
                                             "docs/results/NAME.md from both; the rows of past machines stay. Without "
                                             "NAME: every use case.")
    report.add_argument("name", nargs="?", help="use case (see `usecases list`); default: every one")
    report.add_argument("--store", metavar="URI", help="the tracking store to read (default: MLFLOW_TRACKING_URI, "
                                                       "else the local store)")
    report.add_argument("--check", action="store_true", help="only render from the JSON and exit 2 when the page "
                                                             "differs (a hand edit)")
    report.add_argument("--out", type=Path, metavar="DIR", help="the results folder (default: docs/results/ of the "
                                                                "clone)")
    report.add_argument("--upstream", action="store_true", help="merge into NAME.json, the rows the project publishes "
                                                                "(its maintainers'); default: NAME.local.json")


def _register_server(commands) -> None:
    server = options.add_command(commands, "server", server_command,
                                 help="start an MLflow tracking server on the local store, for a team",
                                 description="Serve the local store (mlflow/mlflow.db, artifacts in "
                                             "mlflow/artifacts/) to other processes and machines: runs, the "
                                             "registry, artifacts and the UI.")
    server.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default: 127.0.0.1; 0.0.0.0 exposes it to the network)")
    server.add_argument("--port", type=int, default=5000, help="port (default: 5000)")
    server.add_argument("--backend-store-uri", metavar="URI",
                        help="the database of runs and models, e.g. postgresql://user@db/mlflow (default: "
                             "MLFLOW_TRACKING_URI when it names a database, else the local store)")
    server.add_argument("--artifacts-destination", metavar="DIR_OR_URI",
                        help="where the server keeps artifacts: a folder or s3://bucket/path (default: artifacts/ "
                             "beside a SQLite store)")
    server.add_argument("--workers", type=int, help="worker processes of the server (default: MLflow's, 4)")
    server.add_argument("--auth", action="store_true",
                        help="require a login (MLflow's basic-auth app): the admin user (MLFLOW_AUTH_ADMIN_USERNAME, "
                             "default admin) is created on the first start with the password in "
                             "MLFLOW_AUTH_ADMIN_PASSWORD, never on the command line; clients log in with "
                             "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD")
    server.add_argument("--auth-database-uri", metavar="URI",
                        help="with --auth: the database of users and permissions (default: the backend store's, "
                             "in tables of their own)")
    server.add_argument("--default-permission", choices=("READ", "USE", "EDIT", "MANAGE", "NO_PERMISSIONS"),
                        help="with --auth: what every user may do with experiments and models that nobody granted "
                             "them (default: READ; EDIT lets a team log runs into each other's experiments)")


def print_runs_links(names: list[str] | None, port: int = 5000) -> None:
    """Each use case's Training runs view (MLflow 3 opens an experiment on its GenAI Overview instead)."""
    from common.tracking.links import training_runs_links
    from common.tracking.stores import tracking_uri

    for name, link in training_runs_links(tracking_uri(), names, ui_url=f"http://127.0.0.1:{port}").items():
        print(f"  {name}: {link}", flush=True)


def ui_command(args: argparse.Namespace) -> int:
    """Become MLflow's UI, so Ctrl-C and SIGTERM reach it; one worker: four took 13 s to start on 2 cores, one 5 s."""
    from common.tracking.stores import tracking_uri

    uri = tracking_uri()
    print(f"MLflow UI on http://127.0.0.1:{args.port} (store: {uri}); Ctrl-C to stop. Each use case's runs:",
          flush=True)
    print_runs_links(None, args.port)
    os.execv(sys.executable, [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", uri,
                              "--host", "127.0.0.1", "--port", str(args.port), "--workers", "1"])


def server_command(args: argparse.Namespace) -> int:
    """Replace this process with `mlflow server`, so that Ctrl-C and SIGTERM reach it directly."""
    from common.tracking.server import ServerRequest, server_command as command_for

    command, announcement = command_for(ServerRequest(
        args.host, args.port, args.backend_store_uri, args.artifacts_destination, args.workers, args.auth,
        args.auth_database_uri, args.default_permission))
    print(announcement, flush=True)
    os.execv(sys.executable, command)


def compare_command(args: argparse.Namespace) -> int:
    from common.tabular import render_table
    from common.tracking.comparison import compare_runs

    metric, mode = options.usecase(args.name).primary_metric
    table = compare_runs(args.name, metric, mode)
    if args.output_format == "csv":
        print(table.to_csv(index=False), end="")
    elif args.output_format == "markdown":
        print(render_table(table, number_format=".4g"))
    else:
        print(table.to_string(index=False, float_format=lambda value: f"{value:.4g}"))
    return EXIT_OK


def report_command(args: argparse.Namespace) -> int:
    """Every use case's page without a name; one with no finished run in the store keeps the page it has."""
    from common.tracking import results
    from common.tracking.stores import tracking_uri

    folder = args.out or results.results_folder()
    if args.check:
        names = [args.name] if args.name else results.pages(folder)
        for page in names:
            results.check(page, folder)
        print(f"current: {', '.join(f'{folder / page}.md' for page in names) or 'no pages'}")
        return EXIT_OK
    store = args.store or tracking_uri()
    chosen = {args.name: options.usecase(args.name)} if args.name else {
        other: usecase for other, usecase in options.loaded().items() if not isinstance(usecase, UserError)}
    for other, usecase in chosen.items():
        page = results.report(other, usecase.primary_metric, store, folder, required=args.name is not None,
                              columns=results.PageColumns.of(usecase), upstream=args.upstream)
        print(f"{other}: {page or f'no finished run in {store}, and no page yet'}", flush=True)
    return EXIT_OK
