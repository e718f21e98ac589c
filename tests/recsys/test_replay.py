"""The replay ranks a chunk of events in one call and gains, event for event, what ranking each event alone with
`Recommender.recommend` gains, in every served form: factors with each fold-in method, the item-item matrix dense
and sparse, the sequence network, popularity; with users never trained on (their events all in the replay, or their
first ones known to the served model: served from that history, factors folded in), seen items left out, repeated
events and chunks that cut a user's events in two."""

import math

import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp
import torch

from usecases.recsys import config as cfg
from usecases.recsys.data import Interactions
from usecases.recsys.foldin import FoldIn
from usecases.recsys.served import serving_bundle
from usecases.recsys.served import replay, replay_gains
from usecases.recsys.train import sequences_by_user
from usecases.recsys.sequence import SASRecNetwork, SequenceScorer, left_padded, served_sequence_form
from usecases.recsys.serving import Recommender

ITEMS, TRAINED, NEWCOMERS, DIM = 40, 45, 6, 6


def interactions() -> Interactions:
    """Item i is in the training histories of 41 - i users (distinct counts: popularity has no ties, so which of two
    equal items comes first cannot differ between the two paths); then the validation period: eight trained users and
    six newcomers, six to nine events each, one of them seen before and one repeated."""
    generator = np.random.default_rng(0)
    train = [(int(user), item, 0) for item in range(1, ITEMS + 1)
             for user in generator.choice(np.arange(1, TRAINED + 1), size=41 - item, replace=False)]
    frame = pd.DataFrame(train, columns=["user", "item", "timestamp"])
    val = []
    for user in [*range(1, 9), *range(TRAINED + 1, TRAINED + NEWCOMERS + 1)]:
        items = generator.choice(np.arange(1, ITEMS + 1), size=generator.integers(6, 10), replace=False)
        items[-1] = items[1]  # an event repeated
        seen = frame.loc[frame["user"] == user, "item"].to_numpy()
        if len(seen):
            items[2] = seen[0]  # an item of their history again
        val += [(user, int(item), 100 + 10 * user + position) for position, item in enumerate(items)]
    events = pd.DataFrame(val, columns=["user", "item", "timestamp"]).sample(frac=1, random_state=0)  # any row order
    empty = events.iloc[:0]
    return Interactions(frame, events, empty, np.arange(-1, TRAINED + NEWCOMERS + 1), np.arange(-1, ITEMS + 1), None,
                        "replay", "", val_events=events)


DATA = interactions()
NEWCOMER_FIRST = DATA.val_events[DATA.val_events["user"] > TRAINED].sort_values("timestamp").groupby("user").head(3)
RANDOM = np.random.default_rng(1)
USER_FACTORS = torch.from_numpy(RANDOM.normal(size=(DATA.n_users, DIM)).astype(np.float32))
ITEM_FACTORS = torch.from_numpy(RANDOM.normal(size=(DATA.n_items, DIM)).astype(np.float32))
# half the pairs without a weight; the sparse form's are positive, so that its top ten are never a tie of zeros
DENSE = RANDOM.normal(size=(DATA.n_items, DATA.n_items)).astype(np.float32) * (RANDOM.random((DATA.n_items,) * 2) < 0.5)


def factors(foldin: FoldIn, **tables) -> dict:
    return {"kind": "factors", "users": USER_FACTORS, "items": ITEM_FACTORS, "foldin": foldin.as_plain(), **tables}


def sequence() -> dict:
    torch.manual_seed(0)
    network = SASRecNetwork(n_items=DATA.n_items, dim=8, layers=1, heads=2, dropout=0.0, max_len=5).eval()
    return served_sequence_form(SequenceScorer(network, left_padded(sequences_by_user(DATA.train, DATA.n_users), 5)))


FORMS = {
    "als": lambda: factors(FoldIn("als", regularization=0.1, alpha=3.0)),
    "least_squares": lambda: factors(FoldIn("least_squares", regularization=1.0)),
    "gradient": lambda: factors(FoldIn("gradient", steps=5, lr=0.1, weight_decay=0.01, seed=3)),
    "graph": lambda: factors(FoldIn("graph", layers=2), egos=USER_FACTORS / 3, layer_sum=ITEM_FACTORS * 2,
                             degree=torch.from_numpy(np.diff(DATA.matrix("train").tocsc().indptr).astype(np.float32))),
    "item_item whole": lambda: {"kind": "item_item", "similarity": torch.from_numpy(DENSE)},
    "item_item sparse": lambda: {"kind": "item_item", "similarity": sp.csr_matrix(np.abs(DENSE))},  # ItemKNN, pruned
    "sequence": sequence,
    "popularity": lambda: {"kind": "popularity"},
}


CUTS = {  # what the served form knows, and the events replayed after it
    "training split": (DATA.matrix("train"), DATA.val_events),
    "newcomers' first three events too": ((DATA.matrix("train") + DATA.matrix("val_events").multiply(
        sp.csr_matrix((np.ones(len(NEWCOMER_FIRST)), (NEWCOMER_FIRST["user"], NEWCOMER_FIRST["item"])),
                      shape=(DATA.n_users, DATA.n_items)))).sign().tocsr(),
        DATA.val_events.drop(NEWCOMER_FIRST.index)),
}


def recommender(form: str, max_events: int = 200, cut: str = "training split") -> Recommender:
    """The served form knowing the training split (as the validation replay sees it) or more: a history of users
    who have no trained rows."""
    config = cfg.Config(serving={"foldin": {"max_events": max_events}})
    sequence_known = pd.concat([DATA.train, NEWCOMER_FIRST]) if cut != "training split" else DATA.train
    form_bundle = FORMS[form]()
    if form == "sequence":
        form_bundle = served_sequence_form(SequenceScorer.from_form(form_bundle).with_history(
            sequences_by_user(sequence_known, DATA.n_users)))
    return Recommender(serving_bundle(form_bundle, DATA, config, CUTS[cut][0]))


