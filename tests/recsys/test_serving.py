"""The served forms answer like the models, leave seen items out, and send strangers the popular items."""

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp
import torch
from mlflow.exceptions import MlflowException

from usecases.recsys import config as cfg
from usecases.recsys.baselines import EASE, ItemKNN, Popularity
from usecases.recsys.data import load_interactions
from usecases.recsys.served import served_form, serving_bundle
from common.serving.bundle import load_bundle, save_bundle
from usecases.recsys.served import latency
from usecases.recsys.serving import Recommender, RecommenderModel


def bundle(kind="factors"):
    history = sp.csr_matrix(np.array([[0, 0, 0, 0, 0], [0, 1, 0, 0, 0], [0, 0, 1, 1, 0]], dtype=np.float32))
    base = {"history": history, "seen": history, "popularity": np.array([0, 5, 9, 1, 3], dtype=np.float32),
            "user_ids": np.array([-1, 100, 200]), "item_ids": np.array([-1, 11, 12, 13, 14]),
            "titles": np.array(["", "a", "b", "c", "d"], dtype=object), "k": 2, "latency_users": 5}
    if kind == "factors":
        return {**base, "kind": kind, "trained": torch.tensor([False, True, True]),
                "users": torch.tensor([[0.0], [1.0], [-1.0]]),
                "items": torch.tensor([[0.0], [4.0], [3.0], [2.0], [1.0]])}
    if kind == "item_item":
        return {**base, "kind": kind, "similarity": sp.csr_matrix(np.eye(5, k=1, dtype=np.float32))}
    return {**base, "kind": kind}


def served(kind):
    model = RecommenderModel()
    model.load(bundle(kind))
    return model


def test_factors_rank_unseen_items_and_strangers_get_popular_ones():
    answer = served("factors").predict(None, pd.DataFrame({"user_id": [100, 999]}))
    mine = answer[answer["user_id"] == 100]
    assert list(mine["item_id"]) == [12, 13] and list(mine["title"]) == ["b", "c"]  # 11 was seen
    assert list(answer[answer["user_id"] == 999]["item_id"]) == [12, 11]


def test_item_item_scores_the_history_through_the_similarity():
    scores = Recommender(bundle("item_item")).score(torch.tensor([2]))
    assert scores[0].tolist() == [0, 0, 0, 1, 1]  # items 2 and 3 point to 3 and 4


def test_popularity_form_and_k_from_the_input():
    answer = served("popularity").predict(None, pd.DataFrame({"user_id": [200], "k": [3]}))
    assert list(answer["item_id"]) == [11, 14]  # only two items are left unseen: no padding rows


@pytest.mark.parametrize(("frame", "match"), [(pd.DataFrame({"user": [1]}), "missing column 'user_id'"),
                                              (pd.DataFrame({"user_id": [100], "k": [0]}), "k row 0 must be")])
def test_bad_requests_are_named(frame, match):
    with pytest.raises(MlflowException, match=match):
        served("factors").predict(None, frame)


