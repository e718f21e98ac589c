"""Running the CLI as a user does: a separate process, with a private MLflow store and checkpoint folder."""

import atexit
import functools
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import mlflow

from common.tools.serve_bench import free_port, stop_process_group as stop  # noqa: F401  (the tests import them)


def private_env(folder) -> dict[str, str]:
    """For module-scoped runs, which start before the per-test store of tests/conftest.py exists: a store of their
    own in FOLDER, started from a copy of an empty one."""
    store = Path(folder) / "mlflow.db"
    if not store.exists():
        store.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(empty_store_file(), store)
    return {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{store}",
            "USECASES_CHECKPOINT_DIR": str(Path(folder) / "checkpoints")}


@functools.cache
def empty_store_file() -> Path:
    """An MLflow store whose tables exist, made once a process: a run in a new store spends 1.4 s creating them
    (alembic's migrations), copying the file takes a millisecond."""
    folder = Path(tempfile.mkdtemp(prefix="gpu-usecases-store-"))
    atexit.register(shutil.rmtree, folder, True)
    mlflow.MlflowClient(f"sqlite:///{folder / 'mlflow.db'}").search_experiments()
    return folder / "mlflow.db"


def usecases(*args, timeout=300, env=None):
    env = {**(env or os.environ), "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "usecases", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def in_process(capsys, *args: str) -> subprocess.CompletedProcess:
    """`usecases ARGS` in this process, as `usecases(...)` returns it (exit code, stdout, stderr): a second, not the
    seconds of a fresh interpreter. What the CLI changes for its own process (signal handlers, logger levels,
    environment variables, torch's thread count) is put back, so nothing leaks into the next test."""
    import torch

    from usecases.cli import main

    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    loggers = ("usecases", "common", "mlflow.store.db.utils", "alembic")
    levels = {name: logging.getLogger(name).level for name in loggers}
    environ = dict(os.environ)
    threads = torch.get_num_threads()  # a preset's runtime.cpu_threads sets it for the whole process
    capsys.readouterr()
    try:
        code = main(list(args))
    except SystemExit as exit_:  # argparse: --help (0) and usage mistakes (2)
        code = exit_.code
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
        os.environ.clear()
        os.environ.update(environ)
        torch.set_num_threads(threads)
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["usecases", *args], code, out, err)


