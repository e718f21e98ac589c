"""The trained network as an MLflow pyfunc: uint8 images in, class probabilities out."""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from common.serving.pyfunc import BadInput, Publication, ServedModel, log_served
from common.usecase import Served
from .models import build_classifier

EXAMPLE_IMAGES = 4
BATCH = 256


class ImageClassifierModel(ServedModel):
    """uint8 images as MedMNIST holds them ((N, H, W) grey, (N, H, W, 3) RGB) in, a probability per class out;
    with `evaluation.tta` the mirror image averaged in, as evaluated."""

    def load(self, bundle: dict) -> None:
        self.network = build_classifier(bundle["architecture"]).eval()
        self.network.load_state_dict(bundle["state"])
        self.classes, self.task, self.size = bundle["classes"], bundle["task"], bundle["size"]
        self.channels = bundle["architecture"]["in_channels"]
        self.tta = bundle.get("tta", False)  # absent from the bundles of models logged before TTA was served

    def _as_batch(self, images) -> torch.Tensor:
        array = np.asarray(images)
        if array.ndim == 3 and self.channels == 1:
            array = array[..., None]
        expected = f"(N, {self.size}, {self.size})" if self.channels == 1 else f"(N, {self.size}, {self.size}, 3)"
        if array.ndim != 4 or array.shape[1:] != (self.size, self.size, self.channels):
            raise BadInput(f"expected images of shape {expected}, got {array.shape}")
        if array.dtype != np.uint8:
            if not np.issubdtype(array.dtype, np.floating) or array.min() < 0 or array.max() > 1:
                raise BadInput(f"expected uint8 pixels, or floats in [0, 1]; got {array.dtype}")
            array = array.astype(np.float32)
        return torch.from_numpy(np.ascontiguousarray(array.transpose(0, 3, 1, 2)))

    @torch.no_grad()
    def answer(self, model_input: np.ndarray, params: dict | None = None) -> pd.DataFrame:
        images = self._as_batch(model_input)
        logits = torch.cat([self._logits(images[start : start + BATCH]) for start in range(0, len(images), BATCH)])
        logits = logits.double()  # as the run's metrics took them: in float32, a confident model's 1 - 1e-9 is 1.0
        probabilities = torch.sigmoid(logits) if self.task == "multi-label" else torch.softmax(logits, dim=1)
        return pd.DataFrame(probabilities.numpy(), columns=self.classes)

    def _logits(self, images: torch.Tensor) -> torch.Tensor:
        """As `predict_logits` in train.py scores the validation and test splits."""
        logits = self.network(images)
        return (logits + self.network(images.flip(-1))) / 2 if self.tta else logits


def log_classifier(model: torch.nn.Module, arch: dict, data, metadata: dict, job, tta: bool = False) -> Served | None:
    """Log the best-epoch network as `model`, real test images its input example."""
    if not job.tracker.active:
        return None
    bundle = {"state": {key: value.cpu() for key, value in model.state_dict().items()}, "architecture": arch,
              "classes": data.classes, "task": data.task, "size": data.size, "tta": tta}
    example = data.images["test"][:EXAMPLE_IMAGES]
    if example.shape[-1] == 1:
        example = example[..., 0]
    return log_served(ImageClassifierModel.from_bundle(bundle), bundle, example, job.tracker, Publication(
        arch["name"], __package__, ("torch", "torchvision", "numpy", "pandas", "mlflow"), metadata=metadata))
