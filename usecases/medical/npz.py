"""A MedMNIST-style `.npz` as an ImageSet, every array checked before training.

A file made by hand or by another tool can hold anything: a missing key, float or text labels, a NaN, an empty
split, one split at another image size. Each stops the run with one line naming the file, the key and, for labels,
the first bad entry; MedMNIST's own files pass unchanged.
"""

from __future__ import annotations

import zipfile
import zlib
from pathlib import Path

import numpy as np

from common.errors import UserError, one_line
from common.paths import file_sha256
from .images import SPLITS, ImageSet, Task, check_classes

KEYS = tuple(f"{split}_{kind}" for split in SPLITS for kind in ("images", "labels"))
DAMAGE_ERRORS = (OSError, EOFError, zipfile.BadZipFile, zlib.error)
NUMERIC_KINDS = "biuf"  # bool, signed and unsigned integers, floats


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
        raise UserError(f"{path}: {key} must be of shape (N,) or (N, 1), one class index per image, "
                        f"got {labels.shape}")
    labels = labels.reshape(-1)
    beyond = labels >= len(classes)
    if beyond.any():
        raise UserError(f"{path}: {entry(key, beyond, labels)}, not a class index 0..{len(classes) - 1} "
                        f"(classes: {', '.join(f'{index} {name!r}' for index, name in enumerate(classes))})")
    return labels
