"""Whole-slide images: reading (OpenSlide and the tifffile fallback), tissue detection, tiling and its cache, and
the synthetic pyramidal slides, on the shared real slides where present."""

from __future__ import annotations

import csv
import hashlib
import shutil
import tracemalloc
import zlib
from pathlib import Path

import numpy as np
import pytest
import tifffile
from PIL import Image

from common.errors import UserError
from usecases.medical.slides import reader, tissue
from usecases.medical.slides.reader import OpenSlideSlide, SlideHandles, TiffSlide, open_slide
from usecases.medical.slides.synthetic import Scene, write_slide, write_slide_set
from usecases.medical.slides.tiles import read_tile, tile_grid
from usecases.medical.slides.tissue import detect_tissue, tissue_mask

PATHOLOGY = Path(__file__).resolve().parents[3] / "shared" / "data" / "pathology"
needs_shared = pytest.mark.skipif(not PATHOLOGY.is_dir(), reason=f"no shared pathology slides at {PATHOLOGY}")
SIDE = 4096
SEED = 3


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("slides")


@pytest.fixture(scope="module")
def positive(folder) -> Path:
    return write_slide(folder / "positive.tif", SIDE, SIDE, positive=True, seed=SEED)


@pytest.fixture(scope="module")
def negative(folder) -> Path:
    return write_slide(folder / "negative.tif", 2048, 2048, positive=False, seed=SEED + 1)


@pytest.fixture(scope="module")
def plain_tiff(folder) -> Path:
    """A plain striped TIFF without resolution tags, which OpenSlide refuses: the tifffile fallback's case."""
    path = folder / "plain.tif"
    rng = np.random.default_rng(0)
    tifffile.imwrite(path, rng.integers(0, 256, (600, 900, 3), dtype=np.uint8), photometric="rgb")
    return path


def one_line_naming(error: pytest.ExceptionInfo, path: Path) -> bool:
    return path.name in str(error.value) and "\n" not in str(error.value)


@needs_shared
@pytest.mark.parametrize("name, mpp, stated_mpp, tissue_share", [
    ("cmu-1-small-region.svs", 0.5, 0.499, (0.2, 0.5)),
    ("tcga-cr-7395-01a-01-ts1.svs", None, None, (0.45, 0.75)),  # JPEG 2000 tiles, no mpp stated
])
def test_real_slides_are_opened_masked_and_tiled(name, mpp, stated_mpp, tissue_share):
    with open_slide(PATHOLOGY / name) as slide:
        assert isinstance(slide, OpenSlideSlide) and slide.mpp == stated_mpp
        mask = tissue_mask(slide, max_size=512)
        assert max(mask.mask.shape) <= 512 and tissue_share[0] < mask.fraction < tissue_share[1]
        grid = tile_grid(slide, mpp, tile_px=256)
        tissue_in_tiles = [detect_tissue(read_tile(slide, grid, index)).mean() for index in range(0, len(grid), 7)]
    assert len(grid) > 20 and np.mean(tissue_in_tiles) > 0.5


@needs_shared
def test_a_plain_tiff_openslide_refuses_is_read_through_tifffile():
    path = PATHOLOGY / "kidney-48-5.tif"
    whole = np.asarray(Image.open(path).convert("RGB"))
    with open_slide(path) as slide:
        assert isinstance(slide, TiffSlide) and slide.level_dimensions == [(1493, 901)] and slide.mpp is None
        np.testing.assert_array_equal(slide.read_region(0, 700, 300, 64, 32), whole[300:332, 700:764])
        past_the_edge = slide.read_region(0, 1480, 890, 32, 32)
    np.testing.assert_array_equal(past_the_edge[:11, :13], whole[890:, 1480:])
    assert (past_the_edge[11:] == 255).all() and (past_the_edge[:, 13:] == 255).all()


@needs_shared
def test_tissue_tiles_are_told_from_glass_and_pen_marks():
    fraction = {path.stem: detect_tissue(np.asarray(Image.open(path).convert("RGB"))).mean()
                for path in (PATHOLOGY / "tiles").glob("*.png")}
    tissue_tiles = [share for name, share in fraction.items() if name.startswith("tissue")]
    glass_tiles = [share for name, share in fraction.items() if name.startswith(("no-tissue", "almost-white"))]
    assert len(tissue_tiles) == 2 and len(glass_tiles) == 4
    assert min(tissue_tiles) > 0.4 and max(glass_tiles) < 0.1, fraction


