"""Stain normalisation: checked against torchstain on the shared real tiles, and on synthetic H&E tiles mixed from
known stain vectors elsewhere, so that a user's clone without ../shared still tests batching, errors and state."""

import io
from pathlib import Path

import numpy as np
import pytest
import torch

from usecases.medical.slides.stain import (LIGHT_INTENSITY, REFERENCE_STAIN_MATRIX, MacenkoNormaliser,
                                           ReinhardNormaliser, estimate_stains, normalise_throughput)

PATHOLOGY = Path(__file__).resolve().parents[3] / "shared" / "data" / "pathology"
NORMALISERS = [MacenkoNormaliser, ReinhardNormaliser]
STATE_KEYS = {MacenkoNormaliser: {"reference_stain_matrix", "reference_max_concentrations", "stain_matrix",
                                  "max_concentrations"},
              ReinhardNormaliser: {"reference_means", "reference_stds", "means", "stds"}}
# another lab's stains: a purpler hematoxylin, a paler eosin (unit columns)
OTHER_LAB_STAINS = torch.nn.functional.normalize(torch.tensor([[0.65, 0.27], [0.70, 0.85], [0.29, 0.46]]), dim=0)


def synthetic_tile(stains: torch.Tensor, seed: int, size: int = 96) -> torch.Tensor:
    """(3, size, size) uint8 by Beer-Lambert from `stains`: mixed, pure-hematoxylin, pure-eosin and glass pixels."""
    generator = torch.Generator().manual_seed(seed)
    concentrations = torch.rand(2, size * size, generator=generator) * torch.tensor([[2.0], [1.0]])
    kind = torch.rand(size * size, generator=generator)
    concentrations[1, kind < 0.15] = 0
    concentrations[0, (kind >= 0.15) & (kind < 0.3)] = 0
    concentrations[:, kind > 0.85] = 0
    rgb = LIGHT_INTENSITY * torch.exp(-stains @ concentrations)
    return rgb.clamp(0, 255).round().to(torch.uint8).reshape(3, size, size)


def fitted(normaliser_class):
    """Reference: tiles of torchstain's stains; slide: another lab's."""
    normaliser = normaliser_class().fit_reference(synthetic_tile(REFERENCE_STAIN_MATRIX, seed=0))
    return normaliser.fit([synthetic_tile(OTHER_LAB_STAINS, seed) for seed in (1, 2)])


@pytest.fixture(scope="module")
def real_tiles():
    tiles = PATHOLOGY / "tiles"
    if not tiles.is_dir():
        pytest.skip(f"no shared real tiles at {tiles} (a user's clone has no ../shared)")
    from PIL import Image

    def read(name):
        rgb = np.asarray(Image.open(tiles / f"{name}.png").convert("RGB"))  # the PNGs are RGBA
        return torch.from_numpy(rgb.copy()).permute(2, 0, 1)

    return [read(name) for name in ("tissue-level0-4302-10273-4814-10785", "tissue-level0-7352-11762-7864-12274",
                                    "low-nuclei-score-level1", "high-nuclei-score-level2")]


@pytest.mark.parametrize("reference, source", [(0, 1), (2, 3)])
def test_macenko_matches_torchstain_fitted_on_one_real_tile_and_normalising_another(real_tiles, reference, source):
    """Measured: mean |difference| 0.002 (0-255 units), at most 1 where torchstain's truncation to int crosses an
    integer. Swapped stains differ by 3 to 13 on average, a missing exp by far more."""
    import torchstain

    theirs = torchstain.normalizers.MacenkoNormalizer(backend="torch")
    theirs.fit(real_tiles[reference])
    expected, _, _ = theirs.normalize(real_tiles[source], stains=False)  # (H, W, 3) int, truncated
    ours = MacenkoNormaliser().fit_reference(real_tiles[reference]).fit(real_tiles[source])
    result = ours.normalize(real_tiles[source][None].float())[0].permute(1, 2, 0).floor()
    difference = (result - expected).abs()
    assert difference.mean() < 0.01 and difference.max() <= 1, (difference.mean(), difference.max())
    torch.testing.assert_close(ours.reference_stain_matrix, theirs.HERef, atol=1e-3, rtol=0)
    torch.testing.assert_close(ours.reference_max_concentrations, theirs.maxCRef, atol=1e-3, rtol=0)


@pytest.mark.parametrize("reference, source", [(0, 1), (2, 3)])
def test_reinhard_matches_torchstain_fitted_on_one_real_tile_and_normalising_another(real_tiles, reference, source):
    """Measured: mean |difference| 0.00002, at most 1 (truncation); the unnormalised tile differs by 6 to 33."""
    import torchstain

    theirs = torchstain.normalizers.ReinhardNormalizer(backend="torch")
    theirs.fit(real_tiles[reference])
    expected = theirs.normalize(real_tiles[source]).float()  # (H, W, 3) uint8, truncated
    ours = ReinhardNormaliser().fit_reference(real_tiles[reference]).fit(real_tiles[source])
    result = ours.normalize(real_tiles[source][None].float())[0].permute(1, 2, 0).floor()
    difference = (result - expected).abs()
    assert difference.mean() < 0.01 and difference.max() <= 1, (difference.mean(), difference.max())


