"""The image data set that every source produces and every step reads: a leaf module, importing no other."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

from common.errors import UserError

SPLITS = ("train", "val", "test")
Task = Literal["binary", "multi-class", "multi-label"]


@dataclass
class ImageSet:
    """uint8 (N, H, W, C) images, C 1 or 3; int64 class indices (N,), or 0/1 (N, L) for multi-label tasks."""

    images: dict[str, np.ndarray]
    labels: dict[str, np.ndarray]
    task: Task
    classes: list[str]
    source: str
    sha256: str
    patients: dict[str, np.ndarray] = field(default_factory=dict)
    notices: list[str] = field(default_factory=list)  # warnings, logged once the data passed every check
    files: list[Path] = field(default_factory=list)  # what it was read from, for data_bytes; none when generated

    @property
    def channels(self) -> int:
        return self.images["train"].shape[-1]

    @property
    def size(self) -> int:
        return self.images["train"].shape[1]

    def counts(self, split: str) -> np.ndarray:
        """Images per class (per label for multi-label tasks)."""
        labels = self.labels[split]
        return labels.sum(axis=0) if self.task == "multi-label" else np.bincount(labels, minlength=len(self.classes))


def check_classes(data: ImageSet, where: str) -> None:
    """Every class must be seen in training and validation, or the loss and the val AUC are undefined."""
    for split in ("train", "val"):
        counts = data.counts(split)
        if (counts == 0).any():
            name = data.classes[int(np.flatnonzero(counts == 0)[0])]
            raise UserError(f"{where}: class '{name}' has no images in the {split} split "
                            f"(images per class: {dict(zip(data.classes, counts.tolist()))})")
