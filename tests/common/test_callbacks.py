"""The Trainer's callbacks: a use case's own get the hooks in order, can stop a fit and keep state across a resume;
the trainer's own are what early stopping and checkpoints are."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from common.config import TrainConfig
from common.runtime.devices import Runtime
from common.runtime.interrupt import Terminated
from common.training.callbacks import CHECKPOINT_NAME, Callback, Checkpoint, EarlyStopping
from common.training.loop import TensorBatches, Trainer, supervised
from common.training.spec import TrainSpec

CPU = Runtime(torch.device("cpu"), None)
X = torch.linspace(-1, 1, 64).unsqueeze(1)
Y = 3 * X + 1


def val_mse(model: nn.Module) -> dict[str, float]:
    return {"val/mse": nn.functional.mse_loss(model(X), Y).item()}


def make_trainer(*, callbacks=(), checkpoint_dir=None, log_metrics=None, seed=0, **settings) -> Trainer:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Linear(8, 1))
    settings = TrainConfig(**{"epochs": 6, "patience": 100, "checkpoint_every_s": 0, **settings})
    return Trainer(model, torch.optim.SGD(model.parameters(), lr=0.05), supervised(nn.functional.mse_loss), CPU,
                   TrainSpec(settings, monitor="val/mse", checkpoint_dir=checkpoint_dir, log_metrics=log_metrics),
                   callbacks=callbacks)


def batches() -> TensorBatches:
    return TensorBatches(X, Y, batch_size=16, seed=0)


class Recorder(Callback):
    """Every hook it gets, with what it was given."""

    def __init__(self):
        self.calls = []

    def on_fit_start(self, trainer):
        self.calls.append(("on_fit_start", trainer, trainer.resumed_from))

    def on_epoch_end(self, trainer, epoch, metrics):
        self.calls.append(("on_epoch_end", epoch, dict(metrics), len(trainer.history)))

    def on_fit_end(self, trainer):
        self.calls.append(("on_fit_end", trainer.epoch))

    def state_dict(self):
        self.calls.append(("state_dict",))
        return {}

    def load_state_dict(self, checkpoint):
        self.calls.append(("load_state_dict", checkpoint["epoch"]))


class EpochCounter(Callback):
    """A use case's own state, which a resume must bring back: the epochs it has seen over every run of the fit."""

    def __init__(self):
        self.seen = 0

    def on_fit_start(self, trainer):
        if trainer.resumed_from is None:
            self.seen = 0

    def on_epoch_end(self, trainer, epoch, metrics):
        self.seen += 1

    def state_dict(self):
        return {"epoch_counter/seen": self.seen}

    def load_state_dict(self, checkpoint):
        self.seen = checkpoint["epoch_counter/seen"]


def test_a_callback_gets_the_hooks_in_order_with_the_epochs_metrics(tmp_path):
    recorder = Recorder()
    trainer = make_trainer(callbacks=[recorder], checkpoint_dir=tmp_path, epochs=3)
    result = trainer.fit(batches(), val_mse)
    assert recorder.calls[0] == ("on_fit_start", trainer, None)
    epochs = [call for call in recorder.calls if call[0] == "on_epoch_end"]
    assert [call[1] for call in epochs] == [0, 1, 2]
    assert [{"epoch": epoch, **metrics} for _, epoch, metrics, _ in epochs] == result.history
    assert [in_history for *_, in_history in epochs] == [1, 2, 3], "the epoch is in the history when the hook runs"
    assert [call[0] for call in recorder.calls] == [
        "on_fit_start", "on_epoch_end", "state_dict", "on_epoch_end", "state_dict", "on_epoch_end", "state_dict",
        "on_fit_end", "state_dict"]
    assert recorder.calls[-2] == ("on_fit_end", 2)

    again = Recorder()
    make_trainer(callbacks=[again], checkpoint_dir=tmp_path, epochs=3).fit(batches(), val_mse, resume=True)
    assert again.calls == [("load_state_dict", 2)], "a finished fit, resumed, loads its state and trains nothing"


def test_a_callback_can_stop_the_fit():
    class StopAfterEpoch(Callback):
        def on_epoch_end(self, trainer, epoch, metrics):
            trainer.should_stop = epoch == 2

    validated = []

    def validate(model):
        validated.append(1)
        return val_mse(model)

    result = make_trainer(callbacks=[StopAfterEpoch()], epochs=10).fit(batches(), validate)
    assert (result.epochs_run, len(result.history), len(validated)) == (3, 3, 3)


def test_a_callbacks_state_survives_a_checkpoint_and_a_resume(tmp_path):
    def interrupt_at_epoch_three(metrics, step):
        if step == 3:
            raise Terminated("signal 15")

    counter = EpochCounter()
    with pytest.raises(Terminated):
        make_trainer(callbacks=[counter], checkpoint_dir=tmp_path, log_metrics=interrupt_at_epoch_three).fit(
            batches(), val_mse)
    assert counter.seen == 3
    assert torch.load(tmp_path / CHECKPOINT_NAME, weights_only=True)["epoch_counter/seen"] == 3
    resumed = EpochCounter()
    result = make_trainer(callbacks=[resumed], checkpoint_dir=tmp_path, seed=1).fit(batches(), val_mse, resume=True)
    assert (result.resumed_from, result.epochs_run) == (3, 6)
    assert resumed.seen == 6, "the count of the interrupted run came back from the checkpoint"


def test_a_callback_may_not_overwrite_the_checkpoints_keys(tmp_path):
    class Clashing(Callback):
        def state_dict(self):
            return {"history": []}

    with pytest.raises(ValueError, match=r"Clashing would overwrite the checkpoint's \['history'\]"):
        make_trainer(callbacks=[Clashing()], checkpoint_dir=tmp_path, epochs=1).fit(batches(), val_mse)


def without(trainer: Trainer, kind: type) -> Trainer:
    trainer.callbacks = [callback for callback in trainer.callbacks if not isinstance(callback, kind)]
    return trainer


def test_early_stopping_and_the_best_weights_are_the_early_stopping_callbacks():
    """A metric that stops improving after epoch 1: with the trainer's own callbacks the fit stops `patience` epochs
    later with epoch 1's weights; without its EarlyStopping it runs every epoch and keeps the last weights."""

    def plateau(model):
        snapshots.append({key: value.clone() for key, value in model.state_dict().items()})
        return {"val/mse": [3.0, 1.0][min(len(snapshots) - 1, 1)]}

    snapshots = []
    trainer = make_trainer(patience=2, epochs=8)
    result = trainer.fit(batches(), plateau)
    assert (result.best_epoch, result.epochs_run) == (1, 4)
    assert all(torch.equal(value, snapshots[1][key]) for key, value in trainer.module.state_dict().items())

    snapshots = []
    trainer = without(make_trainer(patience=2, epochs=8), EarlyStopping)
    result = trainer.fit(batches(), plateau)
    assert (result.best_epoch, result.epochs_run) == (7, 8)
    assert all(torch.equal(value, snapshots[7][key]) for key, value in trainer.module.state_dict().items())


def test_checkpoints_are_the_checkpoint_callbacks(tmp_path):
    make_trainer(checkpoint_dir=tmp_path / "kept", epochs=2).fit(batches(), val_mse)
    without(make_trainer(checkpoint_dir=tmp_path / "dropped", epochs=2), Checkpoint).fit(batches(), val_mse)
    assert (tmp_path / "kept" / CHECKPOINT_NAME).is_file()
    assert not (tmp_path / "dropped").exists()
