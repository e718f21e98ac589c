"""The slide-level job: every slide's tissue tiles, stain-normalised per slide, encoded by the medical network trained
on tiles labelled with their slide's label; then attention MIL against a mean-pooled logistic regression, evaluated as
images are, with an attention heatmap per test slide. The test slides choose nothing: they are only scored."""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from functools import partial

import numpy as np
import pandas as pd

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
from .serving import SlideModel, chosen_tiles, log_slide_classifier, sampled, slide_generator, slide_normaliser
from .stain import ReinhardNormaliser

log = logging.getLogger(__name__)
THUMBNAIL_PX = 1024
ENCODER_NAME = "tile_encoder"


def run_slides(config: Config, data: SlideSet, job: Job) -> RunResult:
    settings, runtime = config.data.slides, job.runtime
    rng = np.random.default_rng(config.runtime.seed)
    started = time.perf_counter()
    slides, normalisers, reference = prepared_slides(config, data, runtime.device.type, rng, job.phase)
    counts = np.array([len(slide.indices) for slide in slides])
    log.info("tiles: %d in %d slides (%d to %d a slide) at %s, %d px, read by %s", counts.sum(), len(slides),
             counts.min(), counts.max(), f"{settings.mpp:g} µm/px" if settings.mpp else "level 0", settings.tile_px,
             " and ".join(sorted({slide.reader for slide in slides})))
    stain_fit_seconds = time.perf_counter() - started
    with job.phase("fit/encoder", "device"):
        network, arch = _trained_encoder(config, data, slides, normalisers, rng, job)
    bags, tiles_per_s = encoded(network, arch, slides, normalisers, config, job)
    if not runtime.is_main:
        return RunResult({})
    bags = Bags(bags, data)
    common = {"tiles_per_s": tiles_per_s, "tiles": float(counts.sum()), "slides": float(len(slides)),
              "stain_fit_seconds": stain_fit_seconds}
    mil, models, (test_probabilities, attentions) = attention_mil(bags, config, job, common)
    models["mean_pool_logreg"] = mean_pool_baseline(bags, config, job, common)
    with job.phase("plots", "serial"):
        _log_heatmaps([slides[i] for i in bags.test], attentions, test_probabilities, job)
        job.tracker.log_text(pd.DataFrame({"slide": [str(data.paths[i]) for i in bags.test],
                                           "label": data.labels[bags.test],
                                           "probability": test_probabilities}).to_csv(index=False),
                             "slides/test_probabilities.csv")
    with job.phase("serving_bundle", "serial"):
        threshold = models["attention_mil"]["threshold"]
        # the served model tiles and normalises a slide as the run did
        as_run = {"mpp": settings.mpp, "tile_px": settings.tile_px, "min_tissue": settings.min_tissue,
                  "max_tiles": settings.max_tiles, "stain": settings.stain, "stain_fit_tiles": settings.stain_fit_tiles,
                  "batch_size": settings.batch_size, "seed": config.runtime.seed,
                  "cache_dir": str(settings.cache_dir) if settings.cache_dir else None}
        served = log_slide_classifier(SlideModel(network, arch, mil, as_run, reference, threshold),
                                      data.paths[bags.test[0]],
                                      {"positive_class": data.classes[1], "operating_threshold": threshold,
                                       "target_sensitivity": config.evaluation.target_sensitivity}, job)
    return RunResult(models, served)


def encoded(network, arch: dict, slides: list[SlideTiles], normalisers: list, config: Config,
            job: Job) -> tuple[list[np.ndarray], float]:
    """Each slide's tile features (a bag), encoded on the Dask cluster or here, and the tiles per second."""
    settings, device = config.data.slides, job.runtime.device
    with job.phase("encode", "cores" if job.dask is not None else "device"):
        if job.dask is not None:
            weights = {name: value.cpu() for name, value in network.state_dict().items()}
            bags, tiles_per_s = encode_on_cluster(job.dask, partial(build_classifier, arch), weights, slides,
                                                  normalisers, device, settings.batch_size)
        else:
            bags, tiles_per_s = encode_slides(network, slides, normalisers, device, settings.batch_size,
                                              settings.readers)
    log.info("features: %d tiles read, normalised and encoded at %.0f tiles/s%s",
             sum(len(slide.indices) for slide in slides), tiles_per_s,
             " on the Dask cluster" if job.dask is not None else "")
    job.tracker.log_metrics({"tiles_per_s": tiles_per_s})
    return bags, tiles_per_s


