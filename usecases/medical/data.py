"""Image data sets as uint8 arrays split into train, val and test: an official MedMNIST `.npz` (cached, mirrored,
downloaded with its MD5 checked, or a local file), your own images (`files.py`), or a synthetic set. An `.npz` has
every array checked before training: a missing key, bad labels, an empty split or a mismatched size stops the run in
one line naming the file, the key and the first bad entry."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import zipfile
import zlib
from pathlib import Path

import numpy as np

from common.errors import DataUnavailable, UserError, one_line
from common.paths import cache_dir, data_search_path, file_sha256
from .config import Data, MedMNIST, Synthetic
from .files import load_files
from .images import SPLITS, ImageSet, Task, check_classes
from .shards import write_image_folder

log = logging.getLogger(__name__)

DOWNLOAD_TIMEOUT_S = 30
KEYS = tuple(f"{split}_{kind}" for split in SPLITS for kind in ("images", "labels"))
DAMAGE_ERRORS = (OSError, EOFError, zipfile.BadZipFile, zlib.error)
NUMERIC_KINDS = "biuf"  # bool, signed and unsigned integers, floats


def load_images(config: Data, path: Path | None, seed: int, client=None) -> ImageSet:
    """`--data` decides the source when given: a `.npz` is MedMNIST, anything else your own files."""
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
    """The cache, then each mirror folder in $USECASES_DATA_PATH, then a download checked by its MD5."""
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
    return ImageSet(images, labels, "binary" if config.classes == 2 else "multi-class", classes, "synthetic", digest)


def load_medmnist_file(path: Path) -> ImageSet:
    """A MedMNIST npz of any 2D set and size; the set's name comes from the file name (`dermamnist_64.npz`)."""
    arrays = read_arrays(path)
    images = {split: check_images(path, f"{split}_images", arrays[f"{split}_images"]) for split in SPLITS}
    for split in SPLITS:
        if images[split].shape[1:] != images["train"].shape[1:]:
            raise UserError(f"{path}: {split}_images are {describe(images[split])} but train_images are "
                            f"{describe(images['train'])}; every split must hold images of one size")
    raw = {split: whole_numbers(path, split, arrays[f"{split}_labels"], len(images[split])) for split in SPLITS}
    task, classes = medmnist_task(path, raw)
    labels = {split: class_labels(path, f"{split}_labels", raw[split], task, classes) for split in SPLITS}
    data = ImageSet(images, labels, task, classes, f"medmnist:{path.name}", file_sha256(path), files=[path])
    check_classes(data, str(path))
    return data


def read_arrays(path: Path) -> dict[str, np.ndarray]:
    """The six arrays, loaded without pickles (unpickling can run code), so an object array is refused by name."""
    if not zipfile.is_zipfile(path):  # else numpy would try the file as a pickle and advise allow_pickle
        raise UserError(f"{path}: not a readable .npz file (not a zip archive; expected the arrays "
                        f"{', '.join(KEYS)} as np.savez writes them)")
    try:
        archive = np.load(path)
    except (*DAMAGE_ERRORS, ValueError) as error:
        raise UserError(f"{path}: not a readable .npz file ({one_line(error)})") from None
    with archive:
        missing = [key for key in KEYS if key not in archive.files]
        if missing:
            raise UserError(f"{path}: missing key '{missing[0]}' (a MedMNIST file has {', '.join(KEYS)}; "
                            f"this one has {', '.join(sorted(archive.files)) or 'none'})")
        arrays = {}
        for key in KEYS:
            try:
                arrays[key] = archive[key]
            except ValueError as error:  # an object array, or a header numpy cannot parse
                raise UserError(f"{path}: {key} cannot be loaded ({one_line(error)}); save it as a numeric array "
                                f"(uint8 images, integer labels) with np.savez") from None
            except DAMAGE_ERRORS as error:
                raise UserError(f"{path}: {key} cannot be read ({one_line(error)}); the file is damaged, copy or "
                                f"download it again") from None
    return arrays


def describe(images: np.ndarray) -> str:
    return f"{images.shape[1]}x{images.shape[2]} with {images.shape[3]} channel(s)"


