"""SASRec learns an order that order-free models cannot, attends causally, is blind to padding, ignores padded
targets, trains by sampled softmax too, never waits for the device in a training step, and scores the same once
rebuilt from its served form."""

import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp
import torch
import torch.nn.functional as F

from common.errors import UserError
from common.job import Job
from common.runtime.devices import Runtime
from common.serving.bundle import decode, encode
from common.tracking.runs import Tracker
from common.training.loop import make_optimizer
from common.training.workload import steady_step_syncs
from usecases.recsys.baselines import Popularity
from usecases.recsys.config import Config
from usecases.recsys.data import Interactions
from usecases.recsys.evaluate import full_ranking
from usecases.recsys.train import fit_sasrec, sequences_by_user, training_windows
from usecases.recsys.sequence import SASRecNetwork, SequenceScorer, left_padded, served_sequence_form

CPU = torch.device("cpu")
CYCLE = 20  # items 1..20; item i is always followed by item i % 20 + 1
USERS = 120


def cyclic_interactions(seed: int = 0) -> Interactions:
    """Each user walks the cycle from a random item for 6 to 12 steps; the last step is test, the one before val.
    Timestamps run backwards in row order within a user, so only the sort by time gives the walk."""
    generator = np.random.default_rng(seed)
    splits = {"train": [], "val": [], "test": []}
    for user in range(1, USERS + 1):
        length, start = generator.integers(6, 13), generator.integers(CYCLE)
        items = (start + np.arange(length)) % CYCLE + 1
        times = 1000 + np.arange(length)
        for name, part in (("train", slice(0, -2)), ("val", slice(-2, -1)), ("test", slice(-1, None))):
            rows = pd.DataFrame({"user": user, "item": items[part], "timestamp": times[part]})
            splits[name].append(rows.iloc[::-1])
    frames = {name: pd.concat(parts, ignore_index=True) for name, parts in splits.items()}
    return Interactions(frames["train"], frames["val"], frames["test"], np.arange(-1, USERS), np.arange(-1, CYCLE),
                        None, "cycle", "")


def tiny_config(**sasrec) -> Config:
    settings = {"dim": 32, "layers": 1, "heads": 2, "dropout": 0.0, "max_len": 12, "epochs": 40, "batch_size": 32,
                "lr": 1e-2, "patience": None, **sasrec}
    return Config.model_validate({"sasrec": settings})


def cpu_job(tmp_path) -> Job:
    return Job(Runtime(CPU, None), Tracker(active=False), tmp_path / "checkpoints")


def network(**overrides) -> SASRecNetwork:
    torch.manual_seed(0)
    settings = {"n_items": 30, "dim": 16, "layers": 2, "heads": 2, "dropout": 0.0, "max_len": 8, **overrides}
    return SASRecNetwork(**settings).eval()


def hit_at_1(scorer, data: Interactions, truth: str, exclude: sp.csr_matrix) -> float:
    return full_ranking(scorer, data.matrix(truth), exclude, [1], CPU, 1024)["hit@1"]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tensors this small train ten times slower on two threads of a busy machine, each waiting on the other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def cyclic_fit(tmp_path_factory, one_thread):
    data = cyclic_interactions()
    scorer, figures = fit_sasrec(data, data.matrix("val"), tiny_config(), cpu_job(tmp_path_factory.mktemp("fit")))
    return data, scorer, figures


def test_it_learns_the_next_item_where_popularity_cannot(cyclic_fit):
    data, scorer, figures = cyclic_fit
    train = data.matrix("train")
    assert hit_at_1(scorer, data, "val", train) > 0.9
    assert hit_at_1(Popularity(train, CPU), data, "val", train) < 0.35
    assert figures["best_epoch"] >= 1 and figures["fit_seconds"] > 0 and figures["seconds_per_epoch"] > 0


def test_test_ranking_uses_the_history_the_pipeline_sets(cyclic_fit):
    """From train + val the next item is the test item; the scorer of the training sequences is left as it was."""
    data, scorer, _ = cyclic_fit
    before = scorer.user_sequences.clone()
    fresh = scorer.with_history(sequences_by_user(pd.concat([data.train, data.val]), data.n_users))
    assert hit_at_1(fresh, data, "test", (data.matrix("train") + data.matrix("val")).sign().tocsr()) > 0.9
    assert torch.equal(scorer.user_sequences, before) and not torch.equal(fresh.user_sequences, before)


def test_score_sequences_ranks_the_next_item_of_any_sequence_first(cyclic_fit):
    _, scorer, _ = cyclic_fit
    scores = scorer.score_sequences([np.array([3, 4, 5, 6]), np.array([0, 17, 18, 19, 20]), np.array([], np.int64)])
    scores[:, 0] = -np.inf
    assert scores[:2].argmax(1).tolist() == [7, 1]  # 20 is followed by 1; the unknown code 0 is skipped
    assert (scores[2, 1:] == 0).all()  # nothing to go on


def test_a_later_item_does_not_change_an_earlier_position():
    model = network()
    sequences = torch.tensor([[0, 0, 3, 4, 5, 6, 7, 8], [0, 0, 3, 4, 5, 6, 7, 29]])
    hidden = model.hidden(sequences)
    assert torch.allclose(hidden[0, :-1], hidden[1, :-1], atol=1e-6)
    assert not torch.allclose(hidden[0, -1], hidden[1, -1], atol=1e-3)


