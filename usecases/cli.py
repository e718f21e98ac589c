"""`usecases`: list, run, bench, demo, ui, server, serve and compare. Exit 0 on success, 2 on a user error, 1 on an internal failure.

Only the standard library and torch are imported before `use_gpu_frames`, so cudf.pandas can take over pandas.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import logging
import os
import shutil
import sys
import time
import traceback
from pathlib import Path

from common.errors import DataUnavailable, UserError
from common.interrupt import Terminated, stop_on_signals

EXIT_OK, EXIT_FAILURE, EXIT_USER_ERROR = 0, 1, 2
log = logging.getLogger("usecases")


class _Parser(argparse.ArgumentParser):
    """Usage mistakes in one line, like every other user error."""

    def error(self, message: str):
        self.exit(EXIT_USER_ERROR, f"error: {message} (see: {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="usecases", description="GPU machine-learning pipelines, tracked in MLflow.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    commands.add_parser("list", help="list the use cases and their presets", description="List the use cases.")

    run = commands.add_parser("run", help="run one use case", description="Run one use case end to end.")
    run.add_argument("name", help="use case (see `usecases list`)")
    _add_run_options(run)
    _add_config_options(run)
    run.add_argument("--resume", action="store_true", help="continue the last interrupted run of this preset")

    bench = commands.add_parser("bench", help="measure a use case's pipeline against a plain baseline loop",
                                description="Run a use case's benchmark: our pipeline and a plain loop on the "
                                            "same data in one run, throughputs and their ratio.")
    bench.add_argument("name", help="use case with a benchmark (see `usecases list`)")
    _add_run_options(bench)
    _add_config_options(bench)

    demo = commands.add_parser("demo", help="run every use case on its default data",
                               description="Run every use case with its default preset; a data set that cannot "
                                           "be had is replaced by the use case's synthetic data.")
    _add_run_options(demo)

    ui = commands.add_parser("ui", help="open the MLflow UI on the local store",
                             description="Start the MLflow UI on the tracking store, on 127.0.0.1 only.")
    ui.add_argument("--port", type=int, default=5000, help="port on 127.0.0.1 (default: 5000)")

    serve = commands.add_parser("serve", help="serve a use case's champion model over REST",
                                description="Serve the registered champion of a use case (or any model URI) with "
                                            "`mlflow models serve --env-manager local`; POST JSON to /invocations.")
    serve.add_argument("name", help="use case (see `usecases list`)")
    serve.add_argument("--model-uri", help="default: models:/gpu-usecases-NAME@champion")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    serve.add_argument("--port", type=int, default=5001, help="port (default: 5001)")

    compare = commands.add_parser("compare", help="compare a use case's runs by hardware",
                                  description="The finished runs of a use case grouped by hardware, instance type "
                                              "and precision, with the primary metric, throughput, wall time and "
                                              "cost (when --set tracking.price_per_hour was given), best first.")
    compare.add_argument("name", help="use case (see `usecases list`)")
    compare.add_argument("--format", default="table", choices=["table", "markdown", "csv"], dest="output_format")

    server = commands.add_parser("server", help="start an MLflow tracking server on the local store, for a team",
                                 description="Serve the local store (mlflow/mlflow.db, artifacts in "
                                             "mlflow/artifacts/) to other processes and machines: runs, the "
                                             "registry, artifacts and the UI.")
    server.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default: 127.0.0.1; 0.0.0.0 exposes it to the network)")
    server.add_argument("--port", type=int, default=5000, help="port (default: 5000)")
    return parser


def _add_config_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="default", help="config preset: smoke, default or full (default: default)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key, e.g. --set train.epochs=5 (repeatable)")
    parser.add_argument("--data", type=Path, help="a data file or folder of your own instead of the preset's data")
    parser.add_argument("--summary", type=Path, metavar="FILE", help="also write summary.json here")


def _add_run_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                        help="where torch runs: auto picks CUDA when there is a GPU")
    parser.add_argument("--frames", default="auto", choices=["auto", "pandas"],
                        help="DataFrame backend: auto uses cuDF through cudf.pandas on a GPU; pandas forces the CPU")


def _list() -> int:
    from common.config import available_presets
    from usecases import USECASES, load_usecase

    for name in USECASES:
        module = load_usecase(name)
        print(f"{name:10} {module.DESCRIPTION}  [presets: {', '.join(available_presets(module.PRESETS_DIR))}]")
    return EXIT_OK


def _checkpoint_root(usecase: str, preset: str) -> Path:
    from common.tracking import project_root

    base = Path(os.environ.get("USECASES_CHECKPOINT_DIR", project_root() / "checkpoints"))
    return base / usecase / preset


def _job_entry(module, name: str, bench: bool):
    """The use case's `pipeline.run`, or its `benchmark.benchmark` for `usecases bench`."""
    if not bench:
        return importlib.import_module(f"{module.__name__}.pipeline").run
    if importlib.util.find_spec(f"{module.__name__}.benchmark") is None:
        raise UserError(f"use case '{name}' has no benchmark")
    return importlib.import_module(f"{module.__name__}.benchmark").benchmark


