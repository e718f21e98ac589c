"""Runs stopped as users stop them: `kill -9` leaves no RUNNING run once the next run starts and stays resumable;
SIGTERM then `--resume` ends where an uninterrupted run ends."""

import json
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import mlflow
import pytest

from common.errors import UserError
from tests.cli_helpers import runs, usecases
from tests.plumbing import PLUMBING

pytestmark = pytest.mark.starts_first(6)  # the default suite's longest files first (tests/conftest.py)

# One baseline (not five): what is stopped and resumed is the neural model's training.
ONE_BASELINE = ["--set", "baselines.models=[ewma]"]
# A checkpoint after every epoch (the presets write one every 5 minutes of a fit), so the signal, sent once the first
# exists, lands with epochs still to train however fast the machine.
EVERY_EPOCH = ["--set", "train.checkpoint_every_s=0"]
LONG_FINANCE = ["--set", "train.epochs=60", "--set", "train.patience=60", "--set", "train.refit_every=200",
                *EVERY_EPOCH, *ONE_BASELINE]
LONG_MEDICAL = ["--set", "train.epochs=4", "--set", "train.patience=4", *EVERY_EPOCH, *PLUMBING["medical"]]


def start_and_stop(name: str, args: list[str], signum: int) -> subprocess.Popen:
    """Start `usecases run NAME --preset smoke ARGS` and send it `signum` once its first checkpoint is written."""
    process = subprocess.Popen([sys.executable, "-m", "usecases", "run", name, "--preset", "smoke", *args],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    folder = Path(os.environ["USECASES_CHECKPOINT_DIR"]) / name / "smoke"
    deadline = time.monotonic() + 120
    while not any(folder.rglob("last.pt")) and time.monotonic() < deadline and process.poll() is None:
        time.sleep(0.1)
    assert process.poll() is None, process.communicate()[1][-2000:]
    process.send_signal(signum)
    process.communicate(timeout=60)
    return process


def test_kill_9_then_a_fresh_run_leaves_no_running_run_and_the_killed_one_resumes():
    killed = start_and_stop("finance", LONG_FINANCE, signal.SIGKILL)
    assert killed.returncode == -signal.SIGKILL
    (left,) = runs("finance")
    assert left.info.status == "RUNNING"  # nothing could end it

    fresh = usecases("run", "finance", "--preset", "smoke", *ONE_BASELINE)
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    run_id = left.info.run_id
    assert f"run {run_id} of preset 'smoke' was left RUNNING (its process {killed.pid} on this host is gone): " \
           f"marked KILLED" in fresh.stderr
    statuses = {run.info.run_id: run.info.status for run in runs("finance")}
    assert statuses.pop(run_id) == "KILLED" and list(statuses.values()) == ["FINISHED"]

    resumed = usecases("run", "finance", "--preset", "smoke", *LONG_FINANCE, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from the checkpoint after epoch" in resumed.stderr
    assert {run.info.run_id: run.info.status for run in runs("finance")}[run_id] == "FINISHED"
    assert not any((Path(os.environ["USECASES_CHECKPOINT_DIR"]) / "finance" / "smoke").iterdir())


def test_resume_if_interrupted_waits_out_a_dead_runs_heartbeat_but_never_joins_a_live_run(tmp_path, monkeypatch):
    """A restarted pod or a recovered spot instance starts before its old run is known dead: it waits for the
    heartbeat to go stale (on a clock that only its waits move), then starts afresh (no checkpoint here); a run whose
    heartbeat stays fresh is refused."""
    from common.tracking import lifecycle
    from common.tracking.lifecycle import heartbeat, interrupted_run
    from common.tracking.runs import ensure_experiment

    monkeypatch.delenv("USECASES_STALE_AFTER_S", raising=False)
    experiment = ensure_experiment("finance", "")
    assert interrupted_run(experiment, "finance", tmp_path, "smoke", {}, {}) is None  # nothing ran yet
    client = mlflow.MlflowClient()
    now, slept = [1_800_000_000.0], []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += seconds

    with monkeypatch.context() as clock:
        clock.setattr(lifecycle, "time", types.SimpleNamespace(time=lambda: now[0], sleep=sleep))
        stalled = client.create_run(experiment, tags={"preset": "smoke", "host": "gone-pod",
                                                      "heartbeat": f"{now[0]:.0f}"})
        assert interrupted_run(experiment, "finance", tmp_path, "smoke", {}, {}) is None
    assert client.get_run(stalled.info.run_id).info.status == "KILLED"
    stale_s = lifecycle.STALE_AFTER_S
    assert stale_s < sum(slept) < 2 * stale_s, f"waited {slept} for a heartbeat stale after {stale_s} s"
    monkeypatch.setenv("USECASES_STALE_AFTER_S", "2")  # ten beats of a live run per period: never stale under load
    live = client.create_run(experiment, tags={"preset": "smoke", "host": "other-pod"})
    with heartbeat(live.info.run_id, every_s=0.2), pytest.raises(
            UserError, match=f"run {live.info.run_id} of preset 'smoke' is still running .* stop it first"):
        interrupted_run(experiment, "finance", tmp_path, "smoke", {}, {})


def test_a_failed_run_keeps_no_checkpoint_and_is_not_resumed(monkeypatch, capsys):
    from usecases import cli
    from usecases.finance import pipeline

    def fail_after_a_checkpoint(config, data, job):
        (job.checkpoint_dir / "neural").mkdir(parents=True)
        (job.checkpoint_dir / "neural" / "last.pt").write_bytes(b"")
        raise RuntimeError("a bug in the model")

    monkeypatch.setattr(pipeline, "run", fail_after_a_checkpoint)
    assert cli.main(["run", "finance", "--preset", "smoke"]) == 1
    (failed,) = runs("finance")
    assert failed.info.status == "FAILED"
    assert not (Path(os.environ["USECASES_CHECKPOINT_DIR"]) / "finance" / "smoke" / failed.info.run_id).exists()
    capsys.readouterr()
    assert cli.main(["run", "finance", "--preset", "smoke", "--resume"]) == 2
    assert f"the last run of preset 'smoke' ({failed.info.run_id}) FAILED, and only an interrupted (KILLED) run " \
           f"can be resumed" in capsys.readouterr().err


@pytest.mark.slow  # a minute; tests/finance/test_end_to_end.py resumes after SIGTERM in the default suite
def test_sigterm_then_resume_gives_the_test_auc_of_an_uninterrupted_run(tmp_path):
    straight = usecases("run", "medical", "--preset", "smoke", *LONG_MEDICAL, "--summary",
                        str(tmp_path / "straight.json"))
    assert straight.returncode == 0, straight.stderr[-2000:]

    stopped = start_and_stop("medical", LONG_MEDICAL, signal.SIGTERM)
    assert stopped.returncode == 143
    resumed = usecases("run", "medical", "--preset", "smoke", *LONG_MEDICAL, "--resume", "--summary",
                       str(tmp_path / "resumed.json"))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from the checkpoint after epoch" in resumed.stderr

    (first, second) = (json.loads((tmp_path / f"{kind}.json").read_text())["models"] for kind in ("straight",
                                                                                                  "resumed"))
    served = runs("medical")[0].data.tags["primary_model"]
    assert second[served]["auc"] == pytest.approx(first[served]["auc"], abs=1e-6)
