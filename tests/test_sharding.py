"""Work shared out among DDP ranks comes back whole and equal to doing it in one process."""

from pathlib import Path

import pytest
import torch

from common.runtime.sharding import share_bounds
from tests.cli_helpers import two_ranks
from tests.sharding_worker import FixedScores, interactions
from usecases.recsys.evaluate import full_ranking

@pytest.mark.parametrize("count, world, expected", [(7, 2, [(0, 4), (4, 7)]), (1, 2, [(0, 0), (0, 1)]),
                                                    (6, 3, [(0, 2), (2, 4), (4, 6)])])
def test_shares_cover_every_row_once(count, world, expected):
    assert share_bounds(count, world) == expected


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return two_ranks(Path(__file__).with_name("sharding_worker.py"), tmp_path_factory.mktemp("sharding"))


def test_gathered_rows_are_whole_and_in_order_on_every_rank(ranks):
    rows = torch.arange(7 * 3, dtype=torch.float32).reshape(7, 3)
    for rank in ranks:
        assert torch.equal(rank["rows"], rows) and torch.equal(rank["predictions"], rows * 2)
    assert ranks[0]["objects"] == ["rank 0", "rank 1"] and ranks[1]["objects"] is None
    assert [rank["max"] for rank in ranks] == [1.0, 1.0]


def test_sharded_full_ranking_equals_the_single_process_one(ranks):
    alone = full_ranking(FixedScores(50, 40), interactions(50, 40, 1), interactions(50, 40, 2), [5, 10],
                         torch.device("cpu"), 8)
    for rank in ranks:
        together = rank["ranking"]
        assert together["users_evaluated"] == alone["users_evaluated"]
        for metric in alone:
            if metric != "users_per_s":
                assert together[metric] == pytest.approx(alone[metric], rel=1e-12), metric


def test_what_rank_0_raises_reaches_every_rank(ranks):
    assert [rank["user_error"] for rank in ranks] == ["UserError: a bad key"] * 2
    assert ranks[0]["bug"] == "ZeroDivisionError: division by zero"
    assert ranks[1]["bug"] == "RuntimeError: rank 0 failed: ZeroDivisionError: division by zero"


def test_a_stop_asked_of_one_rank_in_its_own_work_stops_both_together(ranks):
    assert [rank.get("stopped") for rank in ranks] == [True, True]


def test_each_rank_draws_its_own_negatives(ranks):
    """Identical draws on every rank would repeat each negative world-size times an epoch."""
    first, second = (rank["negatives"] for rank in ranks)
    assert first.shape == second.shape and len(first) > 20
    assert (first == second).float().mean() < 0.3, "the ranks drew the same negatives (one in 19 agree by chance)"


def test_a_resume_follows_the_checkpoint_of_rank_0_where_only_its_machine_has_one(ranks):
    assert [rank["checkpoints"] for rank in ranks] == [["last.pt"], []]
    assert [rank["resumed_from"] for rank in ranks] == [1, 1]
    first, second = (rank["resumed_state"] for rank in ranks)
    assert all(torch.equal(first[key], second[key]) for key in first)
