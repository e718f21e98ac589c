"""`usecases`: list, run, bench, demo, new, export, ui, server, serve, compare, report and advise: argument parsing
and printing; the work is in common/ (runner, scaffold, tracking). Exit 0 on success, 2 on a user error, 1 on an
internal failure.

Only the standard library and torch are imported before `use_gpu_frames`, so cudf.pandas can take over pandas.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

from common.errors import UserError
from common.runtime.interrupt import Terminated, stop_on_signals

EXIT_OK, EXIT_FAILURE, EXIT_USER_ERROR = 0, 1, 2
SLIDES_PRESET = "slides-smoke"  # what `bench --slides` runs unless a preset is given
log = logging.getLogger("usecases")


def _positive(option: str):
    """A number above zero, or a one-line usage error naming the option."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not value > 0 or math.isinf(value):
            raise argparse.ArgumentTypeError(f"expected a positive number, got '{text}'")
        return value
    parse.__name__ = option
    return parse


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
    resume = run.add_mutually_exclusive_group()
    resume.add_argument("--resume", action="store_true", help="continue the last interrupted run of this preset")
    resume.add_argument("--resume-if-interrupted", action="store_true",
                        help="continue the last interrupted run of this preset if there is one, else start one (what "
                             "a spot instance's recovery or a restarted Kubernetes Job runs)")

    bench = commands.add_parser("bench", help="measure a use case's pipeline against a plain baseline loop",
                                description="Run a use case's benchmark: our pipeline and a plain loop on the "
                                            "same data in one run, throughputs and their ratio. With --scale: its "
                                            "`scale` preset at several sizes on each engine, wall time and peak "
                                            "memory against size.")
    bench.add_argument("name", help="use case with a benchmark (see `usecases list`)")
    _add_run_options(bench)
    _add_config_options(bench)
    bench.add_argument("--scale", action="store_true", help="the cost-growth benchmark (a NAME-scale run)")
    bench.add_argument("--sizes", default="1,4,16", help="with --scale: multiples of the base size (default 1,4,16)")
    bench.add_argument("--scale-engines", default="pandas,dask", metavar="ENGINES",
                       help="with --scale: the engines to compare (default pandas,dask)")
    bench.add_argument("--base", type=int, help="with --scale: the 1x value of the use case's size key (default: "
                                                "its declared one)")
    bench.add_argument("--timeout-s", type=float, help="with --scale: stop a run after this long, a row saying so")
    bench.add_argument("--serve", action="store_true", help="the serving benchmark: the use case's own server "
                                                            "against MLflow's scoring server on the same model")
    bench.add_argument("--model-uri", help="with --serve: the model (default: the champion on the data trained on "
                                           "last)")
    bench.add_argument("--concurrency", default="1,8,32", help="with --serve: concurrent clients (default 1,8,32)")
    bench.add_argument("--seconds", type=float, default=20.0, help="with --serve: load per concurrency (default 20)")
    bench.add_argument("--serve-workers", type=int, help="with --serve: our server's workers (default: one per core)")
    bench.add_argument("--batch-ms", type=float, metavar="MS",
                       help="with --serve: also measure our server micro-batching concurrent requests for up to MS "
                            "milliseconds (server ours+batch; ours then runs unbatched)")
    bench.add_argument("--retrieval", metavar="MODES",
                       help="with --serve: our server retrieving each way, e.g. exact,ann, instead of MLflow's server")
    bench.add_argument("--p99-ms", type=_positive("--p99-ms"), default=30.0, metavar="MS",
                       help="with --serve: the p99 target each server's capacity per core is stated at (default 30)")
    bench.add_argument("--slides", action="store_true",
                       help=f"the whole-slide benchmark (tiles/s of read + normalise + encode against a plain per-tile "
                            f"loop; a gigapixel slide's peak memory): --preset {SLIDES_PRESET} unless one is given")
    bench.set_defaults(preset=None)  # None: not given, so that --slides can tell

    demo = commands.add_parser("demo", help="run every use case on its default data",
                               description="Run every use case with its default preset; a data set that cannot "
                                           "be had is replaced by the use case's synthetic data.")
    _add_run_options(demo)

    ui = commands.add_parser("ui", help="open the MLflow UI on the local store",
                             description="Start the MLflow UI on the tracking store, on 127.0.0.1 only.")
    ui.add_argument("--port", type=int, default=5000, help="port on 127.0.0.1 (default: 5000)")

    serve = commands.add_parser("serve", help="serve a use case's champion model over REST",
                                description="Serve the registered champion of a use case (or any model URI): with "
                                            "the use case's own server where it has one (several workers, "
                                            "POST /events), else `mlflow models serve --env-manager local`; POST "
                                            "JSON to /invocations either way.")
    serve.add_argument("name", help="use case (see `usecases list`)")
    serve.add_argument("--model-uri", help="default: models:/gpu-usecases-NAME@champion, the champion on the data "
                                            "trained on last")
    serve.add_argument("--data-sha256", metavar="SHA256",
                       help="serve the champion on this data instead (a run's data_sha256 tag, or its first 12 digits)")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    serve.add_argument("--port", type=int, default=5001, help="port (default: 5001)")
    serve.add_argument("--workers", type=int, help="worker processes of the use case's own server (default: one per "
                                                   "core)")
    serve.add_argument("--events", metavar="URL_OR_PATH",
                       help="the use case's own server: where POST /events keeps events, a SQLite file (default: "
                            "beside the local tracking store) or redis://HOST:PORT/DB for servers on several machines")
    serve.add_argument("--mlflow", action="store_true", help="MLflow's scoring server even where the use case has "
                                                             "its own")
    serve.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                       help="the use case's own server: where each worker scores (default: a GPU where there is one)")
    serve.add_argument("--batch-ms", type=float, metavar="MS",
                       help="the use case's own server: score concurrent requests together, the first waiting at most "
                            "MS milliseconds for others (default: 2 on a GPU, 0 (off) on the CPU)")
    serve.add_argument("--retrieval", choices=["exact", "ann"],
                       help="the use case's own server: rank every item, or retrieve candidates from the model's ANN "
                            "index and score them (default: as the run chose, serving.retrieval)")
    serve.add_argument("--ann-index", type=Path, metavar="FILE",
                       help="the use case's own server: serve by two stages with this FAISS index (faiss.write_index) "
                            "over the model's item vectors instead of the model's own")

    compare = commands.add_parser("compare", help="compare a use case's runs by hardware",
                                  description="The finished runs of a use case grouped by hardware, instance type "
                                              "and precision, with the primary metric, throughput, wall time and "
                                              "cost (when --set tracking.price_per_hour was given), best first.")
    compare.add_argument("name", help="use case (see `usecases list`)")
    compare.add_argument("--format", default="table", choices=["table", "markdown", "csv"], dest="output_format")

    report = commands.add_parser("report", help="write a use case's results page, docs/results/NAME.md, from the store",
                                 description="Merge the store's newest finished run per machine, preset and data set "
                                             "into docs/results/NAME.json (the rows of past machines stay) and render "
                                             "docs/results/NAME.md from it. Without NAME: every use case.")
    report.add_argument("name", nargs="?", help="use case (see `usecases list`); default: every one")
    report.add_argument("--store", metavar="URI", help="the tracking store to read (default: MLFLOW_TRACKING_URI, "
                                                       "else the local store)")
    report.add_argument("--check", action="store_true", help="only render from the JSON and exit 2 when the page "
                                                             "differs (a hand edit)")
    report.add_argument("--out", type=Path, metavar="DIR", help="the results folder (default: docs/results/ of the "
                                                                "clone)")

    advise = commands.add_parser("advise", help="which GPU instance to rent to train and serve a use case, and its cost",
                                 description="Estimate, from a run's measured workload and phases, the time and cost "
                                             "of the whole run (training one part of it) and of serving on each GPU "
                                             "instance of the catalogue, with ranges and the bottleneck, then "
                                             "recommend and say what the measurements call for. The table and a "
                                             "cost-against-time plot are logged to the run.")
    advise.add_argument("name", nargs="?", help="use case (see `usecases list`); not needed with --workload")
    advise.add_argument("--run", dest="run_id", metavar="RUN_ID", help="the run to advise on (default: the latest)")
    advise.add_argument("--task", default="both", choices=["train", "serve", "both"])
    advise.add_argument("--catalog", type=Path, metavar="FILE",
                        help="your own instances and prices, in the columns of common/catalog/instances.csv")
    advise.add_argument("--format", default="table", choices=["table", "markdown", "json"], dest="output_format")
    advise.add_argument("--workload", type=Path, metavar="FILE.json",
                        help="a model of your own: task, flops_per_sample, bytes_per_sample, precision, batch_size, "
                             "optionally measured: {gpu, samples_per_s}, weight_bytes, data_gb, checkpoint_every_s")
    advise.add_argument("--budget", type=_positive("--budget"), metavar="USD",
                        help="only runs expected to cost at most this, the whole run (on demand or spot)")
    advise.add_argument("--deadline", type=_positive("--deadline"), metavar="HOURS",
                        help="only runs expected to finish within this, the whole run, interruptions included")
    advise.add_argument("--data-gb", type=_positive("--data-gb"), metavar="GB",
                        help="the data set you will train on, stored as the run's (default: the run's own): epochs "
                             "grow with it, and where it should sit on each instance is said")
    advise.add_argument("--requests-per-s", type=_positive("--requests-per-s"), metavar="RATE",
                        help="the serving load a month's cost is stated at (default: 100, as the report says)")
    advise.add_argument("--spot-interruptions-per-hour", type=_positive("--spot-interruptions-per-hour"),
                        metavar="RATE", help="the spot interruption rate to plan with (default: 0.05, as the report "
                                             "says)")
    advise.add_argument("--launch", type=Path, metavar="DIR",
                        help="write a SkyPilot task and a Kubernetes Job for the recommended training instance")
    advise.add_argument("--tracking-uri", metavar="URI",
                        help="with --launch: the MLflow server the launched run logs to (default: "
                             "$MLFLOW_TRACKING_URI when it is a server)")
    advise.add_argument("--serve", action="store_true",
                        help="size a serving fleet instead, from the newest `usecases bench NAME --serve` run: "
                             "instances and a month's cost on each catalogue row (--launch: Kubernetes manifests)")
    advise.add_argument("--target-rps", type=_positive("--target-rps"), metavar="RATE",
                        help="with --serve: the requests per second the fleet must carry")
    advise.add_argument("--p99-ms", type=_positive("--p99-ms"), metavar="MS",
                        help="with --serve: the p99 latency each server must keep (default: 30)")

    doctor = commands.add_parser("doctor", help="check that this machine can run every use case, and say why not",
                                 description="One line per check (Python, torch and its CUDA build, the driver, "
                                             "GPUs, NCCL, CuPy, cuDF, NVML, disk, tracking store, CPU), with a fix "
                                             "for each problem. Exit 0 when every use case can run on the device "
                                             "asked for, 2 otherwise.")
    doctor.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                        help="the device to check for: auto and cuda expect a GPU; cpu checks the CPU path only")

    gpu_check = commands.add_parser("gpu-check", help="on a GPU machine: doctor, gpu tests, every default run and "
                                                      "benchmark, written to gpu-report.json and gpu-report.md",
                                    description="Measure everything GPU-side in one command, within a time budget. "
                                                "Without a GPU: one line, exit 2.")
    gpu_check.add_argument("--out", type=Path, default=Path("."), help="where the reports go (default: here)")
    gpu_check.add_argument("--budget-s", type=float, default=420, help="seconds for all steps (default: 420)")

    new = commands.add_parser("new", help="start a use case of your own from an existing one",
                              description="Copy a use case into usecases/NAME (package, imports, presets, README, "
                                          "experiment and model names renamed) and its tests into tests/NAME.")
    new.add_argument("name", help="the new use case's name: a Python identifier, e.g. derm")
    new.add_argument("--from", dest="source", required=True, help="the use case to start from (see `usecases list`)")

    export = commands.add_parser("export", help="write one use case as a standalone project",
                                 description="Write DIR as a project of its own: common/, the one use case and its "
                                             "tests, a pyproject.toml with only what they need, Makefile, CI, README "
                                             "and the source commit it came from.")
    export.add_argument("name", help="use case (see `usecases list`)")
    export.add_argument("folder", type=Path, metavar="DIR", help="where to write it (must be empty or absent)")
    export.add_argument("--force", action="store_true", help="write into a non-empty DIR (an earlier export): each file and folder "
                                                               "the export writes replaces its old one; the rest "
                                                               "(.git, your data) stays")

    server = commands.add_parser("server", help="start an MLflow tracking server on the local store, for a team",
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
    return parser


def _add_config_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="default", help="config preset: smoke, default or full (default: default)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key, e.g. --set train.epochs=5 (repeatable)")
    parser.add_argument("--data", type=Path, help="a data file or folder of your own instead of the preset's data")
    parser.add_argument("--summary", type=Path, metavar="FILE", help="also write summary.json here")
    parser.add_argument("--engine", choices=["pandas", "dask", "auto"],
                        help="where per-series and data work runs (runtime.engine; auto: Dask for large data; "
                             "default: the preset's, pandas)")
    parser.add_argument("--cluster", metavar="ADDRESS", help="a Dask scheduler, e.g. tcp://10.0.0.5:8786 "
                                                              "(runtime.cluster; default: $DASK_SCHEDULER_ADDRESS, "
                                                              "else a local cluster)")
    parser.add_argument("--workers", type=int, metavar="N",
                        help="processes of the local Dask cluster (runtime.workers; default: one per core)")