def test_glass_grey_and_noisy_or_tinted_is_not_tissue():
    grey = np.clip(215 + np.random.default_rng(0).normal(0, 3, (256, 256, 3)), 0, 255).astype(np.uint8)
    tinted = np.full((256, 256, 3), 255, np.uint8)
    tinted[:, 128:] = (255, 232, 244)
    assert detect_tissue(grey).mean() < 0.01 and detect_tissue(tinted).mean() < 0.01


@needs_shared
def test_a_broken_slide_is_refused_in_one_line_naming_it():
    with pytest.raises(UserError) as caught:
        open_slide(PATHOLOGY / "broken.svs")
    assert one_line_naming(caught, PATHOLOGY / "broken.svs")


def test_a_truncated_slide_or_another_format_is_refused_in_one_line(positive, folder):
    truncated = folder / "truncated.tif"
    truncated.write_bytes(positive.read_bytes()[: positive.stat().st_size // 2])
    with pytest.raises(UserError) as caught:
        with open_slide(truncated) as slide:
            slide.read_region(0, 0, 0, SIDE, SIDE)
    assert one_line_naming(caught, truncated)
    picture = folder / "picture.png"
    Image.new("RGB", (8, 8)).save(picture)
    with pytest.raises(UserError, match="expected .svs") as caught:
        open_slide(picture)
    assert one_line_naming(caught, picture)


def test_a_slide_without_mpp_is_refused_a_magnification_in_one_line(plain_tiff, folder):
    with open_slide(plain_tiff) as slide:
        assert slide.mpp is None
        with pytest.raises(UserError, match="mpp") as caught:
            tile_grid(slide, 0.5)
    assert one_line_naming(caught, plain_tiff)
    with open_slide(plain_tiff, mpp=0.25) as slide:  # the fix the message names
        assert tile_grid(slide, 0.5, tile_px=64, min_tissue=0.0).tile_l0 == 128


def test_a_slide_without_tissue_is_refused_in_one_line(folder):
    glass = folder / "glass.tif"
    tifffile.imwrite(glass, np.full((1024, 1024, 3), 245, np.uint8), tile=(256, 256), photometric="rgb")
    with open_slide(glass) as slide, pytest.raises(UserError, match="no tissue found") as caught:
        tile_grid(slide, None)
    assert one_line_naming(caught, glass)


def test_the_synthetic_slide_is_a_pyramid_openslide_reads_with_its_mpp(positive):
    with open_slide(positive) as slide:
        assert isinstance(slide, OpenSlideSlide)
        assert slide.handle.properties["openslide.vendor"] == "generic-tiff"
        assert float(slide.handle.properties["openslide.mpp-x"]) == 0.5 and slide.mpp == 0.5
        assert slide.level_dimensions == [(4096, 4096), (1024, 1024), (256, 256)]
        assert slide.level_downsamples == [1.0, 4.0, 16.0]
        # The same level-0 coordinates name the same place on every level and in both readers.
        level0 = slide.read_region(0, 1024, 1024, 1024, 1024).reshape(256, 4, 256, 4, 3).mean(axis=(1, 3))
        level1 = slide.read_region(1, 1024, 1024, 256, 256)
        assert (slide.read_region(0, SIDE - 16, 0, 32, 8)[:, 16:] == 255).all()  # past the edge: white
    with TiffSlide(positive) as fallback:
        assert fallback.mpp == 0.5
        np.testing.assert_allclose(fallback.read_region(1, 1024, 1024, 256, 256), level1, atol=3)
    assert np.abs(level0 - level1).mean() < 4


def test_the_tissue_of_a_synthetic_slide_is_found_where_it_was_drawn(positive):
    with open_slide(positive) as slide:
        mask = tissue_mask(slide)
    scene = Scene(SIDE, SIDE, True, SEED, 0.5)
    centres = (np.arange(mask.mask.shape[0]) + 0.5) * mask.downsample
    drawn = scene.tissue_field(centres, centres) > scene.threshold
    assert 0.3 < mask.fraction < 0.5 and (mask.mask == drawn).mean() > 0.97


def test_positive_slides_have_dense_nuclei_in_some_tiles_and_negative_ones_none(positive, negative):
    def dark_nuclei_share(path: Path) -> np.ndarray:
        with open_slide(path) as slide:
            grid = tile_grid(slide, 1.0, tile_px=128)
            tiles_rgb = np.stack([read_tile(slide, grid, index) for index in range(len(grid))]).astype(int)
        return ((tiles_rgb[..., 2] > tiles_rgb[..., 0]) & (tiles_rgb.sum(axis=-1) < 300)).mean(axis=(1, 2))

    tumour_tiles = (dark_nuclei_share(positive) > 0.1).mean()
    assert 0.02 < tumour_tiles < 0.3 and dark_nuclei_share(negative).max() < 0.05


def test_the_read_level_and_size_follow_the_magnification(positive):
    with open_slide(positive) as slide:
        cases = {mpp: tile_grid(slide, mpp, tile_px=128, min_tissue=0.25) for mpp in (0.5, 1.0, 2.0, 8.0)}
        assert read_tile(slide, cases[1.0], 0).shape == (128, 128, 3)
    assert [(grid.level, grid.read_px, grid.tile_l0) for grid in cases.values()] == [
        (0, 128, 128), (0, 256, 256), (1, 128, 512), (2, 128, 2048)]


def test_the_tile_grid_is_cached_by_digest_and_settings_and_reused(positive, folder, monkeypatch):
    cache = folder / "cache"
    with open_slide(positive) as slide:
        first = tile_grid(slide, 0.5, cache_dir=cache)
        (saved,) = (cache / hashlib.sha256(positive.read_bytes()).hexdigest()).glob("*.npz")
        written = saved.stat().st_mtime_ns
        monkeypatch.setattr(tissue, "tissue_mask", lambda *args: pytest.fail("the mask was computed again"))
        second = tile_grid(slide, 0.5, cache_dir=cache)
        with pytest.raises(pytest.fail.Exception):
            tile_grid(slide, 0.5, min_tissue=0.8, cache_dir=cache)  # other settings: not this cache
    np.testing.assert_array_equal(first.coords, second.coords)
    assert (first.level, first.read_px, first.tile_l0) == (second.level, second.read_px, second.tile_l0)
    assert saved.stat().st_mtime_ns == written and len(first) > 50
    with np.load(saved, allow_pickle=False) as stored:
        assert stored["coords"].dtype == np.int64


def test_a_region_read_decodes_only_the_tiles_it_covers(folder):
    """A 8192 x 8192 level is 192 MiB; a region and a thumbnail must stay far below that."""
    side, tile = 8192, 256
    gigantic = folder / "gigantic.tif"
    encoded = zlib.compress(np.full((tile, tile, 3), 200, np.uint8).tobytes())
    tifffile.imwrite(gigantic, (encoded for _ in range((side // tile) ** 2)), shape=(side, side, 3),
                     dtype=np.uint8, tile=(tile, tile), photometric="rgb", compression="zlib")
    with TiffSlide(gigantic) as slide:
        tracemalloc.start()
        region = slide.read_region(0, 5000, 3000, 300, 200)
        region_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        thumbnail = slide.thumbnail(512)
        thumbnail_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert region.shape == (200, 300, 3) and (region == 200).all() and thumbnail.shape == (512, 512, 3)
    assert region_peak < 4 * 2**20 and thumbnail_peak < 48 * 2**20


@needs_shared
def test_openslide_is_asked_for_blocks_never_a_whole_level():
    with open_slide(PATHOLOGY / "cmu-1-small-region.svs") as slide:
        asked, read = [], slide.handle.read_region
        slide.handle.read_region = lambda location, level, size: asked.append(size) or read(location, level, size)
        slide.thumbnail(256)
        slide.read_region(0, 10, 20, 30, 40)
    assert max(max(size) for size in asked) < min(slide.level_dimensions[0]) and asked[-1] == (30, 40)


def test_each_process_opens_its_own_handles(plain_tiff, monkeypatch):
    handles = SlideHandles()
    parent = handles.get(plain_tiff)
    assert handles.get(plain_tiff) is parent
    monkeypatch.setattr(reader.os, "getpid", lambda: -1)  # as in a forked DataLoader worker
    worker = handles.get(plain_tiff)
    assert worker is not parent and handles.get(plain_tiff) is worker
    handles.close()
    parent.close()


def test_auto_reads_with_cucim_only_on_a_gpu_run_with_cucim_and_its_formats(monkeypatch):
    monkeypatch.setattr(reader, "cucim_installed", lambda: True)
    assert reader.pixel_reader("auto", "cuda", "a.svs") == reader.pixel_reader("auto", "cuda", "b.tif") == "cucim"
    assert reader.pixel_reader("auto", "cuda", "c.ndpi") == "openslide"  # not a format cuCIM reads
    assert reader.pixel_reader("auto", "cpu", "a.svs") == "openslide"
    assert reader.pixel_reader("openslide", "cuda", "a.svs") == "openslide"
    monkeypatch.setattr(reader, "cucim_installed", lambda: False)
    assert reader.pixel_reader("auto", "cuda", "a.svs") == "openslide"


def test_cucim_asked_for_where_it_is_not_installed_or_cannot_read_is_one_line(plain_tiff, tmp_path):
    ndpi = tmp_path / "scan.ndpi"
    shutil.copy(plain_tiff, ndpi)
    with pytest.raises(UserError, match=r"scan\.ndpi: cuCIM reads .svs, .tif, .tiff slides only"):
        open_slide(ndpi, reader="cucim")
    if reader.cucim_installed():
        pytest.skip("cuCIM is installed here: its reads are compared with OpenSlide's below")
    with pytest.raises(UserError, match=r"needs cuCIM: pip install 'gpu-usecases\[cuda13\]'"):
        open_slide(plain_tiff, reader="cucim")


@needs_shared
@pytest.mark.skipif(not reader.cucim_installed(), reason="cuCIM is not installed (the cuda13 or cuda12 extra)")
@pytest.mark.parametrize("name", ["cmu-1-small-region.svs", "tcga-cr-7395-01a-01-ts1.svs", "kidney-48-5.tif"])
def test_cucim_reads_the_pixels_openslide_reads(name):
    """The JPEG Aperio region, the JPEG 2000 TCGA slide and the kidney TIFF (cuCIM's slow path, RGBA): the same
    levels, resolution and pixels, a region past the edge white as OpenSlide's."""
    with open_slide(PATHOLOGY / name) as ours, open_slide(PATHOLOGY / name, reader="cucim") as theirs:
        assert isinstance(theirs, reader.CuCIMSlide)
        assert theirs.level_dimensions == ours.level_dimensions and theirs.mpp == ours.mpp
        width, height = ours.level_dimensions[0]
        top = len(ours.level_dimensions) - 1
        for level, x, y, w, h in [(0, 500, 400, 96, 64), (top, 0, 0, 128, 100), (0, width - 30, height - 20, 64, 64),
                                  (0, -16, 8, 48, 48)]:
            np.testing.assert_array_equal(theirs.read_region(level, x, y, w, h), ours.read_region(level, x, y, w, h))


def test_a_slide_set_has_labels_and_patients_with_two_slides(folder):
    labels = write_slide_set(folder / "set", n_slides=6, size=(1024, 1024), seed=1)
    rows = list(csv.DictReader(labels.open()))
    assert [row["slide"] for row in rows] == [f"slide-{index:03d}.tif" for index in range(6)]
    assert all((labels.parent / row["slide"]).is_file() for row in rows)
    by_patient: dict[str, set[str]] = {}
    for row in rows:
        by_patient.setdefault(row["patient"], set()).add(row["label"])
    assert {row["label"] for row in rows} == {"0", "1"} and all(len(found) == 1 for found in by_patient.values())
    assert len(by_patient) < 6
    shutil.rmtree(labels.parent)


def hsv_field(hue: float, saturation: float, value: float, size: int = 256, seed: int = 0) -> np.ndarray:
    """A textured blob of one colour (tissue, or a marker stroke) on grey-white glass."""
    import colorsys

    rng = np.random.default_rng(seed)
    image = np.clip(235 + rng.normal(0, 3, (size, size, 3)), 0, 255)
    colour = 255 * np.array(colorsys.hsv_to_rgb(hue / 360, saturation, value))
    rows, columns = np.ogrid[:size, :size]
    blob = (rows - size / 2) ** 2 + (columns - size / 2) ** 2 < (size / 3) ** 2
    image[blob] = np.clip(colour + rng.normal(0, 4, (blob.sum(), 3)), 0, 255)
    return image.astype(np.uint8), blob


@pytest.mark.parametrize("hue", [330, 341, 350, 358, 5])
@pytest.mark.parametrize("saturation", [0.2, 0.3, 0.45])
def test_tissue_whose_eosin_leans_red_stays_tissue(hue, saturation):
    rgb, blob = hsv_field(hue, saturation, 0.88)
    found = detect_tissue(rgb)
    assert found[blob].mean() > 0.9 and found[~blob].mean() < 0.05


@pytest.mark.parametrize("hue", [345, 355, 5, 15])
@pytest.mark.parametrize("saturation", [0.6, 0.8])
def test_a_red_marker_stroke_is_ink_not_tissue(hue, saturation):
    rgb, blob = hsv_field(hue, saturation, 0.8)
    assert detect_tissue(rgb)[blob].mean() < 0.05


@needs_shared
def test_the_shared_pen_marks_stay_ink_and_cmu1_keeps_its_pink_tissue():
    from usecases.medical.slides.tissue import pen_ink, rgb_to_hsv

    for name, least in (("no-tissue-red-pen", 0.5), ("no-tissue-green-pen", 0.6)):
        hue, saturation, value = rgb_to_hsv(np.asarray(Image.open(PATHOLOGY / "tiles" / f"{name}.png").convert("RGB")))
        assert pen_ink(hue, saturation, value).mean() > least, name
    with open_slide(PATHOLOGY / "cmu-1-small-region.svs") as slide:
        for rgb in (slide.thumbnail(512), slide.read_region(0, 0, 0, *slide.level_dimensions[0])):
            hue, saturation, value = rgb_to_hsv(rgb)
            red_leaning = ((hue >= 330) | (hue < 20)) & (saturation > 0.15) & detect_tissue(rgb)
            assert red_leaning.mean() > 0.002, "CMU-1 has red-leaning eosin and red blood cells"
            assert not pen_ink(hue, saturation, value).any(), "and no marker ink, at any resolution"


@pytest.mark.parametrize("pixels_per_cm", [0, 1, 28.35, 4e9])
def test_a_slide_stating_an_implausible_resolution_is_refused_a_magnification_in_one_line(folder, pixels_per_cm):
    """72 dpi writers, 1 px/cm, 0 (which must not divide) and absurdly fine resolutions: none is a scanner's. Tiles in
    level-0 pixels still work, and the refusal says so."""
    path = folder / f"implausible-{pixels_per_cm}.tif"
    pixels = np.full((512, 512, 3), 240, np.uint8)
    pixels[100:400, 100:400] = (200, 120, 170)
    tifffile.imwrite(path, pixels, tile=(256, 256), photometric="rgb", resolution=(pixels_per_cm, pixels_per_cm),
                     resolutionunit="CENTIMETER")
    with open_slide(path) as slide:
        assert slide.mpp is None
        with pytest.raises(UserError, match=r"not a scanner's resolution .*--set data\.slides\.mpp=null") as caught:
            tile_grid(slide, 0.5, tile_px=64)
        assert one_line_naming(caught, path)
        assert len(tile_grid(slide, None, tile_px=64, min_tissue=0.5)) > 0


@pytest.mark.parametrize("values", [["abc"], ["nan"], ["0"], ["-0.25"], ["inf"], ["0.0001"], ["900"], ["0.5", "x"]])
def test_any_stated_mpp_that_is_not_a_plausible_number_is_not_taken_and_says_why(values):
    from usecases.medical.slides.reader import stated_mpp

    mpp, problem = stated_mpp(values, "µm/px (openslide.mpp-x)")
    assert mpp is None and "not a scanner's resolution" in problem and values[0] in problem
    assert stated_mpp(["0.25", "0.2527"], "µm/px")[0] == pytest.approx(0.25135)


@pytest.mark.parametrize("mpp", [0.0, -1.0, float("nan"), 1e-4, 1e4])
def test_an_implausible_mpp_given_in_code_is_refused_at_open(plain_tiff, mpp):
    with pytest.raises(UserError, match="not a scanner's resolution") as caught:
        open_slide(plain_tiff, mpp=mpp)
    assert one_line_naming(caught, plain_tiff)


def test_tiles_that_magnify_the_scan_more_than_four_times_are_refused(positive):
    with open_slide(positive) as slide:  # a 0.5 µm/px scan
        assert tile_grid(slide, 0.125, tile_px=64, min_tissue=0.25).tile_l0 == 16
        with pytest.raises(UserError, match=r"magnify its 0\.5 µm/px scan 10 times; set --set data\.slides\.mpp= "
                                            r"to 0\.125 or more") as caught:
            tile_grid(slide, 0.05, tile_px=64)
    assert one_line_naming(caught, positive)
