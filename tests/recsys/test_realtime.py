"""Events in, recommendations out: every served form folds a request's `recent_items` into the user's history, a
user never trained on gets a personal list (from their request's events, or from the events the run knew of them),
consumed items are not recommended back, unknown ids are counted."""

import numpy as np
import pandas as pd
import pytest
import torch

from common.job import Job
from common.runtime.devices import Runtime
from common.tracking.runs import Tracker
from tests.recsys.test_serving import CLUSTER_ITEMS, bundle, cluster_of, clustered_log, four_cluster_log, served
from usecases.recsys import config as cfg
from usecases.recsys.baselines import ALS, EASE, ItemKNN, als_available
from usecases.recsys.data import load_interactions
from usecases.recsys.models import BPR, LightGCN, NegativeSampler
from usecases.recsys.served import served_form, serving_bundle
from usecases.recsys.requests import parse_rows
from usecases.recsys.serving import RecommenderModel

CPU = torch.device("cpu")


def trained(model, train, steps=300):
    """A few hundred full-batch BPR steps: enough to separate the two clusters."""
    users, items = train.nonzero()
    users, items = torch.from_numpy(users.astype(np.int64)), torch.from_numpy(items.astype(np.int64))
    optimiser = torch.optim.Adam(model.parameters(), lr=0.05)
    for _ in range(steps):
        optimiser.zero_grad()
        model(users, items).backward()
        optimiser.step()
    return model


@pytest.fixture(scope="module")
def clustered(tmp_path_factory):
    config = cfg.Config(data={"source": "file", "columns": {"rating": None}}, split="temporal")
    return config, load_interactions(config, clustered_log(tmp_path_factory.mktemp("log")))


SCORERS = {
    "ease": lambda data, train: EASE(train, cfg.EASE(l2=1.0), CPU),
    "itemknn": lambda data, train: ItemKNN(train, cfg.ItemKNN(), CPU),
    "als": lambda data, train: ALS(train, cfg.ALS(factors=4, iterations=10), CPU),
    "bpr": lambda data, train: trained(BPR(data.n_users, data.n_items, 4, NegativeSampler(train, CPU)), train),
    "lightgcn": lambda data, train: trained(LightGCN(train, 4, 2, NegativeSampler(train, CPU), CPU), train),
}
FORMS = [("ease", None), ("itemknn", None), ("als", None), ("bpr", "gradient"), ("lightgcn", "graph"),
         ("lightgcn", "gradient")]


def served_model(clustered, name: str, method: str | None, fitted=None) -> RecommenderModel:
    """The served form of model `name` (fold-in by `method`) trained on the clustered log (or `fitted`, the model
    already trained), as the pipeline logs it; `sasrec` an untrained network, `pop` popularity alone."""
    config, data = clustered
    if name == "als" and not als_available():
        pytest.skip("implicit is not installed")
    if method:
        config = config.model_copy(update={"serving": cfg.Serving(foldin={name: method})})
    train = data.matrix("train")
    torch.manual_seed(0)
    form = {"sasrec": lambda: sequence_bundle(data, train), "pop": lambda: {"kind": "popularity"}}.get(
        name, lambda: served_form(fitted or SCORERS[name](data, train), config, train))()
    return RecommenderModel.from_bundle(serving_bundle(form, data, config, data.matrix("known")))


@pytest.fixture(scope="module")
def four_clusters(tmp_path_factory):
    """The issue's log: 60 newcomers, all of whose events come after the training cut of a 5:2.5:2.5 split."""
    config = cfg.Config(data={"source": "file", "columns": {"rating": None}}, split="temporal",
                        split_ratios=[0.5, 0.25, 0.25])
    return config, load_interactions(config, four_cluster_log(tmp_path_factory.mktemp("clusters")))


@pytest.fixture(scope="module")
def fitted_on_four_clusters(four_clusters):
    """Each model trained once on the four-cluster log (EASE less overfit than on the tiny two-cluster log)."""
    _, data = four_clusters
    train, fitted = data.matrix("train"), {}
    scorers = {**SCORERS, "ease": lambda data, train: EASE(train, cfg.EASE(l2=10.0), CPU)}

    def fitted_model(name: str):
        if name not in fitted:
            torch.manual_seed(0)
            fitted[name] = scorers[name](data, train)
        return fitted[name]

    return fitted_model


