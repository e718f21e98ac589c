"""`usecases run finance` as a user runs it: the MLflow run, summary.json, the served model, bad files, resume."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import numpy as np
import pandas as pd
import pytest
import torch

from tests.cli_helpers import assert_rejected, runs, usecases
from tests.finance.rounding import FLOAT64_SLACK, assert_within, gap, risk_gap, tail_error, variance_error
from usecases.finance.config import Config
from usecases.finance.data import synthetic_panel
from usecases.finance.evaluate import FZ0_REFERENCE
from usecases.finance.features import add_features
from usecases.finance.serving import SERVED_TAILS
from usecases.finance.tails import TAIL_RULES

pytestmark = pytest.mark.starts_first(10)  # the default suite's longest files first (tests/conftest.py)

MODELS = {"ewma", "garch", "gjr_garch_t", "gjr_garch_t_evt", "har", "har_rv", "gas", "neural", "neural_training",
          "neural_out_of_sample", "neural_out_of_sample_evt", "neural_fz"}
TAIL_METRICS = {"var1_breach_rate", "kupiec_p", "christoffersen_cc_p", "basel_green_windows", "es975_mcneil_frey_p",
                "es975_z2", "es975_z2_p", "var1_h5_breaches", "var1_h5_sqrt_time_kupiec_p", "es975_h5_z2", "es975_fz0",
                "es99_fz0", "dm_t_fz0_es975"}
METRICS = TAIL_METRICS | {"qlike_parkinson", "qlike_sq", "mse_parkinson", "qlike_true", "qlike_sq_oracle"}


@pytest.fixture(scope="module")
def smoke_run(smoke_runs):
    """The session's smoke run (tests/conftest.py), shared by the checks below, and its MLflow run."""
    smoke = smoke_runs("finance")
    run = mlflow.MlflowClient(smoke.uri).get_run(smoke.summary["run_id"])
    return smoke.result, smoke.summary, run, smoke.uri


def test_summary_holds_every_model_per_series_and_averaged(smoke_run):
    result, summary, _, _ = smoke_run
    assert summary["usecase"] == "finance" and summary["preset"] == "smoke" and summary["device"] == "cpu"
    assert set(summary["models"]) == MODELS
    tickers = ["SYN000", "SYN001", "SYN002"]
    for model, metrics in summary["models"].items():
        if model == "gas":  # a model of the tails alone
            assert not {"qlike_sq", "dm_t_vs_gjr_garch_t"} & set(metrics)
        for metric in (TAIL_METRICS if model == "gas" else METRICS) - ({"dm_t_fz0_es975"} if model == FZ0_REFERENCE
                                                                      else set()):
            values = [metrics[f"{metric}/{ticker}"] for ticker in tickers]
            assert metrics[metric] == pytest.approx(np.mean(values)), (model, metric)
    assert "qlike_sq" in result.stdout and "neural" in result.stdout
    assert {"dm_t_vs_gjr_garch_t/SYN000", "dm_p_vs_har_rv"} <= set(summary["models"]["neural"])


def test_the_run_is_finished_with_tags_params_metrics_and_artifacts(smoke_run):
    _, summary, run, uri = smoke_run
    mlflow.set_tracking_uri(uri)
    assert run.info.status == "FINISHED"
    tags = run.data.tags
    for key in ("usecase", "preset", "device", "gpu_name", "world_size", "dataframe_backend", "data_source",
                "data_sha256", "git_commit", "cpu_model"):
        assert key in tags, key
    assert tags["data_source"].startswith("synthetic:") and len(tags["data_sha256"]) == 64
    assert run.data.params["train.epochs"] == "15"
    metrics = run.data.metrics
    assert metrics["test/neural/qlike_parkinson"] == summary["models"]["neural"]["qlike_parkinson"]
    for key in ("val/qlike", "val/qlike_h5", "train/loss", "throughput/samples_per_s", "time/data_wait_share"):
        assert key in metrics, key
    assert any(key.startswith("system/") for key in metrics), "system metrics are logged"
    assert len(mlflow.MlflowClient().get_metric_history(run.info.run_id, "val/qlike")) > 3
    artifacts = mlflow.artifacts.download_artifacts(run_id=run.info.run_id)
    names = {str(path.relative_to(artifacts)) for path in Path(artifacts).rglob("*") if path.is_file()}
    assert {"summary.json", "config.json", "forecasts.csv", "plots/forecast_SYN000.png",
            "plots/risk_SYN000.png"} <= names
    assert json.loads((Path(artifacts) / "summary.json").read_text()) == summary
    (model,) = mlflow.search_logged_models(experiment_ids=[run.info.experiment_id], output_format="list")
    assert model.name == "model" and model.source_run_id == run.info.run_id


