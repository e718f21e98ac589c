"""The `default` preset on the real S&P 500 and NASDAQ: the issue's acceptance run (about a minute on 2 cores)."""

import json

import pytest

from tests.cli_helpers import private_env, runs, usecases
from tests.finance.test_baselines import REFERENCE


@pytest.fixture(scope="module")
def summary(tmp_path_factory):
    env = private_env(tmp_path_factory.mktemp("default"))
    path = tmp_path_factory.mktemp("summary") / "s.json"
    result = usecases("run", "finance", "--preset", "default", "--summary", str(path), timeout=900, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert [run.info.status for run in runs("finance", uri=env["MLFLOW_TRACKING_URI"])] == ["FINISHED"]
    return json.loads(path.read_text())


def test_every_model_has_every_metric_per_series(summary):
    assert set(summary["models"]) == {"ewma", "garch", "gjr_garch_t", "har", "neural"}
    for metrics in summary["models"].values():
        for metric in ("qlike_parkinson", "qlike_sq", "mse_parkinson", "var1_breach_rate", "kupiec_p"):
            assert {metric, f"{metric}/sp500", f"{metric}/nasdaq"} <= set(metrics)


def test_sp500_baselines_match_the_reference_numbers(summary):
    for model, (qlike_parkinson, qlike_sq) in REFERENCE.items():
        metrics = summary["models"][model]
        assert metrics["qlike_parkinson/sp500"] == pytest.approx(qlike_parkinson, abs=0.03), model
        assert metrics["qlike_sq/sp500"] == pytest.approx(qlike_sq, abs=0.03), model


def test_the_neural_model_beats_har_on_qlike(summary):
    models = summary["models"]
    assert models["neural"]["qlike_parkinson"] < models["har"]["qlike_parkinson"]
    assert models["neural"]["qlike_parkinson/sp500"] < models["har"]["qlike_parkinson/sp500"]