NEWCOMER_FORMS = [("ease", None), ("itemknn", None), ("als", None), ("bpr", "gradient"), ("bpr", "least_squares"),
                  ("lightgcn", "least_squares"), ("lightgcn", "gradient"), ("lightgcn", "graph")]


@pytest.mark.parametrize(("name", "method"), NEWCOMER_FORMS)
def test_users_first_seen_after_the_cut_get_their_own_cluster_without_recent_items(four_clusters,
                                                                                     fitted_on_four_clusters, name,
                                                                                     method):
    """The served model knows the newcomers' events but trained on none of them: nine in ten of them get a top ten
    mostly (five or more) of their own cluster, from their known events alone, as a stranger who sends the same
    events gets it (the bundle's fold-in, from zero); popularity gave it to the popular cluster's quarter only."""
    config, data = four_clusters
    if name == "als" and not als_available():
        pytest.skip("implicit is not installed")
    model = served_model(four_clusters, name, method, fitted_on_four_clusters(name))
    train, known = data.matrix("train"), data.matrix("known")
    newcomers = [code for code, raw in enumerate(data.user_ids) if isinstance(raw, str) and raw.startswith("n")]
    assert len(newcomers) == 60 and all(train[code].nnz == 0 and known[code].nnz == 7 for code in newcomers)
    answer = model.predict(None, pd.DataFrame({"user_id": data.user_ids[newcomers], "k": 10}))  # one batch
    mostly_own = 0
    for code in newcomers:
        user, items = data.user_ids[code], data.item_ids[known[code].indices]
        clusters = [cluster_of(item) for item in items]
        listed = answer[answer["user_id"] == user]
        assert len(listed) == 10 and not set(items) & set(listed["item_id"])
        mostly_own += sum(cluster_of(item) == max(clusters, key=clusters.count) for item in listed["item_id"]) >= 5
        alone_items, alone_scores = model.recommender.recommend(code, np.zeros(0, np.int64), 10)
        stranger = model.predict(None, pd.DataFrame({"user_id": ["stranger"], "recent_items": [list(items)]}),
                                 {"k": 10})
        for scores in (alone_scores, stranger["score"].to_numpy()):
            np.testing.assert_allclose(scores, listed["score"].to_numpy(), rtol=1e-4, atol=1e-5)
        above = listed["score"].to_numpy() > listed["score"].iloc[-1] + 1e-4  # ties at the tenth may fall either way
        assert set(listed["item_id"][above]) == set(data.item_ids[alone_items][above]) == \
            set(stranger["item_id"][above])
    assert mostly_own >= 0.9 * len(newcomers), f"{mostly_own} of {len(newcomers)}"


def test_the_run_ranks_users_first_seen_in_validation_as_served_at_the_test_cut(four_clusters, tmp_path):
    """`served_untrained_ndcg@10`: the newcomers who have validation events are ranked against their test items by
    each served form knowing what was known at the test cut; a form that serves them from their events ranks their
    cluster, popularity does not."""
    from usecases.recsys.pipeline import run, untrained_truth

    config, data = four_clusters
    config = config.model_copy(update={
        "models": ["pop", "ease", "bpr"], "ease": cfg.EASE(l2=10.0), "evaluation": cfg.Evaluation(replay=True),
        "bpr": cfg.Learned(dim=8, epochs=30, patience=None, batch_size=256, lr=0.02),
        "serving": cfg.Serving(latency_users=2, foldin={"bpr": "least_squares"})})
    seen_before_test = (data.matrix("train") + data.matrix("val_events")).sign().tocsr()
    truth = untrained_truth(data, seen_before_test, config)
    without_rows = set(np.flatnonzero(np.diff(data.matrix("train").indptr) == 0))
    first_in_validation = without_rows & set(data.val_events["user"]) & set(data.test_events["user"])
    assert set(np.flatnonzero(np.diff(truth.indptr))) == first_in_validation and len(first_in_validation) > 40
    assert not truth.multiply(seen_before_test).nnz  # what they had consumed by the cut is not asked for
    models = run(config, data, Job(Runtime(CPU, None), Tracker(active=False), tmp_path / "checkpoints")).models
    untrained = {name: metrics["served_untrained_ndcg@10"] for name, metrics in models.items()}
    assert min(untrained["ease"], untrained["bpr"]) > 1.5 * untrained["pop"], untrained  # popularity: 1 times


