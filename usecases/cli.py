"""`usecases`: list, run, bench, demo, new, export, ui, server, serve, compare and advise: argument parsing and printing;
the work is in common/ (runner, scaffold, tracking). Exit 0 on success, 2 on a user error, 1 on an internal failure.

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
    """Replace this process with MLflow's server, so Ctrl-C and SIGTERM reach it and its workers directly."""
    from common.tracking.runs import tracking_uri

    uri = tracking_uri()
    print(f"MLflow UI on http://127.0.0.1:{port} (store: {uri}); Ctrl-C to stop. Each use case's runs:", flush=True)
    _print_runs_links(None, port)
    os.execv(sys.executable, [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", uri,
                              "--host", "127.0.0.1", "--port", str(port)])


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
    print(f"Serving {what} on http://{host}:{port}/invocations; Ctrl-C to stop", flush=True)
    os.execve(sys.executable, [sys.executable, "-m", "mlflow", "models", "serve", "-m", model_uri, "--env-manager",
                               "local", "--host", host, "--port", str(port)],
              {**os.environ, "MLFLOW_TRACKING_URI": uri,  # MLflow starts `uvicorn` by name: this venv's first
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


def _server(host: str, port: int, backend_store_uri: str | None, artifacts_destination: str | None) -> int:
    """Replace this process with `mlflow server`, so that Ctrl-C and SIGTERM reach it directly."""
    from common.tracking.runs import server_stores

    store, artifacts = server_stores(backend_store_uri, artifacts_destination)
    print(f"MLflow tracking server on http://{host}:{port} (store: {store}, artifacts: {artifacts})\n"
          f"Track into it from any shell with: export MLFLOW_TRACKING_URI=http://{host}:{port}", flush=True)
    os.execv(sys.executable, [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", store,
                              "--artifacts-destination", str(artifacts), "--serve-artifacts", "--host", host,
                              "--port", str(port)])


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
            return _server(args.host, args.port, args.backend_store_uri, args.artifacts_destination)
        if args.command == "serve":
            return _serve(args.name, args.model_uri, args.host, args.port, args.data_sha256,
                          ServerOptions(args.workers, args.events, args.mlflow, args.device, args.batch_ms,
                                        args.retrieval, args.ann_index))
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
