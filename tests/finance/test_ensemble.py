"""Every neural fit trained as one batched ensemble: the same as training each fit alone, each fit's rows once per
epoch, no host sync in a step, and a resume that ends where an uninterrupted fit does."""

import numpy as np
import pytest
import torch

from common.runtime.devices import Runtime
from common.training.loop import Trainer, make_optimizer, supervised
from common.training.spec import TrainSpec
from common.training.workload import steady_step_syncs
from usecases.finance.config import Config
from usecases.finance.ensemble import Fit, FitBatches, ensemble_step, train_ensemble
from usecases.finance.features import add_features, feature_names
from usecases.finance.models import VolatilityEnsemble, VolatilityMLP, ensemble_forecast, qlike, qlike_loss
from usecases.finance.pipeline import evaluation_window, trainable, training_window, validation_window, walk_starts

CPU = Runtime(torch.device("cpu"), None)


@pytest.fixture
def config():
    return Config.model_validate({
        "evaluation": {"test_start": None, "test_end": None, "test_fraction": 0.3},
        "train": {"epochs": 12, "patience": 2, "lr": 0.03, "grad_clip": 0.05, "batch_size": 64, "refit_every": 100},
        "neural": {"hidden": 8, "dropout": 0.0},
    })


@pytest.fixture
def float64():
    """Networks made in float64: two computations of the same thing that sum in different orders (stacked and
    alone) then agree to about 10⁻¹⁴, far inside float64's default tolerance (10⁻⁷) on any CPU; in float32 they
    agree only to within what the CPU's kernels (AVX-512 or AVX2, the thread count) make of the order."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield torch.float64
    torch.set_default_dtype(previous)


def refits(panel, config, count, dtype=torch.float32):
    """The features and targets of the panel, and one fit for each of its first `count` refits (seeds 11, 12, ...)."""
    frame = add_features(panel)
    mask = evaluation_window(frame, config)
    starts = walk_starts(frame, validation_window(frame, mask, config), mask, config.train.refit_every)
    features = torch.tensor(frame[feature_names([])].to_numpy(), dtype=dtype)
    targets = torch.tensor(frame[["target", "target_h"]].to_numpy(), dtype=dtype)
    fits = [Fit(11 + index, *training_window(frame, trainable(frame), start, config.train.val_fraction))
            for index, start in enumerate(starts[:count])]
    return features, targets, fits


class OneFit:
    """The batches a fit of `batches` gets, alone: its own rows of each batch, in the same order."""

    def __init__(self, batches: FitBatches, fit: int):
        self.batches, self.fit = batches, fit

    def set_epoch(self, epoch):
        self.batches.set_epoch(epoch)

    def __iter__(self):
        rows, weights = self.batches.epoch_rows()
        for batch_rows, batch_weights in zip(rows[:, self.fit], weights[:, self.fit]):
            kept = batch_rows[batch_weights > 0]
            yield self.batches.features[kept], self.batches.targets[kept]


class Training:
    """A tracker that keeps how many fits trained in each epoch."""

    active = False

    def __init__(self):
        self.fits_training = []

    def log_metrics(self, metrics, step=None):
        if "val/fits_training" in metrics:
            self.fits_training.append(metrics["val/fits_training"])


def fit_alone(fit, index, batches, config, grad_clip):
    """The fit as the walk-forward trained it before the ensemble: its own VolatilityMLP, optimizer and Trainer."""
    torch.manual_seed(fit.seed)
    model = VolatilityMLP(batches.features.shape[1], hidden=config.neural.hidden, layers=config.neural.layers,
                          dropout=config.neural.dropout, horizon=config.evaluation.horizon)
    model.fit_scaler(batches.features[fit.train_rows])
    optimizer = make_optimizer("adamw", model.parameters(), CPU, lr=config.train.lr,
                               weight_decay=config.train.weight_decay)
    settings = config.train.model_copy(update={"grad_clip": grad_clip})
    trainer = Trainer(model, optimizer, supervised(qlike_loss), CPU, TrainSpec(settings, monitor="val/qlike"))
    val_x, val_y = batches.features[fit.val_rows], batches.targets[fit.val_rows]
    result = trainer.fit(OneFit(batches, index), lambda network: {"val/qlike": float(qlike(network(val_x), val_y)[0])})
    return model, result.epochs_run


def test_fits_trained_together_end_as_each_trained_alone(panel, config, cpu_job, float64):
    """Dropout 0 (its masks are drawn for all fits at once), the same initial weights and batch order: the two fits
    of the ensemble end with the weights each gets alone, through gradient clipping and early stopping."""
    features, targets, fits = refits(panel, config, 2, float64)
    cpu_job.tracker = Training()
    ensemble = train_ensemble(fits, features, targets, config, cpu_job)
    batches = FitBatches(features, targets, [fit.train_rows for fit in fits], config.train.batch_size,
                         config.runtime.seed, torch.ones(2, dtype=torch.bool))
    epochs = []
    for index, fit in enumerate(fits):
        alone, epochs_run = fit_alone(fit, index, batches, config, config.train.grad_clip)
        epochs.append(epochs_run)
        for name, value in alone.state_dict().items():
            torch.testing.assert_close(ensemble.member(index).state_dict()[name], value,
                                       msg=lambda message: f"fit {index}, {name}: {message}")
        unclipped, _ = fit_alone(fit, index, batches, config, None)
        assert not torch.allclose(unclipped.head.weight, alone.head.weight, atol=1e-4), "clipping acted"
    assert epochs[0] != epochs[1] and max(epochs) < config.train.epochs, "each fit stopped early, at its own epoch"
    training = cpu_job.tracker.fits_training
    assert sorted(epochs) == [training.count(2), len(training)], "and the ensemble stopped each there"


def test_each_fit_sees_each_of_its_rows_once_an_epoch_in_batches_in_proportion_to_its_window():
    features, targets = torch.randn(1000, 3), torch.rand(1000, 2)
    windows = [np.arange(100, 1000), np.arange(0, 301), np.arange(500, 520)]
    batches = FitBatches(features, targets, windows, batch_size=128, seed=4, training=torch.ones(3, dtype=torch.bool))
    assert len(batches) == 8 and batches.width == 113  # 900 rows of the largest fit in 8 batches of at most 128
    orders = []
    for epoch in (0, 1):
        batches.set_epoch(epoch)
        rows, weights = batches.epoch_rows()
        for fit, window in enumerate(windows):
            kept = rows[:, fit][weights[:, fit] > 0]
            np.testing.assert_array_equal(np.sort(kept.numpy()), window)
            sizes = weights[:, fit].sum(1)
            assert sizes.min() >= len(window) // 8 and sizes.max() <= -(-len(window) // 8)
            assert set(rows[:, fit].flatten().tolist()) <= set(window.tolist()), "padding holds the fit's own rows"
        orders.append(rows[:, 0, :5].flatten().tolist())
    assert orders[0] != orders[1], "shuffled anew each epoch"

    batches.training[1] = False
    features_batch, _, weights_batch, fits = next(iter(batches))
    assert fits.tolist() == [0, 2] and len(features_batch) == len(weights_batch) == 2 * batches.width

    shares = [FitBatches(features, targets, windows, 64, 4, torch.ones(3, dtype=torch.bool), rank, 2).epoch_rows()
              for rank in (0, 1)]
    for fit, window in enumerate(windows):
        seen = np.concatenate([rows[:, fit][weights[:, fit] > 0].numpy() for rows, weights in shares])
        assert set(seen) == set(window) and len(seen) == len(window) + len(window) % 2, "two ranks: every row"


def test_a_training_step_makes_no_host_sync():
    torch.manual_seed(0)
    members = [VolatilityMLP(5, hidden=16, dropout=0.1) for _ in range(3)]
    ensemble = VolatilityEnsemble.stack(members, n_features=5, hidden=16, dropout=0.1).train()
    features, targets = torch.randn(500, 5), torch.rand(500, 2) + 0.1
    windows = [np.arange(0, 400), np.arange(100, 300), np.arange(0, 500)]
    batches = iter(FitBatches(features, targets, windows, 64, 0, torch.ones(3, dtype=torch.bool)))
    optimizer = make_optimizer("adamw", ensemble.parameters(), CPU, lr=1e-3)

    syncs = steady_step_syncs(lambda: ensemble_step(ensemble, next(batches)), optimizer,
                              lambda: ensemble.clip_grad_norm_(1.0))
    assert syncs.count == 0, syncs.by_name


def test_the_stacked_members_forecast_as_they_do_alone(float64):
    """In float64, where the stacked product (baddbmm) and each member's nn.Linear, summing in orders of their own,
    agree to float64's default tolerance on any CPU."""
    torch.manual_seed(1)
    members = [VolatilityMLP(4, hidden=8, layers=2).eval() for _ in range(3)]
    for member in members:
        for parameter in member.parameters():
            torch.nn.init.normal_(parameter)
        member.fit_scaler(torch.randn(50, 4) * 3 + 1)
    ensemble = VolatilityEnsemble.stack(members, n_features=4, hidden=8, layers=2).eval()
    rows = torch.randn(7, 4)
    with torch.no_grad():
        stacked = ensemble(rows.expand(3, -1, -1), torch.tensor([0, 1, 2]))
        for index, member in enumerate(members):
            torch.testing.assert_close(stacked[index], member(rows))
            for name, value in member.state_dict().items():
                assert torch.equal(ensemble.member(index).state_dict()[name], value), name
    # the float32 mean of exp of the same float64 log variances, as the served model takes it
    torch.testing.assert_close(ensemble.forecast(rows, torch.tensor([2, 0])),
                               ensemble_forecast([members[2], members[0]], rows))
    assert not torch.allclose(ensemble.forecast(rows, torch.tensor([2, 1])),
                              ensemble_forecast([members[2], members[0]], rows)), "each member forecasts its own"