def test_the_logged_model_loads_and_forecasts(smoke_run):
    _, summary, run, uri = smoke_run
    mlflow.set_tracking_uri(uri)
    model_uri = f"runs:/{run.info.run_id}/model"
    model = mlflow.pyfunc.load_model(model_uri)
    signature = model.metadata.get_input_schema()
    assert signature.input_names() == ["date", "ticker", "high", "low", "close"]
    example = mlflow.models.Model.load(model_uri).load_input_example(
        mlflow.artifacts.download_artifacts(f"{model_uri}"))
    forecast = model.predict(example)
    assert list(forecast["ticker"]) == ["SYN000", "SYN001", "SYN002"]
    assert (forecast["variance"] > 0).all() and (forecast["variance_5d"] > forecast["variance"]).all()
    assert (forecast["var_1pct"] < forecast["var_5pct"]).all() and (forecast["var_5pct"] < 0).all()
    one = example[example["ticker"] == "SYN000"]
    history = add_features(one.assign(date=pd.to_datetime(one["date"])))
    unknown = model.predict(one.assign(ticker="NEW")).iloc[0]
    factors = json.loads(run.data.tags["model_overnight_factors"])
    assert set(factors) == {"SYN000", "SYN001", "SYN002"} and all(1.1 < value < 2.5 for value in factors.values())
    served = model.unwrap_python_model()
    inputs = torch.tensor(history[served.features].tail(1).to_numpy(), dtype=torch.float32)
    rounding = gap(variance_error(served.members, inputs))[0, 0] + FLOAT64_SLACK  # its network on 1 row, and on 3
    assert unknown["variance"] / forecast["variance"].iloc[0] == pytest.approx(
        history["sq_ret"].sum() / history["parkinson"].sum() / factors["SYN000"], rel=rounding), \
        "a ticker it was not trained on takes the overnight factor of the rows given"
    flat = one.assign(ticker="FLAT", high=one["close"], low=one["close"])
    with pytest.raises(mlflow.exceptions.MlflowException, match="ticker 'FLAT': high equals low on each of its last 22 rows"):
        model.predict(flat)
    with pytest.raises(mlflow.exceptions.MlflowException, match=r"missing inputs \['high'\]"):
        model.predict(example.drop(columns=["high"]))
    with pytest.raises(mlflow.exceptions.MlflowException, match="at least 67"):
        model.predict(example.tail(10))
    with pytest.raises(mlflow.exceptions.MlflowException, match="no rows"):
        model.predict(example.head(0))


def test_serving_gives_the_var_and_es_evaluated_on_the_last_test_day(smoke_run):
    """The served model, given each ticker's prices up to the origin of the last test day, answers the VaR and ES
    that the run scored for that day: the chosen tail rule (tag `tails_rule`) as evaluated, nothing recomputed."""
    _, summary, run, uri = smoke_run
    mlflow.set_tracking_uri(uri)
    folder = Path(mlflow.artifacts.download_artifacts(run_id=run.info.run_id, artifact_path="forecasts.csv"))
    evaluated = pd.read_csv(folder, parse_dates=["date"])
    evaluated = evaluated[evaluated["model"] == "neural"].sort_values("date").groupby("ticker").tail(1)
    prices = synthetic_panel(Config.model_validate({"data": {"synthetic": {"tickers": 3, "days": 1200,
                                                                           "seed": 7}}}).data.synthetic).frame
    rows = prices[prices["date"] < evaluated["date"].max()][["date", "ticker", "high", "low", "close"]]
    model = mlflow.pyfunc.load_model(f"runs:/{run.info.run_id}/model")
    answer = model.predict(rows.assign(date=rows["date"].dt.strftime("%Y-%m-%d")))
    assert run.data.tags["tails_rule"] in TAIL_RULES
    both = answer.merge(evaluated, on="ticker", suffixes=("_served", ""))
    assert len(both) == 3
    # the served network and head in float32 on 3 rows, the evaluated ones on a refit's rows: apart by rounding alone
    served = model.unwrap_python_model()
    origins = add_features(rows).groupby("ticker").tail(1).set_index("ticker").loc[both["ticker"], served.features]
    inputs = torch.tensor(origins.to_numpy(), dtype=torch.float32)
    variance_gap = gap(variance_error(served.members, inputs))[:, 0]
    column_gap = 0.0 if served.head is None else gap(tail_error(served.head, served.members[0].scaled(inputs)))
    assert_within(both["variance_served"], both["variance"], variance_gap * both["variance"], "variance")
    sigma = np.sqrt(both["variance"])
    for output, column in SERVED_TAILS:
        assert_within(both[output], both["mu"] + sigma * both[column],
                      risk_gap(both["mu"], both["variance"], both[column], variance_gap, column_gap), output)
    assert (both["es_1pct"] < both["var_1pct"]).all() and (both["es_2_5pct"] < both["var_2_5pct"]).all()