def preset_summary(tmp_path_factory, usecase: str, preset: str, *overrides: str) -> dict:
    """`usecases run USECASE --preset PRESET --set OVERRIDE...` in a private store, as a user runs it: its
    summary.json, after checking that the run finished."""
    env = private_env(tmp_path_factory.mktemp(preset))
    path = tmp_path_factory.mktemp("summary") / "s.json"
    settings = [argument for override in overrides for argument in ("--set", override)]
    result = usecases("run", usecase, "--preset", preset, *settings, "--summary", str(path), timeout=900, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert [run.info.status for run in runs(usecase, uri=env["MLFLOW_TRACKING_URI"])] == ["FINISHED"]
    return json.loads(path.read_text())


def demo_run(usecase: str, preset: str, **tags: str) -> tuple[dict, str, object] | None:
    """Where $USECASES_REPRODUCE_FROM names a tracking store (CI hands the slow suite the demo's, whose real-data runs
    are the ones a reproduction checks), the newest finished PRESET run there whose tags hold TAGS: (its summary.json,
    the store's URI, the run), so that a reproduction checks it instead of training the same models a second time;
    None without the variable. A store without such a run fails the test."""
    uri = os.environ.get("USECASES_REPRODUCE_FROM")
    if not uri:
        return None
    wanted = {"preset": preset, **tags}
    done = [run for run in runs(usecase, uri) if run.info.status == "FINISHED"
            and all(run.data.tags.get(key) == value for key, value in wanted.items())]
    assert done, f"{uri} holds no finished {usecase} run with tags {wanted}"
    run = max(done, key=lambda run: run.info.start_time)
    return mlflow.artifacts.load_dict(f"{run.info.artifact_uri}/summary.json"), uri, run


@dataclass(frozen=True)
class SmokeRun:
    result: subprocess.CompletedProcess  # what the run printed
    summary: dict  # its summary.json
    uri: str  # its private store


def smoke_run(tmp_path_factory, usecase: str) -> SmokeRun:
    """`usecases run USECASE --preset smoke` in a private store, as a user runs it, for tests/conftest.py's
    session-wide `smoke_runs`: one run that every test reading a finished smoke run shares, whichever pytest-xdist
    worker asks first (the others wait for it under a lock in the folder the workers share, pytest-xdist's recipe,
    and read it). System metrics are sampled every 0.5 s, so a run of a few seconds logs some."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return _made_smoke_run(tmp_path_factory.mktemp(f"{usecase}-smoke"), usecase)
    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp().parent / f"{usecase}-smoke"
    record = shared / "record.json"
    with FileLock(f"{shared}.lock"):
        if not record.is_file():
            shared.mkdir(exist_ok=True)
            made = _made_smoke_run(shared, usecase)
            record.write_text(json.dumps({"stdout": made.result.stdout, "stderr": made.result.stderr,
                                          "summary": made.summary, "uri": made.uri}))
            return made
    kept = json.loads(record.read_text())
    return SmokeRun(subprocess.CompletedProcess([], 0, kept["stdout"], kept["stderr"]), kept["summary"], kept["uri"])


def _made_smoke_run(folder: Path, usecase: str) -> SmokeRun:
    env = {**private_env(folder), "MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL": "0.5"}
    result = usecases("run", usecase, "--preset", "smoke", "--summary", str(folder / "s.json"), timeout=900, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return SmokeRun(result, json.loads((folder / "s.json").read_text()), env["MLFLOW_TRACKING_URI"])


def two_ranks(script: Path, outdir: Path, *args: str) -> list[dict]:
    """`script OUTDIR ARGS` as 2 CPU processes under torchrun (gloo), and what each rank saved as OUTDIR/rank{R}.pt."""
    import torch

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script),
               str(outdir), *args]
    done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    # a rank's own error (gloo's "terminate called ... what():" before an abort) comes before torchrun's summary
    causes = [line for line in done.stderr.splitlines() if "what():" in line or "Error" in line][:10]
    assert done.returncode == 0, (f"torchrun failed:\n{done.stdout[-3000:]}\n" + "\n".join(causes) +
                                  f"\n{done.stderr[-3000:]}")
    return [torch.load(outdir / f"rank{rank}.pt", weights_only=True) for rank in range(2)]


def runs(usecase, uri=None):
    mlflow.set_tracking_uri(uri or os.environ["MLFLOW_TRACKING_URI"])
    experiment = mlflow.get_experiment_by_name(f"gpu-usecases-{usecase}")
    if experiment is None:
        return []
    return mlflow.MlflowClient().search_runs([experiment.experiment_id])


def wait_until_up(url: str, process: subprocess.Popen, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert process.poll() is None, f"the server exited with {process.returncode}"
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except (OSError, urllib.error.HTTPError):
            time.sleep(0.5)
    raise TimeoutError(f"{url} did not answer within {seconds:.0f} s")


@contextmanager
def mlflow_server(folder: Path) -> Iterator[str]:
    """A private `mlflow server` as `usecases server` starts it, with its store in `folder`; one worker and no job
    runner keep it quick to start on 2 cores. Yields its URL."""
    port = free_port()
    with (folder / "server.log").open("w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{folder / 'mlflow.db'}",
             "--artifacts-destination", str(folder / "artifacts"), "--serve-artifacts", "--host", "127.0.0.1",
             "--port", str(port), "--workers", "1"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
        url = f"http://127.0.0.1:{port}"
        try:
            wait_until_up(f"{url}/health", process)
            yield url
        finally:
            stop(process)


class _Collected(logging.Handler):
    def __init__(self, level: int):
        super().__init__(level)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def user_error(capsys, *args: str) -> str:
    """`usecases ARGS` as a user types it, in this process: it must exit 2 with one stderr line `error: ...` and
    print no traceback nor warning. Returns the line.

    Warnings logged through `logging` reach pytest's handlers rather than stderr here, so they are collected
    apart: the CLI would print them beside the error line."""
    warned = _Collected(logging.WARNING)
    logging.getLogger().addHandler(warned)
    try:
        result = in_process(capsys, *args)
    finally:
        logging.getLogger().removeHandler(warned)
    code, err = result.returncode, result.stderr
    assert not warned.records, f"warned with the error: {[record.getMessage() for record in warned.records]}"
    lines = err.strip().splitlines()
    assert code == 2, f"exit {code}, stderr:\n{err}"
    assert len(lines) == 1 and lines[0].startswith("error: "), f"not one error line:\n{err}"
    return lines[0]


def assert_rejected(capsys, usecase: str, *args: str, names: tuple[str, ...] = ()) -> str:
    """`user_error(ARGS)` (seconds, not a fresh interpreter per case) whose line contains each of `names` (the file,
    row, column or key), and which leaves no MLflow run and no checkpoint behind. Returns the line."""
    line = user_error(capsys, *args)
    for name in names:
        assert name in line, f"{name!r} not named in: {line}"
    assert runs(usecase) == [], f"a run was left behind by: {line}"
    checkpoints = Path(os.environ["USECASES_CHECKPOINT_DIR"])
    assert not checkpoints.exists() or not any(path.is_file() for path in checkpoints.rglob("*")), line
    return line


def plain_tables(text: str) -> str:
    """`text` with its Markdown tables' padding taken out (tabulate aligns columns), so that a row reads
    `| a | b |` however wide its columns are."""
    lines = []
    for line in text.splitlines():
        if line.startswith("|") and line.rstrip().endswith("|"):
            cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
            line = "|" + " --- |" * len(cells) if all(set(cell) <= set("-:") for cell in cells) else \
                "| " + " | ".join(cells) + " |"
        lines.append(line)
    return "\n".join(lines)
