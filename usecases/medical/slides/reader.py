"""Whole-slide images read region by region (never a whole gigapixel level): OpenSlide for the scanners' formats,
tifffile for a plain TIFF OpenSlide refuses, RAPIDS cuCIM where installed and chosen. Handles are per process
(`SlideHandles`): a forked DataLoader worker must not read through its parent's."""

from __future__ import annotations

import math
import os
from collections import OrderedDict
from pathlib import Path

import numpy as np
import openslide
import tifffile
import zarr

from common.errors import UserError, one_line

SLIDE_SUFFIXES = (".svs", ".tif", ".tiff", ".ndpi", ".mrxs")
CUCIM_SUFFIXES = (".svs", ".tif", ".tiff")  # cuCIM reads Aperio SVS and (generic, Philips) tiled TIFF only
PLAIN_TIFF_SUFFIXES = (".tif", ".tiff")
PLAUSIBLE_MPP = (0.05, 50.0)
# A matching level is one within 1% of the asked downsample: scanners store 2.0005 for a halving.
LEVEL_TOLERANCE = 1.01
THUMBNAIL_BLOCK_PX = 1024
MICRONS_PER_UNIT = {"centimeter": 1e4, "inch": 25400.0}
MAX_MAGNIFICATION = 4  # tiles finer than a quarter of the scan's pixel are refused


