"""`usecases bench slides medical`: tiles per second of read + stain normalisation + encoding, the pipeline against
a plain per-tile loop (one OpenSlide handle, torchstain's Macenko and the encoder per tile) on the same tiles with the
same untrained encoder, and the peak memory of a child process tiling and encoding a gigapixel slide."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import openslide
import psutil
import torch
from PIL import Image

from common.errors import UserError
from common.runtime.interrupt import stop_point
from ..models import ImageClassifier, architecture, build_classifier, use_cifar_stem
from .features import PooledFeatures, SlideTiles, encode_slides, read_tiles
from .reader import CUCIM_SUFFIXES, cucim_installed, open_slide
from .stain import NORMALISERS
from .synthetic import write_slide
from .tiles import TileGrid, tile_grid

if TYPE_CHECKING:  # the gigapixel child imports only what tiling and encoding need, so its memory is theirs
    from common.job import Job
    from ..config import Config
    from .data import SlideSet

log = logging.getLogger(__name__)
PLAIN_WARM_UP = 3  # tiles through the plain loop before its clock starts: kernels, allocator, the first handle
SAMPLE_EVERY_S = 0.1  # the gigapixel child's process tree is sampled this often for its resident memory


def slides_benchmark(config: Config, data: SlideSet, job: Job) -> dict[str, dict[str, float]]:
    if job.runtime.distributed:
        raise UserError("the slides benchmark times one process and its readers; run it without torchrun")
    from .pipeline import prepared_slides

    settings, device, bench = config.data.slides, job.runtime.device, config.benchmark
    slides, normalisers, _ = prepared_slides(config, data, device.type, np.random.default_rng(config.runtime.seed))
    network = encoder(config)
    tiles = sum(len(slide.indices) for slide in slides)
    first = slides[0]
    encode_slides(network, [SlideTiles(first.path, first.grid, first.indices[: settings.batch_size])],
                  normalisers[:1], device, settings.batch_size, 0)  # warm-up: kernels and allocator
    rates = {}
    for readers in sorted({*bench.slide_workers, settings.readers}):
        log.info("benchmark: pipeline, %d tiles of %d slides, %d readers", tiles, len(slides), readers)
        _, rates[readers] = encode_slides(network, slides, normalisers, device, settings.batch_size, readers)
    by_reader = {}
    if cucim_installed() and all(slide.path.suffix.lower() in CUCIM_SUFFIXES for slide in slides):
        for reader in ("openslide", "cucim"):  # the same tiles decoded by each, at the configured readers
            log.info("benchmark: pipeline read by %s", reader)
            _, by_reader[reader] = encode_slides(network, [replace(slide, reader=reader) for slide in slides],
                                                 normalisers, device, settings.batch_size, settings.readers)
    log.info("benchmark: plain per-tile loop, %d tiles", min(bench.plain_tiles, tiles))
    plain, plain_features, plain_normaliser = plain_loop(network, slides, normalisers, settings.stain, device,
                                                         bench.plain_tiles)
    ours = rates[settings.readers]
    per_setting = {**{f"tiles_per_s/readers_{count}": rate for count, rate in rates.items()},
                   **{f"tiles_per_s/{reader}": rate for reader, rate in by_reader.items()}}
    pipeline = {"tiles_per_s": ours, "tiles": float(tiles), "readers": float(settings.readers),
                "speedup": ours / plain, **per_setting}
    results = {"pipeline": pipeline,
               "plain_loop": {"tiles_per_s": plain, "tiles": float(len(plain_features)), "speedup": 1.0}}
    if bench.gigapixel:
        with tempfile.TemporaryDirectory(prefix="gigapixel-") as folder:
            results["gigapixel"] = gigapixel(config, device, Path(folder))
    job.tracker.set_tags({"slides_bench_plain_normaliser": plain_normaliser,
                          "slides_bench_reader": " and ".join(sorted({slide.reader for slide in slides}))})
    job.tracker.log_metrics({"tiles_per_s": ours, "plain_tiles_per_s": plain, "speedup": ours / plain, **per_setting,
                             **{f"gigapixel_{key}": value for key, value in results.get("gigapixel", {}).items()}})
    print(report(results, rates, plain_normaliser, device), flush=True)
    return results


def encoder_architecture(config: Config) -> dict:
    """The network the slide pipeline trains: 3 channels, 2 classes, the stem for its tile size."""
    model = config.model
    stem = use_cifar_stem(model.cifar_stem, model.name, config.data.slides.tile_px)
    return architecture(model.name, 3, 2, stem, model.channels_last)


def encoder(config: Config) -> ImageClassifier:
    torch.manual_seed(config.runtime.seed)
    return build_classifier(encoder_architecture(config))


def plain_read(handle: openslide.OpenSlide, grid: TileGrid, index: int) -> torch.Tensor:
    """One tile as a plain loop reads it: OpenSlide's region as RGB, resized with PIL; uint8 (3, H, W)."""
    x, y = grid.coords[index]
    region = handle.read_region((int(x), int(y)), grid.level, (grid.read_px, grid.read_px)).convert("RGB")
    if grid.read_px != grid.tile_px:
        region = region.resize((grid.tile_px, grid.tile_px), Image.Resampling.BILINEAR)
    return torch.from_numpy(np.array(region)).permute(2, 0, 1)


