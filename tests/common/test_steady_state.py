"""What a GPU would pay for in the common loop, measured on any CPU: host synchronisations per step, the loop's own
overhead against a plain one, checkpoints by time, batch hooks, validation every few epochs, metrics written in
batches, and where a run's time went (its phases)."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from torch import nn

from common.config import TrainConfig
from common.runtime.devices import Runtime
from common.runtime import phases as phases_module
from common.runtime.phases import Phases
from common.training import callbacks as checkpoint_module
from common.training.callbacks import CHECKPOINT_NAME, Callback
from common.training.loop import TensorBatches, Trainer, make_optimizer, supervised
from common.training.spec import TrainSpec
from common.training.workload import HostSyncs
from common.tracking import runs

CPU = Runtime(torch.device("cpu"), None)


def line(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.linspace(-1, 1, rows).unsqueeze(1)
    return x, 3 * x + 1


def fit(rows: int, *, epochs: int = 1, batch_size: int = 8, callbacks=(), checkpoint_dir=None, validate=None,
        **settings):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Linear(8, 1))
    trainer = Trainer(model, make_optimizer("adam", model.parameters(), CPU, lr=0.01),
                      supervised(nn.functional.mse_loss), CPU,
                      TrainSpec(TrainConfig(**{"epochs": epochs, "patience": 100, "grad_clip": 1.0, **settings}),
                                monitor="val/mse", checkpoint_dir=checkpoint_dir),
                      callbacks=callbacks)
    x, y = line(rows)
    validate = validate or (lambda network: {"val/mse": nn.functional.mse_loss(network(x), y)})
    return trainer, trainer.fit(TensorBatches(x, y, batch_size=batch_size), validate)


def test_host_syncs_name_what_a_gpu_would_wait_for():
    values = torch.randn(16)
    with HostSyncs() as syncs:
        values[values > 0].sum()
        float(values.mean())
        torch.where(values > 0, values, 0.0).sum()  # shapes known in advance: no wait
        values.clamp(min=0).sum()
    assert syncs.by_name == {"index": 1, "_local_scalar_dense": 1}


def test_a_training_step_of_the_loop_makes_no_host_sync():
    """Twice the steps, the same synchronisations: they are per epoch (the loss read once), none per step."""
    counts = []
    for rows in (80, 160):
        with HostSyncs() as syncs:
            fit(rows)
        counts.append(syncs.count)
    assert counts[0] == counts[1], counts


def python_calls(work) -> int:
    """The Python and C functions `work()` calls: a machine's load cannot change it, as it changes a time."""
    calls = 0

    def count(frame, event, arg):
        nonlocal calls
        calls += event in ("call", "c_call")

    sys.setprofile(count)
    try:
        work()
    finally:
        sys.setprofile(None)
    return calls


