"""The baselines in a process pool beside the neural training: the forecasts of one process, in its order, and a
pool that ends at once when the run is stopped."""

import multiprocessing
import signal
import time
from multiprocessing.pool import AsyncResult

import pandas as pd
import pytest

from common.runtime import interrupt
from common.runtime.interrupt import Terminated
from usecases.finance.config import Config
from usecases.finance.features import add_features
from usecases.finance.pipeline import baseline_forecasts, baseline_runs, evaluation_window


def walk_forward(panel, **evaluation):
    config = Config.model_validate({"evaluation": {"test_start": None, "test_end": None, **evaluation}})
    frame = add_features(panel)
    return frame, evaluation_window(frame, config), config


def test_the_pool_gives_the_forecasts_of_one_process_in_its_order(panel):
    """One worker: it starts the longest task, and this process takes the others from the queue as it collects."""
    frame, mask, config = walk_forward(panel, refit_every=42)
    with baseline_runs(frame, mask, config, workers=1) as runs:
        pooled = runs.collect()
    assert {type(result) for result in runs.results.values()} == {AsyncResult, list}, "the worker's and its own"
    alone = baseline_forecasts(frame, mask, config, workers=0)
    pd.testing.assert_frame_equal(pooled, alone)
    order = pooled.assign(ticker=frame.loc[pooled.index, "ticker"])[["ticker", "model"]].drop_duplicates()
    with_evt = [name for model in config.baselines.models
                for name in ([model, "gjr_garch_t_evt"] if model == "gjr_garch_t" else [model])]
    assert list(order.itertuples(index=False)) == [(ticker, model) for ticker in ("SYN000", "SYN001")
                                                   for model in with_evt]


def test_a_stop_while_the_baselines_run_ends_their_pool_at_once(panel, monkeypatch):
    """SIGTERM (as the run's handler records it) while waiting for fits of many seconds: the wait stops within a
    moment and no worker is left running."""
    frame, mask, config = walk_forward(panel, refit_every=1)
    config.baselines.models = ["gjr_garch_t"]
    monkeypatch.setattr(interrupt, "_requested", signal.SIGTERM)
    started = time.monotonic()
    with pytest.raises(Terminated), baseline_runs(frame, mask, config, workers=2) as runs:
        runs.collect()
    assert time.monotonic() - started < 10, "the pool starts in a few seconds, and stops at once"
    assert runs.pool is not None and multiprocessing.active_children() == []
