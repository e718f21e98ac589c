"""The runs of one use case and preset across processes: which are dead, which one `--resume` continues, and where each
keeps its checkpoints (a folder per run, so that two runs of one preset never delete each other's). A run killed by
SIGKILL, the OOM killer or a lost machine stays RUNNING in MLflow. The next start of the same preset marks it KILLED,
which makes it resumable, once it is sure the process is gone: on this host by its pid and start time, on another by a
heartbeat older than `USECASES_STALE_AFTER_S`."""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import mlflow
import psutil
from mlflow.exceptions import MlflowException

from common.errors import UserError
from common.paths import project_root

log = logging.getLogger(__name__)

STATE_FILE = "run.json"
HOST_TAG, PID_TAG, PID_STARTED_TAG, HEARTBEAT_TAG = "host", "pid", "pid_started", "heartbeat"
PID_NAMESPACE_TAG = "pid_namespace"  # containers sharing a hostname (host networking) do not share their pids
RESUME_FREE_KEYS = {"runtime.engine", "runtime.cluster", "runtime.workers"}  # where it runs, not what it computes
HEARTBEAT_EVERY_S = 60
STALE_AFTER_S = 900  # a quarter of an hour without a heartbeat: a run on another host is taken for dead


def checkpoint_root(experiment: str, preset: str) -> Path:
    base = Path(os.environ.get("USECASES_CHECKPOINT_DIR", project_root() / "checkpoints"))
    return base / experiment / preset


def process_tags() -> dict[str, str]:
    return {HOST_TAG: socket.gethostname(), PID_NAMESPACE_TAG: pid_namespace(), PID_TAG: str(os.getpid()),
            PID_STARTED_TAG: f"{psutil.Process().create_time():.3f}", HEARTBEAT_TAG: f"{time.time():.0f}"}


def pid_namespace() -> str:
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:  # no /proc (macOS): the hostname alone tells
        return "-"


def stale_after_s() -> float:
    return float(os.environ.get("USECASES_STALE_AFTER_S", STALE_AFTER_S))