def open_slide(path: str | Path, mpp: float | None = None, reader: str = "openslide") -> Slide:
    """Open a slide; `mpp` overrides the file's; `reader` cucim reads the pixels with cuCIM."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such slide file")
    if path.suffix.lower() not in SLIDE_SUFFIXES:
        raise UserError(f"{path}: not a slide format this reader takes (expected {', '.join(SLIDE_SUFFIXES)})")
    if reader == "cucim":
        return CuCIMSlide(path, mpp)
    try:
        return OpenSlideSlide(path, mpp)
    except openslide.OpenSlideUnsupportedFormatError:
        if path.suffix.lower() in PLAIN_TIFF_SUFFIXES:
            return TiffSlide(path, mpp)
        raise UserError(f"{path}: not a readable {path.suffix} slide (damaged, truncated or another format)") from None
    except openslide.OpenSlideError as error:
        raise UserError(f"{path}: damaged or truncated slide ({one_line(error)})") from None


def cucim_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("cucim") is not None


def pixel_reader(setting: str, device_type: str, path: str | Path) -> str:
    """The reader of one slide: `auto` takes cuCIM on a GPU run where it is installed and reads the format."""
    if setting != "auto":
        return setting
    usable = device_type == "cuda" and Path(path).suffix.lower() in CUCIM_SUFFIXES and cucim_installed()
    return "cucim" if usable else "openslide"


def plausible(mpp: float) -> bool:
    return math.isfinite(mpp) and PLAUSIBLE_MPP[0] <= mpp <= PLAUSIBLE_MPP[1]


def stated_mpp(values: list[str], source: str) -> tuple[float | None, str | None]:
    """The level-0 microns per pixel a file states, or None and why not (72 dpi is 353 µm: a writer's default)."""
    if not values:
        return None, None
    try:
        numbers = [float(value) for value in values]
    except ValueError:
        numbers = [math.nan]
    mpp = sum(numbers) / len(numbers)
    if plausible(mpp):
        return mpp, None
    return None, (f"states {' and '.join(map(str, values))} {source}, which is not a scanner's resolution "
                  f"({PLAUSIBLE_MPP[0]:g} to {PLAUSIBLE_MPP[1]:g} µm/px at level 0)")


def mpp_from_resolution(resolution: tuple[float, float] | None, unit: str | None) -> tuple[float | None, str | None]:
    """`stated_mpp` of a TIFF XResolution (pixels per unit, as a fraction) and ResolutionUnit, where both are set."""
    if not resolution or str(unit).lower() not in MICRONS_PER_UNIT or not any(resolution):
        return None, None
    numerator, denominator = (float(part) for part in resolution)
    per_micron = numerator / denominator / MICRONS_PER_UNIT[str(unit).lower()] if denominator else math.inf
    mpp = 1 / per_micron if per_micron else math.inf
    return stated_mpp([f"{mpp:.6g}"], f"µm/px (its TIFF resolution, {numerator:g}/{denominator:g} px a {unit})")


def on_white(pixels: np.ndarray) -> np.ndarray:
    """RGB uint8 from grey, RGB or RGBA: transparent parts (outside the scanned area) become white background."""
    if pixels.ndim == 2:
        pixels = pixels[..., None]
    if pixels.shape[-1] == 1:
        return np.repeat(pixels, 3, axis=-1)
    if pixels.shape[-1] == 3:
        return pixels
    alpha = pixels[..., 3:4].astype(np.float32) / 255
    return (pixels[..., :3] * alpha + 255 * (1 - alpha) + 0.5).astype(np.uint8)


class Slide:
    """A pyramid of levels read by region: coordinates in level-0 pixels, sizes in level pixels, as in OpenSlide.
    Subclasses define `read_level` (those arguments as ints, any of grey, RGB or RGBA back) and `close`."""

    def __init__(self, path: Path, level_dimensions: list[tuple[int, int]], stated: tuple[float | None, str | None],
                 mpp: float | None = None):
        if mpp is not None and not plausible(mpp):
            raise UserError(f"{path}: mpp={mpp!r} is not a scanner's resolution (expected {PLAUSIBLE_MPP[0]:g} to "
                            f"{PLAUSIBLE_MPP[1]:g} µm/px at level 0)")
        self.path, self.level_dimensions = path, level_dimensions
        width, height = level_dimensions[0]
        if min(width, height) <= 0 or any(min(dims) <= 0 for dims in level_dimensions):
            raise UserError(f"{path}: a level of {level_dimensions} pixels is empty; expected a non-empty image")
        self.level_downsamples = [(width / w + height / h) / 2 for w, h in level_dimensions]
        self.mpp, self.mpp_problem = (mpp, None) if mpp is not None else stated

    def read_region(self, level: int, x: int, y: int, width: int, height: int) -> np.ndarray:
        """RGB uint8 (height, width, 3) of `level` at level-0 (x, y); outside the slide is white."""
        if not 0 <= level < len(self.level_dimensions):
            raise UserError(f"{self.path}: no level {level} (the slide has {len(self.level_dimensions)})")
        if width <= 0 or height <= 0:
            raise UserError(f"{self.path}: region size must be positive, not {width}x{height}")
        return on_white(self.read_level(level, int(x), int(y), int(width), int(height)))

    def best_level_for_downsample(self, downsample: float) -> int:
        """The most reduced level that still has at least the detail asked for (downsample at or below)."""
        fitting = [level for level, ds in enumerate(self.level_downsamples) if ds <= downsample * LEVEL_TOLERANCE]
        return max(fitting, default=0)

    def downsample_for_mpp(self, target_mpp: float) -> float:
        """Level-0 pixels per output pixel at `target_mpp`, magnifying the scan at most MAX_MAGNIFICATION times."""
        if self.mpp is None:
            said = self.mpp_problem or "states no microns per pixel"
            raise UserError(f"{self.path}: the file {said}, so tiles at {target_mpp:g} µm/px cannot be sized; cut "
                            "tiles in level-0 pixels instead (--set data.slides.mpp=null; in code open_slide(path, "
                            "mpp=...) supplies it)")
        downsample = target_mpp / self.mpp
        if not downsample * MAX_MAGNIFICATION >= 1:
            raise UserError(f"{self.path}: tiles at {target_mpp:g} µm/px would magnify its {self.mpp:g} µm/px scan "
                            f"{1 / downsample:.0f} times; set --set data.slides.mpp= to "
                            f"{self.mpp / MAX_MAGNIFICATION:g} or more (or null for level-0 pixels)")
        return downsample

    def thumbnail_plan(self, max_size: int) -> tuple[int, int]:
        """(level, block): a thumbnail is `level` averaged over block x block pixels, at most `max_size` a side."""
        level = self.best_level_for_downsample(max(self.level_dimensions[0]) / max_size)
        return level, max(1, math.ceil(max(self.level_dimensions[level]) / max_size))

    def thumbnail(self, max_size: int = 1024) -> np.ndarray:
        """RGB uint8 overview, read in blocks so a slide whose only level is gigapixels still fits in memory."""
        level, block = self.thumbnail_plan(max_size)
        width, height = self.level_dimensions[level]
        downsample = self.level_downsamples[level]
        step = block * max(1, THUMBNAIL_BLOCK_PX // block)
        out = np.empty((math.ceil(height / block), math.ceil(width / block), 3), np.uint8)
        for top in range(0, height, step):
            for left in range(0, width, step):
                region = self.read_region(level, round(left * downsample), round(top * downsample),
                                          min(step, width - left), min(step, height - top))
                reduced = block_mean(region, block)
                row, col = top // block, left // block
                out[row : row + reduced.shape[0], col : col + reduced.shape[1]] = reduced
        return out

    def __enter__(self) -> Slide:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.path)!r}, levels={self.level_dimensions}, mpp={self.mpp})"


