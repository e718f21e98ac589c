"""The Dask engine: the walk-forward baselines on a cluster give the pandas engine's forecasts exactly, row for row;
a scheduler that does not answer or has no workers, or Dask not installed, is one line and no run."""

import sys

import pandas as pd
import pytest

from common.config import load_config
from tests.cli_helpers import assert_rejected, free_port, runs, usecases
from usecases import cli
from usecases.cli.options import engine_overrides
from usecases.finance import USECASE, Config
from usecases.finance.pipeline import baseline_forecasts, load_data

distributed = pytest.importorskip("distributed")


def test_dask_baselines_equal_the_pandas_ones(dask_client):
    config = load_config(Config, USECASE.presets_dir, "smoke", ["data.synthetic.tickers=4",
                                                                 "baselines.models=[ewma,gjr_garch_t]"])
    prepared, _ = load_data(config, None)
    alone = baseline_forecasts(prepared.frame, prepared.test, config)
    spread = baseline_forecasts(prepared.frame, prepared.test, config, client=dask_client)
    tickers = prepared.frame.loc[spread.index, "ticker"]  # forecasts are indexed by the panel's rows
    assert len(spread) > 0 and tickers.nunique() == 4 and not spread.reset_index().duplicated(["index", "model"]).any()
    pd.testing.assert_frame_equal(spread, alone)


def test_dask_features_equal_the_pandas_ones(dask_client):
    config = load_config(Config, USECASE.presets_dir, "smoke", ["data.synthetic.tickers=5"])
    alone, _ = load_data(config, None)
    spread, _ = load_data(config, None, client=dask_client)
    assert spread.frame["ticker"].nunique() == 5
    pd.testing.assert_frame_equal(spread.frame, alone.frame)
    pd.testing.assert_series_equal(spread.test, alone.test)


def test_a_run_on_a_local_cluster_records_it():
    result = usecases("run", "finance", "--preset", "smoke", "--workers", "2", "--set", "train.epochs=2",
                      "--set", "baselines.models=[ewma,garch]")  # what is tested is where the baselines ran
    assert result.returncode == 0, result.stderr[-2000:]
    assert "dask: a local cluster of 2 workers" in result.stderr
    (run,) = runs("finance")
    assert run.data.tags["engine"] == "dask" and run.data.tags["dask_workers"] == "2"
    assert run.data.params["runtime.engine"] == "dask"
    metrics = run.data.metrics
    phases = sum(value for name, value in metrics.items()
                 if name.startswith("time/") and name.endswith("_s") and name != "time/total_s")
    assert 0 < metrics["time/baselines_s"] < phases <= metrics["time/total_s"], "a phase of the run's wall time"


def test_an_unreachable_cluster_is_one_line_and_no_run(capsys):
    address = f"tcp://127.0.0.1:{free_port()}"
    assert_rejected(capsys, "finance", "run", "finance", "--preset", "smoke", "--cluster", address,
                    names=(f"runtime.cluster {address}", "no Dask scheduler answers there"))


def test_a_scheduler_without_workers_is_one_line_and_no_run(capsys, monkeypatch):
    from common.runtime import engine

    monkeypatch.setattr(engine, "WORKERS_TIMEOUT_S", 1)
    with distributed.LocalCluster(n_workers=0, processes=False, dashboard_address=":0") as empty:
        assert_rejected(capsys, "finance", "run", "finance", "--preset", "smoke", "--cluster", empty.scheduler_address,
                        names=(f"runtime.cluster {empty.scheduler_address}", "has no workers after 1 s"))


def test_the_dask_engine_without_dask_says_which_extra_to_install(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "distributed", None)  # `import distributed` now fails as if not installed
    assert_rejected(capsys, "finance", "run", "finance", "--preset", "smoke", "--engine", "dask",
                    names=("runtime.engine=dask needs Dask", "gpu-usecases[dask]"))


@pytest.mark.parametrize("options, overrides", [
    ([], []),
    (["--engine", "dask"], ["runtime.engine=dask"]),
    (["--workers", "2"], ["runtime.workers=2", "runtime.engine=dask"]),
    (["--engine", "pandas", "--cluster", "tcp://h:8786"], ["runtime.engine=pandas", "runtime.cluster=tcp://h:8786"]),
])
def test_engine_options_are_the_config_s_runtime_keys(options, overrides):
    args = cli.parser().parse_args(["run", "finance", *options])
    assert engine_overrides(args) == overrides