@pytest.mark.parametrize(("name", "method"), FORMS)
def test_a_stranger_with_three_events_gets_their_cluster_without_the_events(clustered, name, method):
    model = served_model(clustered, name, method)
    cold = model.predict(None, pd.DataFrame({"user_id": ["stranger"], "k": [5]}))
    assert all(item <= CLUSTER_ITEMS for item in cold["item_id"])  # cluster A is the popular one
    recent = [CLUSTER_ITEMS + 1, CLUSTER_ITEMS + 2, CLUSTER_ITEMS + 3]
    warm = model.predict(None, pd.DataFrame({"user_id": ["stranger"], "recent_items": [recent]}), {"k": 5})
    assert len(warm) == 5 and not set(recent) & set(warm["item_id"])
    assert all(item > CLUSTER_ITEMS for item in warm["item_id"]), list(warm["item_id"])


def test_a_known_users_events_join_their_history_and_are_not_recommended_back():
    model = served("item_item")  # item i points to i + 1; user 100 has seen item 11
    before = model.predict(None, pd.DataFrame({"user_id": [100]}), {"k": 4})
    assert list(before["item_id"])[:1] == [12]
    after = model.predict(None, pd.DataFrame({"user_id": [100], "recent_items": [[12]]}), {"k": 4})
    assert list(after["item_id"])[:1] == [13] and 12 not in set(after["item_id"])


def test_unknown_event_ids_are_skipped_and_counted():
    model = served("item_item")
    answer = model.predict(None, pd.DataFrame({"user_id": [100, 200], "recent_items": [["nope", 12, 999], []]}))
    assert list(answer["unknown_recent_items"]) == [2, 2, 0, 0]
    assert list(answer[answer["user_id"] == 100]["item_id"])[:1] == [13]


def test_only_unknown_events_answer_as_without_events():
    model = served("factors")
    plain = model.predict(None, pd.DataFrame({"user_id": [100]}))
    unknown = model.predict(None, pd.DataFrame({"user_id": [100], "recent_items": [["nope"]]}))
    assert list(unknown["item_id"]) == list(plain["item_id"]) and list(unknown["unknown_recent_items"]) == [1, 1]


def test_factor_foldin_uses_the_bundles_method():
    raw = bundle("factors")
    raw["foldin"] = {"method": "least_squares", "regularization": 0.1}
    model = RecommenderModel.from_bundle(raw)
    # the stranger's single event, item 14 (factor 1): least squares gives p = 1 / (30 + 0.1) > 0, items by factor
    answer = model.predict(None, pd.DataFrame({"user_id": ["stranger"], "recent_items": [[14]]}), {"k": 3})
    assert list(answer["item_id"]) == [11, 12, 13]


def test_auto_serves_the_foldin_method_that_replays_a_sample_of_the_validation_period_best(clustered, monkeypatch):
    from usecases.recsys import served

    config, data = clustered
    config = config.model_copy(update={"evaluation": cfg.Evaluation(replay=True)})
    train = data.matrix("train")
    torch.manual_seed(0)
    form = served_form(SCORERS["lightgcn"](data, train), config, train)
    assert set(form["foldin_choices"]) == {"least_squares", "gradient", "graph"}
    fresh = {"least_squares": 0.1, "gradient": 0.3, "graph": 0.2}
    asked = []

    def replayed(name, recommender, events, config, period, users=None):
        asked.append(users)
        return {"replay_fresh_ndcg@10": fresh[recommender.form.foldin.spec.method]}

    monkeypatch.setattr(served, "replayed", replayed)
    cut = served.Cut(train, (data.train,))
    period = data.val_events["user"].nunique()
    sampled = config.model_copy(update={"serving": cfg.Serving(foldin={"choice_users": period - 1})})
    chosen, figures, replay = served.chosen_foldin("lightgcn", form, data, sampled, cut, CPU)
    assert chosen["foldin"]["method"] == "gradient" and "foldin_choices" not in chosen
    assert asked == [period - 1] * 3 and replay is None  # the chosen method's whole replay is still to run
    assert figures == {f"foldin_{method}_val_replay_ndcg@10": value for method, value in fresh.items()}
    every = config.model_copy(update={"serving": cfg.Serving(foldin={"choice_users": period + 5})})
    _, _, replay = served.chosen_foldin("lightgcn", form, data, every, cut, CPU)
    assert asked[3:] == [period] * 3 and replay == {"replay_fresh_ndcg@10": 0.3}  # the whole one: reused
    without_replay, none, no_replay = served.chosen_foldin("lightgcn", form, data, config.model_copy(
        update={"evaluation": cfg.Evaluation(replay=False)}), cut, CPU)
    assert without_replay["foldin"]["method"] == "least_squares" and none == {} and no_replay is None