def test_real_tiles_give_unit_stain_vectors_hematoxylin_first(real_tiles):
    """Hematoxylin stains nuclei blue-purple, eosin stains cytoplasm pink: rendered alone, H is bluer than red and
    E redder than blue."""
    for tile in real_tiles:
        stain_matrix, max_concentrations = estimate_stains(tile)
        torch.testing.assert_close(stain_matrix.norm(dim=0), torch.ones(2))
        hematoxylin, eosin = (LIGHT_INTENSITY * torch.exp(-stain_matrix)).T  # RGB of one unit of each stain
        assert hematoxylin[2] > hematoxylin[0] and eosin[0] > eosin[2], stain_matrix
        assert (max_concentrations > 0).all()


@pytest.mark.parametrize("stains", [REFERENCE_STAIN_MATRIX, OTHER_LAB_STAINS], ids=["reference", "other-lab"])
def test_macenko_recovers_the_stains_a_tile_was_mixed_from_hematoxylin_first(stains):
    stain_matrix, _ = estimate_stains(synthetic_tile(stains, seed=0))
    torch.testing.assert_close(stain_matrix, stains / stains.norm(dim=0), atol=0.01, rtol=0)


def test_a_slide_fit_pools_the_pixels_of_all_its_sample_tiles():
    """Two tiles fitted as a list are one image of both side by side, not the first tile or an average of fits."""
    tiles = [synthetic_tile(REFERENCE_STAIN_MATRIX, seed=1), synthetic_tile(OTHER_LAB_STAINS, seed=2)]
    pooled = estimate_stains(tiles)
    side_by_side = estimate_stains(torch.cat(tiles, dim=2))
    # The same pixels in another order: the covariance's float32 sums over N pixels may round differently on
    # another CPU or thread count, by at most (N - 1) * eps / 2 relative whatever the order (measured here: 1 ulp).
    # Fits of the first tile or the average of both tiles' fits differ by 0.08 and more.
    pixels = sum(tile[0].numel() for tile in tiles)
    tolerance = (pixels - 1) * torch.finfo(torch.float32).eps / 2  # 1.1e-3
    for got, expected in zip(pooled, side_by_side):
        torch.testing.assert_close(got, expected, atol=tolerance, rtol=tolerance)
    first, second = estimate_stains(tiles[0]), estimate_stains(tiles[1])
    for other in (first, [(one + two) / 2 for one, two in zip(first, second)]):
        assert (pooled[0] - other[0]).abs().max() > 10 * tolerance


@pytest.mark.parametrize("normaliser_class", NORMALISERS)
def test_a_batch_is_normalised_tile_by_tile_with_the_slide_fit_in_its_dtype(normaliser_class):
    """Tiles of different stains in one batch: batch statistics would make the batched result differ.

    Each pixel goes through a chain of float32 operations of its own (a 3x3 map of its optical density and an exp,
    or the CIELAB round trip: under 32 roundings) on values up to 255. A batch of two may take another kernel than
    a batch of one (vectorised or scalar, FMA or not), so the two may differ by up to 32 roundings of 255 (1e-3),
    and a uint8 tile by 1 where that crosses a rounding half. Batch statistics move pixels by whole units."""
    normaliser = fitted(normaliser_class)
    batch = torch.stack([synthetic_tile(OTHER_LAB_STAINS, seed=3), synthetic_tile(REFERENCE_STAIN_MATRIX, seed=4)])
    roundings = 32 * 255 * torch.finfo(torch.float32).eps
    for dtype in (torch.uint8, torch.float32):
        tiles = batch.to(dtype)
        result = normaliser.normalize(tiles)
        assert result.shape == tiles.shape and result.dtype == dtype
        alone = torch.cat([normaliser.normalize(tile[None]) for tile in tiles])
        if dtype == torch.uint8:
            assert (result.int() - alone.int()).abs().max() <= 1 and (result != alone).float().mean() < 1e-3
        else:
            torch.testing.assert_close(result, alone, atol=roundings, rtol=0)
    as_float = normaliser.normalize(batch.float())
    assert torch.equal(normaliser.normalize(batch), as_float.round().to(torch.uint8))
    assert (as_float - batch).abs().mean() > 5  # it changed the colours