@torch.no_grad()
def test_padding_does_not_change_the_scores():
    model = network()
    unpadded = model.scores(model.last_hidden(torch.tensor([[5, 9, 2]])))
    for padded in ([[0, 0, 5, 9, 2]], [[0, 0, 0, 0, 0, 5, 9, 2]]):
        assert torch.allclose(model.scores(model.last_hidden(torch.tensor(padded))), unpadded, atol=1e-5)
    scorer = SequenceScorer(model, torch.zeros(1, 8, dtype=torch.long))
    assert np.allclose(scorer.score_sequences([np.array([5, 9, 2])]), unpadded.numpy(), atol=1e-5)


def test_the_loss_ignores_padded_targets():
    model = network()
    inputs, targets = torch.tensor([[0, 0, 0, 0, 0, 5, 9, 2]]), torch.tensor([[0, 0, 0, 0, 0, 9, 2, 7]])
    logits = model.scores(model.hidden(inputs)[0, -3:])
    logits[:, 0] = -torch.inf
    assert model(inputs, targets).item() == pytest.approx(F.cross_entropy(logits, targets[0, -3:]).item(), rel=1e-5)
    other_inputs = inputs.clone()
    other_inputs[0, :5] = 0  # already padding: nothing else may count
    other_targets = targets.clone()
    other_targets[0, :3] = 0
    assert model(other_inputs, other_targets).item() == pytest.approx(model(inputs, targets).item(), rel=1e-6)


def test_the_sampled_softmax_ignores_padded_targets():
    model = network(sampled_negatives=6)
    inputs, targets = torch.tensor([[0, 0, 0, 0, 0, 5, 9, 2]]), torch.tensor([[0, 0, 0, 0, 0, 9, 2, 7]])
    torch.manual_seed(1)
    loss = model(inputs, targets)
    torch.manual_seed(1)
    hidden = model.hidden(inputs)[0, -3:]
    expected = model._sampled_softmax(hidden, targets[0, -3:])  # the real positions alone
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)


@pytest.mark.parametrize("sampled_negatives", [None, 8])
def test_a_training_step_never_waits_for_the_device(sampled_negatives):
    """Forward, backward and the fused AdamW step: every shape is static (padded positions weigh 0 in the loss
    instead of being selected out), so on a GPU the host never waits for a count of the real positions."""
    model = network(sampled_negatives=sampled_negatives, dropout=0.1).train()
    optimizer = make_optimizer("adamw", model.parameters(), Runtime(CPU, None), lr=1e-3)
    inputs, targets = torch.tensor([[0, 0, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6, 7, 9]]), \
        torch.tensor([[0, 0, 4, 5, 6, 7, 8, 9], [2, 3, 4, 5, 6, 7, 9, 1]])
    syncs = steady_step_syncs(lambda: model(inputs, targets), optimizer)
    assert syncs.count == 0, syncs.by_name


def test_sampled_softmax_trains(tmp_path):
    data = cyclic_interactions(seed=1)
    scorer, _ = fit_sasrec(data, data.matrix("val"), tiny_config(sampled_negatives=8, epochs=30), cpu_job(tmp_path))
    assert hit_at_1(scorer, data, "val", data.matrix("train")) > 0.7


def test_the_served_form_round_trips_through_the_bundle_codec():
    model = network()
    scorer = SequenceScorer(model, left_padded([np.array([], np.int64), np.array([1, 2, 3])], 8))
    form = decode(encode(served_sequence_form(scorer)))
    assert form["kind"] == "sequence" and form["settings"]["max_len"] == 8
    rebuilt = SequenceScorer.from_form(form)
    sequences = [np.array([4, 5, 6]), np.arange(1, 20)]
    assert np.allclose(rebuilt.score_sequences(sequences), scorer.score_sequences(sequences), atol=1e-6)
    assert torch.allclose(rebuilt.score(torch.tensor([1])), scorer.score(torch.tensor([1])), atol=1e-6)


def test_sequences_follow_time_then_row_order_and_windows_shift_by_one():
    frame = pd.DataFrame({"user": [1, 1, 2, 1, 2], "item": [7, 8, 3, 9, 4], "timestamp": [5, 3, 1, 3, 1]})
    sequences = sequences_by_user(frame, 3)
    assert [sequence.tolist() for sequence in sequences] == [[], [8, 9, 7], [3, 4]]
    inputs, targets = training_windows(sequences, 2)
    assert inputs.tolist() == [[8, 9], [0, 3]] and targets.tolist() == [[9, 7], [0, 4]]


def test_a_log_without_event_order_is_refused_in_one_line(tmp_path):
    data = cyclic_interactions()
    on_dask = Interactions(None, None, None, data.user_ids, data.item_ids, None, "dask", "",
                           {"train": data.matrix("train"), "val": data.matrix("val")})
    with pytest.raises(UserError, match="runtime.engine=pandas"):
        fit_sasrec(on_dask, on_dask.matrix("val"), tiny_config(), cpu_job(tmp_path))
