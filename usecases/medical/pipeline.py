"""The medical job: train the network, evaluate it and the baseline (logistic regression on downsized pixels, for
scale) alike on the test set, log plots, Grad-CAM overlays (`explain.py`) and the model."""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.linear_model import LogisticRegression
from sklearn.multioutput import MultiOutputClassifier
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from common.errors import UserError
from common.job import Job
from common.paths import stored_bytes
from common.runtime.sharding import shared_predictions
from common.usecase import RunResult
from .config import Baselines, Config
from .data import load_images
from .evaluate import conventional_positive, evaluate_model, positive_class_index, reliability_figure, roc_pr_figure
from .explain import grad_cam, overlay_figure, pick_examples
from .images import ImageSet
from .models import check_backbone_fits, use_cifar_stem
from .serving import log_classifier
from .train import channels_first, fit_network, predict_logits

if TYPE_CHECKING:
    from .slides.data import SlideSet

log = logging.getLogger(__name__)


def load_data(config: Config, path: Path | None, client=None) -> tuple[ImageSet | SlideSet, dict[str, str]]:
    """Everything that can be wrong with the data is found here, before an MLflow run starts (image files decoded on
    a Dask `client`'s cluster when given); `evaluation.positive_class` becomes an index, for the run's params."""
    if config.data.source == "slides":
        return _load_slides(config, path, client)
    data = load_images(config.data, path, config.runtime.seed, client)
    own_data = path is not None and data.source.startswith("files:")
    setting = config.evaluation.positive_class
    config.evaluation.positive_class = positive_class_index(setting, data.classes, data.task, own_data)
    if own_data and setting is None and conventional_positive(data.classes) is None:
        data.notices.append(f"evaluation.positive_class: no class has a conventional positive name, so the operating "
                            f"threshold is for class 1 '{data.classes[1]}' (name another with --set "
                            f"evaluation.positive_class=NAME)")
    if config.train.imbalance == "sampler" and data.task == "multi-label":
        raise UserError(f"train.imbalance: 'sampler' draws one class per image, but {data.source} is multi-label "
                        f"(use class_weights)")
    model = config.model
    check_backbone_fits(model.name, data.channels, len(data.classes),
                        use_cifar_stem(model.cifar_stem, model.name, data.size), data.size)
    sizes = {split: len(data.labels[split]) for split in ("train", "val", "test")}
    positive = data.classes[config.evaluation.positive_class]
    log.info("data: %s, %s, %d classes, %s px, train/val/test %s, positive class '%s'", data.source, data.task,
             len(data.classes), data.size, "/".join(map(str, sizes.values())), positive)
    for notice in data.notices:  # not before: a rejected input is reported in one line, without them
        log.warning(notice)
    schema = "image:binary,label:long" + (",patient_id:string" if data.patients else "")  # uint8 H x W x C images
    # what a run reads from storage: its files, or a generated set's arrays as stored uncompressed
    stored = stored_bytes(*data.files) if data.files else sum(
        array.nbytes for arrays in (data.images, data.labels) for array in arrays.values())
    return data, {"data_source": data.source, "data_sha256": data.sha256, "task": data.task,
                  **{f"data_{split}_images": count for split, count in sizes.items()},
                  "data_bytes": stored, "data_samples": sum(sizes.values()),
                  **({"data_path": str(path)} if path else {}), "data_schema": schema, "positive_class": positive}


AUTO_DASK_IMAGES = 50_000  # runtime.engine=auto decodes image files on Dask above this many


def large_data(config: Config, path: Path | None) -> str | None:
    """For `runtime.engine: auto`: more than AUTO_DASK_IMAGES synthetic image files to decode."""
    synthetic = config.data.synthetic
    count = synthetic.train + synthetic.val + synthetic.test
    if path is None and config.data.source == "synthetic" and synthetic.as_files and count > AUTO_DASK_IMAGES:
        return f"{count:,} image files (more than {AUTO_DASK_IMAGES:,})"
    return None


def _load_slides(config: Config, path: Path | None, client=None) -> tuple[SlideSet, dict[str, str]]:
    from .slides.data import load_slides  # the slides extra: imported by a slides run only
    data = load_slides(config, path, client)
    counts = {split: len(data.members(split)) for split in ("train", "val", "test")}
    log.info("data: %s, %d slides, train/val/test %s, positive class '%s'", data.source, len(data.paths),
             "/".join(map(str, counts.values())), data.classes[1])
    for notice in data.notices:
        log.warning(notice)
    return data, {"data_source": data.source, "data_sha256": data.sha256, "task": "binary",
                  **{f"data_{split}_slides": count for split, count in counts.items()},
                  "data_bytes": data.stored_size, "data_samples": len(data.paths),
                  **({"data_path": str(path)} if path else {}), "positive_class": data.classes[1]}


