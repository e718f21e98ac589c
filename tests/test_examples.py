"""examples/ end to end, as a user runs their own file: `usecases run NAME --data examples/...` (a separate process, a
private store), then `usecases serve NAME` on the model that run registered, and one request built from the same
example file, answered over HTTP. The runs take the smallest settings (`--preset smoke` and `--set`s, below): what is
tested is the own-data path and the files' formats, not how well a model learns (the use cases' own tests do that)."""

import csv
import json
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from tests.cli_helpers import free_port, private_env, runs, stop, usecases, wait_until_up
from tests.test_workbench import post

pytestmark = pytest.mark.starts_first(6)  # the default suite's longest files first (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
# Each example run's settings: the smallest preset, less what costs seconds and the served path does not need
# (finance: two of its baselines; medical: one epoch, no Grad-CAM; recsys: two of its models, no replay; the slides
# run already takes ~20 s).
CHEAPEST = {
    "finance": ("--preset", "smoke", "--set", "baselines.models=[gjr_garch_t,har]"),
    "medical": ("--preset", "smoke", "--set", "train.epochs=1", "--set", "evaluation.gradcam_examples=0"),
    "recsys": ("--preset", "smoke", "--set", "models=[pop,ease]",
               "--set", "evaluation.replay=false"),
    "slides": ("--preset", "slides-smoke"),
}
SERVE_TIMEOUT_S = 180


