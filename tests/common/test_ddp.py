"""Two CPU processes under torchrun train one model through the shared Trainer: DDP must keep them in step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.cli_helpers import two_ranks

WORKER = Path(__file__).with_name("ddp_worker.py")

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo")


def test_a_signal_to_one_rank_stops_both_at_the_same_epoch(tmp_path):
    ranks = two_ranks(WORKER, tmp_path, "1")
    assert [rank["stopped_after"] for rank in ranks] == [1, 1]
    for key in ranks[0]["state"]:
        assert torch.equal(ranks[0]["state"][key], ranks[1]["state"][key])
    # shutdown really closed the group: no gloo thread runs on into interpreter exit, where it aborted a rank
    assert [rank["gloo_threads_left"] for rank in ranks] == [[], []]


def test_two_ranks_end_with_identical_learned_parameters(tmp_path):
    ranks = two_ranks(WORKER, tmp_path)
    assert all(rank["world_size"] == 2 and rank["backend"] == "gloo" for rank in ranks)
    first, second = (rank["state"] for rank in ranks)
    assert first.keys() == second.keys()
    assert any(not torch.equal(ranks[0]["initial"][key], ranks[1]["initial"][key]) for key in first), (
        "ranks must start from different weights for the check to mean anything")
    for key in first:
        assert torch.equal(first[key], second[key]), f"{key} differs between ranks"
    assert [epoch for epoch, _ in ranks[0]["epoch_metrics"]] == [0, 1, 2, 3]
    assert ranks[0]["epoch_metrics"] == ranks[1]["epoch_metrics"], "a callback sees the all-reduced metrics on every rank"
    for rank in ranks:
        assert rank["epochs_run"] == 4
        assert rank["loss_end"] < rank["loss_start"] / 4
        assert rank["gloo_threads_left"] == []
