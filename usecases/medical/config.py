"""The medical imaging config schema; presets in presets/*.yaml set a subset of these keys."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator
from pydantic_core import PydanticCustomError

from common.config import ConfigModel, RuntimeConfig, TrackingConfig, TrainConfig


class MedMNIST(ConfigModel):
    """An official MedMNIST v2 file: downloaded (MD5 checked) into the cache, or given with --data."""

    flag: str = Field("breastmnist", description="the data set's name, e.g. breastmnist, pneumoniamnist, dermamnist")
    size: Literal[28, 64, 128, 224] = 28
    cache_dir: Path | None = Field(
        None, description="looked in first, and downloads go here; default: $MEDMNIST_CACHE, else "
                          "$XDG_CACHE_HOME/gpu-usecases/medmnist or ~/.cache/gpu-usecases/medmnist. Then "
                          "medmnist/<file>.npz in each folder of $USECASES_DATA_PATH, then a download (MD5 checked)")
    download: bool = True


class Files(ConfigModel):
    """Your own images: a CSV manifest (path, label, patient id, optional split) or a folder of class folders."""

    path_column: str = "path"
    label_column: str = "label"
    patient_column: str | None = Field("patient_id",
                                       description="split by this column; null: every image its own patient")
    split_column: str | None = Field("split", description="use the manifest's own train/val/test split when present")
    image_size: int = Field(28, ge=8, description="images are resized to this square size")
    channels: Literal[1, 3] = 1
    val_fraction: float = Field(0.1, gt=0, lt=0.5)
    test_fraction: float = Field(0.2, gt=0, lt=0.5)
    window_center: float | None = Field(None, description="DICOM window; null takes the file's own, else min-max")
    window_width: float | None = Field(None, gt=0)


class Synthetic(ConfigModel):
    """Class-dependent shapes under noise: learnable, so a test can assert that the model learned."""

    classes: int = Field(2, ge=2)
    size: int = Field(28, ge=16)
    train: int = Field(512, ge=8)
    val: int = Field(128, ge=4)
    test: int = Field(256, ge=4)
    noise: float = Field(0.25, ge=0)
    as_files: bool = Field(False, description="write the set as PNG files with a manifest first, and read it back as "
                                              "your own files are read (the scale preset)")
    seed: int = 0


class Slides(ConfigModel):
    """Whole-slide images: `--data FOLDER` with the slides and a labels file (slide, label, optional patient)."""

    labels_file: str = "labels.csv"
    unlabelled: Literal["refuse", "skip"] = Field(
        "refuse", description="slides in the folder that the labels file does not list: refuse the run naming them, "
                              "or skip them (the run says how many)")
    mpp: float | None = Field(1.0, ge=0.05, le=50, description="microns per pixel of the tiles (0.25: about 40x, "
                              "0.5: 20x, 1.0: 10x); null: level-0 pixels, for slides without one")
    tile_px: int = Field(224, ge=16)
    min_tissue: float = Field(0.5, gt=0, le=1, description="the tissue fraction of a tile to keep it")
    max_tiles: int | None = Field(2000, ge=1, description="per slide: a seeded sample where a slide has more")
    stain: Literal["macenko", "reinhard", "none"] = Field(
        "macenko", description="normalised to a reference, fitted once per slide on a sample of its tiles")
    stain_fit_tiles: int = Field(16, ge=1, description="tiles per slide the stain fit pools")
    cache_dir: Path | None = Field(None, description="tile coordinates by the slide's digest; default: "
                                                     "~/.cache/gpu-usecases/slides (or $XDG_CACHE_HOME)")
    readers: int = Field(2, ge=0, description="DataLoader workers reading tiles, each with its own slide handles")
    reader: Literal["auto", "openslide", "cucim"] = Field(
        "auto", description="what decodes the tiles: auto takes cuCIM on a GPU run where it is installed (the "
                            "cuda13 extra) for .svs and .tif slides, else OpenSlide (tifffile for plain TIFFs)")
    batch_size: int = Field(64, ge=1, description="tiles per batch through normalisation and the encoder")
    val_fraction: float = Field(0.2, gt=0, lt=0.5)
    test_fraction: float = Field(0.3, gt=0, lt=0.5)


class SlideEncoder(ConfigModel):
    """Tile features: `model.name` trained on tiles that carry their slide's label, its pooled layer read by MIL."""

    tiles_per_slide: int = Field(48, ge=1, description="tiles sampled per training and validation slide")
    epochs: int = Field(4, ge=1)
    batch_size: int = Field(64, ge=1)
    lr: float = Field(1e-3, gt=0)


class MIL(ConfigModel):
    """Gated attention MIL per slide (Ilse et al. 2018), the best epoch on validation AUC."""

    hidden: int = Field(128, ge=1)
    dropout: float = Field(0.25, ge=0, lt=1)
    lr: float = Field(2e-4, gt=0)
    weight_decay: float = Field(1e-5, ge=0)
    epochs: int = Field(40, ge=1)
    max_tiles: int = Field(4096, ge=1, description="tiles per slide per training step (all in evaluation)")


