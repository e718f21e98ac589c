"""`usecases`: one module per area registers its commands, each handler calling the library; `main` dispatches and
maps errors to exit codes: 0 on success, 2 on a user error (one line), 1 on an internal failure (a traceback). Only
the standard library is imported before `use_gpu_frames`, so cudf.pandas can take over pandas."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback

from common.errors import UserError
from common.runtime.interrupt import Terminated, stop_on_signals
from usecases.cli import advise, bench, options, project, runs, serve, tracking
from usecases.cli.options import EXIT_FAILURE, EXIT_USER_ERROR

AREAS = (project, runs, bench, serve, tracking, advise)  # in the order `usecases --help` lists their commands


def parser() -> argparse.ArgumentParser:
    """Every command and option of `usecases` (docs/cli.md is written from it: `make cli-docs`)."""
    root = options.Parser(prog="usecases", description="GPU machine-learning pipelines, tracked in MLflow.")
    commands = root.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for area in AREAS:
        area.register(commands)
    return root


def _quiet_logs() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    if not sys.stderr.isatty():
        os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    for name in ("usecases", "common"):
        logging.getLogger(name).setLevel(logging.INFO)
    for name in ("mlflow.store.db.utils", "alembic"):  # "Creating initial MLflow database tables...": not news
        logging.getLogger(name).setLevel(logging.WARNING)


def main(argv: list[str] | None = None) -> int:
    _quiet_logs()
    argv = sys.argv[1:] if argv is None else list(argv)
    moved = bench.old_spelling(argv)
    if moved is not None:
        print(f"error: {moved}", file=sys.stderr)
        return EXIT_USER_ERROR
    args = parser().parse_args(argv)
    stop_on_signals()
    try:
        return args.handler(args)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("interrupted; continue with --resume", file=sys.stderr)
        return 130
    except Terminated:
        print("terminated; continue with --resume", file=sys.stderr)
        return 143
    except Exception:
        traceback.print_exc()
        return EXIT_FAILURE
