"""One tracked run of a use case, from config to registry: what `usecases run`, `bench` and `demo` do. Only the
standard library and torch are imported before `use_gpu_frames`, so cudf.pandas can take over pandas."""

from __future__ import annotations

import logging
import os
import shutil
import time
import warnings
from contextlib import ExitStack
from pathlib import Path

from common.errors import DataUnavailable, UserError
from common.runtime.interrupt import Capped, Terminated, stop_handled
from common.usecase import RunRequest, RunResult, UseCase

log = logging.getLogger(__name__)

QUIET_ON_OTHER_RANKS = ("usecases", "common")


def _load_checked(usecase: UseCase, config, data: Path | None, client=None):
    """The use case's data, with the warnings raised while reading it held back until it passed every check: a
    rejected input is reported in one line, not after the warnings it caused."""
    with warnings.catch_warnings(record=True) as held:
        warnings.simplefilter("always")
        loaded = usecase.load_data(config, data, client)
    for warning in held:  # the user's own filters (-W, PYTHONWARNINGS) decide now, as they would have then
        warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    return loaded


def run_usecase(request: RunRequest) -> dict:
    """One tracked run (with `request.bench`, the benchmark, in the `<name>-benchmark` experiment). What it sets
    process-wide is undone afterwards, so that each run of `usecases demo` gets the settings its presets ask for."""
    from common.runtime.process import isolated_process_state, use_gpu_frames
    started = time.perf_counter()
    request.usecase.require()
    backend = use_gpu_frames(request.frames, request.device)
    with isolated_process_state(QUIET_ON_OTHER_RANKS):
        return _run(request, backend, started)


def _run(request: RunRequest, backend: str, started: float) -> dict:
    from common.config import load_config
    from common.runtime.devices import make_runtime, shutdown
    from common.runtime.process import PeakMemory
    from common.tracking.stores import check_reachable, tracking_uri

    usecase, data, summary = request.usecase, request.data, request.summary
    check_reachable(tracking_uri())
    if request.bench and not usecase.has_benchmark:
        raise UserError(f"use case '{usecase.name}' has no benchmark")
    config = load_config(usecase.config, usecase.presets_dir, request.preset, list(request.overrides))
    if data is not None and not data.exists():
        raise UserError(f"--data {data}: no such file or folder")
    if summary is not None and not (summary.parent.is_dir() and os.access(summary.parent, os.W_OK)):
        raise UserError(f"--summary {summary}: cannot write there (no such folder, or no permission)")
    runtime = make_runtime(request.device, config.runtime.precision, config.runtime.cpu_threads, config.runtime.tf32,
                           config.runtime.compile)
    if not runtime.is_main:
        for logger in QUIET_ON_OTHER_RANKS:
            logging.getLogger(logger).setLevel(logging.WARNING)
    try:
        with ExitStack() as engine:
            memory = engine.enter_context(PeakMemory())
            client = engine.enter_context(_engine(config.runtime, runtime)) \
                if resolve_engine(usecase, config, data, runtime) == "dask" else None
            return _tracked(request, config, runtime, backend, client, started, memory)
    finally:
        shutdown(runtime)