class Bags:
    """The slides' bags and labels by split."""

    def __init__(self, bags: list[np.ndarray], data: SlideSet):
        self.train, self.val, self.test = (data.members(split) for split in ("train", "val", "test"))
        self.bags, self.labels = bags, data.labels

    def of(self, members) -> list[np.ndarray]:
        return [self.bags[index] for index in members]


def attention_mil(bags: Bags, config: Config, job: Job, common: dict):
    """Attention MIL, its epoch chosen on validation; its metrics, and the test slides' probabilities and attention."""
    settings, evaluation, device, seed = config.mil, config.evaluation, job.runtime.device, config.runtime.seed
    with job.phase("fit/attention_mil", "device"):
        fit = MILSettings(**settings.model_dump(), attention_hidden=settings.hidden,
                          checkpoint_dir=job.checkpoint_dir / "attention_mil", resume=job.resume)
        mil, history = fit_attention_mil(bags.of(bags.train), bags.labels[bags.train], bags.of(bags.val),
                                         bags.labels[bags.val], fit, device, seed)
    for epoch, value in enumerate(history.val_auc):
        job.tracker.log_metrics({"attention_mil/val_auc": value}, step=epoch)
    with job.phase("evaluate", "serial"):
        val_probabilities, _ = predict_bags(mil, bags.of(bags.val), device)
        test_probabilities, attentions = predict_bags(mil, bags.of(bags.test), device)
        models = {"attention_mil": {**slide_metrics(bags.labels[bags.val], val_probabilities, bags.labels[bags.test],
                                                    test_probabilities, evaluation.target_sensitivity,
                                                    evaluation.bootstrap, seed),
                                    "best_epoch": history.best_epoch + 1, **common}}
    job.model_done("attention_mil", models["attention_mil"])
    return mil, models, (test_probabilities, attentions)


def mean_pool_baseline(bags: Bags, config: Config, job: Job, common: dict) -> dict[str, float]:
    """Logistic regression on mean-pooled features, its C chosen on validation: the baseline."""
    evaluation = config.evaluation
    with job.phase("fit/mean_pool_logreg", "serial"):
        pooled = fit_pooled_baseline(bags.of(bags.train), bags.labels[bags.train], bags.of(bags.val),
                                     bags.labels[bags.val])
    with job.phase("evaluate", "serial"):
        metrics = {**slide_metrics(bags.labels[bags.val], pooled_probabilities(pooled, bags.of(bags.val)),
                                   bags.labels[bags.test], pooled_probabilities(pooled, bags.of(bags.test)),
                                   evaluation.target_sensitivity, evaluation.bootstrap, config.runtime.seed), **common}
    job.model_done("mean_pool_logreg", metrics)
    return metrics


def prepared_slides(config: Config, data: SlideSet, device_type: str, rng: np.random.Generator,
                    phase=lambda name, scales: nullcontext()) -> tuple[list[SlideTiles], list, dict | None]:
    """Each slide's tiles and stain normaliser, drawn as the served model draws them, and Reinhard's reference."""
    settings, seed = config.data.slides, config.runtime.seed
    with phase("tiles", "serial"):
        generators = [slide_generator(seed, path) for path in data.paths]
        slides = [chosen_tiles(path, grid, settings.max_tiles, generator, pixel_reader(settings.reader, device_type,
                                                                                       path))
                  for path, grid, generator in zip(data.paths, data.grids, generators)]
    with phase("stain_fit", "serial"):
        reference = None
        if settings.stain == "reinhard":  # the first training slide's sample, as a normaliser's state
            sample = read_tiles(sampled(slides[data.members("train")[0]], settings.stain_fit_tiles, rng))
            reference = ReinhardNormaliser().fit_reference(sample).state_dict()
        normalisers = [slide_normaliser(slide, settings.stain, settings.stain_fit_tiles, generator, reference)
                       for slide, generator in zip(slides, generators)]
    return slides, normalisers, reference


def _trained_encoder(config: Config, data: SlideSet, slides: list[SlideTiles], normalisers, rng, job: Job):
    """The medical network trained on normalised tiles of the training and validation slides, weakly labelled."""
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


def _log_heatmaps(slides: list[SlideTiles], attentions: list[np.ndarray], probabilities: np.ndarray, job: Job) -> None:
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
