"""The slide-level job: tissue tiles of every slide, stain-normalised per slide, encoded by the medical network
trained on tiles that carry their slide's label; then attention MIL per slide against mean-pooled features with
logistic regression, both evaluated as the medical use case evaluates images (test AUC with its bootstrap
interval, the rates at the threshold chosen on validation), and an attention heatmap per test slide.

Only the training and validation slides teach the encoder and select its epoch, the MIL epoch and the baseline's
C; the test slides are read once, to be scored.
"""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from functools import partial

import numpy as np
import pandas as pd
import torch

from common.job import Job
from common.usecase import RunResult
from ..config import Config
from ..images import ImageSet
from ..models import build_classifier
from ..train import fit_network
from .data import SlideSet
from .features import SlideTiles, encode_on_cluster, encode_slides, read_tiles
from .mil import (MILSettings, fit_attention_mil, fit_pooled_baseline, heatmap_figure, attention_heatmap,
                  pooled_probabilities, predict_bags, slide_metrics)
from .reader import open_slide, pixel_reader
from .serving import chosen_tiles, log_slide_classifier, sampled, slide_generator, slide_normaliser
from .stain import ReinhardNormaliser

log = logging.getLogger(__name__)
THUMBNAIL_PX = 1024
ENCODER_NAME = "tile_encoder"


def run_slides(config: Config, data: SlideSet, job: Job) -> RunResult:
    settings, runtime, seed = config.data.slides, job.runtime, config.runtime.seed
    rng = np.random.default_rng(seed)
    started = time.perf_counter()
    slides, normalisers, reference = prepared_slides(config, data, runtime.device.type, rng, job.phase)
    counts = np.array([len(slide.indices) for slide in slides])
    log.info("tiles: %d in %d slides (%d to %d a slide) at %s, %d px, read by %s", counts.sum(), len(slides),
             counts.min(), counts.max(), f"{settings.mpp:g} µm/px" if settings.mpp else "level 0", settings.tile_px,
             " and ".join(sorted({slide.reader for slide in slides})))
    stain_fit_seconds = time.perf_counter() - started

    with job.phase("fit/encoder", "device"):
        network, arch = _trained_encoder(config, data, slides, normalisers, rng, job)
    with job.phase("encode", "cores" if job.dask is not None else "device"):
        if job.dask is not None:
            weights = {name: value.cpu() for name, value in network.state_dict().items()}
            bags, tiles_per_s = encode_on_cluster(job.dask, partial(build_classifier, arch), weights, slides,
                                                  normalisers, runtime.device, settings.batch_size)
        else:
            bags, tiles_per_s = encode_slides(network, slides, normalisers, runtime.device, settings.batch_size,
                                              settings.readers)
    log.info("features: %d tiles read, normalised and encoded at %.0f tiles/s%s", counts.sum(), tiles_per_s,
             " on the Dask cluster" if job.dask is not None else "")
    job.tracker.log_metrics({"tiles_per_s": tiles_per_s})
    if not runtime.is_main:
        return RunResult({})

    train, val, test = (data.members(split) for split in ("train", "val", "test"))
    labels = data.labels
    mil_config = config.mil
    with job.phase("fit/attention_mil", "device"):
        mil, history = fit_attention_mil([bags[i] for i in train], labels[train], [bags[i] for i in val],
                                         labels[val],
                                         MILSettings(hidden=mil_config.hidden, attention_hidden=mil_config.hidden,
                                                     dropout=mil_config.dropout, lr=mil_config.lr,
                                                     weight_decay=mil_config.weight_decay, epochs=mil_config.epochs,
                                                     max_tiles=mil_config.max_tiles),
                                         runtime.device, seed)
    for epoch, value in enumerate(history.val_auc):
        job.tracker.log_metrics({"attention_mil/val_auc": value}, step=epoch)
    evaluation = config.evaluation
    common = {"tiles_per_s": tiles_per_s, "tiles": float(counts.sum()), "slides": float(len(slides)),
              "stain_fit_seconds": stain_fit_seconds}
    with job.phase("evaluate", "serial"):
        val_probabilities, _ = predict_bags(mil, [bags[i] for i in val], runtime.device)
        test_probabilities, attentions = predict_bags(mil, [bags[i] for i in test], runtime.device)
        models = {"attention_mil": {**slide_metrics(labels[val], val_probabilities, labels[test],
                                                    test_probabilities, evaluation.target_sensitivity,
                                                    evaluation.bootstrap, seed),
                                    "best_epoch": history.best_epoch + 1, **common}}
    job.model_done("attention_mil", models["attention_mil"])
    with job.phase("fit/mean_pool_logreg", "serial"):
        pooled = fit_pooled_baseline([bags[i] for i in train], labels[train], [bags[i] for i in val], labels[val])
    with job.phase("evaluate", "serial"):
        models["mean_pool_logreg"] = {
            **slide_metrics(labels[val], pooled_probabilities(pooled, [bags[i] for i in val]), labels[test],
                            pooled_probabilities(pooled, [bags[i] for i in test]), evaluation.target_sensitivity,
                            evaluation.bootstrap, seed), **common}
    job.model_done("mean_pool_logreg", models["mean_pool_logreg"])
    with job.phase("plots", "serial"):
        _log_heatmaps([slides[i] for i in test], attentions, test_probabilities, job)
        job.tracker.log_text(pd.DataFrame({"slide": [str(data.paths[i]) for i in test], "label": labels[test],
                                           "probability": test_probabilities}).to_csv(index=False),
                             "slides/test_probabilities.csv")
    with job.phase("serving_bundle", "serial"):
        served = log_slide_classifier(
            network, arch, mil, {"mpp": settings.mpp, "tile_px": settings.tile_px, "min_tissue": settings.min_tissue,
                                 "max_tiles": settings.max_tiles, "stain": settings.stain,
                                 "stain_fit_tiles": settings.stain_fit_tiles, "batch_size": settings.batch_size,
                                 "seed": seed, "cache_dir": str(settings.cache_dir) if settings.cache_dir else None},
            reference, models["attention_mil"]["threshold"], data.paths[test[0]],
            {"positive_class": data.classes[1], "operating_threshold": models["attention_mil"]["threshold"],
             "target_sensitivity": evaluation.target_sensitivity}, job)
    return RunResult(models, served)