def _resume_run_id(state_file: Path, params: dict, data_tags: dict, preset: str) -> str:
    """The interrupted run to continue, if it ran on the same config and the same data."""
    if not state_file.is_file():
        raise UserError(f"--resume: no interrupted run of preset '{preset}' to resume ({state_file} is missing)")
    state = json.loads(state_file.read_text())
    for key in sorted(set(params) | set(state["params"])):
        if params.get(key) != state["params"].get(key):
            raise UserError(f"--resume: config key '{key}' is {params.get(key)!r} now but was "
                            f"{state['params'].get(key)!r} in the interrupted run")
    if state["data"].get("data_sha256") != data_tags.get("data_sha256"):
        raise UserError(f"--resume: the data ({data_tags.get('data_source')}) differs from the interrupted run's "
                        f"({state['data'].get('data_source')}, another SHA-256)")
    return state["run_id"]


def run_usecase(name: str, preset: str, overrides: list[str], device: str, frames: str,
                data: Path | None = None, summary: Path | None = None, resume: bool = False,
                bench: bool = False) -> dict:
    """One tracked run; with `bench`, the use case's benchmark in the `<name>-benchmark` experiment."""
    from common.runtime import use_gpu_frames

    started = time.perf_counter()
    backend = use_gpu_frames(frames)

    from common.config import flatten, load_config
    from common.job import Job
    from common.runtime import hardware_info, make_runtime, seed_everything, shutdown
    from common.tracking import check_reachable, tracked_run, tracking_uri, write_json_atomic, write_summary
    from usecases import load_usecase

    check_reachable(tracking_uri())
    module = load_usecase(name)
    entry = _job_entry(module, name, bench)
    config = load_config(module.Config, module.PRESETS_DIR, preset, overrides)
    if data is not None and not data.exists():
        raise UserError(f"--data {data}: no such file or folder")
    if summary is not None and not (summary.parent.is_dir() and os.access(summary.parent, os.W_OK)):
        raise UserError(f"--summary {summary}: cannot write there (no such folder, or no permission)")
    runtime = make_runtime(device, config.runtime.precision, config.runtime.cpu_threads)
    if not runtime.is_main:
        for logger in ("usecases", "common"):
            logging.getLogger(logger).setLevel(logging.WARNING)
    try:
        seed_everything(config.runtime.seed, config.runtime.deterministic)
        loaded, data_tags = importlib.import_module(f"{module.__name__}.pipeline").load_data(config, data)
        experiment = f"{name}-benchmark" if bench else name
        checkpoint_dir = _checkpoint_root(experiment, preset)
        state_file = checkpoint_dir / "run.json"
        params = flatten(config)
        run_id = _resume_run_id(state_file, params, data_tags, preset) if resume else None
        if not resume and runtime.is_main and checkpoint_dir.exists():
            shutil.rmtree(checkpoint_dir)
        if runtime.distributed:
            import torch.distributed as dist

            dist.barrier()
        tags = {"preset": preset, "device": runtime.device.type, "precision": runtime.precision,
                "world_size": runtime.world_size, "dataframe_backend": backend, **hardware_info(), **data_tags,
                **{key: value for key, value in config.tracking.model_dump().items() if value is not None}}
        with tracked_run(experiment, config, tags, is_main=runtime.is_main, run_id=run_id,
                         run_name=f"{experiment}-{preset}") as tracker:
            if runtime.is_main:
                write_json_atomic({"run_id": tracker.run_id, "params": params, "data": data_tags}, state_file)
            job = Job(runtime, tracker, checkpoint_dir, resume)
            models = entry(config, loaded, job)
            if not runtime.is_main:
                return {}
            columns = module.summary_columns(config) if hasattr(module, "summary_columns") and not bench else None
            result = write_summary(tracker, experiment, preset, runtime.device.type, models, summary, columns)
            _log_total_time_and_cost(tracker, config.tracking.price_per_hour, time.perf_counter() - started)
            if not bench:
                _register(tracker, name, module.PRIMARY_METRIC, models, data_tags["data_sha256"])
        shutil.rmtree(checkpoint_dir, ignore_errors=True)  # finished: nothing left to resume
        return result
    finally:
        shutdown(runtime)


def _log_total_time_and_cost(tracker, price_per_hour: float | None, seconds: float) -> None:
    metrics = {"time/total_s": seconds}
    if price_per_hour is not None:
        metrics["cost"] = price_per_hour * seconds / 3600
    tracker.log_metrics(metrics)