def _add_run_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                        help="where torch runs: auto picks CUDA when there is a GPU")
    parser.add_argument("--frames", default="auto", choices=["auto", "pandas"],
                        help="DataFrame backend: auto uses cuDF through cudf.pandas on a GPU; pandas forces the CPU")


def _engine_overrides(args: argparse.Namespace) -> list[str]:
    """--engine, --cluster and --workers are the config's runtime keys, so the run records them as params."""
    given = {"engine": args.engine, "cluster": args.cluster, "workers": args.workers}
    overrides = [f"runtime.{key}={value}" for key, value in given.items() if value is not None]
    if (args.cluster or args.workers) and not args.engine:
        overrides.append("runtime.engine=dask")
    return overrides


def _bench_preset(args: argparse.Namespace) -> str:
    """`--slides` means the slides preset unless one is given, and a given one must read slides; else `default`."""
    if not args.slides:
        return args.preset or "default"
    from common.config import load_config

    preset, usecase = args.preset or SLIDES_PRESET, _usecase(args.name)
    source = getattr(getattr(load_config(usecase.config, usecase.presets_dir, preset, args.overrides), "data", None),
                     "source", None)
    if source != "slides":
        raise UserError(f"--slides: preset '{preset}' reads {source or 'no slides'} (data.source), not slides; give a "
                        f"preset with data.source: slides, such as {SLIDES_PRESET}")
    return preset


