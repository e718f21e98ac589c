"""The smoke preset end to end, as a user runs it: every model in the summary, its phases timed, the served model
answering."""

import json
import sys

import mlflow
import numpy as np
import pandas as pd
import pytest

from common.config import load_config
from tests.cli_helpers import assert_rejected, runs, user_error, usecases
from usecases.recsys import USECASE, Config
from usecases.recsys.data import load_interactions

pytestmark = pytest.mark.starts_first(8)  # the default suite's longest files first (tests/conftest.py)

REQUIRED = {"recall@10", "ndcg@10", "hit@10", "mrr@10", "precision@10", "coverage@10"}


@pytest.fixture(scope="module")
def smoke(smoke_runs):
    """The session's smoke run (tests/conftest.py), shared by the checks below."""
    run = smoke_runs("recsys")
    return run.uri, run.summary


def test_every_model_is_scored_and_learns_more_than_random(smoke):
    _, summary = smoke
    models = summary["models"]
    assert {"pop", "itemknn", "ease", "bpr", "lightgcn"} <= set(models)
    for name, metrics in models.items():
        assert REQUIRED <= set(metrics), name
        assert metrics["ndcg@10"] > 0.05, name  # random ranking of ~1000 items scores about 0.01
    assert max(metrics["ndcg@10"] for metrics in models.values()) > models["pop"]["ndcg@10"]


def test_every_models_served_form_scores_as_the_model_evaluated(smoke):
    """EASE's 1,000-item matrix fits serving.max_similarity_mb, so it is served whole: no model loses NDCG to the form
    it is served in (scores differ only in float rounding). With the history known at the test cut it does no worse."""
    _, summary = smoke
    for name, metrics in summary["models"].items():
        assert metrics["served_ndcg@10"] == pytest.approx(metrics["ndcg@10"], abs=1e-4), name
        assert metrics["served_fresh_ndcg@10"] >= metrics["served_ndcg@10"] - 0.01, name


def test_served_model_recommends_unseen_items_and_popular_ones_to_strangers(smoke):
    uri, summary = smoke
    (run,) = runs("recsys", uri)
    assert run.info.status == "FINISHED"
    served = run.data.tags["served_model"]
    timed = [name for name, metrics in summary["models"].items() if "latency_p50_ms" in metrics]
    assert timed == [served], "the latency is the served model's, timed as it is served"
    for figure in ("latency_p50_ms", "latency_p95_ms", "batch_users_per_s"):
        assert run.data.metrics[f"test/{served}/{figure}"] == pytest.approx(summary["models"][served][figure])
    mlflow.set_tracking_uri(uri)
    model = mlflow.pyfunc.load_model(f"runs:/{run.info.run_id}/model")
    data = load_interactions(load_config(Config, USECASE.presets_dir, "smoke"), None)
    user_code = 5
    user = data.user_ids[user_code]
    answer = model.predict(pd.DataFrame({"user_id": [user], "k": [10]}))
    assert len(answer) == 10 and list(answer["rank"]) == list(range(1, 11))
    known = data.matrix("known")  # the served model knows every event of the run, validation and test included
    latest = max(int(frame["timestamp"].max()) for frame in (data.train, data.val_events, data.test_events))
    assert model.unwrap_python_model().events_after == latest, "a server folds in only the events after them"
    assert not set(data.item_ids[known[user_code].indices]) & set(answer["item_id"])
    stranger = model.predict(pd.DataFrame({"user_id": [-12345], "k": [5]}))
    popularity = np.asarray(known.sum(axis=0)).ravel()
    assert list(stranger["score"]) == sorted(popularity, reverse=True)[:5]  # the five most popular, ties aside
    assert (popularity[np.searchsorted(data.item_ids[1:], stranger["item_id"]) + 1] == stranger["score"]).all()


def test_the_run_times_each_models_phases_and_says_how_they_scale(smoke):
    uri, summary = smoke
    (run,) = runs("recsys", uri)
    scales = json.loads(run.data.tags["time_phases"])
    for name in summary["models"]:  # each model's phases timed apart, and inner phases counted once in the whole
        for phase in ("fit", "evaluate", "replay"):
            assert run.data.metrics[f"time/{phase}/{name}_s"] > 0, (phase, name)
    assert sum(run.data.metrics[f"time/{phase}_s"] for phase in scales) <= run.data.metrics["time/total_s"]
    assert {"foldin/bpr", "foldin/lightgcn"} <= set(scales)  # the fold-in choice, on a sample of the validation users
    assert scales["serving_bundle"] == "serial" and scales["fit/ease"] == scales["replay/ease"] == "device"


