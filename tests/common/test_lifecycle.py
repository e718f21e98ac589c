"""Runs across processes: dead RUNNING runs are told from live ones, only KILLED runs resume, checkpoint folders are
one per run and only unresumable ones are pruned."""

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import types

import mlflow
import psutil
import pytest

from common.tracking import lifecycle
from common.errors import UserError
from common.tracking.runs import ensure_experiment

NOW = 1_800_000_000.0
USECASE = "mine"  # any name: this is the core's behaviour, not a use case's


def dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def here(pid: int, started: float) -> dict:
    return {"host": socket.gethostname(), "pid_namespace": lifecycle.pid_namespace(), "pid": str(pid),
            "pid_started": f"{started:.3f}"}


def test_a_live_process_on_this_host_is_alive():
    assert lifecycle.why_dead(here(os.getpid(), psutil.Process().create_time()), 0) is None


def test_a_dead_pid_on_this_host_is_dead():
    pid = dead_pid()
    assert lifecycle.why_dead(here(pid, 0.0), 0) == f"its process {pid} on this host is gone"


def test_a_reused_pid_is_not_taken_for_the_run():
    assert "is gone" in lifecycle.why_dead(here(os.getpid(), psutil.Process().create_time() - 3600), 0)


def test_another_host_is_judged_by_its_heartbeat(monkeypatch):
    tags = {"host": "gpu-box-7", "pid": "1", "heartbeat": f"{NOW - 60:.0f}"}
    assert lifecycle.why_dead(tags, 0, now=NOW) is None
    assert lifecycle.why_dead({**tags, "heartbeat": f"{NOW - 3600:.0f}"}, 0, now=NOW) == \
        "no heartbeat from gpu-box-7 for 60 min"
    monkeypatch.setenv("USECASES_STALE_AFTER_S", "30")
    assert lifecycle.why_dead(tags, 0, now=NOW) is not None


def test_another_container_with_this_hostname_is_judged_by_its_heartbeat():
    tags = {**here(dead_pid(), 0.0), "pid_namespace": "4026531836-elsewhere", "heartbeat": f"{NOW - 60:.0f}"}
    assert lifecycle.why_dead(tags, 0, now=NOW) is None  # its pid means nothing here


def test_the_heartbeat_beats_well_within_the_stale_period(monkeypatch):
    """Over one stale period (30 s, on a clock its waits move) the tag is written three times, each with the time it
    was written at: a beat or two lost to a busy store leave the run alive."""
    monkeypatch.setenv("USECASES_STALE_AFTER_S", "30")
    now = [NOW]

    class Waits(threading.Event):
        def wait(self, timeout=None):  # a beat is due each time a wait times out, until the period is over
            now[0] += timeout
            return now[0] > NOW + 30

    monkeypatch.setattr(lifecycle, "time", types.SimpleNamespace(time=lambda: now[0]))
    monkeypatch.setattr(lifecycle, "threading", types.SimpleNamespace(Event=Waits, Thread=threading.Thread))
    run_id = make_run("RUNNING", tags={"heartbeat": f"{NOW:.0f}"})
    beats = []
    monkeypatch.setattr(lifecycle, "mlflow", types.SimpleNamespace(MlflowClient=lambda: Recorded(beats)))
    with lifecycle.heartbeat(run_id):
        pass
    assert beats == [f"{NOW + 10:.0f}", f"{NOW + 20:.0f}", f"{NOW + 30:.0f}"]
    assert mlflow.MlflowClient().get_run(run_id).data.tags["heartbeat"] == f"{NOW + 30:.0f}"


class Recorded:
    """An MLflow client that notes the heartbeats it writes."""

    def __init__(self, beats: list):
        self.client, self.beats = mlflow.MlflowClient(), beats

    def set_tag(self, run_id: str, key: str, value: str) -> None:
        self.beats.append(value)
        self.client.set_tag(run_id, key, value)


def test_where_a_run_ran_does_not_stop_it_resuming(tmp_path):
    """A killed run resumes with other workers or another engine; another config does not."""
    run_id = make_run("KILLED")
    checkpoint(tmp_path, run_id, params={"train.epochs": 3, "runtime.workers": 1, "runtime.engine": "dask"},
               data={"data_sha256": "a"})
    elsewhere = {"train.epochs": 3, "runtime.workers": 2, "runtime.engine": "pandas"}
    assert lifecycle.resumable_run(ensure_experiment(USECASE), tmp_path, "smoke", elsewhere, {"data_sha256": "a"}) \
        == run_id
    with pytest.raises(UserError, match="config key 'train.epochs' is 4 now but was 3"):
        lifecycle.resumable_run(ensure_experiment(USECASE), tmp_path, "smoke", {**elsewhere, "train.epochs": 4},
                                {"data_sha256": "a"})


