"""Loading your own images: splits never share a patient, and every bad input fails with one line naming it."""

from __future__ import annotations

import copy
import shutil
import warnings

import numpy as np
import pandas as pd
import pydicom
import pytest
from PIL import Image
from pydicom.data import get_testdata_file, get_testdata_files
from pydicom.errors import InvalidDicomError

from common.errors import UserError
from usecases.medical.config import Files
from usecases.medical.files import assert_no_patient_leak, load_files
from usecases.medical.images import SPLITS
from usecases.medical.pixels import dicom_to_uint8

PATIENTS_PER_CLASS = 20
IMAGES_PER_PATIENT = 2


def write_image(path, value, mode="L", size=(12, 10)):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new(mode, size, value).save(path)
    return path


def write_manifest(tmp_path, rows, name="manifest.csv"):
    path = tmp_path / name
    pd.DataFrame(rows).to_csv(path, index=False)
    return path


def patient_rows(tmp_path, mode="L"):
    """Two classes told apart by brightness, several images per patient."""
    rows = []
    for label, value in (("benign", 60), ("malignant", 200)):
        for patient in range(PATIENTS_PER_CLASS):
            for image in range(IMAGES_PER_PATIENT):
                relative = f"scans/{label}_{patient}_{image}.png"
                write_image(tmp_path / relative, value if mode == "L" else (value, 0, 0), mode)
                rows.append({"path": relative, "label": label, "patient_id": f"{label[0]}{patient:03d}"})
    return rows


def given_split_rows(tmp_path):
    """The smallest manifest with both classes in every split."""
    rows = []
    for number, split in enumerate(["train", "train", "val", "val", "test", "test"]):
        label = "yes" if number % 2 else "no"
        write_image(tmp_path / f"img{number}.png", 40 * number)
        rows.append({"path": f"img{number}.png", "label": label, "patient_id": f"P{number:03d}", "split": split})
    return rows


def error_for(path, config=None, seed=0):
    with pytest.raises(UserError) as caught:
        load_files(path, config or Files(), seed)
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_manifest_is_split_by_patient_and_stratified(tmp_path):
    manifest = write_manifest(tmp_path, patient_rows(tmp_path))
    data = load_files(manifest, Files(image_size=16), seed=3)
    assert data.classes == ["benign", "malignant"] and data.task == "binary"
    assert sum(len(data.labels[split]) for split in SPLITS) == 2 * PATIENTS_PER_CLASS * IMAGES_PER_PATIENT
    for split in SPLITS:
        assert data.images[split].dtype == np.uint8 and data.images[split].shape[1:] == (16, 16, 1)
        assert (data.counts(split) > 0).all()
    for first, second in [("train", "val"), ("train", "test"), ("val", "test")]:
        assert not set(data.patients[first]) & set(data.patients[second])
    bright = data.images["train"][data.labels["train"] == 1]
    assert (bright == 200).all()
    assert data.source == "files:manifest.csv" and len(data.sha256) == 64
    again = load_files(manifest, Files(image_size=16), seed=3)
    assert all((again.patients[split] == data.patients[split]).all() for split in SPLITS)


def test_a_parquet_or_utf16_manifest_is_read_as_its_csv_and_na_is_a_name(tmp_path):
    """The manifest goes through the shared table reader: the same images from a Parquet or a UTF-16 copy, and a
    patient called "NA" stays a patient, not a missing value."""
    rows = [dict(row, patient_id="NA" if row["patient_id"] == "b000" else row["patient_id"])
            for row in patient_rows(tmp_path)]
    frame = pd.DataFrame(rows)
    frame.to_parquet(tmp_path / "manifest.parquet", index=False)
    frame.to_csv(tmp_path / "utf16.csv", index=False, encoding="utf-16")
    expected = load_files(write_manifest(tmp_path, rows), Files(image_size=8), seed=3)
    assert "NA" in set(np.concatenate([expected.patients[split] for split in SPLITS]))
    for other in ("manifest.parquet", "utf16.csv"):
        data = load_files(tmp_path / other, Files(image_size=8), seed=3)
        assert all((data.patients[split] == expected.patients[split]).all() for split in SPLITS), other
        assert all((data.images[split] == expected.images[split]).all() for split in SPLITS), other


@pytest.mark.parametrize(("mode", "channels", "expected"), [("L", 3, (60, 60, 60)), ("RGB", 1, (18,))])
def test_grey_and_rgb_become_the_configured_channels(tmp_path, mode, channels, expected):
    manifest = write_manifest(tmp_path, patient_rows(tmp_path, mode))
    data = load_files(manifest, Files(channels=channels, image_size=8), seed=0)
    dark = data.images["test"][data.labels["test"] == 0]
    assert dark.shape[1:] == (8, 8, channels)
    assert (dark == np.array(expected, dtype=np.uint8)).all()


