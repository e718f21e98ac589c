"""The walk-forward baselines on a Dask cluster give the pandas engine's forecasts exactly, row for row."""

import pandas as pd
import pytest

from common.config import load_config
from tests.cli_helpers import runs, usecases
from usecases.finance import USECASE, Config
from usecases.finance.pipeline import baseline_forecasts, load_data

distributed = pytest.importorskip("distributed")


@pytest.fixture(scope="module")
def client():
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=None) as \
            cluster, distributed.Client(cluster) as connected:
        yield connected


def test_dask_baselines_equal_the_pandas_ones(client):
    config = load_config(Config, USECASE.presets_dir, "smoke", ["data.synthetic.tickers=4"])
    prepared, _ = load_data(config, None)
    alone = baseline_forecasts(prepared.frame, prepared.test, config)
    spread = baseline_forecasts(prepared.frame, prepared.test, config, client=client)
    tickers = prepared.frame.loc[spread.index, "ticker"]  # forecasts are indexed by the panel's rows
    assert len(spread) > 0 and tickers.nunique() == 4 and not spread.reset_index().duplicated(["index", "model"]).any()
    pd.testing.assert_frame_equal(spread, alone)


def test_a_run_on_a_local_cluster_records_it():
    result = usecases("run", "finance", "--preset", "smoke", "--workers", "2")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "dask: a local cluster of 2 workers" in result.stderr
    (run,) = runs("finance")
    assert run.data.tags["engine"] == "dask" and run.data.tags["dask_workers"] == "2"
    assert run.data.params["runtime.engine"] == "dask" and run.data.metrics["time/baselines_s"] > 0
