"""Issue 43 on the real MovieLens latest-small copy: two stages keep the exact top 10 of the users a server meets, the
test period's, with their test events folded in, at every seed. Seed 0 is the demo's `default` run (checked in
test_realtime_reproduction.py); seeds 1 and 2 train the four models with item vectors again, with the replay off (it
neither tunes nor measures the index). At seed 1, before tuning weighed users by their activity, BPR served an
inverted file at nprobe 32 that kept 0.935 of the test users' top 10: two users with 2,516 and 1,646 films seen
kept 3 and 4 of theirs (2026-12-07)."""

import json
from pathlib import Path

import pytest

from tests.cli_helpers import private_env, usecases

SHARED = Path(__file__).resolve().parents[3] / "shared" / "data" / "movielens" / "ml-latest-small"
INDEXED = ("als", "bpr", "lightgcn", "sasrec")

pytestmark = [pytest.mark.slow, pytest.mark.starts_first(3),
              pytest.mark.skipif(not SHARED.is_dir(), reason="the shared MovieLens copy is absent")]


@pytest.fixture(scope="module", params=[1, 2])
def seeded(request, tmp_path_factory) -> dict:
    env = private_env(tmp_path_factory.mktemp(f"seed{request.param}"))
    path = tmp_path_factory.mktemp("summary") / "s.json"
    result = usecases("run", "recsys", "--preset", "default", "--data", str(SHARED), "--set",
                      f"models=[{','.join(INDEXED)}]", "--set", f"runtime.seed={request.param}", "--set",
                      "evaluation.replay=false", "--set", "serving.select_by=val_ndcg", "--set",
                      "serving.retrieval=ann", "--summary", str(path), timeout=3000, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(path.read_text())["models"]


def test_every_indexed_model_keeps_95_percent_of_the_test_users_exact_top_10(seeded):
    for name in INDEXED:
        figures = seeded[name]
        assert figures["ann_recall_users"] >= 20, name  # every user of the test period
        assert figures["ann_recall@10"] >= 0.95, (name, figures["ann_recall@10"], figures["ann_search_effort"])
