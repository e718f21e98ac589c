"""Synthetic whole-slide images: real pyramidal tiled TIFFs of H&E-like tissue on glass (Beer-Lambert colours with
Ruifrok and Johnston's stain vectors), a positive slide with a few small regions of dense dark nuclei that only
attention finds. Written tile by tile, each reduced level averaged via a scratch file: bounded memory at any size."""

from __future__ import annotations

import csv
import math
import tempfile
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from pathlib import Path

import numpy as np
import tifffile
from scipy import ndimage
from threadpoolctl import threadpool_limits

from common.runtime.process import usable_cores

HAEMATOXYLIN = np.array([0.644, 0.717, 0.267], np.float32)  # optical density per unit stain, R G B
EOSIN = np.array([0.093, 0.954, 0.283], np.float32)
LEVEL_FACTOR = 4
MAX_REDUCED_LEVELS = 3
TISSUE_SHARE = 0.4  # of the slide's area
NUCLEUS_KINDS = ("normal", "tumour")
NUCLEUS_UM = {"normal": 2.0, "tumour": 3.5}  # radius
NUCLEI_PER_UM2 = {"normal": 1 / 250, "tumour": 1 / 60}
NUCLEUS_STAIN = {"normal": 0.8, "tumour": 1.3}


def write_slide(path: str | Path, width: int, height: int, positive: bool, seed: int, mpp: float = 0.5,
                tile: int = 256) -> Path:
    """A pyramidal tiled TIFF at `mpp`, with levels reduced 4, 16 and 64 times while at least a tile a side."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    scene = Scene(width, height, positive, seed, mpp)
    shapes = [(height, width)]
    while len(shapes) <= MAX_REDUCED_LEVELS and min(shapes[-1]) // LEVEL_FACTOR >= tile:
        shapes.append((shapes[-1][0] // LEVEL_FACTOR, shapes[-1][1] // LEVEL_FACTOR))
    options = dict(dtype=np.uint8, tile=(tile, tile), photometric="rgb", compression="jpeg", metadata=None,
                   resolutionunit="CENTIMETER", compressionargs={"level": 90})
    with tempfile.TemporaryDirectory(dir=path.parent) as scratch, \
            tifffile.TiffWriter(path, bigtiff=width * height * 3 > 2**31) as tiff:
        tiles = scene.tiles(tile)
        for level, (level_height, level_width) in enumerate(shapes):
            rows, cols = math.ceil(level_height / tile), math.ceil(level_width / tile)
            reduced = None
            if level + 1 < len(shapes):
                reduced = np.memmap(Path(scratch) / f"level{level + 1}.raw", np.uint8, "w+",
                                    shape=(rows * tile // LEVEL_FACTOR, cols * tile // LEVEL_FACTOR, 3))
            microns = 1e4 / (mpp * width / level_width), 1e4 / (mpp * height / level_height)
            tiff.write(reducing(tiles, reduced, cols, tile), shape=(level_height, level_width, 3),
                       resolution=microns, subfiletype=1 if level else 0, **options)
            if reduced is not None:
                next_height, next_width = shapes[level + 1]
                tiles = tiles_of(reduced, math.ceil(next_height / tile), math.ceil(next_width / tile), tile)
    return path


def reducing(tiles: Iterator[np.ndarray], reduced: np.ndarray | None, cols: int, tile: int) -> Iterator[np.ndarray]:
    """Pass tiles on to the writer, averaging each 4 x 4 block into the next level on the way."""
    small = tile // LEVEL_FACTOR
    for index, pixels in enumerate(tiles):
        if reduced is not None:
            row, col = divmod(index, cols)
            blocks = pixels.astype(np.float32).reshape(small, LEVEL_FACTOR, small, LEVEL_FACTOR, 3)
            mean = blocks.sum(axis=1).sum(axis=2) / LEVEL_FACTOR**2  # one axis at a time: 4x numpy's mean of two
            reduced[row * small : (row + 1) * small, col * small : (col + 1) * small] = mean + 0.5
        yield pixels


def tiles_of(image: np.ndarray, rows: int, cols: int, tile: int) -> Iterator[np.ndarray]:
    """Tiles of an image in row-major order, padded with white past its edge."""
    for row in range(rows):
        for col in range(cols):
            pixels = np.full((tile, tile, 3), 255, np.uint8)
            part = image[row * tile : (row + 1) * tile, col * tile : (col + 1) * tile]
            pixels[: part.shape[0], : part.shape[1]] = part
            yield pixels


class ValueNoise:
    """A smooth random field: a grid of random values blended by smoothstep, separable for any rectangle."""

    def __init__(self, rng: np.random.Generator, spacing: float, width: int, height: int):
        self.spacing = spacing
        self.width, self.height = width, height
        self.grid = rng.random((math.ceil(height / spacing) + 2, math.ceil(width / spacing) + 2), dtype=np.float32)

    def weights(self, coords: np.ndarray, limit: int) -> tuple[int, np.ndarray]:
        position = np.clip(coords, 0, limit) / self.spacing
        base = np.floor(position).astype(np.int64)
        frac = (position - base).astype(np.float32)
        smooth = frac * frac * (3 - 2 * frac)
        first = int(base.min())
        matrix = np.zeros((len(coords), int(base.max()) - first + 2), np.float32)
        matrix[np.arange(len(coords)), base - first] = 1 - smooth
        matrix[np.arange(len(coords)), base - first + 1] = smooth
        return first, matrix

    def sample(self, xs: np.ndarray, ys: np.ndarray) -> np.ndarray:
        """The field at every (y, x) of the pixel rows `ys` and columns `xs`."""
        x0, across = self.weights(xs, self.width)
        y0, down = self.weights(ys, self.height)
        return down @ self.grid[y0 : y0 + down.shape[1], x0 : x0 + across.shape[1]] @ across.T


class Scene:
    """What a slide shows, defined at every level-0 pixel so any tile can be rendered on its own."""

    def __init__(self, width: int, height: int, positive: bool, seed: int, mpp: float):
        rng = np.random.default_rng(seed)
        self.width, self.height, self.seed = width, height, seed
        side = min(width, height)
        self.shape_noise = [ValueNoise(rng, side / 4, width, height), ValueNoise(rng, side / 14, width, height)]
        self.stain_noise = ValueNoise(rng, 20 / mpp, width, height)
        self.radius_px = {kind: um / mpp for kind, um in NUCLEUS_UM.items()}
        self.density_px = {kind: per_um2 * mpp * mpp for kind, per_um2 in NUCLEI_PER_UM2.items()}
        preview_x, preview_y = np.linspace(0, width, 256), np.linspace(0, height, 256)
        preview = self.tissue_field(preview_x, preview_y)
        self.threshold = float(np.quantile(preview, 1 - TISSUE_SHARE))
        self.tumours = np.zeros((0, 3))
        if positive:
            inside_y, inside_x = np.nonzero(preview >= np.quantile(preview, 0.95))  # deep in the tissue
            picks = rng.choice(len(inside_x), size=rng.integers(2, 4), replace=False)
            radii = rng.uniform(0.04, 0.07, len(picks)) * side
            self.tumours = np.stack([preview_x[inside_x[picks]], preview_y[inside_y[picks]], radii], axis=1)

    def tissue_field(self, xs: np.ndarray, ys: np.ndarray) -> np.ndarray:
        """Above the threshold is tissue; a band along the edges is always glass."""
        coarse, fine = (noise.sample(xs, ys) for noise in self.shape_noise)
        ramp = 0.1 * min(self.width, self.height)

        def window(coords: np.ndarray, extent: int) -> np.ndarray:
            return np.clip((np.minimum(coords, extent - coords) - 0.03 * extent) / ramp, 0, 1)

        return (0.7 * coarse + 0.3 * fine) * np.outer(window(ys, self.height), window(xs, self.width))

    def tumour_mask(self, xs: np.ndarray, ys: np.ndarray) -> np.ndarray:
        """Discs with ragged edges (their radius varies with the fine shape noise)."""
        inside = np.zeros((len(ys), len(xs)), bool)
        ragged = 0.75 + 0.5 * self.shape_noise[1].sample(xs, ys)
        for cx, cy, radius in self.tumours:
            inside |= (xs[None, :] - cx) ** 2 + (ys[:, None] - cy) ** 2 < (radius * ragged) ** 2
        return inside

    def nuclei(self, kind: str, left: int, top: int, tile: int) -> np.ndarray:
        """Stain of one kind of nuclei over a tile, its neighbours' drawn too, so nuclei cross tile edges."""
        margin = math.ceil(self.radius_px[kind]) + 1
        centres = np.ones((tile + 2 * margin, tile + 2 * margin), bool)
        for row in (-1, 0, 1):
            for col in (-1, 0, 1):
                cell = [top // tile + row + 1, left // tile + col + 1]  # + 1: seeds are non-negative
                rng = np.random.default_rng([self.seed, *cell, NUCLEUS_KINDS.index(kind)])
                count = rng.poisson(self.density_px[kind] * tile * tile)
                points = rng.integers(0, tile, (count, 2)) + np.array([row, col]) * tile + margin
                points = points[((points >= 0) & (points < tile + 2 * margin)).all(axis=1)]
                centres[points[:, 0], points[:, 1]] = False
        if centres.all():
            return np.zeros((tile, tile), np.float32)
        distance = ndimage.distance_transform_edt(centres)[margin:-margin, margin:-margin]
        return NUCLEUS_STAIN[kind] * np.clip(1.3 - distance / self.radius_px[kind], 0, 1)

    def render(self, left: int, top: int, tile: int) -> np.ndarray:
        xs = np.arange(left, left + tile, dtype=np.float32) + 0.5
        ys = np.arange(top, top + tile, dtype=np.float32) + 0.5
        tissue = self.tissue_field(xs, ys) > self.threshold
        rng = np.random.default_rng([self.seed, top, left])
        optical_density = np.full((tile, tile, 3), 0.012, np.float32)  # the glass's faint grey
        if tissue.any():
            eosin = (0.2 + 0.25 * self.stain_noise.sample(xs, ys)) * tissue
            haematoxylin = 0.06 * tissue + self.nuclei("normal", left, top, tile) * tissue
            tumour = self.tumour_mask(xs, ys) & tissue
            if tumour.any():
                haematoxylin = np.where(tumour, 0.1 + self.nuclei("tumour", left, top, tile), haematoxylin)
            optical_density += eosin[..., None] * EOSIN + haematoxylin[..., None] * HAEMATOXYLIN
        pixels = np.exp(optical_density * np.float32(-math.log(10)))  # Beer-Lambert: 10 ** -density, in float32
        pixels *= 255
        pixels += rng.integers(-3, 4, (tile, tile, 3), dtype=np.int8)  # the camera's noise: uniform, std 2
        pixels += 0.5  # rounding
        return np.clip(pixels, 0, 255, out=pixels).astype(np.uint8)

    def tiles(self, tile: int) -> Iterator[np.ndarray]:
        for top in range(0, self.height, tile):
            for left in range(0, self.width, tile):
                yield self.render(left, top, tile)


def write_slide_set(folder: str | Path, n_slides: int, size: tuple[int, int] = (4096, 4096), seed: int = 0,
                    mpp: float = 0.5) -> Path:
    """`n_slides` slides and labels.csv, half positive; some patients have two slides (split by patient)."""
    folder = Path(folder)
    rng = np.random.default_rng(seed)
    patients: list[int] = []
    while len(patients) < n_slides:
        patient = len(set(patients))
        patients += [patient] * min(int(rng.integers(1, 3)), n_slides - len(patients))
    patient_labels = rng.permutation(np.arange(patients[-1] + 1) % 2)
    rows = [{"slide": f"slide-{index:03d}.tif", "label": int(patient_labels[patient]),
             "patient": f"patient-{patient:03d}"} for index, patient in enumerate(patients)]
    seeds = [int(rng.integers(2**31)) for _ in rows]
    with ProcessPoolExecutor(max_workers=max(1, min(len(rows), usable_cores()))) as pool:
        list(pool.map(partial(_write_one, folder, size, mpp), rows, seeds))
    labels = folder / "labels.csv"
    with open(labels, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=["slide", "label", "patient"])
        writer.writeheader()
        writer.writerows(rows)
    return labels


def _write_one(folder: Path, size: tuple[int, int], mpp: float, row: dict, seed: int) -> Path:
    """One slide in a writer process, its BLAS on one thread (OpenBLAS threads made two writers slower than one)."""
    with threadpool_limits(1):
        return write_slide(folder / row["slide"], *size, positive=bool(row["label"]), seed=seed, mpp=mpp)