@pytest.mark.parametrize("normaliser_class", NORMALISERS)
def test_white_and_overshooting_tiles_are_normalised_without_nans_and_macenko_keeps_white_white(normaliser_class):
    """Resampled float tiles overshoot [0, 255] a little; below -1 the optical density's log would be NaN."""
    white = torch.full((2, 3, 32, 32), 255.0)
    overshooting = torch.stack([torch.full((3, 32, 32), -3.0), torch.full((3, 32, 32), 258.0)])
    normaliser = fitted(normaliser_class)
    assert torch.isfinite(normaliser.normalize(overshooting)).all()
    result = normaliser.normalize(white)
    assert torch.isfinite(result).all()
    if normaliser_class is MacenkoNormaliser:
        assert result.min() > 240, result.amin(dim=(0, 2, 3))


def few_tissue_pixels():
    tile = torch.full((3, 256, 256), 255, dtype=torch.uint8)
    tile[:, :20, :20] = synthetic_tile(REFERENCE_STAIN_MATRIX, seed=0, size=20)
    return tile


def sparse_tissue():
    """1,600 stained pixels in a quarter million: enough to find the stains, but the 99th-percentile
    concentration is background's."""
    tile = torch.full((3, 512, 512), 255, dtype=torch.uint8)
    tile[:, :40, :40] = torch.tensor([90, 60, 140], dtype=torch.uint8)[:, None, None]
    tile[:, :40, :20] = torch.tensor([200, 90, 160], dtype=torch.uint8)[:, None, None]
    return tile


@pytest.mark.parametrize("normaliser_class, tile, message", [
    (MacenkoNormaliser, torch.full((3, 64, 64), 255, dtype=torch.uint8), "too few tissue pixels"),
    (ReinhardNormaliser, torch.full((3, 64, 64), 255, dtype=torch.uint8), "too few tissue pixels"),
    (MacenkoNormaliser, few_tissue_pixels(), "too few tissue pixels"),
    (ReinhardNormaliser, few_tissue_pixels(), "too few tissue pixels"),
    (MacenkoNormaliser, sparse_tissue(), "too little stain"),
    (ReinhardNormaliser, torch.full((3, 64, 64), 100, dtype=torch.uint8), "one uniform colour"),
    (MacenkoNormaliser, torch.zeros(3, 64, 64, 1), "(3, H, W) or (B, 3, H, W)"),
], ids=["white-macenko", "white-reinhard", "few-macenko", "few-reinhard", "sparse-macenko", "uniform-reinhard",
        "channels-last"])
def test_a_fit_without_enough_tissue_says_so_in_one_line(normaliser_class, tile, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")) as error:
        normaliser_class().fit(tile)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("normaliser_class", NORMALISERS)
def test_normalising_before_the_slide_fit_says_which_fit_is_missing(normaliser_class):
    with pytest.raises(RuntimeError, match="not fitted"):
        normaliser_class().normalize(torch.zeros(1, 3, 8, 8))
    with pytest.raises(ValueError, match=r"\(B, 3, H, W\)"):
        fitted(normaliser_class).normalize(torch.zeros(3, 8, 8))


@pytest.mark.parametrize("normaliser_class", NORMALISERS)
def test_the_state_dict_round_trips_through_a_weights_only_load(normaliser_class):
    normaliser = fitted(normaliser_class)
    buffer = io.BytesIO()
    torch.save(normaliser.state_dict(), buffer)
    state = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    assert set(state) == STATE_KEYS[normaliser_class]
    assert all(isinstance(value, torch.Tensor) and value.device.type == "cpu" for value in state.values())
    tiles = synthetic_tile(OTHER_LAB_STAINS, seed=5)[None]
    assert torch.equal(normaliser_class.from_state_dict(state).normalize(tiles), normaliser.normalize(tiles))


def test_throughput_counts_tiles_per_second():
    batch = torch.stack([synthetic_tile(OTHER_LAB_STAINS, seed) for seed in range(4)])
    assert normalise_throughput(fitted(MacenkoNormaliser), batch, repeats=2) > 0


@pytest.mark.gpu
@pytest.mark.parametrize("normaliser_class", NORMALISERS)
def test_cuda_fits_and_normalises_as_the_cpu_does(normaliser_class):
    """The fit's eigenvector signs are fixed, so CPU and CUDA pick the same percentile pixels."""
    reference = synthetic_tile(REFERENCE_STAIN_MATRIX, seed=0)
    slide = [synthetic_tile(OTHER_LAB_STAINS, seed) for seed in (1, 2)]
    batch = torch.stack([synthetic_tile(OTHER_LAB_STAINS, seed=3), synthetic_tile(REFERENCE_STAIN_MATRIX, seed=4)])
    on_cpu = normaliser_class().fit_reference(reference).fit(slide)
    on_cuda = normaliser_class().fit_reference(reference.cuda()).fit([tile.cuda() for tile in slide])
    for key, value in on_cpu.state_dict().items():
        torch.testing.assert_close(on_cuda.state_dict()[key], value, atol=1e-4, rtol=1e-4)
    result = on_cuda.normalize(batch.cuda().float())
    assert result.device.type == "cuda"
    torch.testing.assert_close(result.cpu(), on_cpu.normalize(batch.float()), atol=0.05, rtol=0)
