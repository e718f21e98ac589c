"""The shared `Trainer` on CPU: learning, early stopping, checkpoints and resume, batching and logged metrics."""

from __future__ import annotations

import copy
import pickle
import types

import pytest
import torch
from torch import nn

from common.training import loop as training
from common.errors import UserError
from common.runtime.interrupt import Terminated
from common.runtime.devices import Runtime
from common.config import TrainConfig
from common.training.callbacks import CHECKPOINT_NAME, save_atomic
from common.training.loop import TensorBatches, Trainer, supervised
from common.training.spec import TrainSpec

CPU = Runtime(torch.device("cpu"), None)


def line_data(n: int = 256, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """y = 3x + 1 with a little noise."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, generator=generator)
    return x, 3 * x + 1 + 0.01 * torch.randn(n, 1, generator=generator)


X, Y = line_data()
X_VAL, Y_VAL = line_data(64, seed=1)


def val_mse(model: nn.Module) -> dict[str, float]:
    return {"val/mse": nn.functional.mse_loss(model(X_VAL).float(), Y_VAL).item()}


def make_trainer(model, runtime=CPU, *, lr=0.1, momentum=0.0, scheduler=False, checkpoint_dir=None,
                 log_metrics=None, monitor="val/mse", mode="min", tie_break=None, **settings):
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    sched = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5) if scheduler else None
    settings = {"epochs": 10, "patience": 100, "checkpoint_every_s": 0, **settings}
    spec = TrainSpec(TrainConfig(**settings), monitor=monitor, mode=mode, tie_break=tie_break,
                     checkpoint_dir=checkpoint_dir, log_metrics=log_metrics)
    return Trainer(model, optimizer, supervised(nn.functional.mse_loss), runtime, spec, scheduler=sched)


def linear(seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(1, 1)


def mlp(seed: int) -> nn.Module:
    """Dropout-free, so that a run depends only on its seed, its batches and its checkpoint."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Linear(8, 1))


def batches(**kwargs) -> TensorBatches:
    return TensorBatches(X, Y, batch_size=32, seed=0, **kwargs)


def test_an_epoch_of_at_most_n_batches_draws_a_fresh_sample_each_epoch():
    limited = batches(max_batches=2)
    first = torch.cat([x for x, _ in limited])
    limited.set_epoch(1)
    second = torch.cat([x for x, _ in limited])
    assert len(limited) == 2 and len(first) == len(second) == 64 < len(X)
    assert not torch.equal(first, second)


def test_learns_a_line():
    model = linear()
    result = make_trainer(model, epochs=15).fit(batches(), val_mse)
    losses = [row["train/loss"] for row in result.history]
    assert losses[-1] < losses[0] / 100
    assert model.weight.item() == pytest.approx(3.0, abs=0.05)
    assert model.bias.item() == pytest.approx(1.0, abs=0.05)
    assert (result.epochs_run, result.resumed_from, len(result.history)) == (15, None, 15)
    assert result.best_metric == min(row["val/mse"] for row in result.history)


def test_early_stopping_keeps_the_best_epoch_weights():
    """The monitored value stops improving after epoch 2: stop after `patience` more, with epoch 2's weights."""
    values = iter([3.0, 2.0, 1.0] + [1.0] * 20)
    snapshots = []

    def validate(model):
        snapshots.append(copy.deepcopy(model.state_dict()))
        return {"val/score": next(values)}

    model = linear()
    result = make_trainer(model, monitor="val/score", patience=2, epochs=20).fit(batches(), validate)
    assert (result.best_epoch, result.best_metric, result.epochs_run) == (2, 1.0, 5)
    assert len(snapshots) == 5
    final = model.state_dict()
    assert all(torch.equal(final[key], snapshots[2][key]) for key in final)
    assert not torch.equal(final["weight"], snapshots[4]["weight"]), "training went on after the best epoch"


def test_early_stopping_in_max_mode():
    values = iter([0.5, 0.9, 0.7, 0.8, 0.6])
    result = make_trainer(linear(), monitor="val/auc", mode="max", patience=3).fit(
        batches(), lambda model: {"val/auc": next(values)})
    assert (result.best_epoch, result.best_metric, result.epochs_run) == (1, 0.9, 5)


def test_missing_monitor_metric_is_named():
    with pytest.raises(KeyError, match="val/mse"):
        make_trainer(linear()).fit(batches(), lambda model: {"val/other": 1.0})


def test_resume_after_interrupt_matches_an_uninterrupted_run(tmp_path):
    """Optimizer momentum, scheduler and counters come back from the checkpoint, so resuming changes nothing."""
    settings = {"epochs": 6, "lr": 0.05, "momentum": 0.9, "scheduler": True}
    straight_model = mlp(seed=0)
    straight = make_trainer(straight_model, checkpoint_dir=tmp_path / "straight", **settings).fit(batches(), val_mse)

    def interrupt_after_three_epochs(metrics, step):
        if step == 3:
            raise Terminated("signal 15")

    with pytest.raises(Terminated):
        make_trainer(mlp(seed=0), checkpoint_dir=tmp_path / "resumed", log_metrics=interrupt_after_three_epochs,
                     **settings).fit(batches(), val_mse)
    resumed_model = mlp(seed=1)
    resumed = make_trainer(resumed_model, checkpoint_dir=tmp_path / "resumed", **settings).fit(
        batches(), val_mse, resume=True)

    assert (resumed.resumed_from, resumed.epochs_run) == (3, 6)
    assert [row["epoch"] for row in resumed.history] == list(range(6))
    for key in ("train/loss", "val/mse"):
        assert [row[key] for row in resumed.history] == [row[key] for row in straight.history]
    assert (resumed.best_epoch, resumed.best_metric) == (straight.best_epoch, straight.best_metric)
    expected = straight_model.state_dict()
    assert all(torch.equal(value, expected[key]) for key, value in resumed_model.state_dict().items())


def dropout_mlp(seed: int) -> nn.Module:
    """With dropout, each step draws from the device's generator: a resume is identical only if it restores it."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(1, 16), nn.Tanh(), nn.Dropout(0.3), nn.Linear(16, 1))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_resumed_run_with_dropout_is_bit_identical_to_an_uninterrupted_one(tmp_path, device):
    runtime = Runtime(torch.device(device), None)
    x, y = X.to(runtime.device), Y.to(runtime.device)

    def validate(model):
        return {"val/mse": nn.functional.mse_loss(model(x), y).item()}

    def fit(model, folder, **kwargs):
        trainer = make_trainer(model, runtime, epochs=5, lr=0.05, checkpoint_dir=tmp_path / folder, **kwargs)
        return trainer.fit(TensorBatches(x, y, batch_size=32, seed=0), validate, resume="log_metrics" not in kwargs)

    torch.manual_seed(123)
    straight_model = dropout_mlp(0).to(runtime.device)
    straight = fit(straight_model, "straight")

    def interrupt_after_two_epochs(metrics, step):
        if step == 2:
            raise Terminated("signal 15")

    torch.manual_seed(123)
    with pytest.raises(Terminated):
        fit(dropout_mlp(0).to(runtime.device), "resumed", log_metrics=interrupt_after_two_epochs)
    torch.manual_seed(999)  # whatever the generators did in between, the checkpoint's state comes back
    if device == "cuda":
        torch.cuda.manual_seed_all(999)
    resumed_model = dropout_mlp(1).to(runtime.device)
    resumed = fit(resumed_model, "resumed")
    assert resumed.resumed_from == 2
    assert [row["train/loss"] for row in resumed.history] == [row["train/loss"] for row in straight.history]
    expected = straight_model.state_dict()
    assert all(torch.equal(value, expected[key]) for key, value in resumed_model.state_dict().items())


def test_compile_wraps_the_trained_model_and_leaves_its_warm_up_out_of_the_throughput(monkeypatch):
    compiled = []
    monkeypatch.setattr(torch, "compile", lambda model: compiled.append(model) or model)
    runtime = Runtime(torch.device("cpu"), None, compile=True)
    result = make_trainer(linear(), runtime, epochs=3).fit(batches(), val_mse)
    assert len(compiled) == 1
    assert ["throughput/samples_per_s" in row for row in result.history] == [False, True, True]


@pytest.mark.gpu
def test_resume_on_cuda(tmp_path):
    runtime = Runtime(torch.device("cuda", 0), None)
    x, y = X.to(runtime.device), Y.to(runtime.device)

    def validate(model):
        return {"val/mse": nn.functional.mse_loss(model(x), y).item()}

    def interrupt_after_two_epochs(metrics, step):
        if step == 2:
            raise Terminated("signal 15")

    with pytest.raises(Terminated):
        make_trainer(linear(), runtime, epochs=4, checkpoint_dir=tmp_path,
                     log_metrics=interrupt_after_two_epochs).fit(TensorBatches(x, y, batch_size=32), validate)
    result = make_trainer(linear(), runtime, epochs=4, checkpoint_dir=tmp_path).fit(
        TensorBatches(x, y, batch_size=32), validate, resume=True)
    assert (result.resumed_from, result.epochs_run) == (2, 4)


def test_finished_checkpoint_returns_without_training(tmp_path):
    """A run that reached max_epochs is finished: resuming it, even with a larger max_epochs, trains nothing."""
    model = mlp(seed=0)
    first = make_trainer(model, epochs=3, checkpoint_dir=tmp_path).fit(batches(), val_mse)

    class NoBatches:
        def __iter__(self):
            raise AssertionError("a finished run must not train again")

    def no_validation(model):
        raise AssertionError("a finished run must not validate again")

    logged = []
    again_model = mlp(seed=1)
    again = make_trainer(again_model, epochs=6, checkpoint_dir=tmp_path,
                         log_metrics=lambda metrics, step: logged.append(step)).fit(
        NoBatches(), no_validation, resume=True)
    assert (again.epochs_run, again.resumed_from, again.best_epoch) == (3, 3, first.best_epoch)
    assert again.history == first.history and logged == []
    expected = model.state_dict()
    assert all(torch.equal(value, expected[key]) for key, value in again_model.state_dict().items())


def test_resume_without_checkpoint_starts_fresh(tmp_path):
    result = make_trainer(linear(), epochs=2, checkpoint_dir=tmp_path).fit(batches(), val_mse, resume=True)
    assert (result.resumed_from, result.epochs_run) == (None, 2)


def test_checkpoint_dir_holds_only_the_checkpoint(tmp_path):
    make_trainer(linear(), epochs=3, checkpoint_dir=tmp_path / "ckpt").fit(batches(), val_mse)
    assert [path.name for path in (tmp_path / "ckpt").iterdir()] == [CHECKPOINT_NAME]
    state = torch.load(tmp_path / "ckpt" / CHECKPOINT_NAME, weights_only=True)
    assert state["finished"] and state["epoch"] == 2


def test_save_atomic_replaces_without_leftovers(tmp_path):
    path = tmp_path / "nested" / "last.pt"
    save_atomic({"step": 1}, path)
    save_atomic({"step": 2, "weights": torch.ones(3)}, path)
    assert [entry.name for entry in path.parent.iterdir()] == ["last.pt"]
    loaded = torch.load(path)
    assert loaded["step"] == 2 and torch.equal(loaded["weights"], torch.ones(3))


def test_save_atomic_failure_keeps_the_previous_checkpoint(tmp_path):
    path = tmp_path / "last.pt"
    save_atomic({"step": 1}, path)
    with pytest.raises((AttributeError, TypeError, pickle.PicklingError)):
        save_atomic({"step": 2, "unpicklable": lambda: None}, path)
    assert torch.load(path) == {"step": 1}
    assert [entry.name for entry in tmp_path.iterdir()] == ["last.pt"], "the failed write left its temporary file"


@pytest.mark.parametrize("n", [10, 11])
def test_ranks_get_disjoint_shards_covering_everything(n):
    """Two ranks with the same seed and epoch see one permutation and split it between them."""
    indices = torch.arange(n)
    shards = []
    for rank in range(2):
        sharded = TensorBatches(indices, batch_size=3, seed=5, rank=rank, world_size=2)
        sharded.set_epoch(4)
        got = torch.cat([batch for (batch,) in sharded]).tolist()
        assert len(list(sharded)) == len(sharded)
        shards.append(got)
    assert len(shards[0]) == len(shards[1]) == (n + 1) // 2, "equal batch counts, or DDP ranks deadlock"
    assert set(shards[0]) | set(shards[1]) == set(range(n))
    if n % 2 == 0:
        assert set(shards[0]).isdisjoint(shards[1]) and len(set(shards[0])) == n // 2


def test_shuffle_depends_on_seed_and_epoch_only():
    def order(epoch, seed=0, shuffle=True):
        loader = TensorBatches(torch.arange(64), batch_size=64, seed=seed, shuffle=shuffle)
        loader.set_epoch(epoch)
        return next(iter(loader))[0].tolist()

    assert order(1) == order(1) and order(1) != order(2) and order(1, seed=1) != order(1)
    assert sorted(order(1)) == list(range(64))
    assert order(3, shuffle=False) == list(range(64))


def test_batches_keep_rows_paired_and_include_the_remainder():
    index = torch.arange(256)
    loader = TensorBatches(index, index * 10, batch_size=100, seed=0)
    sizes = []
    for first, second in loader:
        assert torch.equal(second, first * 10)
        sizes.append(len(first))
    assert sizes == [100, 100, 56] and len(loader) == 3


def test_data_wait_share_and_throughput_logged(monkeypatch):
    """A fake clock: each batch takes 1 s to arrive and 3 s to train on, so a quarter of the time is data wait."""
    clock = [0.0]
    monkeypatch.setattr(training, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))

    class SlowBatches(TensorBatches):
        def __iter__(self):
            for batch in super().__iter__():
                clock[0] += 1.0
                yield batch

    def slow_loss(output, target):
        clock[0] += 3.0
        return nn.functional.mse_loss(output, target)

    logged = []
    model = linear()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), supervised(slow_loss), CPU,
                      TrainSpec(TrainConfig(epochs=2), monitor="val/mse", step_offset=10,
                                log_metrics=lambda metrics, step: logged.append((step, metrics))))
    trainer.fit(SlowBatches(X, Y, batch_size=32, seed=0), val_mse)
    epochs = [(step, metrics) for step, metrics in logged if "train/loss" in metrics]
    assert [step for step, _ in epochs] == [10, 11]
    for _, metrics in epochs:
        assert {"train/loss", "val/mse", "time/data_wait_share", "throughput/samples_per_s"} <= set(metrics)
        assert metrics["time/data_wait_share"] == pytest.approx(0.25)
        assert metrics["throughput/samples_per_s"] == pytest.approx(256 / (8 * 4.0))


def test_grad_clip_bounds_each_step():
    model = linear()
    start = torch.cat([parameter.detach().clone().flatten() for parameter in model.parameters()])
    make_trainer(model, lr=1.0, grad_clip=1e-3, epochs=1).fit(batches(), val_mse)
    end = torch.cat([parameter.detach().flatten() for parameter in model.parameters()])
    assert 0 < (end - start).norm() <= len(batches()) * 1e-3 + 1e-6


def test_bf16_autocast_on_cpu_trains():
    dtypes = set()
    model = linear()
    model.register_forward_hook(lambda module, inputs, output: dtypes.add(output.dtype) if module.training else None)
    result = make_trainer(model, Runtime(torch.device("cpu"), torch.bfloat16), epochs=5).fit(batches(), val_mse)
    assert dtypes == {torch.bfloat16}, "the forward pass ran under bf16 autocast"
    assert model.weight.dtype == torch.float32
    losses = [row["train/loss"] for row in result.history]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0] / 10
    assert model.weight.item() == pytest.approx(3.0, abs=0.1)


def test_a_dataloader_trains_like_tensor_batches():
    """The DataLoader path (for data that does not fit in memory) goes through the same loop."""
    dataset = torch.utils.data.TensorDataset(X, Y)
    loader = training.make_loader(dataset, batch_size=32, runtime=CPU, seed=0)
    model = linear()
    result = make_trainer(model, epochs=30).fit(loader, val_mse)
    assert result.best_metric < 0.01
    assert model.weight.item() == pytest.approx(3, abs=0.05)


def test_make_loader_shards_with_a_distributed_sampler_under_ddp():
    dataset = torch.utils.data.TensorDataset(torch.arange(10.0), torch.arange(10.0))
    ranks = [Runtime(torch.device("cpu"), None, rank=rank, world_size=2) for rank in (0, 1)]
    loaders = [training.make_loader(dataset, batch_size=4, runtime=runtime) for runtime in ranks]
    assert all(isinstance(loader.sampler, torch.utils.data.DistributedSampler) for loader in loaders)
    seen = [torch.cat([batch[0] for batch in loader]).tolist() for loader in loaders]
    assert sorted(seen[0] + seen[1]) == [float(i) for i in range(10)]
    assert not set(seen[0]) & set(seen[1])


def test_weighted_batches_draw_rows_in_proportion_to_their_weights():
    rows = torch.arange(100)
    weights = torch.where(rows < 10, 9.0, 1.0)  # the first 10 rows carry half the total weight
    drawn = torch.cat([batch[0] for epoch in range(20) for batch in _epoch(
        TensorBatches(rows, batch_size=25, seed=1, weights=weights), epoch)])
    assert len(drawn) == 2000
    assert 0.45 < (drawn < 10).float().mean().item() < 0.55


def _epoch(batches, epoch):
    batches.set_epoch(epoch)
    return list(batches)


def test_make_loader_samples_by_weight_and_refuses_it_under_ddp():
    dataset = torch.utils.data.TensorDataset(torch.arange(10.0))
    weights = torch.tensor([1.0] + [0.0] * 9)
    loader = training.make_loader(dataset, batch_size=5, runtime=CPU, weights=weights)
    assert torch.cat([batch[0] for batch in loader]).tolist() == [0.0] * 10
    with pytest.raises(UserError, match="weighted sampler cannot be combined with DDP"):
        training.make_loader(dataset, batch_size=5, runtime=Runtime(torch.device("cpu"), None, world_size=2),
                             weights=weights)


def test_batch_norm_is_synchronised_under_ddp_on_gpus_only():
    from common.training.loop import synchronised_batch_norm

    def network():
        return nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2))

    names = list(network().state_dict())
    on_gpus = synchronised_batch_norm(network(), Runtime(torch.device("cuda"), None, world_size=2))
    assert isinstance(on_gpus[1], nn.SyncBatchNorm) and list(on_gpus.state_dict()) == names
    for runtime in (Runtime(torch.device("cpu"), None, world_size=2), Runtime(torch.device("cuda"), None)):
        assert type(synchronised_batch_norm(network(), runtime)[1]) is nn.BatchNorm2d


def batch_norm_net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(1, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 1))


def test_the_fitted_model_is_the_best_epochs_model_buffers_included(tmp_path):
    """After the fit (and its workload probe, a train-mode forward pass) every parameter and buffer, batch norm's
    running statistics included, is the best epoch's; a resume of the finished fit returns the same model."""
    snapshots = []

    def validate(model):
        snapshots.append(copy.deepcopy(model.state_dict()))
        return val_mse(model)

    model = batch_norm_net(0)
    result = make_trainer(model, epochs=4, lr=0.05, checkpoint_dir=tmp_path).fit(batches(), validate)
    best = snapshots[result.best_epoch]
    fitted = model.state_dict()
    assert any(key.endswith("running_mean") for key in fitted)
    for key, value in fitted.items():
        assert torch.equal(value, best[key]), f"{key} is not the best epoch's"
    resumed = batch_norm_net(1)
    make_trainer(resumed, epochs=4, lr=0.05, checkpoint_dir=tmp_path).fit(batches(), validate, resume=True)
    assert all(torch.equal(value, fitted[key]) for key, value in resumed.state_dict().items())


def test_a_tie_on_the_monitored_metric_goes_to_the_lower_tie_break_loss():
    """A saturated validation AUC (1.0 from epoch 1 on) picks the epoch with the lowest validation loss among the
    tied ones, not the first of them."""
    aucs = iter([0.9, 1.0, 1.0, 1.0, 1.0])
    losses = iter([0.6, 0.5, 0.3, 0.2, 0.4])

    def validate(model):
        return {"val/auc": next(aucs), "val/loss": next(losses)}

    result = make_trainer(linear(), monitor="val/auc", mode="max", epochs=5, tie_break="val/loss").fit(
        batches(), validate)
    assert (result.best_epoch, result.best_metric) == (3, 1.0)
    no_tie_break = make_trainer(linear(), monitor="val/auc", mode="max", epochs=5)
    aucs, losses = iter([0.9, 1.0, 1.0, 1.0, 1.0]), iter([0.6, 0.5, 0.3, 0.2, 0.4])
    assert no_tie_break.fit(batches(), validate).best_epoch == 1


def test_a_missing_tie_break_metric_is_named():
    with pytest.raises(KeyError, match="val/loss"):
        make_trainer(linear(), tie_break="val/loss").fit(batches(), val_mse)


def test_a_checkpoint_from_before_per_rank_random_states_resumes(tmp_path):
    """Such a checkpoint holds one random state where a list of them is now: a run interrupted before an upgrade
    still resumes after it, with the state it saved."""
    settings = {"epochs": 4, "lr": 0.05}

    def interrupt_after_two_epochs(metrics, step):
        if step == 1:
            raise Terminated("signal 15")

    with pytest.raises(Terminated):
        make_trainer(mlp(seed=0), checkpoint_dir=tmp_path, log_metrics=interrupt_after_two_epochs,
                     **settings).fit(batches(), val_mse)
    state = torch.load(tmp_path / CHECKPOINT_NAME, weights_only=True)
    saved = state["torch_rng"][0]
    state["torch_rng"], state["cuda_rng"] = saved, []
    torch.save(state, tmp_path / CHECKPOINT_NAME)
    trainer = make_trainer(mlp(seed=1), checkpoint_dir=tmp_path, **settings)
    states, train_epoch = [], trainer._train_epoch

    def recording(epoch_batches):
        states.append(torch.get_rng_state())
        return train_epoch(epoch_batches)

    trainer._train_epoch = recording
    assert trainer.fit(batches(), val_mse, resume=True).resumed_from == 1
    assert torch.equal(states[0], saved)