def _tracked(request: RunRequest, config, runtime, backend: str, client, started: float, memory) -> dict:
    from torch import distributed as dist

    from common.config import flatten
    from common.job import Job
    from common.paths import write_json_atomic
    from common.runtime.devices import precision_notice
    from common.runtime.process import deterministic_on, seed_everything
    from common.runtime.phases import Phases
    from common.runtime.sharding import on_main
    from common.tracking.lifecycle import STATE_FILE, checkpoint_root
    from common.tracking.runs import tracked_run

    usecase, preset, bench = request.usecase, request.preset, request.bench
    deterministic = deterministic_on(config.runtime.deterministic, runtime.device)
    seed_everything(config.runtime.seed, deterministic)
    phases = Phases(runtime.device)
    with phases("data", "serial"):
        loaded, data_tags = _load_checked(usecase, config, request.data, client)
    notice = precision_notice(runtime.device, config.runtime.precision)
    if notice and runtime.is_main:
        log.warning(notice)
    experiment, description = _experiment(usecase, bench)
    root = checkpoint_root(experiment, preset)
    params = flatten(config)
    run_id = on_main(runtime, lambda: _prepare(request, experiment, description, root, params, data_tags))
    tags = {"preset": preset, "dataframe_backend": backend, **_machine_tags(runtime, deterministic, client),
            **data_tags, **{key: value for key, value in config.tracking.model_dump().items() if value is not None}}
    checkpoint_dir = None
    try:
        with tracked_run(experiment, config, tags, is_main=runtime.is_main, run_id=run_id,
                         run_name=f"{experiment}-{preset}", description=description) as tracker:
            checkpoint_dir = root / on_main(runtime, lambda: tracker.run_id)
            if runtime.is_main:
                write_json_atomic({"run_id": tracker.run_id, "params": params, "data": data_tags},
                                  checkpoint_dir / STATE_FILE)
            job = Job(runtime, tracker, checkpoint_dir, run_id is not None, client, phases, request.summary)
            outcome = _outcome(usecase, config, loaded, job, bench)
            summary = {}
            if runtime.is_main:
                with phases("logging", "serial"):
                    summary = write_summary(tracker, experiment, preset, runtime.device.type, outcome.models,
                                            request.summary, None if bench else usecase.columns(config),
                                            outcome.capped)
                    if outcome.served is not None:
                        register(tracker, usecase, outcome, data_tags)
                total = time.perf_counter() - started
                log_total_time_and_cost(tracker, config.tracking.price_per_hour, total, memory.bytes, phases)
                print(phases.line(total), flush=True)
    except (KeyboardInterrupt, Terminated):
        raise  # KILLED: its checkpoints stay for --resume
    except BaseException:
        if runtime.is_main and checkpoint_dir is not None:
            shutil.rmtree(checkpoint_dir, ignore_errors=True)  # FAILED: it can never be resumed
        raise
    if runtime.is_main:
        shutil.rmtree(checkpoint_dir, ignore_errors=True)  # finished: nothing left to resume
    if runtime.distributed:
        dist.barrier()  # every rank done before any tears down its connections (gloo aborts otherwise)
    return summary


def _experiment(usecase: UseCase, bench: bool) -> tuple[str, str]:
    if bench:
        return f"{usecase.name}-benchmark", f"Benchmark of {usecase.name}: our pipeline against a plain loop, in one run."
    return usecase.name, usecase.summary()


def _machine_tags(runtime, deterministic: bool, client) -> dict:
    from common.runtime.engine import client_tags
    from common.runtime.process import hardware_info
    return {"device": runtime.device.type, "precision": runtime.precision, "deterministic": str(deterministic).lower(),
            "cudnn_benchmark": str(not deterministic).lower(), "world_size": runtime.world_size, **hardware_info(),
            **(client_tags(client) if client is not None else {"engine": "pandas"})}


def _checked_result(usecase: UseCase, outcome) -> RunResult:
    if not isinstance(outcome, RunResult):
        raise TypeError(f"use case '{usecase.name}': run() returned a {type(outcome).__name__}; expected "
                        f"RunResult(models, served) (common.usecase)")
    return outcome


def resolve_engine(usecase: UseCase, config, data: Path | None, runtime) -> str:
    """The engine the run uses: `auto` asks the use case's `large_data(config, path)`, which says why its data
    is large or returns None; it takes Dask only when installed (else says so and stays on pandas)."""
    import importlib.util
    engine = config.runtime.engine
    if engine != "auto":
        return engine
    reason = usecase.large_data(config, data)
    if reason is None or runtime.distributed:
        return "pandas"
    if importlib.util.find_spec("distributed") is None:
        log.warning("runtime.engine=auto: %s, but Dask is not installed (pip install 'gpu-usecases[dask]'); "
                    "running on pandas", reason)
        return "pandas"
    log.info("runtime.engine=auto: %s: running on Dask", reason)
    return "dask"


def _engine(settings, runtime):
    """The Dask client the run uses; one process per job for now (under torchrun, ranks would each start one)."""
    from common.runtime.engine import dask_client
    if runtime.distributed:
        raise UserError("runtime.engine=dask: start the run without torchrun (the Dask engine drives its cluster "
                        "from one process for now)")
    return dask_client(settings.cluster, settings.workers, gpus=runtime.device.type == "cuda")


def _prepare(request: RunRequest, experiment: str, description: str, root: Path, params: dict,
             data_tags: dict) -> str | None:
    """End the runs of this preset whose process died, pick the run to resume, drop the checkpoints none can resume."""
    from common.tracking.lifecycle import interrupted_run, mark_dead_runs, prune_checkpoints, resumable_run
    from common.tracking.runs import check_project_run, ensure_experiment
    name, preset = request.usecase.name, request.preset
    experiment_id = ensure_experiment(experiment, description)
    check_project_run(experiment, experiment_id, resuming=request.resume or request.resume_if_interrupted)
    name = name if experiment == name else None  # benchmarks do not resume
    if request.resume_if_interrupted:
        run_id = interrupted_run(experiment_id, name, root, preset, params, data_tags)
    else:
        mark_dead_runs(experiment_id, name, preset)
        run_id = resumable_run(experiment_id, root, preset, params, data_tags) if request.resume else None
    prune_checkpoints(root, keep=run_id)
    return run_id


