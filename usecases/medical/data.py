"""Image classification data sets as uint8 arrays split into train, val and test.

Three sources: an official MedMNIST `.npz` (from the cache, a mirror folder in $USECASES_DATA_PATH, a download
with its MD5 checked, or a local file; read and checked in `npz.py`), your own images through a CSV manifest or
class folders (`files.py`: PNG, JPEG or DICOM, split by patient), and a synthetic set. The `ImageSet` they all
return is in `images.py`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
from pathlib import Path

import numpy as np

from common.errors import DataUnavailable, UserError, one_line
from common.paths import cache_dir, data_search_path
from .config import Data, MedMNIST, Synthetic
from .files import load_files
from .images import SPLITS, ImageSet
from .npz import load_medmnist_file
from .shards import write_image_folder

log = logging.getLogger(__name__)

DOWNLOAD_TIMEOUT_S = 30


def load_images(config: Data, path: Path | None, seed: int, client=None) -> ImageSet:
    """`--data` decides the source when given: a `.npz` is MedMNIST, anything else your own files. With a Dask
    `client`, files are decoded on its cluster into memory-mapped shards (`shards.py`)."""
    if path is not None:
        if path.suffix.lower() == ".npz":
            return load_medmnist_file(path)
        return load_files(path, config.files, seed, client)
    if config.source == "files":
        raise UserError("data.source=files needs --data PATH (a CSV manifest or a folder of class folders)")
    if config.source == "synthetic":
        if not config.synthetic.as_files:
            return synthetic_images(config.synthetic)
        folder = write_image_folder(config.synthetic, lambda: synthetic_images(config.synthetic), client)
        as_written = config.files.model_copy(update={"image_size": config.synthetic.size, "channels": 1})
        return load_files(folder / "manifest.csv", as_written, seed, client)
    return load_medmnist_file(medmnist_path(config.medmnist))


def medmnist_path(config: MedMNIST) -> Path:
    """The cache (`data.medmnist.cache_dir`, else $MEDMNIST_CACHE, else ~/.cache/gpu-usecases/medmnist), then
    `medmnist/NAME` in each mirror folder in $USECASES_DATA_PATH, then a download (into the cache) checked against
    the official MD5."""
    from medmnist.info import INFO

    if config.flag not in INFO:
        raise UserError(f"data.medmnist.flag: unknown data set '{config.flag}' "
                        f"(MedMNIST 2D sets: {', '.join(name for name in INFO if not name.endswith('3d'))})")
    suffix = "" if config.size == 28 else f"_{config.size}"
    name = f"{config.flag}{suffix}.npz"
    cache = cache_dir("medmnist", config.cache_dir, "MEDMNIST_CACHE")
    for candidate in (cache / name, *(folder / "medmnist" / name for folder in data_search_path())):
        if candidate.is_file():
            return candidate
    info = INFO[config.flag]
    url, md5 = info[f"url{suffix}"], info[f"MD5{suffix}"]
    where = (f"put {name} in {cache} or in medmnist/ under a mirror folder in $USECASES_DATA_PATH "
             f"(from {url}, MD5 {md5}), or pass --data FILE.npz")
    if not config.download:
        raise DataUnavailable(f"MedMNIST {name} is not in the cache nor in a mirror folder in $USECASES_DATA_PATH, "
                              f"and data.medmnist.download is off: {where}")
    return _download(url, cache, name, md5, where)


def _download(url: str, folder: Path, name: str, md5: str, where: str) -> Path:
    from torchvision.datasets.utils import check_integrity, download_url

    log.info("downloading %s from %s", name, url)
    previous = socket.getdefaulttimeout()
    socket.setdefaulttimeout(DOWNLOAD_TIMEOUT_S)
    try:
        download_url(url, str(folder), f"{name}.part", md5=None)
    except Exception as exc:
        raise DataUnavailable(f"cannot download MedMNIST {name} ({one_line(exc, 80)}): {where}") from None
    finally:
        socket.setdefaulttimeout(previous)
    part = folder / f"{name}.part"
    if not check_integrity(str(part), md5):
        part.unlink(missing_ok=True)
        raise UserError(f"the downloaded {name} does not match the official MD5 {md5}: {where}")
    os.replace(part, folder / name)
    return folder / name


SHAPES = ("disc", "square", "cross", "ring", "horizontal_bars", "vertical_bars")


def _shape_masks(kind: str, size: int, count: int, rng: np.random.Generator) -> np.ndarray:
    """One shape per image at a random place and scale: the class is in the shape, not in where it is."""
    grid = np.arange(size, dtype=np.float32)
    rows, cols = grid[None, :, None], grid[None, None, :]
    radius = rng.uniform(0.18, 0.3, count)[:, None, None] * size
    centre_row = rng.uniform(0.35, 0.65, count)[:, None, None] * size
    centre_col = rng.uniform(0.35, 0.65, count)[:, None, None] * size
    dy, dx = np.abs(rows - centre_row), np.abs(cols - centre_col)
    inside = (dy <= radius) & (dx <= radius)
    if kind == "disc":
        return np.hypot(dy, dx) <= radius
    if kind == "square":
        return inside
    if kind == "cross":
        return inside & ((dy <= radius / 3) | (dx <= radius / 3))
    if kind == "ring":
        return (np.hypot(dy, dx) <= radius) & (np.hypot(dy, dx) >= radius * 0.55)
    stripes = rows if kind == "horizontal_bars" else cols
    return inside & ((stripes // 3) % 2 == 0)


def synthetic_images(config: Synthetic) -> ImageSet:
    """Grey images with a class-dependent shape under Gaussian noise; more than six classes vary brightness too."""
    rng = np.random.default_rng(config.seed)
    images, labels = {}, {}
    for split in SPLITS:
        count = getattr(config, split)
        label = rng.integers(0, config.classes, count)
        canvas = rng.normal(0.3, config.noise * 0.5, (count, config.size, config.size)).astype(np.float32)
        for index in range(config.classes):
            chosen = np.flatnonzero(label == index)
            mask = _shape_masks(SHAPES[index % len(SHAPES)], config.size, len(chosen), rng)
            brightness = 0.7 + 0.1 * (index // len(SHAPES))
            canvas[chosen] += mask * brightness
        canvas += rng.normal(0, config.noise, canvas.shape).astype(np.float32)
        images[split] = (np.clip(canvas, 0, 1) * 255).astype(np.uint8)[..., None]
        labels[split] = label.astype(np.int64)
    classes = [SHAPES[index % len(SHAPES)] + ("" if index < len(SHAPES) else f"_{index // len(SHAPES)}")
               for index in range(config.classes)]
    digest = hashlib.sha256(json.dumps(config.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()
    return ImageSet(images, labels, "binary" if config.classes == 2 else "multi-class", classes, "synthetic",
                    digest)
