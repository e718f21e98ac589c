"""`usecases bench run medical`: both loops train in one run, each timed after its warm-up epoch."""

import json

import mlflow
import pytest

from tests.cli_helpers import runs, usecases


def test_bench_reports_both_throughputs_without_the_warm_up_epoch(tmp_path):
    summary = tmp_path / "bench.json"
    small = ["--set", "data.synthetic.train=64", "--set", "data.synthetic.val=32", "--set", "data.synthetic.test=32"]
    result = usecases("bench", "run", "medical", "--preset", "smoke", "--set", "benchmark.epochs=2", *small,
                      "--summary", str(summary), timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    models = json.loads(summary.read_text())["models"]
    ours, plain = models["pipeline"], models["plain_loop"]
    assert ours["epochs_counted"] == plain["epochs_counted"] == 1  # the warm-up epoch is left out
    (run,) = runs("medical-benchmark")
    assert run.info.status == "FINISHED" and runs("medical") == []
    history = mlflow.MlflowClient().get_metric_history(run.info.run_id, "throughput/samples_per_s")
    assert sorted(metric.step for metric in history) == [0, 1], "our loop trained the 2 epochs asked for"
    counted = next(metric.value for metric in history if metric.step == 1)
    assert ours["images_per_s"] == pytest.approx(counted), "ours is the loop's own rate of the epoch after warm-up"
    assert plain["images_per_s"] > 0 and 0 < plain["data_wait_share"] < 1
    assert run.data.metrics["speedup"] == pytest.approx(ours["speedup"])