def test_jpeg_loads(tmp_path):
    rows = given_split_rows(tmp_path)
    write_image(tmp_path / "photo.jpg", (120, 120, 120), "RGB", (20, 30))
    rows[0]["path"] = "photo.jpg"
    data = load_files(write_manifest(tmp_path, rows), Files(image_size=8), seed=0)
    assert abs(int(data.images["train"][0].mean()) - 120) <= 2


def test_the_given_split_is_used(tmp_path):
    data = load_files(write_manifest(tmp_path, given_split_rows(tmp_path)), Files(), seed=0)
    patients = {split: data.patients[split].tolist() for split in SPLITS}
    assert patients == {"train": ["P000", "P001"], "val": ["P002", "P003"], "test": ["P004", "P005"]}


def test_a_patient_in_two_given_splits_is_refused(tmp_path):
    rows = given_split_rows(tmp_path)
    rows[4]["patient_id"] = "P001"
    message = error_for(write_manifest(tmp_path, rows))
    assert message == (f"{tmp_path / 'manifest.csv'}: patient 'P001' appears in both train and test; "
                       f"a patient's images must all be in one split")


def test_assert_no_patient_leak_names_the_first_shared_patient():
    assert_no_patient_leak({"train": np.array(["a", "b"]), "val": np.array(["c"])}, "here")
    with pytest.raises(UserError, match="here: patient 'b' appears in both val and test.*2 patients are in both"):
        assert_no_patient_leak({"train": np.array(["a"]), "val": np.array(["b", "c"]),
                                "test": np.array(["c", "b"])}, "here")


def test_a_bad_split_value_names_the_value_and_row(tmp_path):
    rows = given_split_rows(tmp_path)
    rows[2]["split"] = "validation"
    assert "column 'split', row 3: split 'validation' is not one of train, val, test" in error_for(
        write_manifest(tmp_path, rows))


def test_a_corrupt_png_names_the_file(tmp_path):
    rows = given_split_rows(tmp_path)
    (tmp_path / "scans").mkdir()
    (tmp_path / "scans" / "p3_a.png").write_bytes(np.random.default_rng(0).bytes(300))
    rows[3]["path"] = "scans/p3_a.png"
    message = error_for(write_manifest(tmp_path, rows))
    assert message.startswith(f"{tmp_path / 'scans' / 'p3_a.png'}: cannot read the image (")


def test_a_missing_label_column_is_named_with_the_columns_found(tmp_path):
    rows = [{key: value for key, value in row.items() if key != "label"} for row in given_split_rows(tmp_path)]
    message = error_for(write_manifest(tmp_path, rows))
    assert "manifest.csv: missing column 'label'" in message and "found: path, patient_id, split" in message


def test_a_missing_file_is_named(tmp_path):
    rows = given_split_rows(tmp_path)
    rows[1]["path"] = "gone.png"
    assert "column 'path', row 2: file not found:" in error_for(write_manifest(tmp_path, rows))


def test_an_empty_manifest_is_refused(tmp_path):
    (tmp_path / "blank.csv").write_text("")
    assert "blank.csv: empty file (no header line, no data rows)" in error_for(tmp_path / "blank.csv")
    (tmp_path / "header.csv").write_text("path,label\n")
    assert "the manifest has no rows" in error_for(tmp_path / "header.csv")


def test_without_patient_ids_each_image_is_its_own_patient(tmp_path):
    rows = [{"path": row["path"], "label": row["label"]} for row in patient_rows(tmp_path)]
    data = load_files(write_manifest(tmp_path, rows), Files(), seed=0)
    assert any("split is by image, not patient" in notice for notice in data.notices)
    assert set(data.patients["test"]) <= {row["path"] for row in rows}


def test_class_folders_load_with_nested_folders_and_hidden_files_ignored(tmp_path):
    for label, value in (("normal", 30), ("pneumonia", 220)):
        for number in range(PATIENTS_PER_CLASS):
            write_image(tmp_path / label / f"batch{number % 2}" / f"{number}.png", value)
    (tmp_path / "normal" / ".DS_Store").write_bytes(b"junk")
    write_image(tmp_path / ".thumbnails" / "x.png", 0)
    data = load_files(tmp_path, Files(image_size=8), seed=1)
    assert data.classes == ["normal", "pneumonia"] and data.source == f"files:{tmp_path.name}"
    assert sum(len(data.labels[split]) for split in SPLITS) == 2 * PATIENTS_PER_CLASS
    assert (data.images["train"][data.labels["train"] == 1] == 220).all()


def test_a_folder_with_a_manifest_uses_the_manifest(tmp_path):
    write_manifest(tmp_path, given_split_rows(tmp_path))
    assert load_files(tmp_path, Files(), seed=0).classes == ["no", "yes"]


def test_an_empty_class_folder_is_named(tmp_path):
    write_image(tmp_path / "normal" / "a.png", 10)
    (tmp_path / "pneumonia").mkdir()
    assert "class 'pneumonia' has no images" in error_for(tmp_path)


