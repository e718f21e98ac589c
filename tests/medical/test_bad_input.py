"""Bad inputs a new user may give `usecases run medical --data PATH [--set ...]`: each stops before an MLflow run
starts, with exit 2 and one `error:` line naming the file, array, image, column or config key, and what was
expected (see `assert_rejected`). Errors already covered in test_data.py, test_files.py and test_cli.py are not
repeated here."""

from __future__ import annotations

import copy
import io
import zipfile

import numpy as np
import pydicom
import pytest
from PIL import Image
from pydicom.data import get_testdata_file

from tests.cli_helpers import assert_rejected

IMAGES_PER_CLASS = 12  # enough for the patient split (5 folds for test, then 8 by class for val) to succeed


@pytest.fixture
def reject(capsys):
    """`assert_rejected` for `run medical --preset smoke [--data DATA] [--set OVERRIDE ...]`."""

    def rejected(data, *overrides: str, names: tuple[str, ...]) -> str:
        args = ["run", "medical", "--preset", "smoke"]
        if data is not None:
            args += ["--data", str(data)]
        for override in overrides:
            args += ["--set", override]
        return assert_rejected(capsys, "medical", *args, names=names)

    return rejected


def good_arrays(labels_per_image: int | None = None) -> dict[str, np.ndarray]:
    """A valid MedMNIST-style set: 28 px grey images, both classes (or every label) in each split."""
    rng = np.random.default_rng(0)
    arrays = {}
    for split in ("train", "val", "test"):
        arrays[f"{split}_images"] = rng.integers(0, 256, (12, 28, 28), dtype=np.uint8)
        if labels_per_image:
            arrays[f"{split}_labels"] = np.tile(np.eye(2, dtype=np.uint8).repeat(labels_per_image // 2, 1), (6, 1))
        else:
            arrays[f"{split}_labels"] = (np.arange(12) % 2).astype(np.uint8)
    return arrays


def write_npz(path, changes: dict, labels_per_image: int | None = None):
    """`good_arrays` with `changes` applied; a change to None removes the key."""
    arrays = {**good_arrays(labels_per_image), **changes}
    np.savez(path, **{key: value for key, value in arrays.items() if value is not None})
    return path


def png_bytes(value: int, size=(10, 10)) -> bytes:
    buffer = io.BytesIO()
    Image.new("L", size, value).save(buffer, "PNG")
    return buffer.getvalue()


def noise_png_bytes() -> bytes:
    """A PNG that barely compresses, so that half of it stops inside its pixel data."""
    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (32, 32), dtype=np.uint8)).save(buffer, "PNG")
    return buffer.getvalue()


def with_label(labels: list, dtype=None) -> np.ndarray:
    """Twelve labels, alternating 0 and 1, ending with `labels`."""
    head = [0, 1] * 6
    return np.array(head[: 12 - len(labels)] + labels, dtype=dtype)


# MedMNIST-style .npz files

