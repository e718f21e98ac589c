"""Your own images (PNG, JPEG or DICOM, read by `pixels.py`) as an ImageSet, split so that no patient is in two
splits (a patient in train and test inflates every test metric); every mistake fails before training in one line."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from sklearn.model_selection import StratifiedGroupKFold

from common.errors import UserError, one_line
from common.paths import file_sha256
from common.tables import read_table
from .config import Files
from .images import SPLITS, ImageSet, check_classes
from .pixels import is_image_file, read_image

MANIFEST_NAME = "manifest.csv"


@dataclass
class Listing:
    """What is known about each image before a pixel is read, so that bad labels and splits fail fast."""

    where: str
    files: list[Path]
    labels: list[str]
    patients: list[str]
    has_patients: bool
    splits: list[str] | None = None
    manifest: Path | None = None
    notices: list[str] = field(default_factory=list)  # warnings, for ImageSet.notices


def load_files(path: Path, config: Files, seed: int, client=None) -> ImageSet:
    """A CSV manifest, a folder holding `manifest.csv`, or a folder of class folders."""
    path = Path(path)
    if (config.window_center is None) != (config.window_width is None):
        raise UserError("data.files.window_center and data.files.window_width must be set together (or both null)")
    if path.is_dir() and (path / MANIFEST_NAME).is_file():
        listing = read_manifest(path / MANIFEST_NAME, config)
    elif path.is_dir():
        listing = list_class_folders(path)
    elif path.is_file():
        listing = read_manifest(path, config)
    else:
        raise UserError(f"{path}: no such file or folder (expected a CSV manifest or a folder of class folders)")

    classes = class_names(listing.labels, listing.where)
    index = {name: position for position, name in enumerate(classes)}
    labels = np.array([index[label] for label in listing.labels], dtype=np.int64)
    patients = np.array(listing.patients, dtype=str)
    if not listing.has_patients:
        listing.notices.append(f"{listing.where}: no patient ids, so every image is its own patient: the split is by "
                               f"image, not patient, and images of one patient may land in different splits")
    split_of = (split_by_patient(labels, patients, config, seed, listing.where) if listing.splits is None
                else np.array(listing.splits, dtype=str))
    rows = {split: np.flatnonzero(split_of == split) for split in SPLITS}
    for split, members in rows.items():
        if len(members) == 0:
            raise UserError(f"{listing.where}: the {split} split has no images")
    assert_no_patient_leak({split: patients[members] for split, members in rows.items()}, listing.where)

    sha256 = listing_sha256(listing)
    if client is not None:
        from .shards import decode_to_shards

        images = decode_to_shards(listing.files, rows, config, sha256, client)
    else:
        decoded = np.stack([read_image(file, config) for file in listing.files])
        images = {split: decoded[members] for split, members in rows.items()}
    data = ImageSet(images, {split: labels[members] for split, members in rows.items()},
                    "binary" if len(classes) == 2 else "multi-class", classes, f"files:{path.name}", sha256,
                    patients={split: patients[members] for split, members in rows.items()}, notices=listing.notices,
                    files=([listing.manifest] if listing.manifest else []) + listing.files)
    check_classes(data, where=str(path))
    return data


def read_manifest(manifest: Path, config: Files) -> Listing:
    """One row per image; paths are relative to the manifest's folder so that the folder can move."""
    where = str(manifest)
    table = read_table(manifest, "a manifest: a CSV or Parquet table of one row per image", text=True).frame
    if table.empty:
        raise UserError(f"{where}: the manifest has no rows (expected one row per image)")
    table.columns = [str(column).strip() for column in table.columns]
    for key in ("path_column", "label_column"):
        column = getattr(config, key)
        if column not in table.columns:
            raise UserError(f"{where}: missing column '{column}' (rename it with --set data.files.{key}=NAME; "
                            f"found: {', '.join(table.columns)})")
    table = table.apply(lambda column: column.str.strip())
    for column in (config.path_column, config.label_column):
        empty = np.flatnonzero(table[column] == "")
        if len(empty):
            raise UserError(f"{where}: column '{column}', row {empty[0] + 1}: empty value")

    files = [manifest.parent / value for value in table[config.path_column]]
    for row, file in enumerate(files, start=1):
        if not file.is_file():
            raise UserError(f"{where}: column '{config.path_column}', row {row}: file not found: {file}")
    has_patients = config.patient_column is not None and config.patient_column in table.columns
    if has_patients:
        patients = table[config.patient_column]
        empty = np.flatnonzero(patients == "")
        if len(empty):
            raise UserError(f"{where}: column '{config.patient_column}', row {empty[0] + 1}: empty patient id")
    else:
        patients = table[config.path_column]
    splits = None
    if config.split_column is not None and config.split_column in table.columns:
        splits = table[config.split_column].str.lower()
        bad = np.flatnonzero(~splits.isin(SPLITS))
        if len(bad):
            raise UserError(f"{where}: column '{config.split_column}', row {bad[0] + 1}: split "
                            f"'{table[config.split_column].iloc[bad[0]]}' is not one of {', '.join(SPLITS)}")
        splits = splits.tolist()
    return Listing(where, files, table[config.label_column].tolist(), patients.tolist(), has_patients, splits, manifest)


