"""Stain normalisation of H&E tiles in torch, batched on the tiles' device, so a model does not learn one lab's pink.
`fit_reference(tiles)` sets the reference (Macenko's default: torchstain's H&E matrix), `fit(tiles)` estimates a
slide once from a sample of its tiles, and `normalize(batch)` moves all its tiles alike (torchstain re-estimates each
image; on one tile the two agree). Batches are (B, 3, H, W), uint8 or float in [0, 255], returned alike."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

LIGHT_INTENSITY = 240.0  # Io, the transmitted light of the background (torchstain's and Macenko's default)
TRANSPARENT_OD = 0.15  # beta: a pixel whose optical density is below this in any channel is glass, not stain
ANGLE_PERCENTILE = 1.0  # alpha: the stain vectors are the 1st and 99th percentile angles, robust to outliers
MAX_CONCENTRATION_PERCENTILE = 99.0
MIN_TISSUE_PIXELS = 1000  # fewer, and the 1st/99th percentiles rest on a handful of pixels
# torchstain's reference, from Macenko's original code: columns are hematoxylin and eosin optical density.
REFERENCE_STAIN_MATRIX = torch.tensor([[0.5626, 0.2159], [0.7201, 0.8012], [0.4062, 0.5581]])
REFERENCE_MAX_CONCENTRATIONS = torch.tensor([1.9705, 1.0308])
# sRGB (D65) to CIE XYZ and the white point, as torchstain's rgb2lab uses them.
RGB_TO_XYZ = torch.tensor([[0.412453, 0.357580, 0.180423],
                           [0.212671, 0.715160, 0.072169],
                           [0.019334, 0.119193, 0.950227]])
XYZ_TO_RGB = torch.linalg.inv(RGB_TO_XYZ)
WHITE_XYZ = torch.tensor([0.95047, 1.0, 1.08883])


class _Normaliser:
    """Shared input handling: subclasses map (B, 3, N) float pixels in [0, 255] to the same (`_normalize_pixels`)."""

    _state_keys: tuple[str, ...]

    def normalize(self, batch: torch.Tensor) -> torch.Tensor:
        """The fitted slide-to-reference mapping on every tile of `batch`, on its device, in its shape and dtype."""
        if batch.dim() != 4 or batch.shape[1] != 3:
            raise ValueError(f"stain normalisation needs a (B, 3, H, W) batch of RGB tiles, got {tuple(batch.shape)}")
        missing = [key for key in self._state_keys if getattr(self, key) is None]
        if missing:
            raise RuntimeError(f"{type(self).__name__} is not fitted ({', '.join(missing)}): fit_reference(tiles) "
                               "sets the reference_*, fit(slide tiles) the slide's")
        # clamped: resampled float tiles can stray below 0, where the log of the optical density is NaN
        pixels = batch.float().clamp(0, 255).flatten(2)
        normalised = self._normalize_pixels(pixels).clamp(0, 255).reshape(batch.shape)
        return normalised.round().to(batch.dtype) if not batch.is_floating_point() else normalised.to(batch.dtype)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """CPU tensors only, so the fit reloads under torch.load(weights_only=True)."""
        return {key: getattr(self, key).cpu() for key in self._state_keys if getattr(self, key) is not None}

    @classmethod
    def from_state_dict(cls, state: dict[str, torch.Tensor]):
        normaliser = cls()
        unknown = set(state) - set(cls._state_keys)
        if unknown:
            raise ValueError(f"not a {cls.__name__} state: unknown keys {sorted(unknown)}")
        for key, value in state.items():
            setattr(normaliser, key, value)
        return normaliser


class MacenkoNormaliser(_Normaliser):
    """Macenko et al. 2009: unmix optical density into H and E, rescale to the reference's, remix with its vectors."""

    _state_keys = ("reference_stain_matrix", "reference_max_concentrations", "stain_matrix", "max_concentrations")

    def __init__(self):
        self.reference_stain_matrix = REFERENCE_STAIN_MATRIX.clone()
        self.reference_max_concentrations = REFERENCE_MAX_CONCENTRATIONS.clone()
        self.stain_matrix: torch.Tensor | None = None  # (3, 2): unit H and E optical-density vectors
        self.max_concentrations: torch.Tensor | None = None  # (2,)

    def fit_reference(self, images: torch.Tensor | Sequence[torch.Tensor]) -> MacenkoNormaliser:
        self.reference_stain_matrix, self.reference_max_concentrations = estimate_stains(images)
        return self

    def fit(self, images: torch.Tensor | Sequence[torch.Tensor]) -> MacenkoNormaliser:
        self.stain_matrix, self.max_concentrations = estimate_stains(images)
        return self

    def _normalize_pixels(self, pixels: torch.Tensor) -> torch.Tensor:
        """Unmixing, rescaling and remixing are all linear in optical density: one 3x3 map for the whole batch."""
        device = pixels.device
        scale = self.reference_max_concentrations.to(device) / self.max_concentrations.to(device)
        unmix = torch.linalg.pinv(self.stain_matrix.to(device))  # least squares, as torchstain's lstsq
        transfer = self.reference_stain_matrix.to(device) @ (scale[:, None] * unmix)
        return LIGHT_INTENSITY * torch.exp(-(transfer @ optical_density(pixels)))


