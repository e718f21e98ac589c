"""What is served is what was evaluated: the logged model scores images as the run scored them, so that the
threshold, the temperature and the metrics it reports hold for what a user serves (issue 19, items 3 and 9)."""

from pathlib import Path

import mlflow
import numpy as np
import pytest
from sklearn.metrics import roc_auc_score

from common.config import load_config
from common.paths import data_search_path
from common.runner import run_usecase
from common.usecase import RunRequest
from usecases.medical import USECASE, pipeline
from usecases.medical.config import Config
from usecases.medical.data import synthetic_images
from usecases.medical.evaluate import nll, probabilities

MIRRORS = [Path(__file__).resolve().parents[3] / "shared" / "data", *data_search_path()]
SHARED = next((path for folder in MIRRORS if (path := folder / "medmnist" / "breastmnist.npz").is_file()),
              MIRRORS[0] / "medmnist" / "breastmnist.npz")
QUICK = ["evaluation.bootstrap=0", "evaluation.gradcam_examples=0", "baselines.models=[]"]


def logged_model(run_id: str):
    return mlflow.pyfunc.load_model(f"runs:/{run_id}/model")


def test_the_served_probabilities_under_tta_are_the_evaluated_ones(monkeypatch):
    """With TTA on, the threshold and the temperature were fitted on mirror-averaged logits: the served model must
    compute those too, not the plain ones (without TTA, the BreastMNIST test below checks the served scores)."""
    evaluated = {}
    evaluate_model = pipeline.evaluate_model

    def recording(val_logits, val_labels, test_logits, *args, **kwargs):
        evaluated.setdefault("test", test_logits)  # the network's, first; the baselines' come after
        return evaluate_model(val_logits, val_labels, test_logits, *args, **kwargs)

    monkeypatch.setattr(pipeline, "evaluate_model", recording)
    overrides = [*QUICK, "train.epochs=1", "data.synthetic.train=64", "data.synthetic.val=32",
                 "data.synthetic.test=32", "evaluation.tta=true"]
    result = run_usecase(RunRequest(USECASE, "smoke", overrides, device="cpu"))
    model = logged_model(result["run_id"])
    synthetic = load_config(Config, USECASE.presets_dir, "smoke", overrides).data.synthetic
    images = synthetic_images(synthetic).images["test"][..., 0]
    served = model.predict(images).to_numpy()
    np.testing.assert_allclose(served, probabilities(evaluated["test"], "binary"), rtol=0, atol=1e-6)
    assert model.metadata.metadata["tta"] is True


def breastmnist_excerpt(folder: Path) -> Path:
    """The whole real validation split with the first 128 training and 32 test images, under BreastMNIST's file name
    (its classes come from it): what is checked is the validation scores, and fewer images keep the fp32 epochs
    short on 2 cores."""
    split = np.load(SHARED)
    counts = {"train": 128, "val": len(split["val_labels"]), "test": 32}
    path = folder / SHARED.name
    np.savez(path, **{f"{name}_{kind}": split[f"{name}_{kind}"][:count]
                      for name, count in counts.items() for kind in ("images", "labels")})
    return path


@pytest.mark.skipif(not SHARED.is_file(), reason="the shared BreastMNIST copy is absent")
def test_the_logged_network_scores_validation_as_its_best_epoch_did(tmp_path):
    """BreastMNIST in fp32: the logged model's validation AUC and loss are those its best epoch logged, so nothing
    after training (a measurement pass in train mode moving batch norm's statistics) changed the network."""
    result = run_usecase(RunRequest(USECASE, "default", [*QUICK, "train.epochs=2", "runtime.precision=fp32"],
                                    device="cpu", data=breastmnist_excerpt(tmp_path)))
    model = logged_model(result["run_id"])
    step = model.metadata.metadata["best_epoch"] - 1  # logged 1-based; the epochs' metrics are at 0-based steps
    logged = {key: next(row.value for row in mlflow.MlflowClient().get_metric_history(result["run_id"], key)
                        if row.step == step)
              for key in ("val/auc", "val/loss")}
    split = np.load(SHARED)
    labels = split["val_labels"].reshape(-1)
    served = model.predict(split["val_images"]).to_numpy()
    assert roc_auc_score(labels, served[:, 1]) == pytest.approx(logged["val/auc"], abs=1e-6)
    assert nll(np.log(served), labels, "binary") == pytest.approx(logged["val/loss"], rel=1e-5)
