"""Tiles of a slide at a chosen magnification where the tissue mask (`tissue.py`) says tissue. As in CLAM only
coordinates are kept, cached by the slide file's digest (a renamed copy reuses them, an edited slide does not)."""

from __future__ import annotations

import functools
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from common.errors import UserError
from common.paths import file_sha256
from .reader import Slide
from . import tissue

CACHE_VERSION = 2  # bump when the mask or the grid changes, so old caches are not read


@dataclass(frozen=True)
class TileGrid:
    """Read `read_px` square at `level` from each level-0 (x, y) in `coords` and resize to `tile_px`."""

    level: int
    read_px: int
    tile_px: int
    tile_l0: int
    coords: np.ndarray  # (N, 2) int64, level-0 x and y of each tile's top-left corner
    mask_downsample: float

    def __len__(self) -> int:
        return len(self.coords)


def tile_grid(slide: Slide, mpp: float | None, tile_px: int = 256, min_tissue: float = 0.5,
              cache_dir: Path | None = None, mask_size: int = 1024) -> TileGrid:
    """The tissue tiles of `slide` at `mpp` (None: level-0 pixels), from `cache_dir` when computed there before."""
    cache = None
    if cache_dir is not None:
        settings = f"mpp{'level0' if mpp is None else f'{mpp:g}'}-px{tile_px}-min{min_tissue:g}-mask{mask_size}"
        cache = Path(cache_dir) / slide_digest(slide.path) / f"tiles-v{CACHE_VERSION}-{settings}.npz"
        if cache.is_file():
            with np.load(cache, allow_pickle=False) as saved:
                return TileGrid(int(saved["level"]), int(saved["read_px"]), int(saved["tile_px"]),
                                int(saved["tile_l0"]), saved["coords"], float(saved["mask_downsample"]))
    grid = compute_grid(slide, mpp, tile_px, min_tissue, mask_size)
    if cache is not None:  # written beside the target, then renamed: a reader never sees half a file
        cache.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=cache.parent, suffix=".tmp", delete=False) as handle:
            np.savez(handle, coords=grid.coords, level=grid.level, read_px=grid.read_px, tile_px=grid.tile_px,
                     tile_l0=grid.tile_l0, mask_downsample=grid.mask_downsample)
        os.replace(handle.name, cache)
    return grid


def compute_grid(slide: Slide, mpp: float | None, tile_px: int, min_tissue: float, mask_size: int) -> TileGrid:
    downsample = 1.0 if mpp is None else slide.downsample_for_mpp(mpp)
    tile_l0 = max(1, round(tile_px * downsample))
    level = slide.best_level_for_downsample(downsample)
    read_px = max(1, round(tile_l0 / slide.level_downsamples[level]))
    mask = tissue.tissue_mask(slide, mask_size)
    width, height = slide.level_dimensions[0]
    xs, ys = np.meshgrid(np.arange(0, width - tile_l0 + 1, tile_l0), np.arange(0, height - tile_l0 + 1, tile_l0))
    coords = np.stack([xs.ravel(), ys.ravel()], axis=1).astype(np.int64)
    keep = tissue_fractions(mask, coords, tile_l0) >= min_tissue
    if not keep.any():
        where = "level-0 pixels" if mpp is None else f"{mpp:g} µm/px"
        raise UserError(f"{slide.path}: no tissue found (no {tile_px}-px tile at {where} is {min_tissue:.0%} "
                        "tissue); check the slide, or lower min_tissue")
    return TileGrid(level, read_px, tile_px, tile_l0, coords[keep], mask.downsample)


def tissue_fractions(mask: tissue.TissueMask, coords: np.ndarray, tile_l0: int) -> np.ndarray:
    """The tissue fraction of each tile's box in the mask, from a summed-area table: one pass for any count."""
    summed = np.pad(mask.mask.astype(np.int64).cumsum(0).cumsum(1), ((1, 0), (1, 0)))
    rows, cols = mask.mask.shape
    first = np.floor(coords / mask.downsample).astype(np.int64)
    last = np.ceil((coords + tile_l0) / mask.downsample).astype(np.int64)
    x0, y0 = np.clip(first[:, 0], 0, cols - 1), np.clip(first[:, 1], 0, rows - 1)
    x1, y1 = np.clip(np.maximum(last[:, 0], x0 + 1), 1, cols), np.clip(np.maximum(last[:, 1], y0 + 1), 1, rows)
    inside = summed[y1, x1] - summed[y0, x1] - summed[y1, x0] + summed[y0, x0]
    return inside / ((x1 - x0) * (y1 - y0))


def read_tile(slide: Slide, grid: TileGrid, index: int) -> np.ndarray:
    """Tile `index` of `grid`, RGB uint8 tile_px x tile_px, resized when no level has exactly the magnification."""
    x, y = grid.coords[index]
    pixels = slide.read_region(grid.level, int(x), int(y), grid.read_px, grid.read_px)
    if grid.read_px == grid.tile_px:
        return pixels
    return np.asarray(Image.fromarray(pixels).resize((grid.tile_px, grid.tile_px), Image.Resampling.BILINEAR))


def slide_digest(path: Path) -> str:
    """SHA-256 of the slide's bytes (a Mirax slide's data folder too), hashed once per process while unchanged."""
    stat = Path(path).stat()
    return cached_digest(str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=1024)
def cached_digest(path: str, size: int, mtime_ns: int) -> str:
    slide = Path(path)
    data_folder = slide.with_suffix("")
    parts = sorted(data_folder.iterdir()) if slide.suffix.lower() == ".mrxs" and data_folder.is_dir() else []
    return file_sha256(slide, *[part for part in parts if part.is_file()])