def per_tile_normaliser(method: str):
    """(normalise(tile, the slide's normaliser), its name): torchstain's Macenko where installed, else ours."""
    if method == "none":
        return None, "none"
    if method == "macenko":
        try:
            import torchstain
        except ImportError:
            pass
        else:
            theirs = torchstain.normalizers.MacenkoNormalizer(backend="torch")
            return (lambda tile, fitted: theirs.normalize(I=tile, stains=False)[0].permute(2, 0, 1).to(torch.uint8),
                    "torchstain")
    return (lambda tile, fitted: fitted.normalize(tile[None])[0]), "ours"


@torch.no_grad()
def plain_loop(network: ImageClassifier, slides: list[SlideTiles], normalisers: list, method: str,
               device: torch.device, count: int) -> tuple[float, np.ndarray, str]:
    """Tiles per second of `count` tiles encoded one at a time, their features and the normaliser's name."""
    network = network.to(device).eval()
    pooled = PooledFeatures(network)
    normalise, name = per_tile_normaliser(method)
    chosen = [(position, int(index)) for position, slide in enumerate(slides) for index in slide.indices][:count]

    def encode(position: int, tile: torch.Tensor) -> np.ndarray:
        if normalise is not None:
            tile = normalise(tile, normalisers[position])
        network(tile[None].to(device))
        return pooled.features.float().cpu().numpy()

    try:
        for position, tile in _plain_tiles(slides, chosen[:1] * PLAIN_WARM_UP):
            encode(position, tile)
        started = time.perf_counter()
        features = [encode(position, tile) for position, tile in _plain_tiles(slides, chosen)]
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - started
    finally:
        pooled.close()
    return len(chosen) / seconds, np.concatenate(features), name


def _plain_tiles(slides: list[SlideTiles], chosen: list[tuple[int, int]]):
    """(slide position, tile) of each chosen tile, through one OpenSlide handle at a time."""
    handle, opened = None, None
    try:
        for position, index in chosen:
            stop_point()
            if position != opened:
                if handle is not None:
                    handle.close()
                handle, opened = _openslide(slides[position].path), position
            yield position, plain_read(handle, slides[position].grid, index)
    finally:
        if handle is not None:
            handle.close()


def _openslide(path: Path) -> openslide.OpenSlide:
    try:
        return openslide.OpenSlide(path)
    except openslide.OpenSlideError:
        raise UserError(f"{path}: OpenSlide cannot open this slide, so the plain loop (OpenSlide read_region per tile) "
                        f"has no baseline for it; benchmark on slides OpenSlide reads") from None


def gigapixel(config: Config, device: torch.device, folder: Path) -> dict[str, float]:
    """Write a gigapixel slide, then tile and encode it in a child process, its tree's peak memory sampled."""
    width, height = config.benchmark.gigapixel_size
    settings, path = config.data.slides, folder / "gigapixel.tif"
    log.info("benchmark: writing a %d x %d slide (%.2f gigapixels)", width, height, width * height / 1e9)
    started = time.perf_counter()
    write_slide(path, width, height, positive=True, seed=config.runtime.seed, mpp=config.data.synthetic_slides.mpp)
    write_s = time.perf_counter() - started
    spec = {"path": str(path), "mpp": settings.mpp, "tile_px": settings.tile_px, "min_tissue": settings.min_tissue,
            "stain": settings.stain, "stain_fit_tiles": settings.stain_fit_tiles, "seed": config.runtime.seed,
            "arch": encoder_architecture(config), "device": str(device), "batch_size": settings.batch_size,
            "readers": settings.readers}
    (folder / "spec.json").write_text(json.dumps(spec))
    log.info("benchmark: tiling and encoding it in a child process, %d readers", settings.readers)
    with open(folder / "child.log", "w") as output:
        child = subprocess.Popen([sys.executable, "-m", __name__, str(folder / "spec.json"),
                                  str(folder / "result.json")], stdout=output, stderr=subprocess.STDOUT)
        peak = np.zeros(2)
        try:
            while child.poll() is None:
                stop_point()
                peak = np.maximum(peak, tree_memory(child.pid))
                time.sleep(SAMPLE_EVERY_S)
        finally:
            if child.poll() is None:
                child.kill()
            child.wait()
    if child.returncode != 0:
        last = (folder / "child.log").read_text().strip().splitlines() or ["(no output)"]
        raise RuntimeError(f"the gigapixel child exited with {child.returncode}: {last[-1]}")
    result = json.loads((folder / "result.json").read_text())
    return {"peak_rss_gb": peak[0] / 2**30, "peak_pss_gb": peak[1] / 2**30, "gigapixels": width * height / 1e9,
            "write_s": write_s, "file_gb": path.stat().st_size / 2**30, **result}


