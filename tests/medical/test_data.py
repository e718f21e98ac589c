"""MedMNIST files of every shape the official sets come in, the cache and mirror lookups, the synthetic set, and the
data_bytes and data_samples tags of each source."""

import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from common.config import load_config
from common.errors import DataUnavailable, UserError
from usecases.medical import USECASE
from usecases.medical.config import Data, MedMNIST, Synthetic
from usecases.medical.data import load_images, load_medmnist_file, medmnist_path, synthetic_images
from usecases.medical.pipeline import load_data

SHARED = Path(__file__).resolve().parents[3] / "shared" / "data" / "medmnist" / "breastmnist.npz"


def write_npz(path, *, channels=None, label_shape="flat", classes=2, labels_per_image=None, size=28, count=12):
    rng = np.random.default_rng(0)
    arrays = {}
    for split in ("train", "val", "test"):
        shape = (count, size, size) if channels is None else (count, size, size, channels)
        arrays[f"{split}_images"] = rng.integers(0, 256, shape, dtype=np.uint8)
        if labels_per_image:
            labels = rng.integers(0, 2, (count, labels_per_image))
            labels[:2] = [[0] * labels_per_image, [1] * labels_per_image]
        else:
            labels = np.arange(count) % classes
            labels = labels[:, None] if label_shape == "column" else labels
        arrays[f"{split}_labels"] = labels.astype(np.uint8)
    np.savez(path, **arrays)
    return path


@pytest.mark.parametrize("label_shape", ["flat", "column"])
def test_labels_of_shape_n_or_n_by_1_load_alike(tmp_path, label_shape):
    data = load_medmnist_file(write_npz(tmp_path / "breastmnist.npz", label_shape=label_shape))
    assert data.task == "binary" and data.classes == ["malignant", "normal, benign"]
    assert data.labels["train"].shape == (12,) and data.labels["train"].dtype == np.int64
    assert data.images["train"].shape == (12, 28, 28, 1) and data.images["train"].dtype == np.uint8


def test_rgb_multiclass_and_sizes(tmp_path):
    data = load_medmnist_file(write_npz(tmp_path / "dermamnist_64.npz", channels=3, classes=7, size=64, count=14))
    assert data.task == "multi-class" and len(data.classes) == 7
    assert data.images["test"].shape == (14, 64, 64, 3) and data.size == 64 and data.channels == 3


def test_multi_label_file(tmp_path):
    data = load_medmnist_file(write_npz(tmp_path / "chestmnist.npz", labels_per_image=14))
    assert data.task == "multi-label" and len(data.classes) == 14
    assert data.labels["val"].shape == (12, 14)


def test_unknown_name_infers_the_task_from_the_labels(tmp_path):
    data = load_medmnist_file(write_npz(tmp_path / "myscans.npz", classes=3))
    assert data.task == "multi-class" and data.classes == ["0", "1", "2"]


def test_wrong_keys_are_named(tmp_path):
    path = tmp_path / "bad.npz"
    np.savez(path, x_train=np.zeros((2, 28, 28), np.uint8))
    with pytest.raises(UserError, match=r"bad.npz: missing key 'train_images'.*has x_train"):
        load_medmnist_file(path)


def test_float_images_are_refused(tmp_path):
    path = write_npz(tmp_path / "breastmnist.npz")
    arrays = dict(np.load(path))
    arrays["val_images"] = arrays["val_images"].astype(np.float32)
    np.savez(path, **arrays)
    with pytest.raises(UserError, match="val_images must be uint8"):
        load_medmnist_file(path)


def test_not_an_npz(tmp_path):
    path = tmp_path / "broken.npz"
    path.write_bytes(b"not a zip")
    with pytest.raises(UserError, match="broken.npz: not a readable .npz file"):
        load_medmnist_file(path)


def test_empty_class_is_refused(tmp_path):
    path = write_npz(tmp_path / "breastmnist.npz")
    arrays = dict(np.load(path))
    arrays["train_labels"][:] = 1
    np.savez(path, **arrays)
    with pytest.raises(UserError, match="class 'malignant' has no images in the train split"):
        load_images(Data(), path, seed=0)


def test_cache_is_used_before_any_download(tmp_path):
    write_npz(tmp_path / "pneumoniamnist_64.npz", size=64)
    assert medmnist_path(MedMNIST(flag="pneumoniamnist", size=64, cache_dir=tmp_path)) == (
        tmp_path / "pneumoniamnist_64.npz")


def test_offline_without_a_file_says_where_to_put_it(tmp_path, monkeypatch):
    monkeypatch.delenv("USECASES_DATA_PATH", raising=False)
    config = MedMNIST(flag="pneumoniamnist", size=128, cache_dir=tmp_path, download=False)
    with pytest.raises(DataUnavailable, match=rf"put pneumoniamnist_128.npz in {tmp_path}.*MD5 [0-9a-f]{{32}}"):
        medmnist_path(config)


