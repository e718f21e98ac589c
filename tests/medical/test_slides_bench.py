"""`usecases bench slides medical`: the pipeline and the plain per-tile loop timed on the same tiles in one run, a
gigapixel-style slide tiled and encoded in a child process whose peak memory is measured; a preset that reads no
slides refused in one line."""

import json

import numpy as np
import openslide
import pytest
import torch

from common.config import load_config
from tests.cli_helpers import in_process, runs, user_error
from usecases.medical import USECASE
from usecases.medical.slides.bench import encoder, plain_loop, plain_read
from usecases.medical.slides.data import load_slides
from usecases.medical.slides.features import SlideTiles, encode_slides
from usecases.medical.slides.reader import open_slide
from usecases.medical.slides.synthetic import write_slide
from usecases.medical.slides.tiles import read_tile, tile_grid

# ten small slides whose split by patient has both classes in training and validation (seed 2)
SMALL = ["data.synthetic_slides.slides=10", "data.synthetic_slides.size=1024", "data.synthetic_slides.seed=2",
         "data.slides.readers=1", "benchmark.slide_workers=[0,1]", "benchmark.plain_tiles=20",
         "benchmark.gigapixel_size=[2048,2048]"]


def test_both_loops_time_the_same_tiles_and_the_gigapixel_child_is_measured(capsys, tmp_path):
    overrides = [*SMALL, f"data.slides.cache_dir={tmp_path / 'cache'}"]
    summary = tmp_path / "bench.json"
    result = in_process(capsys, "bench", "slides", "medical", "--device", "cpu", "--summary", str(summary),
                        *[part for item in overrides for part in ("--set", item)])
    assert result.returncode == 0, result.stderr[-3000:]
    models = json.loads(summary.read_text())["models"]
    pipeline, plain, giga = models["pipeline"], models["plain_loop"], models["gigapixel"]

    config = load_config(USECASE.config, USECASE.presets_dir, "slides-smoke", overrides)
    grids = load_slides(config, None).grids  # the tile coordinates the bench cached
    assert pipeline["tiles"] == sum(min(len(grid), config.data.slides.max_tiles) for grid in grids)
    assert plain["tiles"] == 20 and pipeline["readers"] == 1
    assert all(pipeline[f"tiles_per_s/readers_{count}"] > 0 for count in (0, 1))
    assert pipeline["tiles_per_s"] == pipeline["tiles_per_s/readers_1"] and plain["tiles_per_s"] > 0

    slide_path = tmp_path / "again.tif"  # the gigapixel slide was deleted: the same one again, to count its tiles
    write_slide(slide_path, 2048, 2048, positive=True, seed=config.runtime.seed, mpp=config.data.synthetic_slides.mpp)
    with open_slide(slide_path) as slide:
        assert giga["tiles"] == len(tile_grid(slide, config.data.slides.mpp, config.data.slides.tile_px,
                                              config.data.slides.min_tissue))
    assert 0.05 < giga["peak_pss_gb"] <= giga["peak_rss_gb"] and giga["peak_pss_gb"] < 3
    assert giga["tiles_per_s"] > 0 and giga["write_s"] > 0

    (run,) = runs("medical-benchmark")
    metrics = run.data.metrics
    assert run.info.status == "FINISHED" and runs("medical") == []
    assert metrics["speedup"] == pytest.approx(pipeline["speedup"]) and metrics["speedup"] > 0
    assert {"tiles_per_s", "tiles_per_s/readers_0", "plain_tiles_per_s", "gigapixel_peak_rss_gb",
            "gigapixel_tiles", "gigapixel_tiles_per_s", "gigapixel_write_s"} <= set(metrics)
    assert run.data.tags["slides_bench_plain_normaliser"] == "torchstain"
    assert "readers  tiles/s" in result.stdout and "gigapixel slide" in result.stdout


@pytest.fixture(scope="module")
def two_slides(tmp_path_factory):
    folder = tmp_path_factory.mktemp("slides")
    slides = []
    for index in range(2):
        path = write_slide(folder / f"s{index}.tif", 1024, 1024, positive=bool(index), seed=index)
        with open_slide(path) as slide:
            grid = tile_grid(slide, 2.0, 64)
        slides.append(SlideTiles(path, grid, np.arange(len(grid))))
    return slides


def test_the_plain_loop_reads_the_pipelines_pixels_with_openslide(two_slides):
    slide = two_slides[0]
    with open_slide(slide.path) as ours:
        handle = openslide.OpenSlide(slide.path)
        for index in slide.indices:
            assert torch.equal(plain_read(handle, slide.grid, index),
                               torch.from_numpy(read_tile(ours, slide.grid, index)).permute(2, 0, 1))
        handle.close()


def test_without_normalisation_both_loops_encode_the_same_tiles_alike(two_slides):
    """Batch of one against batches of 64, in eval mode: the same features, tile for tile."""
    network = encoder(load_config(USECASE.config, USECASE.presets_dir, "slides-smoke"))
    count = len(two_slides[0].indices) + 2  # across the slide boundary
    _, features, name = plain_loop(network, two_slides, [None, None], "none", torch.device("cpu"), count)
    bags, _ = encode_slides(network, two_slides, [None, None], torch.device("cpu"), 64, 0)
    assert name == "none" and features.shape == (count, 512)
    np.testing.assert_allclose(features, np.concatenate(bags)[:count], rtol=1e-3, atol=1e-4)


def test_slides_needs_a_preset_that_reads_slides(capsys):
    line = user_error(capsys, "bench", "slides", "medical", "--preset", "smoke")
    assert "bench slides: preset 'smoke' reads" in line and "slides-smoke" in line
    assert "--scale --slides" in user_error(capsys, "bench", "medical", "--slides", "--scale")
    assert runs("medical-benchmark") == []
