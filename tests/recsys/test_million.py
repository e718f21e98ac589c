"""Issues 33 and 43 on a catalogue of a million items, on this machine: the `million` preset trained (ALS, every item
learned), indexed and served by two stages within its memory, then both retrievals served over HTTP in one bench run,
micro-batched alike, and the fleet sized from it."""

import json
import resource

import mlflow
import pytest

from tests.cli_helpers import private_env, runs, usecases

pytestmark = [pytest.mark.slow, pytest.mark.starts_first(2)]

MEMORY_BYTES = 24 * 2**30  # the machine the README's figures are for
CONCURRENCY = 8


@pytest.fixture(scope="module")
def million(tmp_path_factory):
    """The run (its summary, store and peak memory) and the serving bench of its model, exact against ann."""
    env = private_env(tmp_path_factory.mktemp("million"))
    summary = tmp_path_factory.mktemp("summary") / "s.json"
    result = usecases("run", "recsys", "--preset", "million", "--summary", str(summary), timeout=3000, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # the largest child's: the run's
    (run,) = runs("recsys", env["MLFLOW_TRACKING_URI"])
    bench = usecases("bench", "serve", "recsys", "--model-uri", f"runs:/{run.info.run_id}/model", "--retrieval",
                     "exact,ann", "--concurrency", str(CONCURRENCY), "--seconds", "10", "--batch-ms", "2",
                     timeout=1200, env=env)
    assert bench.returncode == 0, bench.stderr[-3000:]
    return json.loads(summary.read_text()), run, peak_kib * 1024, env


def served(env) -> dict[str, float]:
    mlflow.set_tracking_uri(env["MLFLOW_TRACKING_URI"])
    (bench,) = mlflow.search_runs(experiment_names=["gpu-usecases-recsys-serve"], output_format="list")
    return bench.data.metrics


def test_a_million_items_are_trained_indexed_and_served_by_two_stages_within_the_memory(million):
    summary, run, peak, _ = million
    als = summary["models"]["als"]
    assert int(run.data.tags["data_items"]) >= 1_000_000  # the items some user took
    assert run.data.tags["retrieval"] == "ann"  # auto: exact ranking's measured p95 is above 5 ms here
    # learned: NDCG@10 was 0.0378 (2026-12-07, on the 2-core Intel Xeon), where BPR's three epochs, which left most
    # items near their initial vectors, reached 0.0100
    assert als["served_ndcg@10"] > 0.03
    # In process, one query at a time: ann's p95 was 2.1 ms against exact's 25.9 (12x) on the Xeon; a two-stage
    # path that fell back to a full scan would be about 1x
    assert als["exact_latency_p95_ms"] > 5 and als["ann_latency_p95_ms"] < als["exact_latency_p95_ms"] / 3
    assert als["ann_recall@10"] >= 0.95 and als["ann_recall_users"] >= 500  # test users, with their test events
    assert als["ann_served_ndcg@10"] >= 0.95 * als["served_ndcg@10"]
    assert peak < MEMORY_BYTES, f"{peak / 2**30:.1f} GB"


def test_ann_serves_twice_the_requests_of_exact_ranking_over_http(million):
    """The ratio of one bench run (both servers on the same cores, micro-batched alike, the load generator beside
    them). With the machine to itself it was 9.5x (660 against 70 requests/s, p99 27 against 230 ms) on the 2-core
    Intel Xeon (2026-12-07, docs/recsys-serving.md). The preset's earlier model and index (BPR, an inverted file) gave
    8.2x alone, 4.9x beside the slow suite's second worker and 2.7x while that worker installed a fresh venv, so the
    bound is 2x: a two-stage path that fell back to a full scan serves about 1x. Its tail is shorter too, by less
    beside the second worker (1.73x then), so the bound there is 1.25x, where a full scan's tail would be about 1x."""
    metrics = served(million[3])
    exact, ann = (metrics[f"serve/{mode}/c{CONCURRENCY}/requests_per_s"] for mode in ("exact", "ann"))
    assert ann >= 2 * exact, (ann, exact)
    assert metrics[f"serve/ann/c{CONCURRENCY}/p99_ms"] < metrics[f"serve/exact/c{CONCURRENCY}/p99_ms"] / 1.25
    assert metrics[f"serve/ann/c{CONCURRENCY}/errors"] == metrics[f"serve/exact/c{CONCURRENCY}/errors"] == 0


def test_the_fleet_for_ten_thousand_requests_is_sized_from_that_bench(million):
    """At a p99 of 400 ms: ann's p99 at 8 clients was 13 ms alone on the machine, and 51 ms then 100 ms in two CI runs
    beside the slow suite's second worker; the README sizes at 30 ms from the run with the machine to itself."""
    env = million[3]
    result = usecases("advise", "recsys", "--serve", "--target-rps", "10000", "--p99-ms", "400", env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "- ann:" in result.stdout and "sized" in result.stdout and "Cheapest (expected):" in result.stdout