NPZ_CASES = [
    pytest.param("scan.npz", {"train_labels": with_label([np.nan], np.float64)},
                 ("scan.npz", "train_labels[11] is nan"), id="nan-label"),
    pytest.param("breastmnist.npz", {"test_labels": with_label([np.nan], np.float64)},
                 ("breastmnist.npz", "test_labels[11] is nan"), id="nan-label-in-a-known-set"),
    pytest.param("scan.npz", {"test_images": np.zeros((0, 28, 28), np.uint8), "test_labels": np.zeros(0, np.uint8)},
                 ("scan.npz", "test_images", "no images"), id="empty-test-split"),
    pytest.param("scan.npz", {"val_images": np.zeros((0, 28, 28), np.uint8), "val_labels": np.zeros(0, np.uint8)},
                 ("scan.npz", "val_images", "no images"), id="empty-val-split"),
    pytest.param("scan.npz", {"train_images": np.zeros((0, 28, 28), np.uint8), "train_labels": np.zeros(0)},
                 ("scan.npz", "train_images", "no images"), id="empty-train-split"),
    pytest.param("scan.npz", {"test_labels": None}, ("scan.npz", "missing key 'test_labels'"), id="missing-key"),
    pytest.param("scan.npz", {"train_labels": np.arange(13) % 2}, ("scan.npz", "train_labels has 13 rows", "12"),
                 id="more-labels-than-images"),
    pytest.param("scan.npz", {"val_labels": np.arange(11) % 2}, ("scan.npz", "val_labels has 11 rows", "12"),
                 id="fewer-labels-than-images"),
    pytest.param("scan.npz", {"train_labels": with_label([2.5])}, ("scan.npz", "train_labels[11] is 2.5",
                                                                  "whole number"), id="fractional-label"),
    pytest.param("scan.npz", {"val_labels": with_label([-1])}, ("scan.npz", "val_labels[11] is -1", "start at 0"),
                 id="negative-label"),
    pytest.param("breastmnist.npz", {"test_labels": with_label([2])},
                 ("breastmnist.npz", "test_labels[11] is 2", "0..1"), id="label-beyond-the-classes"),
    pytest.param("scan.npz", {"train_labels": np.array(["benign", "malignant"] * 6)},
                 ("scan.npz", "train_labels", "integer class indices", "<U9"), id="text-labels"),
    pytest.param("scan.npz", {"train_labels": np.array(1)}, ("scan.npz", "train_labels", "single value"),
                 id="scalar-labels"),
    pytest.param("breastmnist.npz", {"train_labels": np.zeros((12, 3), np.uint8)},
                 ("breastmnist.npz", "train_labels", "(N,) or (N, 1)", "(12, 3)"), id="label-columns-for-one-class"),
    pytest.param("scan.npz", {f"{split}_labels": np.zeros(12, np.uint8) for split in ("train", "val", "test")},
                 ("scan.npz", "at least 2 classes"), id="one-class-only"),
    pytest.param("scan.npz", {"train_images": np.zeros((12, 784), np.uint8)},
                 ("scan.npz", "train_images", "(N, H, W)", "(12, 784)"), id="flattened-images"),
    pytest.param("scan.npz", {"test_images": np.zeros((12, 28, 28, 4), np.uint8)},
                 ("scan.npz", "test_images", "(N, H, W, 3)", "(12, 28, 28, 4)"), id="rgba-images"),
    pytest.param("scan.npz", {"train_images": np.array([[1, 2], [3]] * 6, dtype=object)},
                 ("scan.npz", "train_images", "numeric array"), id="object-images"),
    pytest.param("scan.npz", {"val_images": np.zeros((12, 32, 32), np.uint8)},
                 ("scan.npz", "val_images are 32x32", "train_images are 28x28"), id="one-split-at-another-size"),
    pytest.param("scan.npz", {split: np.zeros((12, 28, 20), np.uint8) for split in
                              ("train_images", "val_images", "test_images")},
                 ("scan.npz", "train_images are 28x20", "square"), id="non-square-images"),
]


@pytest.mark.parametrize(("name", "changes", "names"), NPZ_CASES)
def test_a_bad_npz_array_is_named(reject, tmp_path, name, changes, names):
    reject(write_npz(tmp_path / name, changes), names=names)


MULTI_LABEL_CASES = [
    pytest.param({"val_labels": np.arange(12, dtype=np.uint8) % 2}, ("chestmnist.npz", "val_labels", "(N, 14)"),
                 id="one-column-for-14-labels"),
    pytest.param({"test_labels": np.full((12, 14), 2, np.uint8)}, ("chestmnist.npz", "test_labels[0, 0] is 2",
                                                                   "0 or 1"), id="label-not-0-or-1"),
]


@pytest.mark.parametrize(("changes", "names"), MULTI_LABEL_CASES)
def test_bad_multi_label_arrays_are_named(reject, tmp_path, changes, names):
    reject(write_npz(tmp_path / "chestmnist.npz", changes, labels_per_image=14), names=names)


def test_a_weighted_sampler_for_multi_label_data_is_refused(reject, tmp_path):
    reject(write_npz(tmp_path / "chestmnist.npz", {}, labels_per_image=14), "train.imbalance=sampler",
           names=("train.imbalance", "chestmnist.npz", "multi-label", "class_weights"))