def one_parameter_loops(steps: int) -> tuple[int, int]:
    """The calls of a plain loop and of the Trainer's epoch over the same `steps` batches of a one-parameter model,
    where the loop's own work is all there is."""
    x, y = torch.randn(steps * 64, 1), torch.randn(steps * 64, 1)

    def plain() -> None:
        model = nn.Linear(1, 1, bias=False)
        optimizer = make_optimizer("adam", model.parameters(), CPU, lr=1e-3)
        for batch_x, batch_y in TensorBatches(x, y, batch_size=64):
            loss = nn.functional.mse_loss(model(batch_x), batch_y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

    def ours() -> None:
        model = nn.Linear(1, 1, bias=False)
        trainer = Trainer(model, make_optimizer("adam", model.parameters(), CPU, lr=1e-3),
                          supervised(nn.functional.mse_loss), CPU, TrainSpec(TrainConfig(epochs=1), monitor="val/mse"))
        trainer.callbacks = [callback for callback in trainer.callbacks
                             if type(callback).__name__ != "WorkloadProbe"]  # a fit's one-off measurement
        trainer._train_epoch(TensorBatches(x, y, batch_size=64))

    return python_calls(plain), python_calls(ours)


def test_the_loops_overhead_per_step_is_at_most_a_fifth_of_a_plain_loops_calls():
    """Per step, from the difference of two epoch lengths (set-up cancels out): 203 calls plain, 223 the Trainer's
    (2026-12-05). Timed instead, the ratio read 1.36 in CI beside another worker, for 1.1 alone."""
    one_parameter_loops(20)  # the first calls import and cache what later ones reuse
    (plain_short, ours_short), (plain_long, ours_long) = one_parameter_loops(50), one_parameter_loops(150)
    plain, ours = (plain_long - plain_short) / 100, (ours_long - ours_short) / 100
    assert plain > 100, plain  # a plain step is forward, loss, backward and Adam: the count sees them
    assert ours <= 1.2 * plain, f"the Trainer's step makes {ours:.0f} calls, a plain loop's {plain:.0f}"


def test_a_fit_shorter_than_the_checkpoint_interval_writes_no_checkpoint(tmp_path):
    fit(64, epochs=3, checkpoint_dir=tmp_path / "short", checkpoint_every_s=300)
    assert not (tmp_path / "short" / CHECKPOINT_NAME).exists()
    fit(64, epochs=3, checkpoint_dir=tmp_path / "every", checkpoint_every_s=0)
    assert torch.load(tmp_path / "every" / CHECKPOINT_NAME, weights_only=True)["finished"]


def test_checkpoints_come_when_the_interval_has_passed_not_every_epoch(tmp_path, monkeypatch):
    """On a clock that moves 40 s an epoch, a 100 s interval writes after epochs 3 and 6 of 7, then the finished
    state."""
    now = [0.0]
    monkeypatch.setattr(checkpoint_module.time, "monotonic", lambda: now[0])
    written = []
    monkeypatch.setattr(checkpoint_module, "save_atomic", lambda state, path: written.append(
        (state["epoch"], state["finished"])))

    class Clock(Callback):
        def on_epoch_end(self, trainer, epoch, metrics):
            now[0] += 40

    fit(64, epochs=7, checkpoint_dir=tmp_path, checkpoint_every_s=100, callbacks=[Clock()])
    assert written == [(2, False), (5, False), (6, True)]


def test_a_batch_hook_sees_every_step_with_its_loss_on_the_device():
    seen = []

    class Steps(Callback):
        def on_train_batch_end(self, trainer, index, batch, loss):
            seen.append((index, len(batch[0]), loss.requires_grad, loss.dim()))

    fit(20, batch_size=8, callbacks=[Steps()])
    assert seen == [(0, 8, True, 0), (1, 8, True, 0), (2, 4, True, 0)]


def test_validation_every_few_epochs_and_at_the_last_one_and_early_stopping_counts_epochs():
    validated = []

    def validate(network):
        validated.append(1)
        return {"val/mse": 1.0}  # never better after the first: patience runs out

    _, result = fit(32, epochs=30, validate=validate, validate_every=3, patience=10)
    assert [row["epoch"] for row in result.history if "val/mse" in row] == [2, 5, 8, 11, 14]
    assert len(validated) == 5 and result.best_epoch == 2
    assert result.epochs_run == 15 and len(result.history) == 15, "12 epochs after the best, on a validated epoch"
    _, result = fit(32, epochs=7, validate=lambda network: {"val/mse": 1.0}, validate_every=3)
    assert [row["epoch"] for row in result.history if "val/mse" in row] == [2, 5, 6]


def test_metrics_reach_mlflow_in_batches(monkeypatch):
    calls = []

    class Client:
        def log_batch(self, run_id, metrics):
            calls.append(len(metrics))

    monkeypatch.setattr(runs.mlflow, "MlflowClient", Client)
    tracker = runs.Tracker(active=True, run_id="r")
    for epoch in range(500):
        tracker.log_metrics({"train/loss": 1.0, "val/mse": 2.0, "throughput/samples_per_s": 3.0}, epoch)
    tracker.flush()
    assert sum(calls) == 1500 and len(calls) <= 3 and max(calls) <= runs.MAX_BATCH, calls


def test_metrics_wait_at_most_the_flush_interval(monkeypatch):
    calls = []
    now = [0.0]

    class Client:
        def log_batch(self, run_id, metrics):
            calls.append([metric.key for metric in metrics])

    monkeypatch.setattr(runs.mlflow, "MlflowClient", Client)
    monkeypatch.setattr(runs.time, "monotonic", lambda: now[0])
    tracker = runs.Tracker(active=True, run_id="r")
    tracker.log_metrics({"a": 1.0})
    now[0] += runs.FLUSH_EVERY_S
    tracker.log_metrics({"b@10": float("nan"), "c": 2.0})
    assert calls == [["a", "c"]], "written once the interval passed; NaN left out"


def test_phases_count_inner_time_once_and_say_where_the_time_went(monkeypatch):
    """On a clock the test moves: a phase inside another counts in the inner one only, at any depth, and a phase run
    twice adds up."""
    now = [0.0]
    monkeypatch.setattr(phases_module, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    phases = Phases()
    with phases("fit/model", "device"):
        now[0] += 0.25
        with phases("evaluate", "serial"):
            now[0] += 1.0
            with phases("logging", "serial"):
                now[0] += 0.5
        now[0] += 0.25
    with phases("fit/model", "device"):
        now[0] += 2.0
    assert phases.metrics() == {"time/fit/model_s": 2.5, "time/evaluate_s": 1.0, "time/logging_s": 0.5}
    assert phases.tags() == {"time_phases": '{"fit/model": "device", "evaluate": "serial", "logging": "serial"}'}
    assert phases.line(10.0) == \
        "time: 10 s in all — fit/model 2.5 s (25 %), evaluate 1.0 s (10 %), logging 0.5 s (5 %), other 6.0 s (60 %)"
    with phases("instant", "serial"):
        now[0] += 0.03125
    assert phases.metrics()["time/instant_s"] == 0.03125
    assert "instant" not in phases.line(10.0), "a phase under SHOWN_FROM_S is in the metrics, not in the line"
    with pytest.raises(ValueError, match="scales must be one of"):
        with phases("fit", "gpu"):
            pass
    with pytest.raises(ValueError, match="reserved"):
        with phases("other"):
            pass


def test_the_optimizer_updates_every_parameter_in_one_fused_kernel():
    model = nn.Linear(2, 2)
    optimizer = make_optimizer("adamw", model.parameters(), CPU, lr=0.1, weight_decay=0.01)
    assert isinstance(optimizer, torch.optim.AdamW) and optimizer.defaults["fused"]