def test_a_csv_without_high_is_one_line_and_exit_2(capsys, tmp_path):
    csv = tmp_path / "prices.csv"
    pd.DataFrame({"date": ["2020-01-02"], "ticker": ["A"], "low": [1.0], "close": [1.0]}).to_csv(csv, index=False)
    assert_rejected(capsys, "finance", "run", "finance", "--data", str(csv), names=("prices.csv", "'high'"))


def test_a_user_csv_with_an_exogenous_input_runs_end_to_end(tmp_path):
    from usecases.finance.config import Synthetic
    from usecases.finance.data import synthetic_panel

    frame = synthetic_panel(Synthetic(tickers=1, days=700, seed=1)).frame.rename(columns=str.upper)
    csv = tmp_path / "mine.csv"
    frame.to_csv(csv, index=False)
    columns = [f"--set=data.columns.{key}={key.upper()}" for key in ("date", "ticker", "open", "high", "low",
                                                                      "close", "volume")]
    result = usecases("run", "finance", "--preset", "smoke", "--data", str(csv), *columns,
                      "--set", "data.exogenous=[wti]", "--set", "baselines.models=[har]", "--set", "train.epochs=3")
    assert result.returncode == 0, result.stderr[-2000:]
    (run,) = runs("finance")
    assert run.data.tags["data_source"] == "file:mine.csv+wti" and run.data.tags["data_filled_rows"] == "0"
    assert "test/neural/qlike_parkinson/SYN000" in run.data.metrics
    model = mlflow.pyfunc.load_model(f"runs:/{run.info.run_id}/model")
    assert "wti" in model.metadata.get_input_schema().input_names()
    recent = frame.tail(80).rename(columns=str.lower).assign(wti=60.0)
    recent["date"] = recent["date"].astype(str)
    forecast = model.predict(recent[["date", "ticker", "high", "low", "close", "wti"]])
    assert forecast["variance"].iloc[0] > 0


def test_sigterm_then_resume_continues_from_the_checkpoint(tmp_path):
    long_run = ["--set", "train.epochs=60", "--set", "train.patience=60", "--set", "train.refit_every=200",
                "--set", "train.checkpoint_every_s=0",  # after every epoch: the signal lands with epochs to go
                "--set", "baselines.models=[ewma]"]  # one baseline: what is stopped and resumed is the training
    args = [sys.executable, "-m", "usecases", "run", "finance", "--preset", "smoke", *long_run]
    first = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    folder = Path(os.environ["USECASES_CHECKPOINT_DIR"]) / "finance" / "smoke"
    deadline = time.monotonic() + 120
    while not any(folder.glob("*/neural/last.pt")) and time.monotonic() < deadline \
            and first.poll() is None:
        time.sleep(0.02)
    first.send_signal(signal.SIGTERM)  # at once: an epoch of its fits takes tens of ms, so it may end within seconds
    _, stderr = first.communicate(timeout=60)
    assert first.returncode == 143, stderr[-2000:]
    (killed,) = runs("finance")
    assert killed.info.status == "KILLED"

    # what a recovered spot instance runs (`usecases advise --launch`): it continues the interrupted run
    second = usecases("run", "finance", "--preset", "smoke", *long_run, "--resume-if-interrupted")
    assert second.returncode == 0, second.stderr[-2000:]
    assert "resumed from the checkpoint after epoch" in second.stderr
    epoch = int(second.stderr.split("resumed from the checkpoint after epoch")[1].split()[0])
    assert 0 < epoch < 60
    (finished,) = runs("finance")
    assert finished.info.run_id == killed.info.run_id and finished.info.status == "FINISHED"
    assert finished.data.tags["resumed"] == "true"
    history = mlflow.MlflowClient().get_metric_history(finished.info.run_id, "val/qlike")
    steps = [metric.step for metric in history]
    assert set(range(60)) <= set(steps), "every epoch of the fit is logged"
    assert len(steps) - len(set(steps)) <= 1, "only the epoch cut short by the signal may run twice"
