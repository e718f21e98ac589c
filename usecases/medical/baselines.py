"""A baseline in the same run for scale: logistic regression on downsized pixels (scikit-learn)."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.linear_model import LogisticRegression
from sklearn.multioutput import MultiOutputClassifier
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from .config import Baselines
from .images import ImageSet

EPSILON = 1e-7


def pixel_features(images: np.ndarray, size: int, batch: int = 4096) -> np.ndarray:
    """uint8 (N, H, W, C) images, area-resized to `size` and flattened to [0, 1] floats; a batch at a time, so that
    memory-mapped shards are read in pieces and only the small features are held."""
    features = []
    for start in range(0, len(images), batch):
        tensor = torch.from_numpy(np.ascontiguousarray(images[start : start + batch])).permute(0, 3, 1, 2).float()
        tensor = tensor / 255
        if tensor.shape[-1] != size:
            tensor = F.interpolate(tensor, size=(size, size), mode="area")
        features.append(tensor.flatten(1).numpy())
    return np.concatenate(features)


def logreg_logits(data: ImageSet, config: Baselines, seed: int) -> dict[str, np.ndarray]:
    """Validation and test logits: log-probabilities, or log-odds per label for a multi-label task."""
    classifier = LogisticRegression(C=config.logreg_c, max_iter=2000, random_state=seed)
    if data.task == "multi-label":
        classifier = MultiOutputClassifier(classifier)
    model = make_pipeline(StandardScaler(), classifier)
    model.fit(pixel_features(data.images["train"], config.logreg_size), data.labels["train"])
    logits = {}
    for split in ("val", "test"):
        probabilities = model.predict_proba(pixel_features(data.images[split], config.logreg_size))
        if data.task == "multi-label":
            positive = np.clip(np.stack([column[:, 1] for column in probabilities], axis=1), EPSILON, 1 - EPSILON)
            logits[split] = np.log(positive) - np.log1p(-positive)
        else:
            logits[split] = np.log(np.clip(probabilities, EPSILON, 1))
    return logits