def run(config: Config, data: ImageSet | SlideSet, job: Job) -> RunResult:
    if not isinstance(data, ImageSet):  # a SlideSet
        from .slides.pipeline import run_slides
        return run_slides(config, data, job)
    runtime, evaluation = job.runtime, config.evaluation
    started = time.perf_counter()
    with job.phase(f"fit/{config.model.name}", "device"):
        model, arch, result = fit_network(config, data, job)
    train_seconds = time.perf_counter() - started
    as_served = replace(runtime, amp_dtype=None)  # scored in fp32, as the logged model predicts
    with job.phase("predict", "device"):
        logits = {split: shared_predictions(lambda rows: predict_logits(model, data.images[split][rows], as_served,
                                                                        tta=evaluation.tta), len(data.images[split]),
                                            runtime)
                  for split in ("val", "test")}
    if not runtime.is_main:
        return RunResult({})
    with job.phase("evaluate", "serial"):  # calibration, thresholds and the bootstrap, in NumPy
        metrics, details = evaluate_model(logits["val"], data.labels["val"], logits["test"], data.labels["test"],
                                          data.task, data.classes, evaluation, config.runtime.seed)
    metrics.update(best_epoch=result.best_epoch + 1, epochs_run=result.epochs_run, train_seconds=train_seconds)
    models = {arch["name"]: metrics}
    job.model_done(arch["name"], metrics)
    with job.phase("plots", "serial"):
        _log_figures(arch["name"], details, job)
    with job.phase("explain", "device"):
        _log_gradcam(model, data, details, evaluation.gradcam_examples, job)
    with job.phase("serving_bundle", "serial"):
        served = log_classifier(model, arch, data, {"operating_threshold": metrics["threshold"],
                                                    "positive_class": data.classes[evaluation.positive_class],
                                                    "target_sensitivity": evaluation.target_sensitivity,
                                                    "temperature": metrics["temperature"],
                                                    "best_epoch": result.best_epoch + 1, "tta": evaluation.tta},
                                job, tta=evaluation.tta)
    models.update(baselines(config, data, job))
    return RunResult(models, served)


def baselines(config: Config, data: ImageSet, job: Job) -> dict[str, dict[str, float]]:
    """Each baseline fitted on the same images and evaluated as the network is, in the same run."""
    models, evaluation = {}, config.evaluation
    for name in config.baselines.models:
        with job.phase(f"fit/{name}", "serial"):  # scikit-learn's lbfgs, on one core
            baseline = logreg_logits(data, config.baselines, config.runtime.seed)
        with job.phase("evaluate", "serial"):
            models[name], details = evaluate_model(baseline["val"], data.labels["val"], baseline["test"],
                                                   data.labels["test"], data.task, data.classes, evaluation,
                                                   config.runtime.seed)
        job.model_done(name, models[name])
        with job.phase("plots", "serial"):
            _log_figures(name, details, job)
    return models


EPSILON = 1e-7  # keeps the baseline's log-probabilities finite


def pixel_features(images: np.ndarray, size: int, batch: int = 4096) -> np.ndarray:
    """uint8 (N, H, W, C) images area-resized and flattened to [0, 1] floats, a batch at a time."""
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
    model = make_pipeline(StandardScaler(),
                          MultiOutputClassifier(classifier) if data.task == "multi-label" else classifier)
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


def _log_figures(name: str, details, job: Job) -> None:
    job.tracker.log_figure(roc_pr_figure(details), f"plots/{name}_roc_pr.png")
    job.tracker.log_figure(reliability_figure(details), f"plots/{name}_reliability.png")


def _log_gradcam(model: torch.nn.Module, data: ImageSet, details, count: int, job: Job) -> None:
    """Where the network looked, for its most confident true positives, false positives and false negatives."""
    if count == 0 or not job.tracker.active:
        return
    examples = pick_examples(details.is_positive, details.predicted_positive, details.score, count)
    rows = {}
    device = next(model.parameters()).device  # on the device it trained on: a GPU takes it in milliseconds
    target = details.positive_class
    for group, indices in examples.items():
        images = data.images["test"][indices]
        heatmaps = (grad_cam(model, channels_first(images).to(device).float() / 255, target) if len(indices)
                    else np.zeros((0, data.size, data.size)))
        titles = [f"p={details.score[index]:.2f}" for index in indices]
        rows[group] = (images, heatmaps, titles)
    job.tracker.log_figure(overlay_figure(rows), "plots/gradcam.png")