def test_models_with_item_vectors_are_also_served_by_two_stages_that_keep_the_exact_top_10(smoke, capsys, tmp_path,
                                                                                           monkeypatch):
    """Issue 33: each factor and sequence model is indexed (FAISS, its search effort tuned) and its two-stage form
    ranked beside the exact one; the served model carries its index, `serving.retrieval: auto` serves ann only where
    exact ranking's measured p95 is above 5 ms, and the server refuses an index of another model in one line."""
    import faiss

    uri, summary = smoke
    for name in ("als", "bpr", "lightgcn", "sasrec"):
        metrics = summary["models"][name]
        assert metrics["ann_recall@10"] >= 0.95 and metrics["ann_index_mb"] > 0 and metrics["ann_search_effort"] >= 1
        assert metrics["ann_served_ndcg@10"] == pytest.approx(metrics["served_ndcg@10"], abs=0.01), name
    (run,) = runs("recsys", uri)
    served = summary["models"][run.data.tags["served_model"]]
    mlflow.set_tracking_uri(uri)
    model = mlflow.pyfunc.load_model(f"runs:/{run.info.run_id}/model").unwrap_python_model()
    index = model.recommender.index
    chosen = "ann" if served["exact_latency_p95_ms"] > 5 and index.recall >= index.target else "exact"
    assert run.data.tags["retrieval"] == chosen == model.recommender.retrieval
    assert served["latency_p95_ms"] == served[f"{chosen}_latency_p95_ms"]
    users = np.asarray(model.user_ids[1:60])
    exact = model.recommender.use_retrieval("exact").top_k(np.arange(1, 60), 10)[0]
    ann = model.recommender.use_retrieval("ann").top_k(np.arange(1, 60), 10)[0]
    assert len(users) and np.mean([len(set(a) & set(b)) / 10 for a, b in zip(ann, exact)]) >= 0.95
    faiss.write_index(faiss.IndexFlatIP(3), str(tmp_path / "other.faiss"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    line = user_error(capsys, "serve", "recsys", "--model-uri", f"runs:/{run.info.run_id}/model", "--ann-index",
                      str(tmp_path / "other.faiss"), "--port", "1")
    assert "other.faiss: the index holds 0 vectors of dimension 3, the model" in line and "another model" in line
    from common.server_plugin import ServerSettings
    from usecases.recsys import server

    modules, path = set(sys.modules), list(sys.path)
    server._check_retrieval(ServerSettings(f"runs:/{run.info.run_id}/model", retrieval="ann"))  # an index it has
    assert set(sys.modules) == modules and sys.path == path, "the model is checked in a process of its own"


def test_a_log_without_its_user_column_is_one_line(capsys, tmp_path):
    log = tmp_path / "clicks.csv"
    pd.DataFrame({"customer": [1, 2], "item_id": [3, 4], "timestamp": [10, 20]}).to_csv(log, index=False)
    assert_rejected(capsys, "recsys", "run", "recsys", "--preset", "smoke", "--data", str(log),
                    names=("missing column 'user_id'", "clicks.csv"))


def test_bench_reports_epoch_and_ranking_speed_against_the_plain_loop_and_implicit(tmp_path):
    summary = tmp_path / "bench.json"
    result = usecases("bench", "run", "recsys", "--preset", "smoke", "--set", "benchmark.epochs=2", "--summary", str(summary))
    assert result.returncode == 0, result.stderr[-3000:]
    models = json.loads(summary.read_text())["models"]
    ours, plain = models["pipeline"], models["plain_loop"]
    assert set(models) == {"pipeline", "plain_loop", "implicit"} and plain["seconds_per_epoch"] > 0
    (run,) = runs("recsys-benchmark")
    assert run.info.status == "FINISHED"
    history = mlflow.MlflowClient().get_metric_history(run.info.run_id, "throughput/samples_per_s")
    assert sorted(metric.step for metric in history) == [0, 1], "our loop trained the 2 epochs asked for"
    counted = next(metric.value for metric in history if metric.step == 1)
    pairs = run.data.metrics["model/bpr/samples_per_epoch"]
    assert ours["seconds_per_epoch"] == pytest.approx(pairs / counted), "the loop's own epoch after the warm-up"
    assert run.data.metrics["test/implicit/ranking_users_per_s"] == pytest.approx(
        models["implicit"]["ranking_users_per_s"])