def test_a_truncated_npz_is_refused(reject, tmp_path):
    whole = write_npz(tmp_path / "whole.npz", {}).read_bytes()
    (tmp_path / "scan.npz").write_bytes(whole[: len(whole) // 2])
    reject(tmp_path / "scan.npz", names=("scan.npz", "not a readable .npz file", "zip"))


def test_a_damaged_array_inside_the_npz_is_named(reject, tmp_path):
    path = write_npz(tmp_path / "scan.npz", {})
    raw = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as archive:
        member = archive.getinfo("val_images.npy")
    raw[member.header_offset + member.compress_size // 2] ^= 0xFF  # in the array's bytes: its CRC-32 fails
    path.write_bytes(bytes(raw))
    reject(path, names=("scan.npz", "val_images", "damaged"))


def test_a_single_npy_array_named_npz_is_refused(reject, tmp_path):
    np.save(tmp_path / "scan.npy", np.zeros((12, 28, 28), np.uint8))
    (tmp_path / "scan.npy").rename(tmp_path / "scan.npz")
    reject(tmp_path / "scan.npz", names=("scan.npz", "not a zip archive", "train_images"))


def test_a_zip_of_pngs_named_npz_lists_what_it_holds(reject, tmp_path):
    with zipfile.ZipFile(tmp_path / "scans.npz", "w") as archive:
        archive.writestr("p001.png", png_bytes(40))
    reject(tmp_path / "scans.npz", names=("scans.npz", "missing key 'train_images'", "p001.png"))


# Config values, checked before any data is read (or, for the model, against the data's images)

CONFIG_CASES = [
    pytest.param(["model.name=resnet999"], ("config key 'model.name'", "resnet999", "resnet18",
                                            "torchvision.models.list_models"), id="unknown-model"),
    pytest.param(["model.name=fasterrcnn_resnet50_fpn"], ("model.name", "not a torchvision classification model"),
                 id="detection-model"),
    pytest.param(["model.name=vit_b_16"], ("model.name", "vit_b_16", "28x28"), id="model-fixed-at-224-px"),
    pytest.param(["model.name=googlenet"], ("model.name", "googlenet", "GoogLeNetOutputs", "one tensor"),
                 id="model-with-auxiliary-outputs"),
    pytest.param(["model.name=densenet121", "model.cifar_stem=true"], ("model.cifar_stem", "densenet121"),
                 id="cifar-stem-outside-resnets"),
    pytest.param(["train.batch_size=0"], ("config key 'train.batch_size'", "greater than or equal to 1"),
                 id="batch-size-0"),
    pytest.param(["train.epochs=-3"], ("config key 'train.epochs'", "-3"), id="negative-epochs"),
    pytest.param(["train.milestones=[0.5, 1.5]"], ("config key 'train.milestones.1'", "less than 1"),
                 id="milestone-past-the-end"),
    pytest.param(["runtime.precision=fp8"], ("config key 'runtime.precision'", "'bf16'", "fp8"),
                 id="unknown-precision"),
    pytest.param(["evaluation.bootstrap=-100"], ("config key 'evaluation.bootstrap'", "-100"),
                 id="negative-bootstrap"),
    pytest.param(["data.synthetic.classes=1"], ("config key 'data.synthetic.classes'", "2"), id="one-class"),
    pytest.param(["data.medmnist.size=32"], ("config key 'data.medmnist.size'", "28", "224"),
                 id="medmnist-size-not-published"),
    pytest.param(["data.source=files"], ("data.source=files", "--data"), id="files-without-data"),
]


@pytest.mark.parametrize(("overrides", "names"), CONFIG_CASES)
def test_a_bad_config_value_is_named(reject, overrides, names):
    reject(None, *overrides, names=names)


# Image folders: PNG, JPEG and DICOM files in class folders
def class_folders(root, per_class: int = IMAGES_PER_CLASS):
    """`root/benign/*.png` and `root/malignant/*.png`, told apart by brightness: a set that loads."""
    for label, value in (("benign", 60), ("malignant", 200)):
        (root / label).mkdir(parents=True)
        for number in range(per_class):
            (root / label / f"{label[0]}{number}.png").write_bytes(png_bytes(value))
    return root


def ct_dataset() -> pydicom.Dataset:
    path = get_testdata_file("CT_small.dcm", download=False)
    if path is None:
        pytest.skip("pydicom's CT_small.dcm is not installed")
    return pydicom.dcmread(path)


def truncated_pixel_data(dataset: pydicom.Dataset) -> None:
    dataset.PixelData = dataset.PixelData[:100]


def palette_colour(dataset: pydicom.Dataset) -> None:
    dataset.PhotometricInterpretation = "PALETTE COLOR"


def window_center_in_words(dataset: pydicom.Dataset) -> None:
    dataset.add_new(0x00281050, "LO", "soft tissue")  # Window Center, as a broken exporter writes it
    dataset.WindowWidth = 400


@pytest.mark.parametrize(("spoil", "names"), [
    pytest.param(truncated_pixel_data, ("cannot decode the DICOM pixel data",), id="truncated-pixel-data"),
    pytest.param(palette_colour, ("PALETTE COLOR", "MONOCHROME2"), id="palette-colour"),
    pytest.param(window_center_in_words, ("WindowCenter", "'soft tissue'", "not a number"), id="window-not-a-number"),
])
def test_a_bad_dicom_file_is_named(reject, tmp_path, spoil, names):
    root = class_folders(tmp_path / "scans")
    dataset = copy.deepcopy(ct_dataset())
    spoil(dataset)
    pydicom.dcmwrite(root / "malignant" / "ct.dcm", dataset)
    reject(root, names=(str(root / "malignant" / "ct.dcm"), *names))


@pytest.mark.parametrize(("name", "content", "names"), [
    pytest.param("b9.dcm", b"exported from the viewer\n", ("DICOM", "no DICOM header"), id="dcm-that-is-no-dicom"),
    pytest.param("b9.png", noise_png_bytes()[:600], ("cannot read the image",), id="truncated-png"),
    pytest.param("b9.jpg", b"\xff\xd8\xff\xe0" + bytes(60), ("cannot read the image",), id="corrupt-jpeg"),
    pytest.param("b9.png", b"", ("cannot read the image",), id="empty-png"),
])
def test_a_bad_image_in_a_class_folder_is_named(reject, tmp_path, name, content, names):
    root = class_folders(tmp_path / "scans")
    (root / "benign" / name).write_bytes(content)
    reject(root, names=(str(root / "benign" / name), *names))


def test_images_without_class_folders_are_refused(reject, tmp_path):
    (tmp_path / "scans").mkdir()
    for number in range(4):
        (tmp_path / "scans" / f"{number}.png").write_bytes(png_bytes(number))
    reject(tmp_path / "scans", names=("scans", "no class folders", "<class>"))


def test_a_class_folder_of_non_images_is_named(reject, tmp_path):
    root = class_folders(tmp_path / "scans")
    (root / "notes").mkdir()
    (root / "notes" / "readme.txt").write_text("scanned on 2024-01-02")
    reject(root, names=("class 'notes' has no images", str(root / "notes")))


def test_a_single_class_folder_is_refused(reject, tmp_path):
    root = tmp_path / "scans"
    class_folders(root)
    for file in (root / "malignant").iterdir():
        file.unlink()
    (root / "malignant").rmdir()
    reject(root, names=(str(root), "at least 2 classes", "benign"))


def test_too_few_images_to_split_are_refused(reject, tmp_path):
    reject(class_folders(tmp_path / "scans", per_class=2), names=("scans", "too few", "20%"))


def test_an_image_size_below_the_minimum_names_the_key(reject, tmp_path):
    reject(class_folders(tmp_path / "scans"), "data.files.image_size=0",
           names=("config key 'data.files.image_size'", "8"))


# CSV manifests
def write_manifest(tmp_path, lines: list[str]):
    """A manifest of class-folder images; `lines` are its CSV lines, the header first."""
    class_folders(tmp_path)
    (tmp_path / "manifest.csv").write_text("\n".join(lines) + "\n")
    return tmp_path / "manifest.csv"


def rows(fields: str = "{path},{label},{patient}") -> list[str]:
    return [fields.format(path=f"{label}/{label[0]}{number}.png", label=label, patient=f"P{label[0]}{number}",
                          split=("train", "train", "train", "train", "val", "test")[number % 6])
            for label in ("benign", "malignant") for number in range(IMAGES_PER_CLASS)]


def test_a_manifest_row_naming_a_text_file_names_it(reject, tmp_path):
    manifest = write_manifest(tmp_path, ["path,label,patient_id", *rows(), "notes.txt,benign,P999"])
    (tmp_path / "notes.txt").write_text("not an image")
    reject(manifest, names=(str(tmp_path / "notes.txt"), "cannot read the image"))


def test_rows_longer_than_the_header_are_refused(reject, tmp_path):
    manifest = write_manifest(tmp_path, ["path,label", *rows()])
    reject(manifest, names=("manifest.csv", "more values than the header"))


def test_a_semicolon_separated_manifest_names_the_columns_found(reject, tmp_path):
    manifest = write_manifest(tmp_path, ["path;label;patient_id", *rows("{path};{label};{patient}")])
    reject(manifest, names=("manifest.csv", "'path;label;patient_id'", "separated by ';'"))


def test_a_configured_column_that_is_absent_names_the_key(reject, tmp_path):
    manifest = write_manifest(tmp_path, ["path,label,patient_id", *rows()])
    reject(manifest, "data.files.label_column=diagnosis",
           names=("manifest.csv", "missing column 'diagnosis'", "data.files.label_column"))


def test_an_empty_patient_id_names_its_row(reject, tmp_path):
    lines = rows()
    lines[2] = lines[2].rsplit(",", 1)[0] + ","
    manifest = write_manifest(tmp_path, ["path,label,patient_id", *lines])
    reject(manifest, names=("manifest.csv", "column 'patient_id', row 3", "empty patient id"))


def test_a_given_split_without_test_images_is_refused(reject, tmp_path):
    lines = [line.replace(",test", ",val") for line in rows("{path},{label},{patient},{split}")]
    manifest = write_manifest(tmp_path, ["path,label,patient_id,split", *lines])
    reject(manifest, names=("manifest.csv", "the test split has no images"))


def test_an_image_given_as_the_manifest_is_refused(reject, tmp_path):
    (tmp_path / "scan.png").write_bytes(png_bytes(80))
    reject(tmp_path / "scan.png", names=("scan.png", "expected a manifest: a CSV or Parquet table"))