def _register(tracker, name: str, primary: tuple[str, str], models: dict, data_sha256: str) -> None:
    """Log the served model's primary metric and register the model as champion or challenger."""
    from common.tracking import register_champion

    metric, mode = primary
    if tracker.model_uri is None or tracker.served_model not in models:
        return
    value = models[tracker.served_model][metric]
    tracker.set_tags({"primary_metric": metric, "primary_model": tracker.served_model})
    tracker.log_metrics({f"primary/{metric}": value})
    register_champion(tracker, name, metric, mode, value, data_sha256)


def _demo(args: argparse.Namespace) -> int:
    from usecases import USECASES

    for name in USECASES:
        print(f"== {name}", flush=True)
        try:
            run_usecase(name, "default", [], args.device, args.frames)
        except DataUnavailable as exc:
            print(f"{name}: {exc}; running on synthetic data instead", flush=True)
            run_usecase(name, "default", ["data.source=synthetic"], args.device, args.frames)
    print("Done. Browse the runs with `usecases ui` (from the clone: make ui), then open http://127.0.0.1:5000")
    return EXIT_OK


def _ui(port: int) -> int:
    """Replace this process with MLflow's server, so Ctrl-C and SIGTERM reach it and its workers directly."""
    from common.tracking import tracking_uri

    uri = tracking_uri()
    print(f"MLflow UI on http://127.0.0.1:{port} (store: {uri}); Ctrl-C to stop", flush=True)
    os.execv(sys.executable, [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", uri,
                              "--host", "127.0.0.1", "--port", str(port)])


def _serve(name: str, model_uri: str | None, host: str, port: int) -> int:
    """Replace this process with MLflow's scoring server for the use case's champion (or `model_uri`)."""
    import mlflow
    from mlflow.exceptions import MlflowException

    from common.tracking import check_reachable, registered_name, tracking_uri
    from usecases import load_usecase

    load_usecase(name)
    uri = tracking_uri()
    check_reachable(uri)
    mlflow.set_tracking_uri(uri)
    if model_uri is None:
        try:
            mlflow.MlflowClient().get_model_version_by_alias(registered_name(name), "champion")
        except MlflowException:
            raise UserError(f"no champion of '{name}' in {uri} yet (run `usecases run {name}` first, "
                            f"or pass --model-uri)") from None
        model_uri = f"models:/{registered_name(name)}@champion"
    print(f"Serving {model_uri} on http://{host}:{port}/invocations; Ctrl-C to stop", flush=True)
    os.execve(sys.executable, [sys.executable, "-m", "mlflow", "models", "serve", "-m", model_uri, "--env-manager",
                               "local", "--host", host, "--port", str(port)],
              {**os.environ, "MLFLOW_TRACKING_URI": uri,  # MLflow starts `uvicorn` by name: this venv's first
               "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])})


def _compare(name: str, output_format: str) -> int:
    from common.tracking import compare_runs
    from usecases import load_usecase

    metric, mode = load_usecase(name).PRIMARY_METRIC
    table = compare_runs(name, metric, mode)
    if output_format == "csv":
        print(table.to_csv(index=False), end="")
    elif output_format == "markdown":
        cells = [[str(value) if isinstance(value, str) else f"{value:.4g}" for value in row]
                 for row in table.itertuples(index=False)]
        print("| " + " | ".join(table.columns) + " |")
        print("|" + " --- |" * len(table.columns))
        print("\n".join("| " + " | ".join(row) + " |" for row in cells))
    else:
        print(table.to_string(index=False, float_format=lambda value: f"{value:.4g}"))
    return EXIT_OK


def _server(host: str, port: int) -> int:
    """Replace this process with `mlflow server`, so that Ctrl-C and SIGTERM reach it directly."""
    from common.tracking import default_tracking_uri, local_store

    artifacts = local_store() / "artifacts"
    artifacts.mkdir(parents=True, exist_ok=True)
    print(f"MLflow tracking server on http://{host}:{port} (store: {default_tracking_uri()}, artifacts: {artifacts})\n"
          f"Track into it from any shell with: export MLFLOW_TRACKING_URI=http://{host}:{port}", flush=True)
    os.execv(sys.executable, [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", default_tracking_uri(),
                              "--artifacts-destination", str(artifacts), "--serve-artifacts", "--host", host,
                              "--port", str(port)])


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    if not sys.stderr.isatty():
        os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    for name in ("usecases", "common"):
        logging.getLogger(name).setLevel(logging.INFO)
    args = _parser().parse_args(argv)
    stop_on_signals()
    try:
        if args.command == "list":
            return _list()
        if args.command == "ui":
            return _ui(args.port)
        if args.command == "server":
            return _server(args.host, args.port)
        if args.command == "serve":
            return _serve(args.name, args.model_uri, args.host, args.port)
        if args.command == "compare":
            return _compare(args.name, args.output_format)
        if args.command == "demo":
            return _demo(args)
        run_usecase(args.name, args.preset, args.overrides, args.device, args.frames, args.data, args.summary,
                    getattr(args, "resume", False), bench=args.command == "bench")
        return EXIT_OK
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