class SyntheticSlides(ConfigModel):
    """Pyramidal TIFF slides of tissue on glass, positive ones with tumour-like clusters of nuclei."""

    slides: int = Field(24, ge=8)
    size: int = Field(4096, ge=512, description="level-0 width and height in pixels")
    mpp: float = Field(0.5, gt=0)
    seed: int = 0


class Data(ConfigModel):
    source: Literal["medmnist", "files", "synthetic", "slides"] = "medmnist"
    medmnist: MedMNIST = MedMNIST()
    files: Files = Files()
    synthetic: Synthetic = Synthetic()
    slides: Slides = Slides()
    synthetic_slides: SyntheticSlides = SyntheticSlides()
    in_memory: bool | Literal["auto"] = Field(
        "auto", description="hold the data as one tensor on the device and augment in batches; auto: when it fits")


class Augment(ConfigModel):
    """Applied on the device to whole batches; all off in the MedMNIST recipe."""

    horizontal_flip: bool = False
    vertical_flip: bool = False
    shift_pixels: int = Field(0, ge=0, description="random translation by up to this many pixels (reflect padding)")


class Model(ConfigModel):
    name: str = Field("resnet18", description="a torchvision classification model by name")
    cifar_stem: bool | Literal["auto"] = Field(
        "auto", description="3x3 stride-1 first convolution and no max-pool; auto: for images under 64 px")
    channels_last: bool = True

    @field_validator("name")
    @classmethod
    def _a_torchvision_classifier(cls, name: str) -> str:
        """Checked with the config, so that a typo stops before the data is read and before any run starts."""
        from .models import model_names, unknown_model_hint

        if name not in model_names():
            raise PydanticCustomError("unknown_model", unknown_model_hint(name))
        return name


class Train(TrainConfig):
    """The common loop's keys and the recipe's schedule and imbalance handling."""

    weight_decay: float = Field(0.0, ge=0)
    milestones: list[Annotated[float, Field(gt=0, lt=1)]] = Field(
        [0.5, 0.75], description="lr x gamma at these fractions of the epochs")
    gamma: float = Field(0.1, gt=0, le=1)
    imbalance: Literal["none", "class_weights", "sampler"] = "none"
    workers: int = Field(2, ge=0, description="DataLoader workers when the data is not held in memory")


class Evaluation(ConfigModel):
    positive_class: Annotated[int, Field(ge=0)] | str | None = Field(
        None, description="the class the operating point and the clinical rates are for: an index into the sorted "
                          "class names, or a class name; null: the class with a conventional positive name "
                          "(malignant, pneumonia, abnormal, tumor, positive, disease, 1), else class 1, except that "
                          "your own binary data with no such name is refused")
    target_sensitivity: float = Field(0.95, gt=0, le=1)
    calibration_bins: int = Field(15, ge=2)
    bootstrap: int = Field(1000, ge=0, description="resamples for the AUC confidence interval; 0 skips it")
    tta: bool = Field(False, description="average the logits of each image and its mirror image, in validation, "
                                         "test and the served model alike")
    gradcam_examples: int = Field(4, ge=0, description="per row: true positives, false positives, false negatives")

    @field_validator("positive_class", mode="before")
    @classmethod
    def _an_index_as_a_number(cls, value):
        """`--set evaluation.positive_class=0` arrives as text: digits are an index, as in the presets."""
        return int(value) if isinstance(value, str) and value.strip().isdigit() else value


class Baselines(ConfigModel):
    models: list[Literal["logreg"]] = ["logreg"]
    logreg_size: int = Field(28, ge=4, description="images are resized to this before logistic regression")
    logreg_c: float = Field(0.01, gt=0)


class Benchmark(ConfigModel):
    """`bench medical`: training epochs; with `--slides`, reader counts, plain-loop tiles, the gigapixel slide."""

    epochs: int = Field(3, ge=2, description="per side; the first is a warm-up and not counted")
    slide_workers: list[Annotated[int, Field(ge=0)]] = Field(
        [0, 1, 2], min_length=1, description="--slides: tiles/s at these reader counts and at data.slides.readers")
    plain_tiles: int = Field(300, ge=1, description="--slides: tiles the plain per-tile loop is timed on")
    gigapixel: bool = Field(True, description="--slides: write a slide of gigapixel_size, then tile and encode it in a "
                                              "process of its own, its tree's peak memory measured")
    gigapixel_size: list[Annotated[int, Field(ge=512)]] = Field(
        [50_000, 40_000], min_length=2, max_length=2, description="--slides: its level-0 width and height (2 "
                                                                  "gigapixels: about 3 minutes to write on one core)")


class Config(ConfigModel):
    data: Data = Data()
    augment: Augment = Augment()
    model: Model = Model()
    encoder: SlideEncoder = SlideEncoder()
    mil: MIL = MIL()
    train: Train = Train()
    evaluation: Evaluation = Evaluation()
    baselines: Baselines = Baselines()
    benchmark: Benchmark = Benchmark()
    runtime: RuntimeConfig = RuntimeConfig()
    tracking: TrackingConfig = TrackingConfig()