def block_mean(image: np.ndarray, block: int) -> np.ndarray:
    """Average over block x block pixels; a partial block at the edge averages what is there."""
    if block == 1:
        return image
    height, width = image.shape[:2]
    pad = ((0, -height % block), (0, -width % block), (0, 0))
    padded = np.pad(image, pad, mode="edge").astype(np.float32)
    rows, cols = padded.shape[0] // block, padded.shape[1] // block
    return (padded.reshape(rows, block, cols, block, 3).mean(axis=(1, 3)) + 0.5).astype(np.uint8)


def _fraction(resolution: str | None) -> tuple[float, float] | None:
    """OpenSlide's tiff.XResolution property (a decimal) as the fraction `mpp_from_resolution` takes."""
    try:
        return (float(resolution), 1.0) if resolution is not None else None
    except ValueError:
        return (math.nan, 1.0)


class OpenSlideSlide(Slide):
    """The scanners' formats (Aperio, Hamamatsu, Mirax, generic tiled TIFF)."""

    def __init__(self, path: Path, mpp: float | None = None):
        self.handle = openslide.OpenSlide(path)
        properties = self.handle.properties
        values = [properties[key] for key in ("openslide.mpp-x", "openslide.mpp-y") if key in properties]
        stated = stated_mpp(values, "µm/px (openslide.mpp-x and -y)") if values else mpp_from_resolution(
            _fraction(properties.get("tiff.XResolution")), properties.get("tiff.ResolutionUnit"))
        super().__init__(path, list(self.handle.level_dimensions), stated, mpp)

    def read_level(self, level: int, x: int, y: int, width: int, height: int) -> np.ndarray:
        try:
            return np.asarray(self.handle.read_region((x, y), level, (width, height)))
        except openslide.OpenSlideError as error:
            raise UserError(f"{self.path}: cannot read level {level} at ({x}, {y}), the file is damaged or truncated "
                            f"({one_line(error)})") from None

    def close(self) -> None:
        self.handle.close()


class TiffSlide(Slide):
    """A plain TIFF, through tifffile's zarr store so a region decodes only the strips or tiles it covers."""

    def __init__(self, path: Path, mpp: float | None = None):
        try:
            self.tiff = tifffile.TiffFile(path)
            series = self.tiff.series[0]
            root = zarr.open(series.aszarr(), mode="r")
        except (tifffile.TiffFileError, ValueError, OSError, IndexError) as error:
            raise UserError(f"{path}: not a readable TIFF slide ({one_line(error)})") from None
        self.levels = [root] if isinstance(root, zarr.Array) else [root[str(i)] for i in range(len(series.levels))]
        if series.axes not in ("YX", "YXS") or series.dtype != np.uint8:
            self.tiff.close()
            raise UserError(f"{path}: expected an 8-bit grey, RGB or RGBA image, not {series.axes} of {series.dtype}")
        page = series.pages[0]
        resolution, unit = page.tags.get("XResolution"), page.tags.get("ResolutionUnit")
        stated = mpp_from_resolution(tuple(resolution.value) if resolution else None, unit.value.name if unit else None)
        dimensions = [(level.shape[1], level.shape[0]) for level in self.levels]
        super().__init__(path, dimensions, stated, mpp)

    def read_level(self, level: int, x: int, y: int, width: int, height: int) -> np.ndarray:
        array = self.levels[level]
        downsample = self.level_downsamples[level]
        left, top = math.floor(x / downsample), math.floor(y / downsample)
        samples = array.shape[2:] if array.ndim == 3 else ()
        out = np.full((height, width, *samples), 255, np.uint8)
        rows = slice(max(top, 0), min(top + height, array.shape[0]))
        cols = slice(max(left, 0), min(left + width, array.shape[1]))
        if rows.start < rows.stop and cols.start < cols.stop:
            try:
                block = array[rows, cols]
            except (ValueError, OSError, RuntimeError) as error:
                raise UserError(f"{self.path}: cannot read level {level} at ({x}, {y}), the file is damaged or "
                                f"truncated ({one_line(error)})") from None
            out[rows.start - top : rows.stop - top, cols.start - left : cols.stop - left] = block
        return out

    def close(self) -> None:
        self.tiff.close()