def estimate_stains(images: torch.Tensor | Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The (3, 2) unit H and E vectors and their (2,) 99th-percentile concentrations, from the pooled pixels."""
    density = optical_density(_pooled_pixels(images))
    tissue = density[:, _require_tissue(density)]
    _, eigenvectors = torch.linalg.eigh(torch.cov(tissue))
    plane = eigenvectors[:, 1:]  # the two largest: the plane the two stains span
    # eigh's signs are arbitrary and may differ between devices; fixed signs keep CPU and CUDA fits equal
    plane = plane * torch.where(plane.sum(0) < 0, -1.0, 1.0)
    projected = plane.T @ tissue
    angles = torch.atan2(projected[1], projected[0])
    extremes = torch.stack([_percentile(angles, ANGLE_PERCENTILE), _percentile(angles, 100 - ANGLE_PERCENTILE)])
    vectors = plane @ torch.stack([torch.cos(extremes), torch.sin(extremes)])
    # hematoxylin absorbs more red than eosin does: its vector comes first
    stain_matrix = vectors if vectors[0, 0] > vectors[0, 1] else vectors.flip(1)
    concentrations = torch.linalg.pinv(stain_matrix) @ density  # every pixel, as Macenko and torchstain
    max_concentrations = torch.stack([_percentile(row, MAX_CONCENTRATION_PERCENTILE) for row in concentrations])
    if (max_concentrations <= 0).any():
        raise ValueError("too little stain to fit: the 99th-percentile H or E concentration is not above zero; "
                         "fit on tissue tiles, not background")
    return stain_matrix, max_concentrations


class ReinhardNormaliser(_Normaliser):
    """Reinhard et al. 2001: match the mean and standard deviation of each CIELAB channel to the reference's."""

    _state_keys = ("reference_means", "reference_stds", "means", "stds")

    def __init__(self):
        self.reference_means: torch.Tensor | None = None  # (3,) L, a, b
        self.reference_stds: torch.Tensor | None = None
        self.means: torch.Tensor | None = None
        self.stds: torch.Tensor | None = None

    def fit_reference(self, images: torch.Tensor | Sequence[torch.Tensor]) -> ReinhardNormaliser:
        self.reference_means, self.reference_stds = lab_statistics(images)
        return self

    def fit(self, images: torch.Tensor | Sequence[torch.Tensor]) -> ReinhardNormaliser:
        self.means, self.stds = lab_statistics(images)
        return self

    def _normalize_pixels(self, pixels: torch.Tensor) -> torch.Tensor:
        device = pixels.device
        scale = (self.reference_stds.to(device) / self.stds.to(device))[:, None]
        shift = self.reference_means.to(device)[:, None] - self.means.to(device)[:, None] * scale
        return lab_to_rgb(rgb_to_lab(pixels / 255) * scale + shift) * 255


NORMALISERS = {"macenko": MacenkoNormaliser, "reinhard": ReinhardNormaliser}


def lab_statistics(images: torch.Tensor | Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel CIELAB mean and (unbiased) standard deviation over every pixel, as torchstain's Reinhard."""
    pixels = _pooled_pixels(images)
    _require_tissue(optical_density(pixels))
    lab = rgb_to_lab(pixels / 255)
    means, stds = lab.mean(1), lab.std(1)
    if (stds == 0).any():
        raise ValueError("cannot fit Reinhard normalisation to a tile of one uniform colour")
    return means, stds


def optical_density(pixels: torch.Tensor) -> torch.Tensor:
    """Beer-Lambert: stain absorbance is additive in -log(transmitted / incident light); +1 keeps black finite."""
    return -torch.log((pixels + 1) / LIGHT_INTENSITY)


def rgb_to_lab(rgb: torch.Tensor) -> torch.Tensor:
    """sRGB in [0, 1] to CIELAB (L in [0, 100]), channels on dim -2, with torchstain's constants."""
    linear = torch.where(rgb > 0.04045, ((rgb + 0.055) / 1.055).clamp_min(0) ** 2.4, rgb / 12.92)
    xyz = (RGB_TO_XYZ.to(rgb.device) @ linear) / WHITE_XYZ.to(rgb.device)[:, None]
    f = torch.where(xyz > 0.008856, xyz.clamp_min(0) ** (1 / 3), 7.787 * xyz + 16 / 116)
    fx, fy, fz = f.unbind(-2)
    return torch.stack([116 * fy - 16, 500 * (fx - fy), 200 * (fy - fz)], dim=-2)


def lab_to_rgb(lab: torch.Tensor) -> torch.Tensor:
    """The inverse of `rgb_to_lab`, clipped to [0, 1]: matched statistics can leave the sRGB gamut."""
    lightness, a, b = lab.unbind(-2)
    fy = (lightness + 16) / 116
    f = torch.stack([a / 500 + fy, fy, fy - b / 200], dim=-2)
    xyz = torch.where(f > 0.2068966, f**3, (f - 16 / 116) / 7.787) * WHITE_XYZ.to(lab.device)[:, None]
    linear = XYZ_TO_RGB.to(lab.device) @ xyz
    rgb = torch.where(linear > 0.0031308, 1.055 * linear.clamp_min(0) ** (1 / 2.4) - 0.055, linear * 12.92)
    return rgb.clamp(0, 1)


def normalise_throughput(normaliser: _Normaliser, batch: torch.Tensor, repeats: int) -> float:
    """Tiles per second of `normalize` where `batch` lies, after a warm-up, waiting for the device."""
    normaliser.normalize(batch)
    _wait_for(batch.device)
    start = time.perf_counter()
    for _ in range(repeats):
        normaliser.normalize(batch)
    _wait_for(batch.device)
    return repeats * batch.shape[0] / (time.perf_counter() - start)


def _wait_for(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def _pooled_pixels(images: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
    """(3, N) float pixels of a tile, a batch or a list of tiles of any sizes: a slide's fit pools its sample."""
    tensors = [images] if isinstance(images, torch.Tensor) else list(images)
    if not tensors or any(tensor.dim() not in (3, 4) or tensor.shape[-3] != 3 for tensor in tensors):
        raise ValueError("stain normalisation fits on RGB tiles shaped (3, H, W) or (B, 3, H, W)")
    return torch.cat([tensor.float().clamp(0, 255).movedim(-3, 0).reshape(3, -1) for tensor in tensors], dim=1)


def _require_tissue(density: torch.Tensor) -> torch.Tensor:
    """Pixels stained in every channel; too few of them (a white or near-empty tile) cannot be fitted."""
    mask = (density >= TRANSPARENT_OD).all(0)
    count = int(mask.sum())
    if count < MIN_TISSUE_PIXELS:
        raise ValueError(f"too few tissue pixels to fit stain normalisation: {count} of {mask.numel()} have optical "
                         f"density >= {TRANSPARENT_OD} in every channel, {MIN_TISSUE_PIXELS} needed; fit on tissue "
                         "tiles")
    return mask


def _percentile(values: torch.Tensor, q: float) -> torch.Tensor:
    """The nearest-rank percentile torchstain uses (torch.quantile refuses a slide's sample of over 2**24 values)."""
    rank = 1 + round(0.01 * q * (values.numel() - 1))
    return values.flatten().kthvalue(rank).values