def _found() -> dict:
    """Every use case: the packages in this folder and those that installed distributions register."""
    import usecases
    from common.usecase import discover

    return discover(usecases.__name__, Path(usecases.__file__).parent)


def _usecase(name: str):
    from common.usecase import resolve

    return resolve(name, _found())


def _loaded() -> dict:
    from common.usecase import load_all

    return load_all(_found())


def _list() -> int:
    from common.config import available_presets

    found = _found()
    for name, usecase in _loaded().items():
        if isinstance(usecase, UserError):
            print(f"{name:10} {usecase}")
            continue
        presets = ", ".join(available_presets(usecase.presets_dir))
        print(f"{name:10} {usecase.description}  [presets: {presets}]  ({found[name].origin})")
    return EXIT_OK


def _demo(args: argparse.Namespace) -> int:
    from common.runner import run_demo
    from common.runtime.devices import use_gpu_frames

    use_gpu_frames(args.frames, args.device)  # before any use case is imported, as `run` does
    loaded = _loaded()
    for name, usecase in loaded.items():
        if isinstance(usecase, UserError):
            print(f"{name}: skipped: {usecase}", flush=True)
    run_demo([usecase for usecase in loaded.values() if not isinstance(usecase, UserError)], args.device,
             args.frames)
    print("Done. Browse the runs with `usecases ui` (from the clone: make ui), then open each use case's runs:")
    _print_runs_links(list(loaded))
    return EXIT_OK