@contextmanager
def heartbeat(run_id: str, every_s: float | None = None) -> Iterator[None]:
    """Refresh the run's heartbeat tag in the background, three times per stale period at least."""
    every_s = every_s or min(HEARTBEAT_EVERY_S, stale_after_s() / 3)
    stop = threading.Event()
    client = mlflow.MlflowClient()

    def beat() -> None:
        while not stop.wait(every_s):
            try:
                client.set_tag(run_id, HEARTBEAT_TAG, f"{time.time():.0f}")
            except MlflowException as exc:  # a busy store: the next beat tries again
                log.debug("heartbeat of run %s not written: %s", run_id, exc)

    thread = threading.Thread(target=beat, name="run-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def why_dead(tags: dict[str, str], start_time_ms: int, now: float | None = None) -> str | None:
    now = time.time() if now is None else now
    same_host = tags.get(HOST_TAG) == socket.gethostname() and tags.get(PID_NAMESPACE_TAG, "-") == pid_namespace()
    if same_host and PID_TAG in tags:
        pid = int(tags[PID_TAG])
        try:
            alive = abs(psutil.Process(pid).create_time() - float(tags.get(PID_STARTED_TAG, "nan"))) < 1.0
        except psutil.NoSuchProcess:
            alive = False
        return None if alive else f"its process {pid} on this host is gone"
    last_beat = float(tags.get(HEARTBEAT_TAG, start_time_ms / 1000))
    if now - last_beat > stale_after_s():
        host = tags.get(HOST_TAG, "an unknown host")
        return f"no heartbeat from {host} for {(now - last_beat) / 60:.0f} min"
    return None


def _runs_of(experiment_id: str, preset: str, status: str | None = None) -> list:
    query = f"tags.preset = '{preset}'" + (f" and attributes.status = '{status}'" if status else "")
    return mlflow.MlflowClient().search_runs([experiment_id], filter_string=query, order_by=["attributes.start_time DESC"])


def mark_dead_runs(experiment_id: str, name: str | None, preset: str) -> list[str]:
    """End as KILLED every RUNNING run of this preset whose process is gone, saying so (and, given the use case's
    `name`, how to resume it); returns their ids."""
    client = mlflow.MlflowClient()
    marked = []
    for run in _runs_of(experiment_id, preset, "RUNNING"):
        reason = why_dead(run.data.tags, run.info.start_time)
        if reason is None or client.get_run(run.info.run_id).info.status != "RUNNING":  # it may have ended since
            continue
        client.set_terminated(run.info.run_id, "KILLED")
        marked.append(run.info.run_id)
        resume = f"; `usecases run {name} --preset {preset} --resume` continues it" if name else ""
        log.warning("run %s of preset '%s' was left RUNNING (%s): marked KILLED%s", run.info.run_id, preset, reason,
                    resume)
    return marked


def prune_checkpoints(root: Path, keep: str | None = None) -> None:
    """Remove the checkpoints of finished, failed or deleted runs (one of a run unknown here may be another store's)."""
    if not root.is_dir():
        return
    client = mlflow.MlflowClient()
    for folder in root.iterdir():
        if not folder.is_dir() or folder.name == keep:
            continue
        try:
            run = client.get_run(folder.name)
        except MlflowException:
            continue
        if run.info.status in ("FINISHED", "FAILED") or run.info.lifecycle_stage == "deleted":
            shutil.rmtree(folder, ignore_errors=True)


def resumable_run(experiment_id: str, root: Path, preset: str, params: dict, data_tags: dict) -> str:
    """The newest KILLED run of this preset that left a checkpoint, checked to run on the same config and data."""
    runs = _runs_of(experiment_id, preset)
    for run in runs:
        if (found := _resumable(run, root, params, data_tags)) is not None:
            return found
    newest = runs[0] if runs else None
    if newest is not None and newest.info.status == "FAILED":
        raise UserError(f"--resume: the last run of preset '{preset}' ({newest.info.run_id}) FAILED, and only an "
                        f"interrupted (KILLED) run can be resumed: start it afresh without --resume")
    if newest is not None and newest.info.status == "RUNNING":
        tags = newest.data.tags
        raise UserError(f"--resume: run {newest.info.run_id} of preset '{preset}' is still running (pid "
                        f"{tags.get(PID_TAG, '?')} on {tags.get(HOST_TAG, '?')}): stop it first, or start a fresh "
                        f"run without --resume")
    raise UserError(f"--resume: no interrupted run of preset '{preset}' to resume (no KILLED run with a checkpoint "
                    f"in {root})")


def interrupted_run(experiment_id: str, name: str | None, root: Path, preset: str, params: dict,
                    data_tags: dict) -> str | None:
    """For `--resume-if-interrupted` (a spot instance, a restarted pod): the newest run of this preset if it was
    interrupted and left a checkpoint, else None. One still RUNNING is waited for until its heartbeat goes stale (the
    restart comes before the old run is known dead); after twice the stale period it is alive, and refused."""
    waited_until = time.time() + 2 * stale_after_s()
    while True:
        mark_dead_runs(experiment_id, name, preset)
        runs = _runs_of(experiment_id, preset)
        newest = runs[0] if runs else None
        if newest is None or newest.info.status in ("FINISHED", "FAILED"):
            return None
        if newest.info.status == "KILLED":
            return _resumable(newest, root, params, data_tags)
        tags = newest.data.tags
        if time.time() >= waited_until:
            raise UserError(f"--resume-if-interrupted: run {newest.info.run_id} of preset '{preset}' is still running "
                            f"(pid {tags.get(PID_TAG, '?')} on {tags.get(HOST_TAG, '?')}, its heartbeat fresh after "
                            f"{2 * stale_after_s():.0f} s): stop it first")
        last_beat = float(tags.get(HEARTBEAT_TAG, newest.info.start_time / 1000))
        pause = min(max(1.0, last_beat + stale_after_s() + 1 - time.time()), max(0.0, waited_until - time.time()))
        log.warning("run %s of preset '%s' is RUNNING: waiting %.0f s for its heartbeat to go stale before resuming it",
                    newest.info.run_id, preset, pause)
        time.sleep(pause)


def _resumable(run, root: Path, params: dict, data_tags: dict) -> str | None:
    """The run's id where it was KILLED and left a checkpoint, checked to run on the same config and data."""
    state_file = root / run.info.run_id / STATE_FILE
    if run.info.status != "KILLED" or not state_file.is_file():
        return None
    state = json.loads(state_file.read_text())
    for key in sorted((set(params) | set(state["params"])) - RESUME_FREE_KEYS):
        if params.get(key) != state["params"].get(key):
            raise UserError(f"--resume: config key '{key}' is {params.get(key)!r} now but was "
                            f"{state['params'].get(key)!r} in the interrupted run")
    if state["data"].get("data_sha256") != data_tags.get("data_sha256"):
        raise UserError(f"--resume: the data ({data_tags.get('data_source')}) differs from the interrupted run's "
                        f"({state['data'].get('data_source')}, another SHA-256)")
    return run.info.run_id
