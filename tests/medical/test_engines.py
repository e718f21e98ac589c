"""Images from disk on the Dask engine: decoded into memory-mapped shards equal, pixel for pixel, to the pandas
engine's arrays, cached for the next run, and streamed to training by DataLoader workers."""

from __future__ import annotations

import numpy as np
import pytest

from tests.cli_helpers import runs, usecases
from usecases.medical import shards
from usecases.medical.config import Data, Synthetic
from usecases.medical.data import load_images
from usecases.medical.images import SPLITS

pytest.importorskip("distributed")

ON_DISK = Data(source="synthetic", synthetic=Synthetic(train=120, val=40, test=40, as_files=True, seed=3))


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def test_files_decoded_on_dask_are_the_in_process_ones(dask_client, monkeypatch):
    monkeypatch.setattr(shards, "FILES_PER_TASK", 16)  # several tasks and shards per split
    alone, spread = load_images(ON_DISK, None, seed=0), load_images(ON_DISK, None, seed=0, client=dask_client)
    assert spread.classes == alone.classes and spread.sha256 == alone.sha256
    for split in SPLITS:
        assert isinstance(spread.images[split], np.memmap)
        np.testing.assert_array_equal(spread.images[split], alone.images[split])
        np.testing.assert_array_equal(spread.labels[split], alone.labels[split])
        np.testing.assert_array_equal(spread.patients[split], alone.patients[split])
    in_memory = ON_DISK.synthetic.model_copy(update={"as_files": False})
    generated = load_images(Data(source="synthetic", synthetic=in_memory), None, seed=0)
    assert sorted(map(len, spread.labels.values())) == sorted(map(len, generated.labels.values()))


def test_a_second_run_starts_from_the_decoded_shards(dask_client, monkeypatch):
    first = load_images(ON_DISK, None, seed=0, client=dask_client)

    def decode_again(*args):
        raise AssertionError("decoded again")

    monkeypatch.setattr(shards, "_decode", decode_again)
    again = load_images(ON_DISK, None, seed=0, client=dask_client)
    np.testing.assert_array_equal(again.images["train"], first.images["train"])


@pytest.mark.slow
def test_a_run_streams_the_shards_to_dataloader_workers(tmp_path):
    import os

    result = usecases("run", "medical", "--preset", "smoke", "--engine", "dask", "--workers", "2", "--set",
                      "data.synthetic.as_files=true", "--set", "data.in_memory=false", "--set", "train.workers=2",
                      "--set", "train.epochs=2", env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert result.returncode == 0, result.stderr[-2000:]
    assert "DataLoader, 2 workers" in result.stderr
    (run,) = runs("medical")
    assert run.info.status == "FINISHED" and run.data.tags["engine"] == "dask"
    assert run.data.metrics["test/resnet18/auc"] > 0.5
    assert list((tmp_path / "cache" / "gpu-usecases" / "medical-decoded").glob("*/train.npy"))


def test_another_split_of_the_same_files_is_decoded_anew(dask_client, tmp_path):
    """Class folders carry no split: the seed draws it, and the shards must follow the rows of each draw."""
    from PIL import Image

    from usecases.medical.config import Files
    from usecases.medical.files import load_files

    rng = np.random.default_rng(0)
    for label in ("benign", "malignant"):
        (tmp_path / "scans" / label).mkdir(parents=True)
        for index in range(30):
            Image.fromarray(rng.integers(0, 255, (12, 12), dtype=np.uint8)).save(
                tmp_path / "scans" / label / f"{index}.png")
    for seed in (0, 1):
        alone = load_files(tmp_path / "scans", Files(), seed)
        spread = load_files(tmp_path / "scans", Files(), seed, dask_client)
        for split in SPLITS:
            np.testing.assert_array_equal(spread.images[split], alone.images[split])
    assert len(list((tmp_path / "cache" / "gpu-usecases" / "medical-decoded").iterdir())) == 2