class CuCIMSlide(Slide):
    """RAPIDS cuCIM decoding SVS and tiled TIFF, with OpenSlide's levels and mpp, so slides tile alike."""

    def __init__(self, path: Path, mpp: float | None = None):
        if path.suffix.lower() not in CUCIM_SUFFIXES:
            raise UserError(f"{path}: cuCIM reads {', '.join(CUCIM_SUFFIXES)} slides only (set "
                            f"data.slides.reader=openslide)")
        try:
            from cucim import CuImage
        except ImportError:
            raise UserError("data.slides.reader=cucim needs cuCIM: pip install 'gpu-usecases[cuda13]' (cucim-cu13), "
                            "or set data.slides.reader=openslide") from None
        with open_slide(path, mpp) as described:
            super().__init__(path, described.level_dimensions, (described.mpp, described.mpp_problem))
        try:
            self.image = CuImage(str(path))
        except (ValueError, RuntimeError) as error:
            raise UserError(f"{path}: cuCIM cannot read this slide ({one_line(error)}); set "
                            f"data.slides.reader=openslide") from None
        levels = [tuple(int(side) for side in dims) for dims in self.image.resolutions["level_dimensions"]]
        if levels != [tuple(dims) for dims in self.level_dimensions]:
            raise UserError(f"{path}: cuCIM sees levels {levels}, OpenSlide {self.level_dimensions}; set "
                            f"data.slides.reader=openslide")

    def read_level(self, level: int, x: int, y: int, width: int, height: int) -> np.ndarray:
        """cuCIM refuses a region past the edge of some TIFFs: the part inside is read, the rest stays white."""
        downsample = self.level_downsamples[level]
        level_width, level_height = self.level_dimensions[level]
        left, top = math.floor(x / downsample), math.floor(y / downsample)
        inside = (max(left, 0), max(top, 0), min(left + width, level_width), min(top + height, level_height))
        if inside == (left, top, left + width, top + height):
            return self._read(level, x, y, width, height)
        out = np.full((height, width, 3), 255, np.uint8)
        if inside[0] < inside[2] and inside[1] < inside[3]:
            part = on_white(self._read(level, x if left >= 0 else 0, y if top >= 0 else 0, inside[2] - inside[0],
                                       inside[3] - inside[1]))
            out[inside[1] - top : inside[3] - top, inside[0] - left : inside[2] - left] = part
        return out

    def _read(self, level: int, x: int, y: int, width: int, height: int) -> np.ndarray:
        try:
            return np.asarray(self.image.read_region(location=(x, y), size=(width, height), level=level))
        except (ValueError, RuntimeError) as error:
            raise UserError(f"{self.path}: cuCIM cannot read level {level} at ({x}, {y}), the file is damaged or "
                            f"truncated ({one_line(error)})") from None

    def close(self) -> None:
        self.image.close()


class SlideHandles:
    """Open slides keyed by process and path (a forked DataLoader worker opens its own), LRU past `max_open`."""

    def __init__(self, max_open: int = 16, mpp: float | None = None):
        self.max_open, self.mpp = max_open, mpp
        self.open: OrderedDict[tuple[int, Path, str], Slide] = OrderedDict()

    def get(self, path: str | Path, reader: str = "openslide") -> Slide:
        pid = os.getpid()
        self.open = OrderedDict((key, slide) for key, slide in self.open.items() if key[0] == pid)
        key = (pid, Path(path), reader)
        if key not in self.open:
            self.open[key] = open_slide(path, self.mpp, reader)
            while len(self.open) > self.max_open:
                self.open.popitem(last=False)[1].close()
        self.open.move_to_end(key)
        return self.open[key]

    def close(self) -> None:
        pid = os.getpid()
        for (owner, _, _), slide in self.open.items():
            if owner == pid:
                slide.close()
        self.open.clear()
