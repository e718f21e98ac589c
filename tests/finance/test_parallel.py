"""The baselines in a process pool beside the neural training: the forecasts of one process, in its order, and a
pool that ends at once when the run is stopped."""

import multiprocessing
import os
import signal
from multiprocessing.pool import AsyncResult

import pandas as pd
import psutil
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
    """SIGTERM (as the run's handler records it) while the workers run fits of many seconds: the wait stops without
    waiting for any of them, and the pool's workers are ended, none left running."""
    frame, mask, config = walk_forward(panel, refit_every=1)
    config.baselines.models = ["gjr_garch_t"]
    monkeypatch.setattr(interrupt, "_requested", signal.SIGTERM)
    before = set(psutil.Process().children(recursive=True))
    with pytest.raises(Terminated), baseline_runs(frame, mask, config, workers=2) as runs:
        runs.collect()
    running = [result for result in runs.results.values() if isinstance(result, AsyncResult)]
    assert len(running) == 2, "both tasks went to the pool's two workers"
    assert not any(result.ready() for result in running), "stopped while they ran: their pool ended, not awaited"
    assert runs.pool is not None and multiprocessing.active_children() == []
    started = set(psutil.Process().children(recursive=True)) - before  # the forkserver, if new, and what it forked
    assert [process for process in started if _parent(process) not in (os.getpid(), None)] == [], \
        "the forkserver's workers are gone too"


def _parent(process: psutil.Process) -> int | None:
    """The process's parent's pid; None once it has ended."""
    try:
        return None if process.status() == psutil.STATUS_ZOMBIE else process.ppid()
    except psutil.NoSuchProcess:
        return None