def tree_memory(pid: int) -> tuple[int, int]:
    """Resident bytes of a process tree: RSS (an upper bound) and PSS (shared pages split, the true total)."""
    rss = pss = 0
    try:
        root = psutil.Process(pid)
        members = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0, 0
    for member in members:
        try:
            memory = member.memory_full_info()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        rss, pss = rss + memory.rss, pss + memory.pss
    return rss, pss


def encode_one_slide(spec: dict) -> dict[str, float]:
    """In the child: the slide's tissue tiles, its stain fit on a sample of them, every tile encoded, streamed."""
    started = time.perf_counter()
    with open_slide(spec["path"]) as slide:
        grid = tile_grid(slide, spec["mpp"], spec["tile_px"], spec["min_tissue"])
    tiling_s = time.perf_counter() - started
    tiles = SlideTiles(Path(spec["path"]), grid, np.arange(len(grid)))
    fit_on = np.random.default_rng(spec["seed"]).choice(len(grid), min(spec["stain_fit_tiles"], len(grid)), False)
    sample = read_tiles(SlideTiles(tiles.path, grid, np.sort(fit_on)))
    normaliser = None if spec["stain"] == "none" else NORMALISERS[spec["stain"]]().fit(sample)
    if spec["stain"] == "reinhard":
        normaliser.fit_reference(sample)
    device = torch.device(spec["device"])
    _, tiles_per_s = encode_slides(build_classifier(spec["arch"]), [tiles], [normaliser], device, spec["batch_size"],
                                   spec["readers"])
    gpu = {"gpu_peak_gb": torch.cuda.max_memory_allocated(device) / 2**30} if device.type == "cuda" else {}
    return {"tiles": float(len(grid)), "tiles_per_s": tiles_per_s, "tiling_s": tiling_s, **gpu}


def report(results: dict[str, dict[str, float]], rates: dict[int, float], plain_normaliser: str,
           device: torch.device) -> str:
    """A few lines for the terminal: the pipeline per reader count, the plain loop, the gigapixel slide."""
    pipeline, plain = results["pipeline"], results["plain_loop"]
    lines = [f"slides bench on {device}: {pipeline['tiles']:.0f} tiles through the pipeline, "
             f"{plain['tiles']:.0f} through the plain loop", "readers  tiles/s"]
    lines += [f"{count:>7}  {rate:7.1f}" for count, rate in rates.items()]
    lines += [f"read by {reader}: {pipeline[f'tiles_per_s/{reader}']:.1f} tiles/s" for reader in ("openslide", "cucim")
              if f"tiles_per_s/{reader}" in pipeline]
    lines.append(f"plain loop (per tile, {plain_normaliser} normalisation): {plain['tiles_per_s']:.1f} tiles/s; "
                 f"pipeline at {pipeline['readers']:.0f} readers: {pipeline['speedup']:.2f}x")
    if "gigapixel" in results:
        giga = results["gigapixel"]
        lines.append(f"gigapixel slide ({giga['gigapixels']:.2f} Gpx, written in {giga['write_s']:.0f} s): "
                     f"{giga['tiles']:.0f} tiles at {giga['tiles_per_s']:.1f} tiles/s, process tree peak "
                     f"{giga['peak_pss_gb']:.2f} GB PSS ({giga['peak_rss_gb']:.2f} GB RSS summed)")
    return "\n".join(lines)


if __name__ == "__main__":  # the gigapixel child: python -m usecases.medical.slides.bench SPEC.json RESULT.json
    spec_file, result_file = sys.argv[1:3]
    Path(result_file).write_text(json.dumps(encode_one_slide(json.loads(Path(spec_file).read_text()))))