def test_latency_times_one_user_requests_and_one_batch_through_predict(monkeypatch):
    """On a scripted clock: the single requests take 1..5 ms, the batch 2 s; the figures are theirs."""
    from types import SimpleNamespace

    from usecases.recsys import served as publish

    model, now, requests = served("factors"), [0.0], []
    answer = model.predict

    def timed_predict(context, frame):
        requests.append(len(frame))
        now[0] += 2.0 if len(frame) > 1 else len(requests) / 1000
        return answer(context, frame)

    monkeypatch.setattr(model, "predict", timed_predict)
    monkeypatch.setattr(publish, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    figures = latency(model, np.array([100, 200]), single=5)
    assert requests == [1] * 5 + [publish.LATENCY_BATCH]
    assert figures["latency_p50_ms"] == pytest.approx(3.0) and figures["latency_p95_ms"] == pytest.approx(4.8)
    assert figures["batch_users_per_s"] == pytest.approx(publish.LATENCY_BATCH / 2.0)


@pytest.mark.parametrize("kind", ["factors", "item_item", "popularity"])
@pytest.mark.parametrize("ids", ["integers", "text"])
def test_the_logged_bundle_loads_with_weights_only_and_answers_the_same(tmp_path, kind, ids):
    """Nothing pickled: torch's weights_only loader reads the bundle, and the model answers as before."""
    raw = bundle(kind)
    if ids == "text":
        raw["user_ids"] = np.array([None, "u100", "u200"], dtype=object)
        raw["item_ids"] = np.array([None, "i11", "i12", "i13", "i14"], dtype=object)
    save_bundle(raw, tmp_path / "bundle.pt")
    loaded = load_bundle(tmp_path / "bundle.pt")
    assert loaded["item_ids"].dtype == raw["item_ids"].dtype
    users = pd.DataFrame({"user_id": [raw["user_ids"][1], raw["user_ids"][2], "stranger"]})
    expected, model = RecommenderModel(), RecommenderModel()
    expected.load(raw)
    model.load(loaded)
    pd.testing.assert_frame_equal(model.predict(None, users), expected.predict(None, users))


CLUSTER_ITEMS = 20  # cluster A: items 1-20, cluster B: items 21-40


def clustered_log(path: Path) -> Path:
    """Forty users of cluster A and twenty of B, with two late events each, and ten users (n1..n10, half of each
    cluster) whose events all come after the temporal cut: cluster A's items are the popular ones."""
    rng = np.random.default_rng(0)
    rows = []
    for index, cluster in enumerate(["A"] * 40 + ["B"] * 20 + ["A", "B"] * 5):
        newcomer = index >= 60
        user = f"n{index - 59}" if newcomer else f"u{index}"
        first = 1 if cluster == "A" else CLUSTER_ITEMS + 1
        items = rng.choice(np.arange(first, first + CLUSTER_ITEMS), size=8, replace=False)
        late = 500 + index * 2 + np.arange(2)  # times 500-619; the training cut falls at 588
        times = 588 + (index - 60) * 8 + np.arange(8) if newcomer else np.r_[index * 6 + np.arange(6), late]
        rows += [(user, int(item), int(time)) for item, time in zip(items, times)]
    pd.DataFrame(rows, columns=["user_id", "item_id", "timestamp"]).to_csv(path / "log.csv", index=False)
    return path / "log.csv"


CLUSTERS, PER_CLUSTER = 4, 20  # cluster c holds items 20c+1 .. 20c+20
TRAINED_PER_CLUSTER = (60, 45, 35, 25)  # cluster 0's items are the popular ones
NEWCOMERS_PER_CLUSTER = 15


def cluster_of(item: int) -> int:
    return (int(item) - 1) // PER_CLUSTER


def four_cluster_log(path: Path) -> Path:
    """Users of four item clusters: each picks six items of their cluster and one of another. The trained users (by
    cluster 60, 45, 35, 25: cluster 0 is the popular one) have five events early and two late; the 60 newcomers
    (n1..n60, 15 per cluster) have all seven late, in the validation and test periods of a 6:2:2 temporal split,
    so that the model never trains on them. The late events are shuffled in time: newcomers first seen in the
    validation period have a history at the test cut."""
    rng = np.random.default_rng(0)
    early, late = [], []
    users = [(f"u{index}", cluster, False) for index, cluster in
             enumerate(c for c, count in enumerate(TRAINED_PER_CLUSTER) for _ in range(count))]
    users += [(f"n{index + 1}", index % CLUSTERS, True) for index in range(NEWCOMERS_PER_CLUSTER * CLUSTERS)]
    for user, cluster, newcomer in users:
        own = rng.choice(np.arange(1, PER_CLUSTER + 1) + cluster * PER_CLUSTER, size=6, replace=False)
        other = rng.choice([c for c in range(CLUSTERS) if c != cluster]) * PER_CLUSTER + rng.integers(PER_CLUSTER) + 1
        items = [int(item) for item in rng.permutation([*own, other])]
        late += [(user, item) for item in (items if newcomer else items[5:])]
        early += [] if newcomer else [(user, item) for item in items[:5]]
    late = [late[index] for index in rng.permutation(len(late))]
    rows = [(user, item, time) for time, (user, item) in enumerate(early + late)]
    pd.DataFrame(rows, columns=["user_id", "item_id", "timestamp"]).to_csv(path / "clusters.csv", index=False)
    return path / "clusters.csv"


@pytest.mark.parametrize("form", ["ease", "itemknn", "pop"])
def test_users_first_seen_after_the_temporal_cut_are_served_from_their_own_history_or_popularity(tmp_path, form):
    """Never from an empty history row (the lowest item codes); the factor forms fold the history in (in
    test_realtime.py, on models trained enough to have clusters)."""
    config = cfg.Config(data={"source": "file", "columns": {"rating": None}}, split="temporal")
    data = load_interactions(config, clustered_log(tmp_path))
    train, known = data.matrix("train"), data.matrix("known")
    newcomers = [code for code, raw in enumerate(data.user_ids) if isinstance(raw, str) and raw.startswith("n")]
    assert newcomers and all(train[code].nnz == 0 and known[code].nnz == 8 for code in newcomers)
    scorer = {"ease": lambda: EASE(train, cfg.EASE(l2=1.0), torch.device("cpu")),
              "itemknn": lambda: ItemKNN(train, cfg.ItemKNN(), torch.device("cpu")),
              "pop": lambda: Popularity(train, torch.device("cpu"))}[form]()
    bundle = serving_bundle(served_form(scorer, config, data.matrix("train")), data, config, known)
    np.testing.assert_array_equal(bundle["popularity"], np.asarray(known.sum(axis=0)).ravel())
    model = RecommenderModel.from_bundle(bundle)
    popular = pd.Series(bundle["popularity"][1:], index=data.item_ids[1:])
    for code in newcomers:
        user = data.user_ids[code]
        answer = model.predict(None, pd.DataFrame({"user_id": [user], "k": [5]}))
        own = set(data.item_ids[known[code].indices])
        assert len(answer) == 5 and not own & set(answer["item_id"]), "a seen item came back"
        if form in ("ease", "itemknn"):
            cluster_b = min(own) > CLUSTER_ITEMS
            assert all((item > CLUSTER_ITEMS) == cluster_b for item in answer["item_id"]), (user, list(answer["item_id"]))
        else:
            expected = popular.drop(list(own)).sort_values(ascending=False, kind="stable")
            assert set(answer["item_id"]) <= set(expected[expected >= expected.iloc[4]].index)