def run_example(tmp_path_factory, usecase: str, data: Path, key: str | None = None) -> tuple[dict, dict]:
    """(summary.json, environment with the private store) of `usecases run USECASE --data DATA` with CHEAPEST."""
    folder = tmp_path_factory.mktemp(f"{key or usecase}-example")
    env = private_env(folder)
    extra = ("--set", f"data.slides.cache_dir={folder / 'cache'}") if key == "slides" else ()
    started = time.monotonic()
    result = usecases("run", usecase, "--data", str(data), *CHEAPEST[key or usecase], *extra,
                      "--summary", str(folder / "s.json"), timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    print(f"{key or usecase}: run on the example in {time.monotonic() - started:.0f} s")
    (run,) = runs(usecase, env["MLFLOW_TRACKING_URI"])
    assert run.info.status == "FINISHED" and run.data.tags["data_path"] == str(data)
    return json.loads((folder / "s.json").read_text()), env


@contextmanager
def served(env: dict, log: Path, *args: str):
    """`usecases serve ARGS` on a free port, as a user starts it: (its URL, the first line it printed)."""
    port = free_port()
    started = time.monotonic()
    with log.open("w") as output:
        process = subprocess.Popen([sys.executable, "-m", "usecases", "serve", *args, "--port", str(port)], env=env,
                                   stdout=output, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_until_up(f"{url}/ping", process, SERVE_TIMEOUT_S)
        except (AssertionError, TimeoutError) as error:
            pytest.fail(f"{error}; the server said:\n{log.read_text()[-3000:]}")
        print(f"{args[0]}: served in {time.monotonic() - started:.0f} s")
        yield url, log.read_text().splitlines()[0]
    finally:
        stop(process)


def answer(url: str, payload: dict) -> list[dict]:
    status, body = post(f"{url}/invocations", payload)
    assert status == 200, body
    return body["predictions"]


def test_the_examples_are_small_and_each_file_is_described():
    files = [path for path in EXAMPLES.rglob("*") if path.is_file() and "__pycache__" not in path.parts]
    assert sum(path.stat().st_size for path in files) < 3 * 2**20
    readme = (EXAMPLES / "README.md").read_text()
    for name in ("finance/prices.csv", "medical/manifest.csv", "recsys/events.csv", "slides/labels.csv",
                 "make_examples.py"):
        assert (EXAMPLES / name).is_file() and f"`{name}" in readme, name


def make_steps(*args: str) -> list[str]:
    """What `make -n ARGS` would run (no make[1] lines under `make test` either)."""
    result = subprocess.run(["make", "--no-print-directory", "-n", *args], cwd=ROOT, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def test_make_install_only_sets_up_the_venv_and_the_editable_install(tmp_path):
    venv = tmp_path / "venv"  # no stamp there: `make -n` lists every step of the set-up
    steps = make_steps("install", f"VENV={venv}")
    assert steps[0].endswith(f"-m venv {venv}") and steps[-1] == f"touch {venv}/.installed", steps
    assert f"{venv}/bin/pip install --quiet -e '.[all]'" in steps  # every use case, not the test tools
    assert not any("bin/usecases" in step or "-m pytest" in step for step in steps), steps  # not demo, not test
    assert f"{venv}/bin/pip install --quiet -e '.[all,dev]'" in make_steps("test", f"VENV={venv}")
    one = make_steps("install", f"VENV={venv}", "EXTRAS=finance", f"WHEELS={tmp_path / 'wheels'}")
    assert one[0].endswith(f"-m common.tools.wheelhouse check {tmp_path / 'wheels'}"), one  # checked, then the venv
    assert one[1].endswith(f"-m venv {venv}") and one[2] == (f"{venv}/bin/pip install --quiet --no-index --find-links {tmp_path / 'wheels'} --constraint "
                      f"{tmp_path / 'wheels'}/constraints.txt -e '.[finance]'"), one


@pytest.fixture(scope="module")
def finance_run(tmp_path_factory):
    return run_example(tmp_path_factory, "finance", EXAMPLES / "finance" / "prices.csv")


def test_finance_example_is_trained_on_and_its_served_model_forecasts_each_ticker(finance_run, tmp_path):
    summary, env = finance_run
    assert {"neural", "gjr_garch_t", "har"} <= set(summary["models"])
    prices = pd.read_csv(EXAMPLES / "finance" / "prices.csv")
    recent = prices.groupby("ticker").tail(70)  # what the README's request sends: the last 70 days of each ticker
    with served(env, tmp_path / "serve.log", "finance") as (url, first):
        assert "prices.csv" in first, first  # the champion on the example, not another data set's
        rows = answer(url, {"dataframe_split": {"columns": list(recent.columns), "data": recent.values.tolist()}})
    assert sorted(row["ticker"] for row in rows) == sorted(prices["ticker"].unique())
    for row in rows:
        assert {"ticker", "origin_date", "variance", "variance_5d", "volatility", "var_1pct", "var_5pct"} <= set(row)
        assert row["origin_date"] == prices["date"].max()
        assert 0 < row["variance"] < row["variance_5d"] and row["volatility"] == pytest.approx(row["variance"] ** 0.5)
        assert row["var_1pct"] < row["var_5pct"] < 0
        assert row["es_1pct"] < row["var_1pct"] and row["es_2_5pct"] < row["var_2_5pct"] < 0  # ES beyond its VaR


def scans_as_served(split: str) -> tuple[list[str], list]:
    """(labels, images) of the example scans in `split`, each read as the run reads it and as the README's request
    does: grey, resized to the 28 px the model is trained at (bilinear), uint8."""
    from PIL import Image

    manifest = pd.read_csv(EXAMPLES / "medical" / "manifest.csv")
    chosen = manifest[manifest["split"] == split]
    images = [Image.open(EXAMPLES / "medical" / path).convert("L").resize((28, 28), Image.Resampling.BILINEAR)
              for path in chosen["path"]]
    return chosen["label"].tolist(), [np.asarray(image).tolist() for image in images]


@pytest.fixture(scope="module")
def medical_run(tmp_path_factory):
    return run_example(tmp_path_factory, "medical", EXAMPLES / "medical" / "manifest.csv")


def test_medical_example_is_trained_on_and_its_served_model_scores_each_scan(medical_run, tmp_path):
    summary, env = medical_run
    assert {"resnet18", "logreg"} <= set(summary["models"])
    (run,) = runs("medical", env["MLFLOW_TRACKING_URI"])
    assert run.data.tags["positive_class"] == "malignant"
    assert [run.data.tags[f"data_{split}_images"] for split in ("train", "val", "test")] == ["42", "8", "14"]
    labels, images = scans_as_served("test")
    with served(env, tmp_path / "serve.log", "medical") as (url, first):
        assert "manifest.csv" in first, first
        rows = answer(url, {"inputs": images})
    assert len(rows) == len(labels) == 14
    for row in rows:
        assert set(row) == {"benign", "malignant"} and sum(row.values()) == pytest.approx(1)


@pytest.fixture(scope="module")
def recsys_run(tmp_path_factory):
    return run_example(tmp_path_factory, "recsys", EXAMPLES / "recsys" / "events.csv")


def test_recsys_example_is_trained_on_and_its_served_model_recommends_unseen_items_of_the_catalogue(recsys_run,
                                                                                                   tmp_path):
    summary, env = recsys_run
    models = summary["models"]
    assert models["ease"]["ndcg@10"] > models["pop"]["ndcg@10"]  # the example's taste signal is learned
    events = pd.read_csv(EXAMPLES / "recsys" / "events.csv")
    titles = dict(zip(events["item_id"], events["title"]))
    user = int(events["user_id"].iloc[0])
    with served(env, tmp_path / "serve.log", "recsys", "--workers", "1") as (url, first):
        assert "events.csv" in first, first
        rows = answer(url, {"dataframe_split": {"columns": ["user_id", "k"], "data": [[user, 3]]}})
    assert [(row["user_id"], row["rank"]) for row in rows] == [(user, 1), (user, 2), (user, 3)]
    items = [row["item_id"] for row in rows]
    assert len(set(items)) == 3 and set(items) <= set(titles)  # from the example's catalogue
    assert not set(items) & set(events.loc[events["user_id"] == user, "item_id"])  # none the user has rated
    assert [row["title"] for row in rows] == [titles[item] for item in items]
    assert rows[0]["score"] >= rows[1]["score"] >= rows[2]["score"]


@pytest.fixture(scope="module")
def slides_run(tmp_path_factory):
    return run_example(tmp_path_factory, "medical", EXAMPLES / "slides", key="slides")


def test_slides_example_is_trained_on_and_its_served_model_answers_each_test_slide_as_evaluated(slides_run, tmp_path):
    import mlflow

    summary, env = slides_run
    assert set(summary["models"]) == {"attention_mil", "mean_pool_logreg"}
    (run,) = runs("medical", env["MLFLOW_TRACKING_URI"])
    logged = mlflow.artifacts.download_artifacts(f"runs:/{run.info.run_id}/slides/test_probabilities.csv",
                                                 tracking_uri=env["MLFLOW_TRACKING_URI"])
    evaluated = {row["slide"]: float(row["probability"]) for row in csv.DictReader(open(logged))}
    with (EXAMPLES / "slides" / "labels.csv").open() as file:
        tested = [str(EXAMPLES / "slides" / row["slide"]) for row in csv.DictReader(file) if row["split"] == "test"]
    assert sorted(evaluated) == sorted(tested)
    with served(env, tmp_path / "serve.log", "medical", "--model-uri",
                "models:/gpu-usecases-medical-slides@champion") as (url, _):
        rows = answer(url, {"dataframe_split": {"columns": ["slide"], "data": [[slide] for slide in tested]}})
    assert [row["slide"] for row in rows] == tested
    for row in rows:
        assert row["probability"] == pytest.approx(evaluated[row["slide"]], abs=1e-6)
        assert isinstance(row["positive"], bool) and json.loads(row["top_tiles"])