def test_a_run_without_process_tags_is_judged_by_its_start():
    assert lifecycle.why_dead({}, int((NOW - 60) * 1000), now=NOW) is None
    assert lifecycle.why_dead({}, int((NOW - 7200) * 1000), now=NOW) == "no heartbeat from an unknown host for 120 min"


def make_run(status: str, preset: str = "smoke", tags: dict | None = None) -> str:
    experiment_id = ensure_experiment(USECASE)  # first: it points MLflow at this test's store
    client = mlflow.MlflowClient()
    run_id = client.create_run(experiment_id, tags={"preset": preset, **(tags or {})}).info.run_id
    if status != "RUNNING":
        client.set_terminated(run_id, status)
    time.sleep(0.01)  # distinct start times, newest last
    return run_id


def status(run_id: str) -> str:
    return mlflow.MlflowClient().get_run(run_id).info.status


def test_only_dead_running_runs_of_the_preset_are_marked_killed(caplog):
    dead = make_run("RUNNING", tags=here(dead_pid(), 0.0))
    alive = make_run("RUNNING", tags=here(os.getpid(), psutil.Process().create_time()))
    other_preset = make_run("RUNNING", preset="default", tags=here(dead_pid(), 0.0))
    with caplog.at_level("WARNING"):
        assert lifecycle.mark_dead_runs(ensure_experiment(USECASE), USECASE, "smoke") == [dead]
    assert [status(run) for run in (dead, alive, other_preset)] == ["KILLED", "RUNNING", "RUNNING"]
    assert f"run {dead} of preset 'smoke' was left RUNNING" in caplog.text
    assert f"usecases run {USECASE} --preset smoke --resume" in caplog.text


def checkpoint(root, run_id: str, params=None, data=None) -> None:
    (root / run_id).mkdir(parents=True)
    state = {"run_id": run_id, "params": params or {"train.epochs": 3}, "data": data or {"data_sha256": "a" * 64}}
    (root / run_id / lifecycle.STATE_FILE).write_text(json.dumps(state))


def test_resume_picks_the_newest_killed_run_with_a_checkpoint(tmp_path):
    older, newer, without_checkpoint = make_run("KILLED"), make_run("KILLED"), make_run("KILLED")
    checkpoint(tmp_path, older)
    checkpoint(tmp_path, newer)
    found = lifecycle.resumable_run(ensure_experiment(USECASE), tmp_path, "smoke", {"train.epochs": 3},
                                    {"data_sha256": "a" * 64})
    assert found == newer != without_checkpoint


@pytest.mark.parametrize("last, expected", [("FAILED", "FAILED, and only an interrupted (KILLED) run"),
                                            ("RUNNING", "is still running"), ("FINISHED", "no interrupted run")])
def test_resume_refuses_anything_but_a_killed_run(tmp_path, last, expected):
    run_id = make_run(last, tags=here(os.getpid(), psutil.Process().create_time()))
    checkpoint(tmp_path, run_id)
    with pytest.raises(UserError, match=re.escape(expected)):
        lifecycle.resumable_run(ensure_experiment(USECASE), tmp_path, "smoke", {"train.epochs": 3},
                                {"data_sha256": "a" * 64})


def test_only_checkpoints_that_can_never_resume_are_pruned(tmp_path):
    kept = {make_run("KILLED"), make_run("RUNNING"), "0" * 32}  # the last: a run of another store
    pruned = {make_run("FINISHED"), make_run("FAILED")}
    root = tmp_path / "checkpoints"
    for run_id in kept | pruned:
        checkpoint(root, run_id)
    lifecycle.prune_checkpoints(root)
    assert {folder.name for folder in root.iterdir()} == kept


def test_the_heartbeat_refreshes_its_tag():
    run_id = make_run("RUNNING", tags={"heartbeat": "0"})
    with lifecycle.heartbeat(run_id, every_s=0.05):
        time.sleep(0.5)
    assert float(mlflow.MlflowClient().get_run(run_id).data.tags["heartbeat"]) > time.time() - 60
