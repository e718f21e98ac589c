"""Medical image classification: MedMNIST, your image folders or DICOM, with a clinician's view of the results."""

from pathlib import Path

from usecases.medical.config import Config

DESCRIPTION = "medical image classification (MedMNIST, image folders, DICOM): ResNet-18 vs logistic regression"
PRESETS_DIR = Path(__file__).parent / "presets"
PRIMARY_METRIC = ("auc", "max")  # of the served model; the registry picks its champion by it


def summary_columns(config: Config) -> list[str]:
    """The metrics printed at the end of a run; summary.json holds them all."""
    return ["auc", "acc", "auc_ci_low", "auc_ci_high", "ece", "brier", "sensitivity_at_threshold",
            "specificity_at_threshold"]


__all__ = ["Config", "DESCRIPTION", "PRESETS_DIR", "PRIMARY_METRIC", "summary_columns"]
