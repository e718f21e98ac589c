"""The smoke preset end to end, as a user runs it (once a session, tests/conftest.py): summary, MLflow run with
plots and model, a model that loads."""

import mlflow
import numpy as np
import pytest
from PIL import Image

from tests.cli_helpers import assert_rejected, runs

pytestmark = pytest.mark.starts_first(7)  # the default suite's longest files first (tests/conftest.py)

REQUIRED = {"auc", "acc", "auc_ci_low", "auc_ci_high", "ece", "brier", "sensitivity_at_threshold",
            "specificity_at_threshold"}


@pytest.fixture(scope="module")
def medical_smoke(smoke_runs):
    """The session's smoke run (tests/conftest.py), shared by the checks below."""
    return smoke_runs("medical")


def test_summary_has_the_clinical_metrics_and_the_network_learned(medical_smoke):
    summary, result = medical_smoke.summary, medical_smoke.result
    models = summary["models"]
    assert set(models) == {"resnet18", "logreg"}
    for metrics in models.values():
        assert REQUIRED <= set(metrics)
        assert metrics["auc_ci_low"] <= metrics["auc"] <= metrics["auc_ci_high"]
    assert models["resnet18"]["auc"] > 0.9  # shapes under noise are learnable in a few epochs
    assert "resnet18" in result.stdout and "sensitivity_at_threshold" in result.stdout


def test_run_has_plots_and_a_model_that_predicts_probabilities(medical_smoke):
    uri = medical_smoke.uri
    (run,) = runs("medical", uri)
    assert run.info.status == "FINISHED"
    client = mlflow.MlflowClient(uri)
    plots = {item.path for item in client.list_artifacts(run.info.run_id, "plots")}
    assert {"plots/gradcam.png", "plots/resnet18_roc_pr.png", "plots/resnet18_reliability.png",
            "plots/logreg_roc_pr.png"} <= plots
    assert "val/auc" in client.get_run(run.info.run_id).data.metrics
    model = mlflow.pyfunc.load_model(f"runs:/{run.info.run_id}/model")
    images = np.random.default_rng(0).integers(0, 256, (5, 28, 28), dtype=np.uint8)
    probabilities = model.predict(images)
    assert probabilities.shape == (5, 2) and np.allclose(probabilities.sum(axis=1), 1)
    assert model.metadata.metadata["target_sensitivity"] == 0.95


def test_patient_in_two_splits_is_refused_before_any_run(capsys, tmp_path):
    rows = ["path,label,patient_id,split"]
    for index in range(8):
        Image.fromarray(np.full((16, 16), index * 20, np.uint8)).save(tmp_path / f"img{index}.png")
        split = ["train", "train", "train", "train", "val", "val", "test", "test"][index]
        rows.append(f"img{index}.png,{index % 2},P{index},{split}")
    rows[-1] = "img7.png,1,P1,test"  # P1 also has a training image
    (tmp_path / "manifest.csv").write_text("\n".join(rows) + "\n")
    assert_rejected(capsys, "medical", "run", "medical", "--preset", "smoke", "--data",
                    str(tmp_path / "manifest.csv"), names=("patient 'P1' appears in both train and test",))


def test_corrupt_png_is_named(capsys, tmp_path):
    for label in ("benign", "malignant"):
        (tmp_path / label).mkdir()
        for index in range(12):
            Image.fromarray(np.full((16, 16), index, np.uint8)).save(tmp_path / label / f"{index}.png")
    (tmp_path / "malignant" / "broken.png").write_bytes(b"\x89PNG not really")
    assert_rejected(capsys, "medical", "run", "medical", "--preset", "smoke", "--data", str(tmp_path),
                    names=("broken.png: cannot read the image",))


def test_bad_positive_class_is_one_line(capsys):
    assert_rejected(capsys, "medical", "run", "medical", "--preset", "smoke", "--set", "evaluation.positive_class=4",
                    names=("evaluation.positive_class: 4 is not a class index",))
