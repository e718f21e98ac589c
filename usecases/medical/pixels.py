"""One image file (PNG, JPEG or DICOM) as uint8 pixels, or one line naming the file and what is wrong with it."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pydicom
from PIL import Image, ImageOps
from pydicom.errors import InvalidDicomError
from pydicom.misc import is_dicom
from pydicom.multival import MultiValue
from pydicom.pixels import apply_modality_lut

from common.errors import UserError, one_line
from .config import Files

PILLOW_SUFFIXES = {".png", ".jpg", ".jpeg"}
DICOM_SUFFIXES = {".dcm", ".dicom"}
PIXEL_DATA_TAGS = ("PixelData", "FloatPixelData", "DoubleFloatPixelData")
HIGH_BIT_DEPTH_MODES = {"I", "I;16", "I;16B", "I;16L", "I;16N", "F"}
PILLOW_ERRORS = (OSError, SyntaxError, ValueError, Image.DecompressionBombError)
DICOM_READ_ERRORS = (InvalidDicomError, OSError, EOFError, KeyError, TypeError, ValueError, struct.error)
DICOM_DECODE_ERRORS = (AttributeError, KeyError, NotImplementedError, RuntimeError, TypeError, ValueError)
MODALITY_LUT_ERRORS = (AttributeError, IndexError, KeyError, TypeError, ValueError, struct.error)


def is_image_file(file: Path) -> bool:
    """Suffix-less DICOM files are common (PACS exports), so the DICOM header counts as well as the suffix."""
    suffix = file.suffix.lower()
    return suffix in PILLOW_SUFFIXES or suffix in DICOM_SUFFIXES or is_dicom(file)


def read_image(file: Path, config: Files) -> np.ndarray:
    """(size, size, channels) uint8; non-square images are stretched to the square, not cropped."""
    if file.suffix.lower() in DICOM_SUFFIXES or is_dicom(file):
        image = Image.fromarray(dicom_to_uint8(read_dicom(file), config.window_center, config.window_width))
    else:
        image = read_pillow(file)
    image = image.convert("L" if config.channels == 1 else "RGB")
    image = image.resize((config.image_size, config.image_size), Image.Resampling.BILINEAR)
    return np.asarray(image, dtype=np.uint8).reshape(config.image_size, config.image_size, config.channels)


def read_pillow(file: Path) -> Image.Image:
    """Upright (EXIF orientation) and 8-bit: 16-bit grey PNGs are min-max scaled, as Pillow would clip them."""
    try:
        with Image.open(file) as opened:
            image = ImageOps.exif_transpose(opened)
            image.load()
    except PILLOW_ERRORS as error:
        raise UserError(f"{file}: cannot read the image ({one_line(error)})") from None
    if image.mode in HIGH_BIT_DEPTH_MODES:
        image = Image.fromarray(to_uint8(unit_range(np.asarray(image, dtype=np.float64))))
    return image


def read_dicom(file: Path) -> pydicom.Dataset:
    """Forced, since files without the Part 10 header are common."""
    try:
        dataset = pydicom.dcmread(file, force=True)
    except DICOM_READ_ERRORS as error:
        raise UserError(f"{file}: cannot read the DICOM file ({one_line(error)})") from None
    if not dataset.file_meta and not any(tag in dataset for tag in PIXEL_DATA_TAGS):
        raise UserError(f"{file}: cannot read the DICOM file (no DICOM header and no pixel data)")
    return dataset


def dicom_to_uint8(dataset: pydicom.Dataset, center: float | None = None, width: float | None = None) -> np.ndarray:
    """What a radiologist's viewer shows, as uint8 (H, W) grey or (H, W, 3) colour: grey through the modality LUT
    and the DICOM linear window (`center` and `width`, else the file's, else min-max), MONOCHROME1 inverted; colour
    scaled from its bit depth; the middle frame of a multi-frame file."""
    name = getattr(dataset, "filename", None) or "DICOM dataset"
    if not any(tag in dataset for tag in PIXEL_DATA_TAGS):
        raise UserError(f"{name}: DICOM has no pixel data")
    try:
        pixels = dataset.pixel_array
    except DICOM_DECODE_ERRORS as error:
        raise UserError(f"{name}: cannot decode the DICOM pixel data ({one_line(error)})") from None
    if int(dataset.get("NumberOfFrames") or 1) > 1:
        pixels = pixels[len(pixels) // 2]
    photometric = str(dataset.get("PhotometricInterpretation", "MONOCHROME2"))
    if int(dataset.get("SamplesPerPixel") or 1) == 3:
        full_scale = 2 ** int(dataset.get("BitsStored") or 8) - 1
        return to_uint8(np.clip(pixels / full_scale, 0, 1))
    if photometric not in ("MONOCHROME1", "MONOCHROME2"):
        raise UserError(f"{name}: DICOM photometric interpretation '{photometric}' is not supported "
                        f"(MONOCHROME1, MONOCHROME2 or a 3-sample colour image)")
    try:
        values = apply_modality_lut(pixels, dataset).astype(np.float64)
    except MODALITY_LUT_ERRORS as error:  # e.g. a Rescale Slope that is no number
        raise UserError(f"{name}: cannot apply the DICOM rescale slope and intercept or modality LUT "
                        f"({one_line(error)})") from None
    if (center is None or width is None) and "WindowCenter" in dataset and "WindowWidth" in dataset:
        # the file's first window: a file may list several alternatives (e.g. lung, then mediastinum)
        center, width = first_number(dataset, "WindowCenter"), first_number(dataset, "WindowWidth")
    if center is None or width is None:
        scaled = unit_range(values)
    elif width <= 1:
        raise UserError(f"{name}: window width {width} is too narrow (the DICOM linear window needs more than 1)")
    else:
        scaled = np.clip((values - (center - 0.5)) / (width - 1) + 0.5, 0, 1)
    if photometric == "MONOCHROME1":
        scaled = 1 - scaled
    return to_uint8(scaled)


def first_number(dataset: pydicom.Dataset, keyword: str) -> float:
    """A decimal attribute's first value; one that is no number (written by a broken exporter) is named."""
    value = dataset.get(keyword)
    first = value[0] if isinstance(value, MultiValue) else value
    try:
        return float(first)
    except (TypeError, ValueError):
        name = getattr(dataset, "filename", None) or "DICOM dataset"
        raise UserError(f"{name}: DICOM {keyword} {first!r} is not a number (set data.files.window_center and "
                        f"window_width to use another window)") from None


def unit_range(values: np.ndarray) -> np.ndarray:
    """Min-max to [0, 1]: the fallback when nothing says which values matter."""
    low, high = float(values.min()), float(values.max())
    return np.zeros(values.shape) if high == low else (values - low) / (high - low)


def to_uint8(scaled: np.ndarray) -> np.ndarray:
    return np.round(scaled * 255).astype(np.uint8)
