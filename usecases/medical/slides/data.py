"""A folder of whole-slide images and `labels.csv` (`slide`, `label`, optional `patient` and `split`, read by the
medical manifest reader), or the synthetic set written once into the cache; every slide opened and tiled, so a broken
one is refused in one line before the run, and the split made by patient."""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from common.errors import UserError
from common.paths import building, cache_dir, stored_bytes
from ..config import Config, Files
from ..files import assert_no_patient_leak, class_names, read_manifest, split_by_patient
from ..images import SPLITS
from .reader import SLIDE_SUFFIXES, open_slide
from .synthetic import write_slide_set
from .tiles import TileGrid, slide_digest, tile_grid

log = logging.getLogger(__name__)
LABEL_COLUMNS = Files(path_column="slide", label_column="label", patient_column="patient", split_column="split")


@dataclass
class SlideSet:
    """Slides with one binary label each (`classes[1]` the positive one) and the split each slide is in."""

    paths: list[Path]
    labels: np.ndarray
    classes: list[str]
    patients: np.ndarray
    split: np.ndarray
    source: str
    sha256: str
    grids: list[TileGrid]  # each slide's tissue tiles at the configured magnification
    stored_size: int  # bytes of the slides and the labels file, for data_bytes
    notices: list[str] = field(default_factory=list)

    def members(self, split: str) -> np.ndarray:
        return np.flatnonzero(self.split == split)


def load_slides(config: Config, path: Path | None, client=None) -> SlideSet:
    """The user's folder, or the synthetic set; every slide tiled once (on a Dask `client`'s cluster when given)."""
    settings = config.data.slides
    notices = []
    if path is None:
        folder = synthetic_folder(config)
        notices.append(f"data: no --data FOLDER of slides given, so the {config.data.synthetic_slides.slides} "
                       f"synthetic slides in {folder} stand in")
    else:
        folder = Path(path)
        if not folder.is_dir():
            raise UserError(f"{folder}: expected a folder of slides with {settings.labels_file}")
    labels_file = folder / settings.labels_file
    if not labels_file.is_file():
        raise UserError(f"{folder}: no {settings.labels_file} (expected columns slide, label and optionally patient: "
                        f"one row per slide)")
    listing = read_manifest(labels_file, LABEL_COLUMNS)
    notices += unlabelled_slides(folder, listing.files, labels_file, settings.unlabelled)
    tiling = (settings.mpp, settings.tile_px, settings.min_tissue, cache_dir("slides", settings.cache_dir) / "tiles")
    if client is not None:  # many slides: each one's mask and grid on a worker of the cluster
        grids = client.gather(client.map(tiles_of, listing.files, *[[value] * len(listing.files) for value in tiling],
                                         pure=False))
    else:
        grids = [tiles_of(slide_path, *tiling) for slide_path in listing.files]
    classes = class_names(listing.labels, listing.where)
    if len(classes) != 2:
        raise UserError(f"{listing.where}: column 'label' has {len(classes)} classes ({', '.join(classes)}); slide-"
                        f"level learning here is binary (one positive class)")
    labels = np.array([classes.index(label) for label in listing.labels], dtype=np.int64)
    patients = np.array(listing.patients, dtype=str)
    if not listing.has_patients:
        notices.append(f"{listing.where}: no patient column, so every slide is its own patient")
    split = (np.array(listing.splits, dtype=str) if listing.splits is not None
             else split_by_patient(labels, patients, settings, config.runtime.seed, listing.where))
    for name in SPLITS:
        members = np.flatnonzero(split == name)
        if name != "test" and len(np.unique(labels[members])) < 2:
            raise UserError(f"{listing.where}: the {name} split needs slides of both classes (it has "
                            f"{len(members)} slides, labels {sorted(set(labels[members].tolist()))})")
    assert_no_patient_leak({name: patients[split == name] for name in SPLITS}, listing.where)
    digest = hashlib.sha256(labels_file.read_bytes())
    for slide_path in listing.files:
        digest.update(slide_digest(slide_path).encode())
    source = "synthetic:slides" if path is None else f"slides:{folder.name}"
    return SlideSet(list(listing.files), labels, classes, patients, split, source, digest.hexdigest(), grids,
                    stored_bytes(labels_file, *listing.files), notices + listing.notices)


def unlabelled_slides(folder: Path, listed: list[Path], labels_file: Path, setting: str) -> list[str]:
    """Slides that `labels_file` does not list (most often a forgotten row): refused, or (`skip`) a notice."""
    known = {Path(path).resolve() for path in listed}
    left_out = sorted(path.name for path in folder.iterdir()
                      if path.is_file() and path.suffix.lower() in SLIDE_SUFFIXES and path.resolve() not in known)
    if not left_out:
        return []
    named = ", ".join(left_out[:3]) + (f" and {len(left_out) - 3} more" if len(left_out) > 3 else "")
    if setting == "refuse":
        raise UserError(f"{folder}: {len(left_out)} slide(s) are not in {labels_file.name} ({named}); add a row for "
                        f"each, or leave them out with --set data.slides.unlabelled=skip")
    return [f"{folder}: {len(left_out)} slide(s) not in {labels_file.name} left out ({named}; "
            f"data.slides.unlabelled=skip)"]


def tiles_of(slide_path: Path, mpp: float | None, tile_px: int, min_tissue: float, cache: Path) -> TileGrid:
    """One slide's tile grid: a Dask worker's task per slide."""
    with open_slide(slide_path) as slide:
        return tile_grid(slide, mpp, tile_px, min_tissue, cache)


def synthetic_folder(config: Config) -> Path:
    """The synthetic slide set of these settings, written once into the cache."""
    synthetic = config.data.synthetic_slides
    name = f"synthetic-{synthetic.slides}x{synthetic.size}-mpp{synthetic.mpp:g}-seed{synthetic.seed}"
    folder = cache_dir("slides", config.data.slides.cache_dir) / name
    with building(folder, config.data.slides.labels_file) as work:
        if work is not None:
            log.info("writing %d synthetic slides of %d x %d px to %s", synthetic.slides, synthetic.size,
                     synthetic.size, folder)
            write_slide_set(work, synthetic.slides, (synthetic.size, synthetic.size), synthetic.seed, synthetic.mpp)
    return folder