def _print_runs_links(names: list[str] | None, port: int = 5000) -> None:
    """Each use case's Training runs view (every use case with runs in the store, without `names`): MLflow 3 opens an
    experiment's own page on its GenAI Overview instead."""
    from common.tracking.links import training_runs_links
    from common.tracking.runs import tracking_uri

    for name, link in training_runs_links(tracking_uri(), names, ui_url=f"http://127.0.0.1:{port}").items():
        print(f"  {name}: {link}", flush=True)


def _doctor(device: str) -> int:
    from common.tools.doctor import run_checks, verdict

    checks = run_checks(device)
    for check in checks:
        print(check.line(), flush=True)
    ready, line = verdict(checks)
    print(line)
    return EXIT_OK if ready else EXIT_USER_ERROR


def _new(name: str, source: str) -> int:
    from common.tools.scaffold import new_usecase

    created = new_usecase(_usecase(source), name, set(_found()))
    print(f"created {', '.join(str(path) for path in created)}\n"
          f"try it: usecases run {name} --preset smoke && python -m pytest tests/{name}")
    return EXIT_OK


def _export(name: str, folder: Path, force: bool) -> int:
    from common.tools.scaffold import export_usecase

    others = [usecase for other, usecase in _loaded().items() if other != name and not isinstance(usecase, UserError)]
    export_usecase(_usecase(name), others, folder, force)
    print(f"exported {name} to {folder}\nthere: make demo (runs it), make test (its tests)")
    return EXIT_OK


