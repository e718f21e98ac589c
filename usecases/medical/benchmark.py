"""Training throughput, ours against a plain loop in the style of the official MedMNIST script (per-sample
transforms in a DataLoader, fp32): the same model, images and epochs, the first epoch of each a warm-up."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torchvision import transforms

from common.errors import UserError
from common.job import Job
from common.runtime.interrupt import stop_point
from common.runtime.devices import Runtime
from .config import Config
from .images import ImageSet
from .models import build_classifier
from .train import fit_network, label_tensor, loss_function, new_classifier

if TYPE_CHECKING:
    from .slides.data import SlideSet

log = logging.getLogger(__name__)


class PerSampleImages(Dataset):
    """What the official script does per image: a PIL image, ToTensor and Normalize, then the default collate."""

    def __init__(self, images: np.ndarray, labels: torch.Tensor):
        self.images, self.labels = images, labels
        self.transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize(mean=[0.5], std=[0.5])])

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        image = self.images[index]
        pil = Image.fromarray(image[..., 0] if image.shape[-1] == 1 else image)
        return self.transform(pil), self.labels[index]


def plain_loop(config: Config, data: ImageSet, runtime: Runtime, epochs: int) -> list[dict[str, float]]:
    """Per epoch: training images per second and the share of the time spent waiting for data."""
    torch.manual_seed(config.runtime.seed)
    _, arch = new_classifier(config, data)
    model = build_classifier({**arch, "channels_last": False}).backbone.to(runtime.device).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=config.train.lr)
    criterion = loss_function(data, "none", runtime.device)
    loader = DataLoader(PerSampleImages(data.images["train"], label_tensor(data.labels["train"], data.task)),
                        batch_size=config.train.batch_size, shuffle=True)
    history = []
    for _ in range(epochs):
        images_seen, wait = 0, 0.0
        started = time.perf_counter()
        iterator = iter(loader)
        while True:
            stop_point()
            fetch = time.perf_counter()
            batch = next(iterator, None)
            wait += time.perf_counter() - fetch
            if batch is None:
                break
            inputs, targets = (tensor.to(runtime.device) for tensor in batch)
            optimizer.zero_grad()
            loss = criterion(model(inputs), targets)
            loss.backward()
            optimizer.step()
            images_seen += len(targets)
        if runtime.device.type == "cuda":
            torch.cuda.synchronize(runtime.device)
        elapsed = time.perf_counter() - started
        history.append({"throughput/samples_per_s": images_seen / elapsed, "time/data_wait_share": wait / elapsed})
    return history


def _steady(history: list[dict[str, float]]) -> dict[str, float]:
    counted = history[1:] or history
    return {"images_per_s": float(np.mean([epoch["throughput/samples_per_s"] for epoch in counted])),
            "data_wait_share": float(np.mean([epoch["time/data_wait_share"] for epoch in counted])),
            "epochs_counted": len(counted)}


def benchmark(config: Config, data: ImageSet | SlideSet, job: Job) -> dict[str, dict[str, float]]:
    if not isinstance(data, ImageSet):  # a SlideSet: a preset with data.source slides (`bench slides medical`)
        from .slides.bench import slides_benchmark
        return slides_benchmark(config, data, job)
    if job.runtime.distributed:
        raise UserError("the benchmark compares single-process training; run it without torchrun")
    epochs = config.benchmark.epochs
    timed = config.model_copy(deep=True)
    timed.train.epochs, timed.train.patience = epochs, None
    log.info("benchmark: plain per-sample loop, %d epochs", epochs)
    plain = _steady(plain_loop(config, data, job.runtime, epochs))
    log.info("benchmark: our pipeline, %d epochs", epochs)
    _, _, result = fit_network(timed, data, job)
    ours = _steady(result.history)
    speedup = ours["images_per_s"] / plain["images_per_s"]
    job.tracker.log_metrics({"speedup": speedup})
    return {"pipeline": {**ours, "speedup": speedup}, "plain_loop": {**plain, "speedup": 1.0}}