def test_a_factor_model_logged_without_foldin_answers_from_its_trained_rows():
    model = served("factors")  # the bundle has no `foldin`: as logged before fold-in existed
    warm = model.predict(None, pd.DataFrame({"user_id": [100], "recent_items": [[12]]}), {"k": 3})
    assert list(warm["item_id"]) == [13, 14]  # by the trained vector (popularity would give 14, 13); 12 consumed


def sequence_bundle(data, train) -> dict:
    """A SASRec served form (untrained weights: the batch and one-at-a-time paths must agree on any network)."""
    from usecases.recsys.train import sequences_by_user
    from usecases.recsys.sequence import SASRecNetwork, SequenceScorer, left_padded, served_sequence_form

    torch.manual_seed(0)
    network = SASRecNetwork(n_items=data.n_items, dim=8, layers=1, heads=2, dropout=0.0, max_len=6).eval()
    return served_sequence_form(SequenceScorer(network, left_padded(sequences_by_user(data.train, data.n_users), 6)))


def batch_requests(data) -> tuple[np.ndarray, list[np.ndarray]]:
    """Known users and a stranger, without events, with known events, with only unknown ones and with repeats."""
    users = np.asarray([1, 2, 3, 5, 8, 13, 0, 0, 4, 6], np.int64)  # code 0: a user the run never read
    items = np.arange(1, data.n_items)
    events = [np.zeros(0, np.int64), items[:3], items[-2:], np.asarray([0, 0]), items[[4, 4, 9]],
              np.zeros(0, np.int64), items[-3:], np.zeros(0, np.int64), items[:1], np.asarray([0, items[7]])]
    return users, events


@pytest.mark.parametrize(("name", "method"), [*FORMS, ("sasrec", None), ("pop", None)])
def test_a_micro_batch_answers_as_each_request_alone(clustered, name, method):
    """`recommend_batch` (the GPU path, run here on the CPU) gives each row the list `recommend` gives it alone:
    the same scores and, above the k-th score (ties there may fall either way), the same items."""
    _, data = clustered
    recommender = served_model(clustered, name, method).recommender
    users, events = batch_requests(data)
    batched = recommender.to(CPU).recommend_batch(users, events, 6)
    for user, row, (items, scores) in zip(users.tolist(), events, batched):
        alone_items, alone_scores = recommender.recommend(user, row, 6)
        assert np.allclose(scores, alone_scores, rtol=1e-4, atol=1e-5), (name, user, row)
        above = scores > scores[-1] + 1e-4
        assert set(items[above]) == set(alone_items[above]), (name, user, row)
        assert not set(items) & {0, *row.tolist()}  # never the unknown item nor an event


def test_the_model_answers_a_batch_of_requests_each_at_its_own_k(clustered):
    config, data = clustered
    train = data.matrix("train")
    model = RecommenderModel.from_bundle(serving_bundle(served_form(SCORERS["ease"](data, train), config, train),
                                                        data, config, data.matrix("known")))
    first = parse_rows({"user_id": [data.user_ids[1], "stranger"]}, 2)
    second = parse_rows({"user_id": [data.user_ids[2]], "recent_items": [[data.item_ids[3]]]}, 1)
    together = model.recommend_requests([(first, 2, ()), (second, 5, [[data.item_ids[4]]])])
    assert together == [model.recommend(first, 2), model.recommend(second, 5, [[data.item_ids[4]]])]
    model.recommender.to(CPU)
    model.recommender.form.device = torch.device("meta")  # any device but the CPU: every row through recommend_batch
    with pytest.raises(NotImplementedError):  # (no meta kernels for the sparse product: the path was taken)
        model.recommend(first, 2)