def list_class_folders(root: Path) -> Listing:
    """`<root>/<class>/**/<image>`: the folder name is the label; there are no patient ids, nor a given split."""
    where = str(root)
    class_folders = sorted(folder for folder in root.iterdir() if folder.is_dir() and not is_hidden(folder, root))
    if not class_folders:
        raise UserError(f"{where}: no {MANIFEST_NAME} and no class folders (expected <folder>/<class>/<images>)")
    files: list[Path] = []
    labels: list[str] = []
    notices: list[str] = []
    for folder in class_folders:
        candidates = sorted(file for file in folder.rglob("*") if file.is_file() and not is_hidden(file, root))
        images = [file for file in candidates if is_image_file(file)]
        if len(images) < len(candidates):
            notices.append(f"{folder}: skipped {len(candidates) - len(images)} files that are not PNG, JPEG or DICOM")
        if not images:
            raise UserError(f"{where}: class '{folder.name}' has no images (PNG, JPEG or DICOM) in {folder}")
        files += images
        labels += [folder.name] * len(images)
    patients = [file.relative_to(root).as_posix() for file in files]
    return Listing(where, files, labels, patients, has_patients=False, notices=notices)


def is_hidden(path: Path, root: Path) -> bool:
    return any(part.startswith(".") for part in path.relative_to(root).parts)


def class_names(labels: list[str], where: str) -> list[str]:
    """Integer labels sort as numbers, so that label k stays class index k; others sort as text."""
    unique = set(labels)
    if len(unique) < 2:
        raise UserError(f"{where}: needs at least 2 classes, found {len(unique)} ({', '.join(sorted(unique))})")
    return sorted(unique, key=int if all(re.fullmatch(r"-?\d+", label) for label in unique) else None)


def split_by_patient(labels: np.ndarray, patients: np.ndarray, config: Files, seed: int, where: str) -> np.ndarray:
    """Test first, then val from the rest, each about its fraction of the patients with the classes balanced."""
    split_of = np.full(len(labels), "train", dtype=object)
    split_of[held_out_fold(labels, patients, config.test_fraction, seed, where)] = "test"
    rest = np.flatnonzero(split_of == "train")
    val_fraction = config.val_fraction / (1 - config.test_fraction)
    split_of[rest[held_out_fold(labels[rest], patients[rest], val_fraction, seed, where)]] = "val"
    return split_of.astype(str)


def held_out_fold(labels: np.ndarray, patients: np.ndarray, fraction: float, seed: int, where: str) -> np.ndarray:
    """One fold of k = 1/fraction stratified group folds: whole patients, and each class in proportion."""
    n_splits = max(2, round(1 / fraction))
    n_patients = len(np.unique(patients))
    if n_patients < n_splits:
        raise UserError(f"{where}: {n_patients} patients are too few to hold out {fraction:.0%} of them "
                        f"(needs at least {n_splits})")
    folds = StratifiedGroupKFold(n_splits=n_splits, shuffle=True, random_state=seed)
    try:
        _, held_out = next(folds.split(np.zeros(len(labels)), labels, patients))
    except ValueError as error:
        raise UserError(f"{where}: cannot hold out {fraction:.0%} of the patients by label "
                        f"({one_line(error)})") from None
    return held_out


def assert_no_patient_leak(patients: dict[str, np.ndarray], where: str) -> None:
    """A patient in two splits lets the model be tested on a patient it was trained on."""
    names = list(patients)
    for position, first in enumerate(names):
        for second in names[position + 1:]:
            shared = np.intersect1d(patients[first], patients[second])
            if len(shared):
                more = f" ({len(shared)} patients are in both)" if len(shared) > 1 else ""
                raise UserError(f"{where}: patient '{shared[0]}' appears in both {first} and {second}; "
                                f"a patient's images must all be in one split{more}")


def listing_sha256(listing: Listing) -> str:
    """The manifest and the images pin the data; without one, the relative paths (the labels) are hashed too."""
    if listing.manifest is not None:
        return file_sha256(listing.manifest, *listing.files)
    layout = "\n".join(f"{label}\t{patient}" for label, patient in zip(listing.labels, listing.patients))
    return hashlib.sha256((layout + "\n" + file_sha256(*listing.files)).encode()).hexdigest()
