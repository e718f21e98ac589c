"""Training the network with the common loop: data held as one uint8 tensor on the device when it fits,
a DataLoader with workers and pinned memory when it does not; best epoch by validation AUC."""

from __future__ import annotations

import logging
from dataclasses import replace

import numpy as np
import psutil
import torch
from torch import nn
from torch.utils.data import Dataset

from common.job import Job
from common.runtime.devices import Runtime
from common.runtime.sharding import shared_predictions
from common.training.loop import FitResult, TensorBatches, Trainer, make_loader, make_optimizer, supervised
from common.training.spec import TrainSpec
from .config import Config
from .evaluate import auc, nll
from .images import ImageSet
from .models import ImageClassifier, architecture, build_augment, build_classifier, use_cifar_stem

log = logging.getLogger(__name__)

PREDICT_BATCH = 512
GPU_MEMORY_SHARE = 0.25
MEMORY_SHARE = 0.25


def channels_first(images: np.ndarray) -> torch.Tensor:
    """uint8 (N, H, W, C) arrays as the (N, C, H, W) tensors torch models take; still uint8."""
    return torch.from_numpy(np.ascontiguousarray(images.transpose(0, 3, 1, 2)))


def label_tensor(labels: np.ndarray, task: str) -> torch.Tensor:
    return torch.from_numpy(labels).float() if task == "multi-label" else torch.from_numpy(labels).long()


class UInt8Images(Dataset):
    """One uint8 (C, H, W) image per item: the workers only read, the device converts and augments."""

    def __init__(self, images: np.ndarray, labels: torch.Tensor):
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.from_numpy(np.ascontiguousarray(self.images[index].transpose(2, 0, 1))), self.labels[index]


def fits_in_memory(data: ImageSet, runtime: Runtime, setting: bool | str) -> bool:
    """When the training set takes under a quarter of the GPU's free memory (or a CPU's free RAM, for shards)."""
    if setting != "auto":
        return bool(setting)
    images = data.images["train"]
    if runtime.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(runtime.device)
        return images.nbytes < GPU_MEMORY_SHARE * free
    return not isinstance(images, np.memmap) or images.nbytes < MEMORY_SHARE * psutil.virtual_memory().available


def class_weights(data: ImageSet) -> torch.Tensor:
    """Inverse class frequency, scaled so a balanced set gets weights of 1."""
    counts = data.counts("train").astype(np.float64)
    if data.task == "multi-label":
        return torch.tensor((len(data.labels["train"]) - counts) / counts, dtype=torch.float32)  # BCE pos_weight
    return torch.tensor(counts.sum() / (len(counts) * counts), dtype=torch.float32)


def sample_weights(data: ImageSet) -> torch.Tensor:
    """Per image, the inverse frequency of its class, so each epoch draws the classes about equally."""
    if data.task == "multi-label":
        raise ValueError("a weighted sampler needs one class per image; use train.imbalance=class_weights")
    labels = data.labels["train"]
    return torch.tensor(1.0 / data.counts("train")[labels], dtype=torch.float64)


def loss_function(data: ImageSet, imbalance: str, device: torch.device) -> nn.Module:
    weights = class_weights(data).to(device) if imbalance == "class_weights" else None
    if data.task == "multi-label":
        return nn.BCEWithLogitsLoss(pos_weight=weights)
    return nn.CrossEntropyLoss(weight=weights)


@torch.no_grad()
def predict_logits(model: nn.Module, images: torch.Tensor | np.ndarray, runtime: Runtime, tta: bool = False
                   ) -> np.ndarray:
    """fp32 logits of uint8 images, a batch at a time; with `tta`, averaged with those of the mirror image."""
    model.eval()
    outputs = []
    for start in range(0, len(images), PREDICT_BATCH):
        batch = images[start : start + PREDICT_BATCH]
        batch = (channels_first(batch) if isinstance(batch, np.ndarray) else batch).to(runtime.device,
                                                                                      non_blocking=True)
        with torch.autocast(runtime.device.type, dtype=runtime.amp_dtype, enabled=runtime.amp_dtype is not None):
            logits = model(batch).float()
            if tta:
                logits = (logits + model(batch.flip(-1)).float()) / 2
        outputs.append(logits.cpu())
    return torch.cat(outputs).numpy()


def new_classifier(config: Config, data: ImageSet) -> tuple[ImageClassifier, dict]:
    model_config = config.model
    arch = architecture(model_config.name, data.channels, len(data.classes),
                        use_cifar_stem(model_config.cifar_stem, model_config.name, data.size),
                        model_config.channels_last)
    return build_classifier(arch, build_augment(config.augment)), arch


def fit_network(config: Config, data: ImageSet, job: Job) -> tuple[ImageClassifier, dict, FitResult]:
    """Train from scratch; the model of the epoch with the best validation AUC (the lowest loss among equals)."""
    runtime, settings = job.runtime, config.train
    torch.manual_seed(config.runtime.seed)
    model, arch = new_classifier(config, data)
    optimizer = make_optimizer("adam", model.parameters(), runtime, lr=settings.lr, weight_decay=settings.weight_decay)
    milestones = sorted({max(1, round(fraction * settings.epochs)) for fraction in settings.milestones})
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones, settings.gamma)
    train_labels = label_tensor(data.labels["train"], data.task)
    weights = sample_weights(data) if settings.imbalance == "sampler" else None
    if fits_in_memory(data, runtime, config.data.in_memory):
        train_images = channels_first(data.images["train"]).to(runtime.device)
        batches = TensorBatches(train_images, train_labels.to(runtime.device), batch_size=settings.batch_size,
                                seed=config.runtime.seed, rank=runtime.rank, world_size=runtime.world_size,
                                weights=weights)
    else:
        batches = make_loader(UInt8Images(data.images["train"], train_labels), settings.batch_size, runtime,
                              num_workers=settings.workers, seed=config.runtime.seed, weights=weights)
    in_memory = isinstance(batches, TensorBatches)
    log.info("training %s on %d images (%s)", arch["name"], len(train_labels),
             "in memory" if in_memory else f"DataLoader, {settings.workers} workers")
    val_images = channels_first(data.images["val"]).to(runtime.device) if in_memory else data.images["val"]
    val_labels = data.labels["val"]

    as_served, tta = replace(runtime, amp_dtype=None), config.evaluation.tta

    def validate(network: nn.Module) -> dict[str, float]:
        """Scored as the logged model scores: in fp32, with the mirror image under TTA."""
        logits = shared_predictions(lambda rows: predict_logits(network, val_images[rows], as_served, tta=tta),
                                    len(val_labels), runtime)  # each rank scores its share of the images
        return {"val/auc": auc(val_labels, logits, data.task), "val/loss": nll(logits, val_labels, data.task)}

    spec = TrainSpec(settings, monitor="val/auc", mode="max", tie_break="val/loss", name=arch["name"],
                     checkpoint_dir=job.checkpoint_dir / arch["name"], log_metrics=job.tracker.log_metrics)
    trainer = Trainer(model, optimizer, supervised(loss_function(data, settings.imbalance, runtime.device)), runtime,
                      spec, scheduler=scheduler)
    result = trainer.fit(batches, validate, resume=job.resume)
    return trainer.module.eval(), arch, result
