"""`usecases bench medical`: both loops train in one run and the report carries their ratio."""

import json

import pytest

from tests.cli_helpers import runs, usecases


def test_bench_reports_both_throughputs_and_their_ratio(tmp_path):
    summary = tmp_path / "bench.json"
    result = usecases("bench", "medical", "--preset", "smoke", "--set", "benchmark.epochs=2",
                      "--set", "data.synthetic.train=128", "--summary", str(summary))
    assert result.returncode == 0, result.stderr[-3000:]
    models = json.loads(summary.read_text())["models"]
    ours, plain = models["pipeline"], models["plain_loop"]
    assert ours["images_per_s"] > 0 and plain["images_per_s"] > 0
    assert ours["speedup"] == pytest.approx(ours["images_per_s"] / plain["images_per_s"])
    assert 0 <= ours["data_wait_share"] < 1 and 0 < plain["data_wait_share"] < 1
    assert ours["epochs_counted"] == plain["epochs_counted"] == 1  # the warm-up epoch is left out
    (run,) = runs("medical-benchmark")
    assert run.info.status == "FINISHED" and run.data.metrics["speedup"] == pytest.approx(ours["speedup"])
    assert runs("medical") == []