def check_images(path: Path, key: str, images: np.ndarray) -> np.ndarray:
    """Square uint8 (N, S, S, C) with C 1 or 3, at least one image: what the network and the served model take."""
    if images.dtype != np.uint8 or images.ndim not in (3, 4) or (images.ndim == 4 and images.shape[-1] not in (1, 3)):
        raise UserError(f"{path}: {key} must be uint8 of shape (N, H, W) or (N, H, W, 3), "
                        f"got {images.dtype} {images.shape}")
    if len(images) == 0:
        raise UserError(f"{path}: {key} holds no images (shape {images.shape}); every split needs at least one")
    if images.shape[1] != images.shape[2]:
        raise UserError(f"{path}: {key} are {images.shape[1]}x{images.shape[2]} pixels; images must be square "
                        f"(N, S, S), as MedMNIST's are and the served model takes")
    return images[..., None] if images.ndim == 3 else images


def entry(key: str, mask: np.ndarray, values: np.ndarray) -> str:
    """`key[i] is v` for the first True of `mask`, indexed as numpy would (`test_labels[3, 1]`)."""
    index = tuple(int(i) for i in np.unravel_index(int(np.flatnonzero(mask)[0]), mask.shape))
    return f"{key}[{', '.join(map(str, index))}] is {values[index].item()}"


def whole_numbers(path: Path, split: str, labels: np.ndarray, count: int) -> np.ndarray:
    """int64 labels, one row per image, refused unless every value is a finite whole number of at least 0."""
    key = f"{split}_labels"
    if labels.ndim == 0:
        raise UserError(f"{path}: {key} is a single value (shape ()), not one label per image")
    if len(labels) != count:
        raise UserError(f"{path}: {key} has {len(labels)} rows but {split}_images has {count}")
    if labels.dtype.kind not in NUMERIC_KINDS:
        raise UserError(f"{path}: {key} must hold integer class indices, got dtype {labels.dtype}")
    values = labels.astype(np.float64)
    for bad, why in ((~np.isfinite(values), "not a class index"),
                     (values != np.round(values), "not a whole number (labels are class indices)"),
                     (values < 0, "negative (class indices start at 0)")):
        if bad.any():
            raise UserError(f"{path}: {entry(key, bad, labels)}, {why}")
    return labels.astype(np.int64)


def medmnist_task(path: Path, labels: dict[str, np.ndarray]) -> tuple[Task, list[str]]:
    """Task and class names from MedMNIST's own metadata, or from the labels for a file of unknown name."""
    from medmnist.info import INFO

    info = INFO.get(path.name.removesuffix(".npz").split("_")[0])
    if info is not None:
        task = {"binary-class": "binary", "multi-label, binary-class": "multi-label"}.get(info["task"], "multi-class")
        return task, [info["label"][key] for key in sorted(info["label"], key=int)]
    train = labels["train"]
    if train.ndim == 2 and train.shape[1] > 1:
        return "multi-label", [str(index) for index in range(train.shape[1])]
    count = max(int(split.max()) for split in labels.values()) + 1
    if count < 2:
        raise UserError(f"{path}: every label in train_labels, val_labels and test_labels is 0; a classifier "
                        f"needs at least 2 classes")
    return ("binary" if count == 2 else "multi-class"), [str(index) for index in range(count)]


def class_labels(path: Path, key: str, labels: np.ndarray, task: Task, classes: list[str]) -> np.ndarray:
    """(N,) class indices below the number of classes, or (N, L) zeros and ones for a multi-label set."""
    if task == "multi-label":
        if labels.ndim != 2 or labels.shape[1] != len(classes):
            raise UserError(f"{path}: {key} must be of shape (N, {len(classes)}), a 0/1 column per label, "
                            f"got {labels.shape}")
        if (labels > 1).any():
            raise UserError(f"{path}: {entry(key, labels > 1, labels)}, not 0 or 1 (a multi-label set marks each "
                            f"label present or absent)")
        return labels
    if labels.ndim > 2 or (labels.ndim == 2 and labels.shape[1] != 1):
        raise UserError(f"{path}: {key} must be of shape (N,) or (N, 1), one class index per image, got {labels.shape}")
    labels = labels.reshape(-1)
    beyond = labels >= len(classes)
    if beyond.any():
        raise UserError(f"{path}: {entry(key, beyond, labels)}, not a class index 0..{len(classes) - 1} "
                        f"(classes: {', '.join(f'{index} {name!r}' for index, name in enumerate(classes))})")
    return labels