def _ui(port: int) -> int:
    """Replace this process with MLflow's server, so Ctrl-C and SIGTERM reach it directly. One worker: the UI of one
    person's store (MLflow's four took 13 s and four times the memory to start on 2 cores, one 5 s)."""
    from common.tracking.runs import tracking_uri

    uri = tracking_uri()
    print(f"MLflow UI on http://127.0.0.1:{port} (store: {uri}); Ctrl-C to stop. Each use case's runs:", flush=True)
    _print_runs_links(None, port)
    os.execv(sys.executable, [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", uri,
                              "--host", "127.0.0.1", "--port", str(port), "--workers", "1"])


@dataclass(frozen=True)
class ServerOptions:
    """What only a use case's own server takes."""

    workers: int | None = None
    events: str | None = None
    mlflow: bool = False
    device: str = "auto"
    batch_ms: float | None = None
    retrieval: str | None = None
    ann_index: Path | None = None


def _serve(name: str, model_uri: str | None, host: str, port: int, data_sha256: str | None = None,
           options: ServerOptions = ServerOptions()) -> int:
    """Serve the use case's champion (or `model_uri`) with its own server, else replace this process with MLflow's
    scoring server; the first line says which data set's champion it is."""
    from common.tracking.runs import tracking_uri

    usecase = _usecase(name)
    own = None if options.mlflow else usecase.server()
    if options.workers is not None and options.workers < 1:
        raise UserError(f"--workers must be at least 1, got {options.workers}")
    if own is None and (options.workers is not None or options.events is not None or options.batch_ms is not None
                        or options.device != "auto" or options.retrieval or options.ann_index):
        raise UserError(f"--workers, --events, --device, --batch-ms, --retrieval and --ann-index need the use case's "
                        f"own server ('{name}' is served by MLflow's scoring server here)")
    uri = tracking_uri()
    model_uri, what = _served_model(name, model_uri, data_sha256)
    if own is not None:
        from common.runtime.devices import usable_cores

        workers = options.workers or usable_cores()
        events = options.events or own.default_events(uri)
        os.environ["MLFLOW_TRACKING_URI"] = uri
        retrieval = {key: value for key, value in (("retrieval", options.retrieval), ("ann_index", options.ann_index))
                     if value}
        return own.serve(model_uri, host, port, workers, events, device=options.device, batch_ms=options.batch_ms,
                         **retrieval,
                         announce=f"Serving {what} on http://{host}:{port}/invocations with {workers} worker(s), "
                                  f"events in {events}; Ctrl-C to stop")
    from common.serving.pyfunc import server_scratch

    print(f"Serving {what} on http://{host}:{port}/invocations; Ctrl-C to stop", flush=True)
    os.execve(sys.executable, [sys.executable, "-m", "mlflow", "models", "serve", "-m", model_uri, "--env-manager",
                               "local", "--host", host, "--port", str(port)],
              {**os.environ, "MLFLOW_TRACKING_URI": uri, "TMPDIR": str(server_scratch()),
               # MLflow starts `uvicorn` by name: this venv's first
               "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])})


def _served_model(name: str, model_uri: str | None, data_sha256: str | None) -> tuple[str, str]:
    """The model to serve (`model_uri`, else the champion on the data trained on last or on `data_sha256`), and
    how to name it in one line."""
    import mlflow

    from common.tracking.registry import SYNTHETIC_ALIAS, served_champion
    from common.tracking.runs import check_reachable, tracking_uri

    uri = tracking_uri()
    check_reachable(uri)
    mlflow.set_tracking_uri(uri)
    if model_uri is not None:
        return model_uri, model_uri
    if data_sha256 is not None and len(data_sha256) < 12:
        raise UserError(f"--data-sha256 {data_sha256}: give at least its first 12 hex digits")
    found = served_champion(mlflow.MlflowClient(), name, data_sha256, _usecase(name).served_kinds)
    if found is None:
        on = f" on data {data_sha256[:12]}" if data_sha256 else ""
        raise UserError(f"no champion of '{name}'{on} in {uri} yet (run `usecases run {name}` first, "
                        f"or pass --model-uri)")
    version, alias = found
    model_uri = f"models:/{version.name}@{alias}"
    source = version.tags.get("data_source") or "data"
    fallback = "no run on real data has registered a model yet; " if alias == SYNTHETIC_ALIAS else ""
    return model_uri, (f"the champion of '{name}' on {source} ({fallback}data "
                       f"{version.tags.get('data_sha256', '?')[:12]}, version {version.version}, {model_uri})")


def _advise(args) -> int:
    from common.advisor.report import advise_command

    if args.workload is None and args.name is None:
        raise UserError("advise needs a use case name (see `usecases list`) or --workload FILE.json")
    if args.tracking_uri and args.launch is None:
        raise UserError("--tracking-uri is for the launch files: give --launch DIR with it")
    if args.serve or args.target_rps is not None or args.p99_ms is not None:
        if not args.serve or args.target_rps is None:
            raise UserError("a serving fleet is sized with --serve --target-rps RATE (and --p99-ms MS): give both")
        given = [option for option, value in (("--workload", args.workload), ("--budget", args.budget),
                                              ("--deadline", args.deadline), ("--data-gb", args.data_gb),
                                              ("--requests-per-s", args.requests_per_s),
                                              ("--spot-interruptions-per-hour", args.spot_interruptions_per_hour))
                 if value is not None] + (["--task"] if args.task != "both" else [])
        if given or args.name is None:
            raise UserError(f"--serve sizes a use case's serving fleet from its bench run: give its name, without "
                            f"{given[0] if given else '--workload'} (--target-rps is the load)")
        from common.advisor.fleet import fleet_command

        _usecase(args.name)
        print(fleet_command(args.name, args.run_id, args.catalog, args.output_format, args.target_rps,
                            args.p99_ms or 30.0, args.launch, args.tracking_uri))
        return EXIT_OK
    if args.launch is not None and args.task == "serve":
        raise UserError("--launch writes the training instance's files: leave out --task serve")
    if args.name is not None:
        _usecase(args.name)
    from common.advisor.advise import Options

    stated = {"requests_per_s": args.requests_per_s, "interruptions_per_hour": args.spot_interruptions_per_hour}
    options = Options(args.budget, args.deadline, **{key: value for key, value in stated.items() if value})
    print(advise_command(args.name, args.run_id, args.task, args.catalog, args.output_format, args.workload, options,
                         args.data_gb, args.launch, args.tracking_uri))
    return EXIT_OK


def _compare(name: str, output_format: str) -> int:
    from common.tracking.comparison import compare_runs

    metric, mode = _usecase(name).primary_metric
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


def _report(name: str | None, store: str | None, check_only: bool, folder: Path | None) -> int:
    """Every use case's page without `name`; one with no finished run in the store keeps the page it has."""
    from common.tracking import results
    from common.tracking.runs import tracking_uri

    folder = folder or results.results_folder()
    chosen = {name: _usecase(name)} if name else None
    if check_only:
        names = [name] if name else results.pages(folder)
        for page in names:
            results.check(page, folder)
        print(f"current: {', '.join(f'{folder / page}.md' for page in names) or 'no pages'}")
        return EXIT_OK
    store = store or tracking_uri()
    chosen = chosen or {other: usecase for other, usecase in _loaded().items() if not isinstance(usecase, UserError)}
    for other, usecase in chosen.items():
        page = results.report(other, usecase.primary_metric, store, folder, required=name is not None)
        print(f"{other}: {page or f'no finished run in {store}, and no page yet'}", flush=True)
    return EXIT_OK


def _server(args: argparse.Namespace) -> int:
    """Replace this process with `mlflow server`, so that Ctrl-C and SIGTERM reach it directly; its databases are
    checked first, so that a wrong address or password is one line here rather than a traceback of every worker."""
    from common.tracking.runs import server_stores

    store, artifacts = server_stores(args.backend_store_uri, args.artifacts_destination)
    if not args.auth and (args.auth_database_uri or args.default_permission):
        raise UserError("--auth-database-uri and --default-permission go with --auth")
    if args.workers is not None and args.workers < 1:
        raise UserError(f"--workers {args.workers}: expected at least 1")
    _check_database(store, "--backend-store-uri" if args.backend_store_uri else "MLFLOW_TRACKING_URI")
    command = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", store, "--artifacts-destination",
               str(artifacts), "--serve-artifacts", "--host", args.host, "--port", str(args.port)]
    if args.workers:
        command += ["--workers", str(args.workers)]
    login = ""
    if args.auth:
        username = _basic_auth(store, args.auth_database_uri, args.default_permission, args.port)
        command += ["--app-name", "basic-auth"]
        login = f" MLFLOW_TRACKING_USERNAME={username} MLFLOW_TRACKING_PASSWORD=<your password>"
    print(f"MLflow tracking server on http://{args.host}:{args.port} (store: {_without_password(store)}, artifacts: "
          f"{artifacts}{', login required' if args.auth else ''})\n"
          f"Track into it from any shell with: export MLFLOW_TRACKING_URI=http://{args.host}:{args.port}{login}",
          flush=True)
    os.execv(sys.executable, command)


AUTH_PASSWORD_MIN_LENGTH = 12  # MLflow's rule for every password of its basic-auth app


def _basic_auth(store: str, auth_database_uri: str | None, default_permission: str | None, port: int) -> str:
    """Set up the environment of MLflow's basic-auth app (its configuration file, the admin's password, the key of
    its forms) and check its database; returns the admin's user name. The password is only read from
    MLFLOW_AUTH_ADMIN_PASSWORD, and only matters on the first start, when the admin user is created.

    The configuration, which may hold the database's password, is a file of this user only (0600) that the server
    reads at each start of a worker: ~/.cache/gpu-usecases/server/auth-PORT.ini, written again at each start."""
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
        _check_database(database, source)
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


def _without_password(uri: str) -> str:
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


def _check_database(uri: str, source: str) -> None:
    """Connect to the database the server would use: an unreachable host, a wrong password or a missing database
    is one line naming the host and port, and why."""
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
    """What the database's driver said, in one line: 'Connection refused', 'password authentication failed for
    user "mlflow"', 'database "mlflow" does not exist'."""
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


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    if not sys.stderr.isatty():
        os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    for name in ("usecases", "common"):
        logging.getLogger(name).setLevel(logging.INFO)
    for name in ("mlflow.store.db.utils", "alembic"):  # "Creating initial MLflow database tables...": not news
        logging.getLogger(name).setLevel(logging.WARNING)
    args = _parser().parse_args(argv)
    stop_on_signals()
    try:
        if args.command == "list":
            return _list()
        if args.command == "ui":
            return _ui(args.port)
        if args.command == "server":
            return _server(args)
        if args.command == "serve":
            return _serve(args.name, args.model_uri, args.host, args.port, args.data_sha256,
                          ServerOptions(args.workers, args.events, args.mlflow, args.device, args.batch_ms,
                                        args.retrieval, args.ann_index))
        if args.command == "report":
            return _report(args.name, args.store, args.check, args.out)
        if args.command == "compare":
            return _compare(args.name, args.output_format)
        if args.command == "demo":
            return _demo(args)
        if args.command == "doctor":
            return _doctor(args.device)
        if args.command == "advise":
            return _advise(args)
        if args.command == "gpu-check":
            from common.tools.gpu_check import gpu_check

            usable = [usecase for usecase in _loaded().values() if not isinstance(usecase, UserError)]
            return gpu_check(usable, args.out, args.budget_s)
        if args.command == "new":
            return _new(args.name, args.source)
        if args.command == "export":
            return _export(args.name, args.folder, args.force)
        if args.command == "bench" and args.slides and (args.scale or args.serve):
            raise UserError("--slides is a benchmark of its own: give it without --scale and --serve")
        if args.command == "bench" and args.serve:
            from common.tools.scaling import parse_list
            from common.tools.serve_bench import serve_bench

            model_uri, _ = _served_model(args.name, args.model_uri, None)
            serve_bench(_usecase(args.name), model_uri, parse_list(args.concurrency, "--concurrency", int),
                        args.seconds, args.serve_workers, args.batch_ms,
                        parse_list(args.retrieval, "--retrieval") if args.retrieval else None, args.p99_ms)
            return EXIT_OK
        if args.command == "bench" and args.scale:
            from common.tools.scaling import parse_list, scale_bench

            scale_bench(_usecase(args.name), args.overrides, parse_list(args.sizes, "--sizes", int),
                        parse_list(args.scale_engines, "--scale-engines"), args.base, args.timeout_s)
            return EXIT_OK
        from common.runner import run_usecase
        from common.runtime.devices import use_gpu_frames
        from common.usecase import RunRequest

        use_gpu_frames(args.frames, args.device)  # before the use case's package is imported: cudf.pandas takes over
        preset = _bench_preset(args) if args.command == "bench" else args.preset
        run_usecase(RunRequest(_usecase(args.name), preset, (*args.overrides, *_engine_overrides(args)),
                               args.device, args.frames, args.data, args.summary, getattr(args, "resume", False),
                               getattr(args, "resume_if_interrupted", False), bench=args.command == "bench"))
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