# The replay scores a batch in torch, `recommend` one user in numpy: the same float32 sums (a fold-in over a few
# events and DIM factors, an item-item row over a user's history of up to ~45 items, the batch's running sum over a
# user's events) in other orders, on another CPU with other kernels. They differ by a few eps of the row's largest
# score (measured: 2); two items closer than this may rank either way round, so either rank's gain is right.
NEAR_TIE = 64 * float(np.finfo(np.float32).eps)


def per_event_gains(served: Recommender, events: pd.DataFrame, k: int = 10) -> tuple[list, list]:
    """The replay as it was: `recommend` once without events and once per event, each user's in time order. Per
    event, the frozen and the fresh gains it may have: one, or those of every rank of a near tie it is in."""
    frozen, fresh = [], []
    for user, items in events.sort_values(["user", "timestamp"], kind="stable").groupby("user", sort=False)["item"]:
        codes = items.to_numpy(np.int64)
        alone = served.recommend(int(user), np.zeros(0, np.int64), DATA.n_items)  # every item it may rank
        for position, item in enumerate(codes):
            ranked = served.recommend(int(user), codes[:position], DATA.n_items)
            frozen.append(_gains(*alone, item, k))
            fresh.append(_gains(*ranked, item, k))
    return frozen, fresh


def _gains(ranked: np.ndarray, scores: np.ndarray, item: int, k: int) -> set[float]:
    """1 / log2(rank + 1) for each rank `item` may take among items within NEAR_TIE of its score, 0 past k."""
    where = np.flatnonzero(ranked == item)
    if not len(where):
        return {0.0}
    near = np.flatnonzero(np.abs(scores - scores[where[0]]) <= NEAR_TIE * np.abs(scores).max())
    return {1 / math.log2(rank + 2) if rank < k else 0.0 for rank in range(near.min(), near.max() + 1)}


def assert_gains_within(gains: np.ndarray, expected: list[set[float]]):
    """Each gain one of its event's (up to the rounding of two log2 formulas), and near ties rare: most events have
    one gain, so the comparison still bites."""
    assert len(gains) == len(expected)
    wrong = [(event, gain, sorted(allowed)) for event, (gain, allowed) in enumerate(zip(gains, expected))
             if not any(abs(gain - one) <= 1e-12 for one in allowed)]
    assert not wrong, wrong[:5]
    assert sum(len(allowed) > 1 for allowed in expected) <= len(expected) // 20


# popularity past the training split counts the newcomers' events too, and ties items the two paths order apart
@pytest.mark.parametrize(("form", "cut"), [(form, cut) for cut in CUTS for form in FORMS
                                           if form != "popularity" or cut == "training split"])
def test_a_batched_replay_gains_what_each_event_ranked_alone_gains(form, cut):
    served = recommender(form, max_events=4, cut=cut)  # fold-in keeps a user's newest four: the same cap in both
    events = CUTS[cut][1]
    frozen, fresh = replay_gains(served, events, chunk=7)  # chunks of 7 cut users' events in two
    expected_frozen, expected_fresh = per_event_gains(served, events)
    assert len(fresh) == len(events) and fresh.any()
    assert_gains_within(frozen, expected_frozen)
    assert_gains_within(fresh, expected_fresh)
    assert replay(served, events, chunk=7)["replay_fresh_ndcg@10"] == pytest.approx(fresh.mean())


@pytest.mark.parametrize("form", [name for name in FORMS if name != "popularity"])
def test_users_known_without_trained_rows_are_served_from_their_history_not_popularity(form):
    """Frozen, before any replayed event: a newcomer's list is their first three events' (folded in from zero under
    a factor form), as a stranger sending those events gets it."""
    served = recommender(form, cut="newcomers' first three events too")
    for user, first in NEWCOMER_FIRST.sort_values("timestamp", kind="stable").groupby("user")["item"]:
        assert not served.form.cold[user]
        items, scores = served.recommend(int(user), np.zeros(0, np.int64), 10)
        stranger_items, stranger_scores = served.recommend(0, first.to_numpy(np.int64), 10)
        # folded in when the bundle was made (a batch) or per request (one user): NEAR_TIE of the largest score
        tolerance = NEAR_TIE * np.abs(stranger_scores).max()
        np.testing.assert_allclose(scores, stranger_scores, rtol=0, atol=tolerance)
        clear = scores > scores[-1] + 2 * tolerance  # above the tenth by more than rounding: listed either way
        assert set(items[clear]) == set(stranger_items[clear]) and clear.sum() >= 5


def test_a_replay_ranks_each_chunk_of_events_in_one_call(monkeypatch):
    served = recommender("gradient")
    batches = []
    monkeypatch.setattr(served, "recommend", lambda *args: pytest.fail("an event was ranked alone"))
    ranked_batch = served.top_k_batch
    monkeypatch.setattr(served, "top_k_batch", lambda users, events, k: batches.append(len(users)) or
                        ranked_batch(users, events, k))
    figures = replay(served, DATA.val_events, chunk=16)
    events = len(DATA.val_events)
    assert figures["replay_events"] == events and batches == [16] * (events // 16) + [events % 16]


def test_a_sample_of_users_replays_their_events_only():
    served = recommender("popularity")
    figures = replay(served, DATA.val_events, max_users=3, seed=0)
    chosen = np.random.default_rng(0).choice(DATA.val_events["user"].unique(), size=3, replace=False)
    assert figures["replay_events"] == DATA.val_events["user"].isin(chosen).sum()
