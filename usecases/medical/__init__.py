"""Medical image classification: MedMNIST, your image folders or DICOM, with a clinician's view of the results."""

from common.usecase import UseCase

from .config import Config


def summary_columns(config: Config) -> list[str]:
    """The metrics printed at the end of a run; summary.json holds them all."""
    if config.data.source == "slides":
        return ["auc", "auc_ci_low", "auc_ci_high", "sensitivity_at_threshold", "specificity_at_threshold",
                "tiles_per_s"]
    return ["auc", "acc", "auc_ci_low", "auc_ci_high", "ece", "brier", "sensitivity_at_threshold",
            "specificity_at_threshold"]


USECASE = UseCase.declare(
    __name__,
    description="medical image classification (MedMNIST, image folders, DICOM): ResNet-18 vs logistic regression",
    config=Config,
    primary_metric=("auc", "max"),  # of the served model; the registry picks its champion by it
    summary_columns=summary_columns,
    requirements=("torchvision>=0.19", "pillow>=10", "pydicom>=3.0", "medmnist>=3.0", "captum>=0.7"),
    # whole-slide pathology (data.source: slides): the slide readers, asked for only by a slides run
    optional_requirements={"slides": ("openslide-python>=1.3", "openslide-bin>=4.0", "tifffile>=2024.1",
                                      "imagecodecs>=2024.1", "zarr>=2.16")},
    has_benchmark=True,
    evidence=("test_images", "images"),  # what the served model's test AUC rests on, beside its bootstrap interval
    # the images as PNG files: 5,000, 20,000 and 80,000 for bench scale, 80 % of them for training
    scale={"data.synthetic.train": 4_000, "data.synthetic.val": 500, "data.synthetic.test": 500},
    served_kinds=("", "slides"),  # the image classifier, then the whole-slide model (gpu-usecases-medical-slides)
)
