"""Which class the operating threshold and the sensitivity are for: on your own data, the class a clinician calls
positive by its name, whatever its index; a binary set with no such name is refused rather than guessed."""

import numpy as np
import pytest
from PIL import Image

from common.config import load_config
from common.errors import UserError
from tests.cli_helpers import assert_rejected
from usecases.medical import USECASE
from usecases.medical.config import Config
from usecases.medical.evaluate import positive_class_index
from usecases.medical.pipeline import load_data

IMAGES_PER_CLASS = 12  # enough for the split by image (5 folds for test, then 8 by class for val)


def class_folders(root, names=("benign", "malignant")):
    """`root/<name>/*.png`, one brightness per class."""
    for value, name in zip((60, 200), names):
        (root / name).mkdir(parents=True)
        for number in range(IMAGES_PER_CLASS):
            Image.new("L", (10, 10), value).save(root / name / f"{number}.png")
    return root


def default_config(*overrides: str) -> Config:
    return load_config(Config, USECASE.presets_dir, "default", list(overrides))


@pytest.mark.parametrize(("classes", "positive"), [
    (["benign", "malignant"], 1),
    (["malignant", "normal, benign"], 0),  # BreastMNIST: label 0 is malignant
    (["NORMAL", "PNEUMONIA"], 1),
    (["Tumour", "healthy"], 0),
    (["0", "1"], 1),
    (["abnormal", "normal"], 0),
])
def test_the_conventional_positive_name_is_found_in_any_case(classes, positive):
    assert positive_class_index(None, classes, "binary", own_data=True) == positive


def test_a_class_given_by_name_or_index_is_taken_as_given():
    classes = ["benign", "malignant"]
    assert positive_class_index("benign", classes, "binary", own_data=True) == 0
    assert positive_class_index("Benign", classes, "binary", own_data=True) == 0
    assert positive_class_index(0, classes, "binary", own_data=True) == 0
    with pytest.raises(UserError, match=r"'cyst' is not a class name nor index \(classes: 0 'benign', 1 'malignant'\)"):
        positive_class_index("cyst", classes, "binary")


def test_unnamed_classes_fall_back_to_class_1_except_on_your_own_binary_data():
    assert positive_class_index(None, ["disc", "square"], "binary") == 1  # the synthetic set
    assert positive_class_index(None, ["a", "b", "c"], "multi-class", own_data=True) == 1
    with pytest.raises(UserError, match="--set evaluation.positive_class=NAME"):
        positive_class_index(None, ["cats", "dogs"], "binary", own_data=True)


def test_a_folder_of_benign_and_malignant_reports_for_malignant(tmp_path):
    """The `default` preset was made for BreastMNIST, whose label 0 is malignant; on a folder its index 0 is
    benign, and the threshold and the sensitivity must still be malignant's."""
    config = default_config()
    data, tags = load_data(config, class_folders(tmp_path / "scans"))
    assert data.classes == ["benign", "malignant"]
    assert config.evaluation.positive_class == 1 and tags["positive_class"] == "malignant"


def test_a_positive_class_set_by_name_wins_over_the_conventional_one(tmp_path):
    config = default_config("evaluation.positive_class=benign")
    _, tags = load_data(config, class_folders(tmp_path / "scans"))
    assert config.evaluation.positive_class == 0 and tags["positive_class"] == "benign"


def test_breastmnist_keeps_malignant_as_its_positive_class(tmp_path):
    rng = np.random.default_rng(0)
    arrays = {}
    for split in ("train", "val", "test"):
        arrays[f"{split}_images"] = rng.integers(0, 256, (12, 28, 28), dtype=np.uint8)
        arrays[f"{split}_labels"] = (np.arange(12) % 2).astype(np.uint8)
    np.savez(tmp_path / "breastmnist.npz", **arrays)
    config = default_config()
    data, tags = load_data(config, tmp_path / "breastmnist.npz")
    assert data.classes[0] == "malignant"
    assert config.evaluation.positive_class == 0 and tags["positive_class"] == "malignant"


def test_a_binary_folder_without_a_positive_name_is_refused_in_one_line(capsys, tmp_path):
    root = class_folders(tmp_path / "pets", names=("cats", "dogs"))
    assert_rejected(capsys, "medical", "run", "medical", "--preset", "smoke", "--data", str(root),
                    names=("evaluation.positive_class", "0 'cats', 1 'dogs'", "--set evaluation.positive_class=NAME"))
