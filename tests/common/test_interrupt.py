"""Signals request a stop that takes effect at the next safe point; a second signal stops at once."""

import os
import signal

import pytest
import torch
from torch import nn

from common.runtime import interrupt
from common.runtime.interrupt import Terminated, stop_on_signals, stop_point, stop_requested
from common.runtime.devices import Runtime
from common.config import TrainConfig
from common.training.callbacks import CHECKPOINT_NAME
from common.training.loop import TensorBatches, Trainer, supervised
from common.training.spec import TrainSpec


@pytest.fixture(autouse=True)
def restore_handlers():
    saved = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)
    interrupt._requested = None


def test_sigterm_is_deferred_to_the_next_stop_point():
    stop_on_signals()
    os.kill(os.getpid(), signal.SIGTERM)
    with pytest.raises(Terminated):
        stop_point()


def test_ctrl_c_becomes_keyboard_interrupt_at_the_stop_point():
    stop_on_signals()
    os.kill(os.getpid(), signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        stop_point()


def test_a_second_signal_stops_at_once():
    stop_on_signals()
    os.kill(os.getpid(), signal.SIGTERM)
    with pytest.raises(Terminated):
        os.kill(os.getpid(), signal.SIGTERM)


def test_no_request_means_no_stop(tmp_path):
    """A request left by the last job is forgotten when the next one starts, and without one a fit passes every stop
    point of its epochs."""
    stop_on_signals()
    os.kill(os.getpid(), signal.SIGTERM)  # the last job's request
    stop_on_signals()
    assert not stop_requested()
    x = torch.randn(64, 1)
    model = nn.Linear(1, 1)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), supervised(nn.functional.mse_loss),
                      Runtime(torch.device("cpu"), None),
                      TrainSpec(TrainConfig(epochs=3, patience=3), monitor="val/mse", checkpoint_dir=tmp_path))
    result = trainer.fit(TensorBatches(x, 2 * x, batch_size=16), lambda network: {"val/mse": 1.0})
    assert result.epochs_run == 3 and not stop_requested()


def test_training_stops_after_the_checkpoint_of_the_epoch_in_which_the_signal_came(tmp_path):
    stop_on_signals()
    x = torch.randn(64, 1)
    data = TensorBatches(x, 2 * x, batch_size=16)

    def validate(model):
        if len(epochs) == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        epochs.append(len(epochs))
        return {"val/mse": 1.0 / len(epochs)}

    epochs = []
    model = nn.Linear(1, 1)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), supervised(nn.functional.mse_loss),
                      Runtime(torch.device("cpu"), None),
                      TrainSpec(TrainConfig(epochs=10, checkpoint_every_s=0), monitor="val/mse",
                                checkpoint_dir=tmp_path))
    with pytest.raises(Terminated):
        trainer.fit(data, validate)
    assert epochs == [0, 1]
    assert torch.load(tmp_path / CHECKPOINT_NAME, weights_only=True)["epoch"] == 1
