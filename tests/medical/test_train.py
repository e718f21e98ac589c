"""The two data paths, the imbalance options and test-time augmentation."""

import numpy as np
import pytest
import torch

from common.job import Job
from common.runtime.devices import Runtime
from common.tracking.runs import Tracker
from usecases.medical.config import Config
from usecases.medical.data import synthetic_images
from usecases.medical.train import class_weights, fit_network, predict_logits, sample_weights

CPU = Runtime(torch.device("cpu"), None)


def tiny_config(**train) -> Config:
    config = Config.model_validate({
        "data": {"source": "synthetic", "synthetic": {"size": 16, "train": 96, "val": 32, "test": 32}},
        "train": {"epochs": 2, "batch_size": 32, **train},
    })
    return config


@pytest.fixture(scope="module")
def data():
    imbalanced = synthetic_images(tiny_config().data.synthetic)
    keep = np.flatnonzero((imbalanced.labels["train"] == 1) | (np.arange(96) % 3 == 0))
    imbalanced.images["train"], imbalanced.labels["train"] = (imbalanced.images["train"][keep],
                                                              imbalanced.labels["train"][keep])
    return imbalanced


def test_inverse_frequency_weights(data):
    counts = data.counts("train")
    weights = class_weights(data)
    assert torch.allclose(weights * torch.tensor(counts, dtype=torch.float32), torch.full((2,), counts.sum() / 2))
    per_image = sample_weights(data)
    assert per_image[data.labels["train"] == 0].sum().item() == pytest.approx(1.0)
    assert per_image[data.labels["train"] == 1].sum().item() == pytest.approx(1.0)


@pytest.mark.parametrize(("in_memory", "imbalance"), [(True, "sampler"), (False, "sampler"), (False, "class_weights")])
def test_both_data_paths_train_with_either_imbalance_option(tmp_path, data, in_memory, imbalance):
    config = tiny_config(imbalance=imbalance, workers=0)
    config.data.in_memory = in_memory
    model, arch, result = fit_network(config, data, Job(CPU, Tracker(active=False), tmp_path))
    assert arch["cifar_stem"] and result.epochs_run == 2
    assert all(np.isfinite(row["train/loss"]) and 0 <= row["val/auc"] <= 1 for row in result.history)
    assert not model.training


def test_a_saturated_validation_auc_keeps_the_epoch_of_lowest_validation_loss(tmp_path, data, monkeypatch):
    """A validation AUC of 1.0 from the first epoch on would otherwise keep that least-trained epoch."""
    from usecases.medical import train

    monkeypatch.setattr(train, "auc", lambda labels, logits, task: 1.0)
    _, _, result = fit_network(tiny_config(epochs=3), data, Job(CPU, Tracker(active=False), tmp_path))
    losses = [row["val/loss"] for row in result.history]
    assert result.best_epoch == int(np.argmin(losses)) and len(set(losses)) == 3


def test_tta_averages_an_image_and_its_mirror(data):
    class LeftBright(torch.nn.Module):
        def forward(self, images):
            left = images[..., : images.shape[-1] // 2].float().mean(dim=(1, 2, 3))
            return torch.stack([left, -left], dim=1)

    images = torch.zeros(2, 1, 4, 4, dtype=torch.uint8)
    images[0, ..., :2] = 200
    plain = predict_logits(LeftBright(), images, CPU)
    averaged = predict_logits(LeftBright(), images, CPU, tta=True)
    assert plain[0, 0] == pytest.approx(200) and averaged[0, 0] == pytest.approx(100)
    assert averaged[1, 0] == pytest.approx(0)


def test_memory_mapped_splits_are_scored_a_batch_at_a_time_alike(data, tmp_path, monkeypatch):
    """Val and test shards that do not fit in memory are read in batches, with the logits of the whole array."""
    from usecases.medical import pipeline as baselines, train
    from usecases.medical.train import channels_first

    images = data.images["test"]
    mapped = np.lib.format.open_memmap(tmp_path / "test.npy", mode="w+", dtype=np.uint8, shape=images.shape)
    mapped[:] = images
    class Linear(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weights = torch.nn.Linear(int(np.prod(images.shape[1:])), 2)

        def forward(self, batch):
            return self.weights(batch.flatten(1).float() / 255)

    network = Linear()
    expected = predict_logits(network, channels_first(images), CPU)
    monkeypatch.setattr(train, "PREDICT_BATCH", 5)
    # Batches of 5 may take other matmul kernels, summing each logit's K pixel terms in another order: each side is
    # within (K - 1) eps/2 of sum |w x| + |b| <= sum |w| + |b| (pixels in [0, 1]) of the exact logit, whatever the order
    weights, bias = network.weights.weight.detach().abs(), network.weights.bias.detach().abs()
    bound = weights.shape[1] * torch.finfo(torch.float32).eps * (weights.sum(1) + bias).numpy()
    got = predict_logits(network, mapped, CPU)
    assert got.shape == expected.shape and (np.abs(got - expected) <= bound).all()
    assert np.allclose(baselines.pixel_features(mapped, 8, batch=7), baselines.pixel_features(images, 8))


def test_a_training_step_of_the_network_makes_no_host_sync(data):
    """Augmentation, forward, loss and backward of the default network queue on a GPU without waiting for it."""
    from common.training.loop import supervised
    from common.training.workload import HostSyncs
    from usecases.medical.train import channels_first, loss_function, new_classifier

    config = tiny_config()
    config.augment.shift_pixels, config.augment.horizontal_flip = 2, True
    model, _ = new_classifier(config, data)
    step = supervised(loss_function(data, "class_weights", CPU.device))
    batch = (channels_first(data.images["train"][:16]), torch.from_numpy(data.labels["train"][:16]).long())
    model.train()
    step(model, batch).backward()  # the first step's one-off work
    with HostSyncs() as syncs:
        step(model, batch).backward()
    assert syncs.count == 0, syncs.by_name