def test_a_mirror_folder_in_the_data_path_is_looked_in_after_the_cache(tmp_path, monkeypatch):
    cache, empty, mirror = tmp_path / "cache", tmp_path / "empty", tmp_path / "mirror"
    config = MedMNIST(flag="pneumoniamnist", size=64, cache_dir=cache, download=False)
    monkeypatch.delenv("USECASES_DATA_PATH", raising=False)
    with pytest.raises(DataUnavailable, match=r"MedMNIST pneumoniamnist_64.npz is not in the cache nor in a mirror"):
        medmnist_path(config)
    (mirror / "medmnist").mkdir(parents=True)
    copy = write_npz(mirror / "medmnist" / "pneumoniamnist_64.npz", size=64)
    monkeypatch.setenv("USECASES_DATA_PATH", os.pathsep.join([str(empty), str(mirror)]))
    assert medmnist_path(config) == copy
    assert not cache.exists()  # found in place: nothing copied nor downloaded into the cache
    cache.mkdir()
    cached = write_npz(cache / "pneumoniamnist_64.npz", size=64)
    assert medmnist_path(config) == cached  # the cache comes first


def test_unknown_medmnist_name():
    with pytest.raises(UserError, match="unknown data set 'brestmnist'"):
        medmnist_path(MedMNIST(flag="brestmnist"))


def test_synthetic_classes_differ_in_shape_and_are_reproducible():
    first, second = synthetic_images(Synthetic(classes=3, seed=4)), synthetic_images(Synthetic(classes=3, seed=4))
    assert np.array_equal(first.images["train"], second.images["train"]) and first.sha256 == second.sha256
    assert first.task == "multi-class" and (first.counts("train") > 0).all()
    clean = synthetic_images(Synthetic(classes=2, noise=0.0, seed=1))
    means = [clean.images["train"][clean.labels["train"] == label].mean(axis=0) for label in (0, 1)]
    assert np.abs(means[0].astype(float) - means[1]).max() > 20  # a disc and a square cover different pixels


@pytest.mark.skipif(not SHARED.is_file(), reason="the shared BreastMNIST copy is absent")
def test_real_breastmnist_copy():
    data = load_medmnist_file(SHARED)
    assert {split: len(labels) for split, labels in data.labels.items()} == {"train": 546, "val": 78, "test": 156}
    assert data.counts("train").tolist() == [147, 399]


def smoke_config():
    return load_config(USECASE.config, USECASE.presets_dir, "smoke", [])


def class_folders(root: Path) -> list[Path]:
    """Twelve PNGs of each of two classes under `root`; the images written."""
    images = []
    for value, name in ((60, "benign"), (200, "malignant")):
        (root / name).mkdir(parents=True)
        for number in range(12):
            Image.new("L", (10, 10), value).save(root / name / f"{number}.png")
            images.append(root / name / f"{number}.png")
    return images


def test_data_bytes_of_an_npz_is_its_size_and_data_samples_its_images(tmp_path):
    path = write_npz(tmp_path / "breastmnist.npz", count=14)
    _, tags = load_data(smoke_config(), path)
    assert tags["data_bytes"] == path.stat().st_size and tags["data_samples"] == 3 * 14


def test_data_bytes_of_class_folders_counts_the_images_read_not_other_files(tmp_path):
    images = class_folders(tmp_path / "scans")
    (tmp_path / "scans" / "benign" / "notes.txt").write_bytes(b"x" * 5000)  # skipped by the reader
    _, tags = load_data(smoke_config(), tmp_path / "scans")
    assert tags["data_bytes"] == sum(image.stat().st_size for image in images) and tags["data_samples"] == 24


def test_data_bytes_of_the_synthetic_set_in_memory_is_its_arrays_uncompressed():
    data, tags = load_data(smoke_config(), None)
    assert tags["data_samples"] == 256 + 128 + 256
    images = 640 * 28 * 28  # uint8, one channel
    assert tags["data_bytes"] == images + 640 * 8 == sum(data.images[s].nbytes + data.labels[s].nbytes
                                                         for s in ("train", "val", "test"))


def test_data_bytes_of_a_manifest_counts_it_and_the_images_it_names(tmp_path):
    images = class_folders(tmp_path / "scans")
    manifest = tmp_path / "scans" / "manifest.csv"
    manifest.write_text("path,label\n" + "".join(f"{image.parent.name}/{image.name},{image.parent.name}\n"
                                                 for image in images[1:]))
    _, tags = load_data(smoke_config(), manifest)
    assert tags["data_bytes"] == sum(path.stat().st_size for path in [manifest, *images[1:]])
    assert tags["data_samples"] == 23