def _outcome(usecase: UseCase, config, loaded, job, bench: bool) -> RunResult:
    """The run's models; stopped at its time cap (`Capped`: gpu-check's SIGUSR1), the models it measured before it:
    the run then finishes with them and a `capped` tag, and registers nothing."""
    try:
        return RunResult(usecase.benchmark(config, loaded, job)) if bench else \
            _checked_result(usecase, usecase.run(config, loaded, job))
    except Capped:
        stop_handled()
        job.tracker.set_tags({"capped": "true"})
        print(f"capped: stopped at its time cap; the run finishes with the {len(job.finished)} model(s) it measured "
              f"({', '.join(job.finished) or 'none'})", flush=True)
        return RunResult(dict(job.finished), capped=True)


def write_summary(tracker, usecase: str, preset: str, device: str, models: dict[str, dict[str, float]],
                  path: Path | None = None, columns: list[str] | None = None, capped: bool = False) -> dict:
    """Every model's test metrics as MLflow metrics, summary.json and `--summary FILE`, and printed as a table (by
    default every metric without a per-series suffix as a column)."""
    from common.paths import write_json_atomic
    from common.tabular import render_table

    summary = {"usecase": usecase, "run_id": tracker.run_id, "preset": preset, "device": device, "models": models,
               **({"capped": True} if capped else {})}
    for model, metrics in models.items():
        tracker.log_metrics({f"test/{model}/{metric}": value for metric, value in metrics.items()})
    tracker.log_dict(summary, "summary.json")
    if path is not None:
        write_json_atomic(summary, path)
    if columns is None:
        columns = sorted({metric for metrics in models.values() for metric in metrics if "/" not in metric})
    rows = [[name, *(float(metrics.get(column, float("nan"))) for column in columns)] for name, metrics in models.items()]
    print(render_table(rows, ["model", *columns], markdown=False, number_format=".4f"), flush=True)
    return summary


def log_total_time_and_cost(tracker, price_per_hour: float | None, seconds: float, peak_bytes: int, phases) -> None:
    """The run's wall time, phases, cost at the machine's price, and its process tree's peak resident memory."""
    metrics = {"time/total_s": seconds, "memory/peak_rss_gb": peak_bytes / 2**30, **phases.metrics()}
    tracker.set_tags(phases.tags())
    if price_per_hour is not None:
        metrics["cost"] = price_per_hour * seconds / 3600
    tracker.log_metrics(metrics)


def register(tracker, usecase: UseCase, outcome: RunResult, data_tags: dict) -> None:
    """Log the served model's primary metric, and register it as champion or challenger by its validation value."""
    from common.tracking.registry import Candidate, register_champion
    metric, mode = usecase.primary_metric
    served = outcome.served
    metrics = outcome.models.get(served.model)
    if metrics is None:
        raise KeyError(f"use case '{usecase.name}': the served model '{served.model}' is not among the run's models "
                       f"({', '.join(outcome.models)})")
    if f"val_{metric}" not in metrics:
        raise KeyError(f"use case '{usecase.name}': the served model's metrics have no 'val_{metric}', the primary "
                       "metric on validation data that the registry compares versions by")
    value, test_value = metrics[f"val_{metric}"], metrics[metric]
    tracker.set_tags({"primary_metric": metric, "primary_model": served.model})
    tracker.log_metrics({f"primary/{metric}": test_value, f"primary/val_{metric}": value})
    register_champion(tracker, Candidate(served.uri, usecase.name, metric, mode, value, data_tags["data_sha256"],
                                         test_value, str(data_tags.get("data_source", "")), served.kind))


def run_demo(usecases: list[UseCase], device: str = "auto", frames: str = "auto") -> None:
    """Every use case with its default preset, in this process; data that cannot be had replaced by synthetic."""
    for usecase in usecases:
        print(f"== {usecase.name}", flush=True)
        if reason := usecase.missing():
            print(f"{usecase.name}: skipped: {reason}", flush=True)
            continue
        request = RunRequest(usecase, "default", device=device, frames=frames)
        try:
            run_usecase(request)
        except DataUnavailable as exc:
            print(f"{usecase.name}: {exc}; running on synthetic data instead", flush=True)
            run_usecase(request.with_overrides("data.source=synthetic"))
