"""Where the baselines' walk-forward fits run, a task per ticker and model: in a process pool started before the
neural model trains, on a Dask cluster's workers, or under DDP in shares of the ranks. The forecasts are the same
whichever runs them (`fit_baselines` keeps BLAS on one thread), and come back in the tasks' order.

The pool has a worker for each core the training leaves (on a GPU machine every core but the one driving the GPU),
and its workers take the tasks from a queue, the longest first. Once the network has trained, this process takes
from the same queue until it is empty, then waits for what the workers still run: on a CPU run it would otherwise
sit idle while its core's share of the baselines waits in the queue.
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
import time
from dataclasses import dataclass
from multiprocessing.pool import AsyncResult, Pool

import pandas as pd
import torch

from common.runtime.devices import Runtime

from common.runtime.process import usable_cores
from common.runtime.interrupt import stop_point, stops_deferred
from common.runtime.sharding import gather_objects, my_share
from common.training.loop import stop_if_any_rank_asked
from .baselines import FIT_COST, Blocks, fit_baselines, start_pool_worker
from .config import Baselines

log = logging.getLogger(__name__)

WAIT_S = 0.1  # between checks for Ctrl-C or SIGTERM while waiting for a task


@dataclass
class BaselineTask:
    """One baseline's walk-forward on one ticker: its rows (in date order) and its blocks of test origins."""

    ticker: str
    model: str
    rows: pd.DataFrame
    blocks: Blocks


def pool_workers(tasks: int, runtime: Runtime | None) -> int:
    """A worker for each usable core the training leaves (its CPU threads on a CPU run; on a GPU, the one process
    driving it), at least one, at most one per task. On 2 cores beside a one-thread CPU training, two workers
    finished the `default` run no sooner than one (README: the baselines beside the network): the training keeps
    its core."""
    training = torch.get_num_threads() if runtime is None or runtime.device.type == "cpu" else 1
    return max(1, min(tasks, usable_cores() - training))


class BaselineRuns:
    """Entering starts the tasks (on the Dask `client`, else in a pool of `workers` processes, started from a thread
    so that the training need not wait for it; under DDP nothing, each rank fitting its share in `collect`);
    `collect` takes what the pool has not started yet (module docstring) and waits for the rest, stopping within
    WAIT_S on Ctrl-C or SIGTERM; leaving ends whatever still runs (the pool terminated, Dask futures cancelled), on
    every path."""

    def __init__(self, tasks: list[BaselineTask], horizon: int, settings: Baselines, runtime: Runtime | None = None,
                 client=None, workers: int | None = None):
        self.tasks, self.runtime, self.client = tasks, runtime, client
        self.options = {"horizon": horizon, "settings": settings}
        self.distributed = runtime is not None and runtime.distributed
        self.workers = pool_workers(len(tasks), runtime) if workers is None else workers
        self.pool: Pool | None = None
        self.starting: threading.Thread | None = None
        self.failure: BaseException | None = None
        self.queue = sorted(range(len(tasks)), key=lambda index: -FIT_COST[tasks[index].model])  # not yet started
        self.queued = threading.Lock()
        self.results: dict[int, AsyncResult | list[pd.DataFrame]] = {}
        self.futures: list = []

    def __enter__(self) -> BaselineRuns:
        if self.client is not None:
            self.futures = [self.client.submit(fit_baselines, task.rows, task.blocks, models=[task.model],
                                               **self.options, pure=False) for task in self.tasks]
        elif not self.distributed and self.workers > 0 and self.tasks:
            # the pool waits for its forkserver to import the baselines (a second or two): not the training
            self.starting = threading.Thread(target=self._start_pool, name="baselines-pool", daemon=True)
            self.starting.start()
        return self

    def _start_pool(self) -> None:
        """forkserver: a worker holds none of this process's threads or locks (MLflow's, torch's) and ends when this
        process does, even killed; the forkserver imports the baselines once for all of them."""
        try:
            context = multiprocessing.get_context("forkserver")
            context.set_forkserver_preload([fit_baselines.__module__])
            self.pool = context.Pool(self.workers, initializer=start_pool_worker)
            for _ in range(self.workers):
                self._start_next()
        except BaseException as failure:  # raised again by `collect`
            self.failure = failure

    def _next(self) -> int | None:
        with self.queued:
            return self.queue.pop(0) if self.queue else None

    def _start_next(self, *_) -> None:
        """Give a worker the next task; called again as each one ends (in the pool's result thread). Taken and
        started under the queue's lock, so that a task out of the queue is always in `results`."""
        with self.queued:
            if self.queue:
                index = self.queue.pop(0)
                task = self.tasks[index]
                self.results[index] = self.pool.apply_async(fit_baselines, (task.rows, task.blocks),
                                                            {"models": [task.model], **self.options},
                                                            callback=self._start_next)

    def collect(self) -> pd.DataFrame | None:
        """Every task's forecasts in the tasks' order, on rank 0 (None on the other ranks)."""
        if self.client is not None:
            return self._gather([self._wait_for(future) for future in self.futures])
        if self.starting is None:
            return self._fit_shares()
        self.starting.join()
        if self.failure is not None:
            raise self.failure
        while (index := self._next()) is not None:
            task = self.tasks[index]
            self.results[index] = fit_baselines(task.rows, task.blocks, models=[task.model], **self.options)
        return self._gather([self._wait_for(self.results[index]) for index in range(len(self.tasks))])

    def _gather(self, results: list[list[pd.DataFrame]]) -> pd.DataFrame:
        for task, following in zip(self.tasks, [*self.tasks[1:], None]):
            if following is None or following.ticker != task.ticker:
                log.info("baselines: %s done (%d refits)", task.ticker, len(task.blocks))
        return pd.concat([part for parts in results for part in parts])

    def _wait_for(self, running) -> list[pd.DataFrame]:
        """A task's forecasts once done; Ctrl-C or SIGTERM stops the wait within WAIT_S."""
        if isinstance(running, list):  # fitted here
            return running
        if isinstance(running, AsyncResult):
            while not running.ready():
                stop_point()
                running.wait(WAIT_S)
            return running.get()
        while not running.done():  # a Dask future
            stop_point()
            time.sleep(WAIT_S)
        return running.result()

    def _fit_shares(self) -> pd.DataFrame | None:
        """Without a pool or Dask (under DDP, or `workers=0`): this process's share of the tasks, here, and every
        rank's gathered on rank 0."""
        parts = []
        with stops_deferred(self.distributed):
            for task in self.tasks[my_share(len(self.tasks), self.runtime)]:
                parts.extend(fit_baselines(task.rows, task.blocks, models=[task.model], **self.options))
                log.info("baselines: %s %s done (%d refits)", task.ticker, task.model, len(task.blocks))
        gathered = gather_objects(parts, self.runtime)
        if self.distributed:
            stop_if_any_rank_asked(self.runtime)
        return None if gathered is None else pd.concat([part for rank in gathered for part in rank])

    def __exit__(self, *failure) -> None:
        with self.queued:
            self.queue.clear()  # no worker starts another task
        if self.starting is not None:
            self.starting.join()
        if self.pool is not None:
            self.pool.terminate()  # after `collect` nothing runs; on a failure or a stop, what runs ends now
            self.pool.join()
        if self.futures:
            self.client.cancel(self.futures)
