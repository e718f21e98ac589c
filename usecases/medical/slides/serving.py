"""The slide-level model as an MLflow pyfunc: what the run evaluated, one slide at a time (its tiles, stain fit,
features and attention MIL), each slide's draws seeded by the run's seed and its digest, so a test slide served gets the
probability its evaluation logged. Input: a column `slide` of paths the server can read (slide files or folders of
them). Output per slide: `slide`, `probability`, `positive` (at the validation threshold) and `top_tiles` (JSON: the
most attended tiles' x, y, side)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from common.errors import UserError
from common.paths import cache_dir
from common.serving.pyfunc import BadInput, Publication, ServedModel, log_served
from common.usecase import Served
from ..models import build_classifier
from .features import SlideTiles, encode_slides, read_tiles
from .mil import GatedAttentionMIL, predict_bags
from .reader import SLIDE_SUFFIXES, open_slide
from .stain import NORMALISERS
from .tiles import TileGrid, slide_digest, tile_grid

TOP_TILES = 5


def slide_generator(seed: int, path: Path) -> np.random.Generator:
    """One slide's random draws, from the run's seed and the file's digest: independent of the other slides."""
    return np.random.default_rng([seed, int(slide_digest(path)[:16], 16)])


def chosen_tiles(path: Path, grid: TileGrid, max_tiles: int | None, rng: np.random.Generator,
                 reader: str = "openslide") -> SlideTiles:
    """The slide's tissue tiles, a seeded sample of `max_tiles` of them where it has more."""
    every = SlideTiles(path, grid, np.arange(len(grid)), reader)
    return every if max_tiles is None else sampled(every, max_tiles, rng)


def sampled(slide: SlideTiles, count: int, rng: np.random.Generator) -> SlideTiles:
    chosen = slide.indices if len(slide.indices) <= count else np.sort(rng.choice(slide.indices, count, False))
    return SlideTiles(slide.path, slide.grid, chosen, slide.reader)


def slide_normaliser(slide: SlideTiles, method: str, count: int, rng: np.random.Generator,
                     reference: dict[str, torch.Tensor] | None = None):
    """The slide's stain normaliser fitted on `count` of its tiles, onto the run's `reference` where given."""
    if method == "none":
        return None
    normaliser = NORMALISERS[method]() if reference is None else NORMALISERS[method].from_state_dict(reference)
    try:
        return normaliser.fit(read_tiles(sampled(slide, count, rng)))
    except ValueError as error:
        raise UserError(f"{slide.path}: the {method} stain fit failed: {error} (set data.slides.stain=none to skip "
                        f"normalisation)") from None


class SlideClassifierModel(ServedModel):
    def load(self, bundle: dict) -> None:
        self.encoder = build_classifier(bundle["encoder_architecture"]).eval()
        self.encoder.load_state_dict(bundle["encoder_state"])
        self.mil = GatedAttentionMIL(**bundle["mil_dimensions"]).eval()
        self.mil.load_state_dict(bundle["mil_state"])
        self.settings = bundle["slides"]
        self.reference = bundle.get("stain_reference")
        self.threshold = bundle["threshold"]

    def answer(self, model_input, params: dict | None = None) -> pd.DataFrame:
        rows = [self.score(path) for path in requested_slides(model_input)]
        return pd.DataFrame(rows, columns=["slide", "probability", "positive", "top_tiles"])

    def score(self, path: Path) -> dict:
        """One slide's row of the answer; a slide that cannot be read, tiled or fitted is refused in one line."""
        settings = self.settings
        try:
            with open_slide(path) as slide:
                grid = tile_grid(slide, settings["mpp"], settings["tile_px"], settings["min_tissue"],
                                 cache_dir("slides", settings.get("cache_dir")) / "tiles")
            rng = slide_generator(settings["seed"], path)
            tiles = chosen_tiles(path, grid, settings["max_tiles"], rng)
            normaliser = slide_normaliser(tiles, settings["stain"], settings["stain_fit_tiles"], rng, self.reference)
        except UserError as refused:
            raise BadInput(str(refused)) from None
        (features,), _ = encode_slides(self.encoder, [tiles], [normaliser], torch.device("cpu"),
                                       settings["batch_size"], readers=0)
        (probability,), (attention,) = predict_bags(self.mil, [features], "cpu")
        return {"slide": str(path), "probability": float(probability), "positive": bool(probability >= self.threshold),
                "top_tiles": json.dumps(top_tiles(tiles, attention))}


def top_tiles(tiles: SlideTiles, attention: np.ndarray, count: int = TOP_TILES) -> list[dict]:
    """The tiles with the most attention, most first: level-0 top-left corner, side in level-0 pixels, attention."""
    coords = tiles.grid.coords[tiles.indices]
    best = np.argsort(-attention, kind="stable")[:count]
    return [{"x": int(coords[index][0]), "y": int(coords[index][1]), "size": int(tiles.grid.tile_l0),
             "attention": float(attention[index])} for index in best]


def requested_slides(model_input) -> list[Path]:
    """The slide files a request names: each value of its `slide` column, a file or a folder of slide files."""
    if not isinstance(model_input, pd.DataFrame) or "slide" not in model_input.columns:
        raise BadInput("expected a column 'slide' of slide paths (a file, or a folder of slide files)")
    paths = []
    for row, value in enumerate(model_input["slide"].tolist()):
        if not isinstance(value, str) or not value:
            raise BadInput(f"slide, row {row}: expected a path as a string, got {value!r}")
        path = Path(value)
        if path.is_dir():
            found = sorted(item for item in path.iterdir() if item.suffix.lower() in SLIDE_SUFFIXES)
            if not found:
                raise BadInput(f"slide, row {row}: {path} holds no slide file ({', '.join(SLIDE_SUFFIXES)})")
            paths += found
        elif path.is_file():
            paths.append(path)
        else:
            raise BadInput(f"slide, row {row}: {path}: no such file or folder on the server")
    return paths


SLIDE_REQUIREMENTS = ("torch", "torchvision", "numpy", "pandas", "scipy", "mlflow", "openslide-python",
                      "openslide-bin", "tifffile", "zarr", "imagecodecs")


@dataclass(frozen=True)
class SlideModel:
    """The served slide model: tile encoder, attention MIL, tiling and stain settings, validation threshold."""

    encoder: torch.nn.Module
    encoder_architecture: dict
    mil: GatedAttentionMIL
    slides: dict
    reference: dict | None
    threshold: float


def log_slide_classifier(model: SlideModel, example: Path, metadata: dict, job) -> Served | None:
    """Log the slide model as `model`, probed on `example`, a slide the run read."""
    if not job.tracker.active:
        return None
    first = model.mil.embed[0]
    bundle = {"encoder_architecture": model.encoder_architecture,
              "encoder_state": {key: value.cpu() for key, value in model.encoder.state_dict().items()},
              "mil_dimensions": {"d_in": first.in_features, "hidden": first.out_features,
                                 "attention_hidden": model.mil.attention_content[0].out_features,
                                 "dropout": model.mil.embed[2].p},
              "mil_state": {key: value.cpu() for key, value in model.mil.state_dict().items()},
              "slides": model.slides, "threshold": float(model.threshold),
              **({"stain_reference": model.reference} if model.reference is not None else {})}
    return log_served(SlideClassifierModel.from_bundle(bundle), bundle, pd.DataFrame({"slide": [str(example)]}),
                      job.tracker, Publication("attention_mil", "usecases.medical", SLIDE_REQUIREMENTS,
                                               entry="slides_entry.py", kind="slides", metadata=metadata))