class StopAfter:
    """A tracker whose `log_metrics` stops the run (as Ctrl-C would) once it is given epoch `epoch`."""

    active = False

    def __init__(self, epoch):
        self.epoch = epoch

    def log_metrics(self, metrics, step=None):
        if step == self.epoch:
            raise KeyboardInterrupt


def test_a_resumed_fit_ends_where_an_uninterrupted_one_does(panel, config, cpu_job, tmp_path):
    """Checkpoints after every epoch; the run stopped after epoch 3 resumes from epoch 2's and ends with the same
    weights (dropout on: the random streams are in the checkpoint too)."""
    config.train.checkpoint_every_s, config.train.epochs, config.train.patience, config.neural.dropout = 0, 8, 3, 0.1
    features, targets, fits = refits(panel, config, 3)
    straight = train_ensemble(fits, features, targets, config, cpu_job).state_dict()
    cpu_job.checkpoint_dir, tracker = tmp_path / "stopped", cpu_job.tracker
    cpu_job.tracker = StopAfter(3)
    with pytest.raises(KeyboardInterrupt):
        train_ensemble(fits, features, targets, config, cpu_job)
    cpu_job.tracker, cpu_job.resume = tracker, True
    resumed = train_ensemble(fits, features, targets, config, cpu_job).state_dict()
    for name, value in straight.items():
        assert torch.equal(resumed[name], value), name