def test_an_empty_folder_a_missing_path_and_half_a_window_are_refused(tmp_path):
    assert "no manifest.csv and no class folders" in error_for(tmp_path)
    assert "no such file or folder" in error_for(tmp_path / "absent")
    assert "must be set together" in error_for(tmp_path, Files(window_center=40))


def test_integer_labels_keep_their_numeric_order(tmp_path):
    rows = patient_rows(tmp_path)
    for row in rows:
        row["label"] = "10" if row["label"] == "malignant" else "2"
    assert load_files(write_manifest(tmp_path, rows), Files(), seed=0).classes == ["2", "10"]


@pytest.fixture(scope="module")
def ct():
    path = get_testdata_file("CT_small.dcm", download=False)
    if path is None:
        pytest.skip("pydicom's CT_small.dcm is not installed")
    return pydicom.dcmread(path)


@pytest.fixture(scope="module")
def monochrome1():
    """A bundled MONOCHROME1 file, if this pydicom ships one (only local files, no download)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for path in get_testdata_files():
            try:
                header = pydicom.dcmread(path, stop_before_pixels=True)
            except (InvalidDicomError, OSError):  # the bundle holds folders and deliberately broken files
                continue
            if header.get("PhotometricInterpretation") == "MONOCHROME1" and header.get("NumberOfFrames", 1) == 1:
                dataset = pydicom.dcmread(path)
                if "PixelData" in dataset:
                    return dataset
    pytest.skip("no MONOCHROME1 file among pydicom's bundled test files")


def linear_window(values, center, width):
    return np.round(np.clip((values - (center - 0.5)) / (width - 1) + 0.5, 0, 1) * 255)


def test_dicom_rescale_is_applied_before_the_window(ct):
    hounsfield = ct.pixel_array * float(ct.RescaleSlope) + float(ct.RescaleIntercept)
    assert float(ct.RescaleIntercept) == -1024
    pixels = dicom_to_uint8(ct, center=40, width=400)
    assert pixels.dtype == np.uint8 and pixels.shape == ct.pixel_array.shape
    np.testing.assert_array_equal(pixels, linear_window(hounsfield, 40, 400))


def test_dicom_window_maps_its_range_to_black_and_white(ct):
    hounsfield = ct.pixel_array * float(ct.RescaleSlope) + float(ct.RescaleIntercept)
    center = float(hounsfield[64, 64])
    pixels = dicom_to_uint8(ct, center=center, width=400)
    assert (pixels[hounsfield < center - 200] == 0).all() and (pixels[hounsfield > center + 200] == 255).all()
    assert pixels[64, 64] in (127, 128)


def test_dicom_without_a_window_is_min_max_scaled(ct):
    pixels = dicom_to_uint8(ct)
    assert "WindowCenter" not in ct and pixels.min() == 0 and pixels.max() == 255


def test_the_files_first_window_is_the_default(ct):
    windowed = copy.deepcopy(ct)
    windowed.WindowCenter, windowed.WindowWidth = [40, -600], [400, 1500]
    np.testing.assert_array_equal(dicom_to_uint8(windowed), dicom_to_uint8(ct, center=40, width=400))


def test_a_multi_frame_dicom_gives_its_middle_frame(ct):
    frames = copy.deepcopy(ct)
    blank = np.zeros_like(ct.pixel_array)
    frames.PixelData = np.stack([blank, ct.pixel_array, blank]).tobytes()
    frames.NumberOfFrames = 3
    np.testing.assert_array_equal(dicom_to_uint8(frames, 40, 400), dicom_to_uint8(ct, 40, 400))


def test_monochrome1_is_inverted(monochrome1):
    as_monochrome2 = copy.deepcopy(monochrome1)
    as_monochrome2.PhotometricInterpretation = "MONOCHROME2"
    inverted = dicom_to_uint8(monochrome1).astype(int)
    plain = dicom_to_uint8(as_monochrome2).astype(int)
    assert np.abs(inverted + plain - 255).max() <= 1 and plain.std() > 0


def test_a_dicom_without_pixel_data_names_the_file(tmp_path, ct):
    header_only = copy.deepcopy(ct)
    del header_only.PixelData
    pydicom.dcmwrite(tmp_path / "empty.dcm", header_only)
    rows = given_split_rows(tmp_path)
    rows[0]["path"] = "empty.dcm"
    assert error_for(write_manifest(tmp_path, rows)) == f"{tmp_path / 'empty.dcm'}: DICOM has no pixel data"


def test_a_manifest_mixing_dicom_and_png_loads(tmp_path, ct):
    rows = given_split_rows(tmp_path)
    shutil.copy(ct.filename, tmp_path / "ct.dcm")
    rows[0]["path"] = "ct.dcm"
    data = load_files(write_manifest(tmp_path, rows), Files(image_size=32, window_center=40, window_width=400), 0)
    assert data.images["train"].shape == (2, 32, 32, 1)
    assert data.images["train"][0].std() > 0
