"""Where the tissue is: a mask on a thumbnail, so tiling never reads glass, pen marks or dust at full resolution.
CLAM's Otsu threshold of the median-filtered saturation, near-white and marker ink taken out by colour (as histolab
and tiatoolbox do), and a small morphological clean-up."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy import ndimage

from .reader import Slide

# Otsu adapts to how strongly a slide is stained; the floor keeps the noise of an empty glass from being split
# into "tissue", the ceiling keeps a field that is all tissue from being split into pale and dense stain.
SATURATION_FLOOR = 0.05
SATURATION_CEILING = 0.15
MEDIAN_PX = 5
NEAR_WHITE = 230  # every channel at or above: glass, whatever its tint
INK_SATURATION = 0.2
RED_INK_SATURATION = 0.5  # above pale eosin; red blood cells reach it too, but not in strokes
STROKE_SPAN = 0.1
INK_RIM = 0.05  # of the image's longer side
INK_GROW_PX = 4  # marker strokes are blurred: their pale rims go with them
CLEAN_PX = 2
SQUARE = np.ones((3, 3), bool)


@dataclass(frozen=True)
class TissueMask:
    """Boolean tissue mask; one mask pixel covers `downsample` x `downsample` level-0 pixels."""

    mask: np.ndarray
    downsample: float

    @property
    def fraction(self) -> float:
        return float(self.mask.mean())


def tissue_mask(slide: Slide, max_size: int = 1024) -> TissueMask:
    """The tissue of `slide`, found on a thumbnail at most `max_size` pixels a side."""
    level, block = slide.thumbnail_plan(max_size)  # a thumbnail pixel: block x block pixels of `level`
    return TissueMask(detect_tissue(slide.thumbnail(max_size)), slide.level_downsamples[level] * block)


def detect_tissue(rgb: np.ndarray) -> np.ndarray:
    """Boolean mask of the stained tissue in an RGB uint8 image (a slide thumbnail or a single tile)."""
    hue, saturation, value = rgb_to_hsv(rgb)
    smoothed = ndimage.median_filter((saturation * 255).astype(np.uint8), size=MEDIAN_PX)
    threshold = np.clip(otsu_threshold(smoothed), SATURATION_FLOOR * 255, SATURATION_CEILING * 255)
    tissue = (smoothed > threshold) & ~pen_ink(hue, saturation, value) & ~(rgb.min(axis=-1) >= NEAR_WHITE)
    return clean(tissue)


def rgb_to_hsv(rgb: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Hue in degrees [0, 360), saturation and value in [0, 1]."""
    channels = rgb.astype(np.float32) / 255
    red, green, blue = channels[..., 0], channels[..., 1], channels[..., 2]
    value = channels.max(axis=-1)
    chroma = value - channels.min(axis=-1)
    saturation = np.where(value > 0, chroma / np.maximum(value, 1e-6), 0)
    safe = np.maximum(chroma, 1e-6)
    sector = np.where(value == red, ((green - blue) / safe) % 6,
                      np.where(value == green, (blue - red) / safe + 2, (red - green) / safe + 4))
    return np.where(chroma > 0, sector * 60, 0), saturation, value


def otsu_threshold(values: np.ndarray) -> float:
    """Otsu's threshold of uint8 values: the split that maximises the variance between the two classes."""
    counts = np.bincount(values.ravel(), minlength=256).astype(np.float64)
    below = np.cumsum(counts)
    above = below[-1] - below
    moments = np.cumsum(counts * np.arange(256))
    mean_below = moments / np.maximum(below, 1)
    mean_above = (moments[-1] - moments) / np.maximum(above, 1)
    return float(np.argmax(below * above * (mean_below - mean_above) ** 2))


def pen_ink(hue: np.ndarray, saturation: np.ndarray, value: np.ndarray) -> np.ndarray:
    """Marker ink by colour, saturation and shape: red more saturated than pale eosin forming a stroke (a run at
    least STROKE_SPAN long, unlike red blood cells), green or blue; specks inside tissue are noise."""
    red = (hue >= 340) | (hue < 20) | ((hue >= 320) & (value < 0.4))
    red_strokes = long_runs(ndimage.binary_opening(red & (saturation > RED_INK_SATURATION), SQUARE))
    rim = round(INK_RIM * max(hue.shape))  # the stroke's paler edge, as far as it stays red
    if red_strokes.any() and rim:
        red_strokes = ndimage.binary_dilation(red_strokes, SQUARE, iterations=rim,
                                              mask=red & (saturation > INK_SATURATION))
    green = (hue >= 70) & (hue < 190)
    blue = (hue >= 190) & (hue < 240) & (saturation > 0.3)
    strokes = red_strokes | long_runs(ndimage.binary_opening((saturation > INK_SATURATION) & (green | blue), SQUARE))
    return ndimage.binary_dilation(strokes, SQUARE, iterations=INK_GROW_PX)


def long_runs(mask: np.ndarray) -> np.ndarray:
    """The connected parts of `mask` whose bounding box spans at least STROKE_SPAN of the image's longer side."""
    labels, count = ndimage.label(mask, SQUARE)
    if count == 0:
        return mask
    spans = np.array([max(rows.stop - rows.start, columns.stop - columns.start)
                      for rows, columns in ndimage.find_objects(labels)])
    keep = np.concatenate([[False], spans >= STROKE_SPAN * max(mask.shape)])
    return keep[labels]


def clean(mask: np.ndarray) -> np.ndarray:
    """Close small gaps, then drop specks; the border counts as tissue while eroding, keeping tissue at the edge."""
    closed = ndimage.binary_erosion(ndimage.binary_dilation(mask, SQUARE, CLEAN_PX), SQUARE, CLEAN_PX, border_value=1)
    opened = ndimage.binary_erosion(closed, SQUARE, CLEAN_PX, border_value=1)
    return ndimage.binary_dilation(opened, SQUARE, CLEAN_PX) & closed