def prepared_slides(config: Config, data: SlideSet, device_type: str, rng: np.random.Generator,
                    phase=lambda name, scales: nullcontext()) -> tuple[list[SlideTiles], list, dict | None]:
    """Each slide's tiles (a seeded sample where it has more than `max_tiles`) and stain normaliser, drawn from the
    slide's own generator as the served model draws them, and Reinhard's reference (from `rng`)."""
    settings, seed = config.data.slides, config.runtime.seed
    with phase("tiles", "serial"):
        generators = [slide_generator(seed, path) for path in data.paths]
        slides = [chosen_tiles(path, grid, settings.max_tiles, generator, pixel_reader(settings.reader, device_type,
                                                                                       path))
                  for path, grid, generator in zip(data.paths, data.grids, generators)]
    with phase("stain_fit", "serial"):
        reference = stain_reference(slides, data, settings.stain, settings.stain_fit_tiles, rng)
        normalisers = [slide_normaliser(slide, settings.stain, settings.stain_fit_tiles, generator, reference)
                       for slide, generator in zip(slides, generators)]
    return slides, normalisers, reference


def stain_reference(slides: list[SlideTiles], data: SlideSet, method: str, count: int,
                    rng: np.random.Generator) -> dict[str, torch.Tensor] | None:
    """Reinhard's reference, the first training slide's sample, as a normaliser's state (the served model carries
    it); None for Macenko, whose reference is the published one, and for no normalisation."""
    if method != "reinhard":
        return None
    return ReinhardNormaliser().fit_reference(read_tiles(sampled(slides[data.members("train")[0]], count,
                                                                 rng))).state_dict()


def _trained_encoder(config: Config, data: SlideSet, slides: list[SlideTiles], normalisers, rng, job: Job):
    """The medical network trained on `encoder.tiles_per_slide` normalised tiles of each training and validation
    slide, each labelled with its slide's label; its best epoch by the validation tiles' AUC."""
    encoder = config.encoder
    images, labels = {}, {}
    for split in ("train", "val"):
        parts, part_labels = [], []
        for position in data.members(split):
            tiles = read_tiles(sampled(slides[position], encoder.tiles_per_slide, rng))
            if normalisers[position] is not None:
                tiles = normalisers[position].normalize(tiles)
            parts.append(tiles.permute(0, 2, 3, 1).numpy())
            part_labels.append(np.full(len(tiles), data.labels[position], np.int64))
        images[split], labels[split] = np.concatenate(parts), np.concatenate(part_labels)
    images["test"], labels["test"] = images["val"][:0], labels["val"][:0]
    tile_set = ImageSet(images, labels, "binary", data.classes, data.source, data.sha256)
    trained = config.model_copy(deep=True)
    trained.train.epochs, trained.train.batch_size, trained.train.lr = encoder.epochs, encoder.batch_size, encoder.lr
    trained.train.patience = None
    log.info("tile encoder: %s on %d training and %d validation tiles (weak labels: the slide's)",
             config.model.name, len(labels["train"]), len(labels["val"]))
    network, arch, result = fit_network(trained, tile_set, job)
    job.tracker.log_metrics({f"{ENCODER_NAME}/best_epoch": result.best_epoch + 1})
    return network, arch


def _log_heatmaps(slides: list[SlideTiles], attentions: list[np.ndarray], probabilities: np.ndarray,
                  job: Job) -> None:
    """Where attention MIL looked on each test slide, over its thumbnail."""
    if not job.tracker.active:
        return
    for slide, attention, probability in zip(slides, attentions, probabilities):
        with open_slide(slide.path) as opened:
            thumbnail = opened.thumbnail(THUMBNAIL_PX)
            downsample = opened.level_dimensions[0][0] / thumbnail.shape[1]
        heatmap = attention_heatmap(slide.grid.coords[slide.indices], attention, slide.grid.tile_l0,
                                    thumbnail.shape, downsample)
        figure = heatmap_figure(thumbnail, heatmap)
        figure.suptitle(f"{slide.path.name}: p(positive) = {probability:.2f}")
        job.tracker.log_figure(figure, f"heatmaps/{slide.path.stem}.png")
