"""Where the baselines' fits run, a task per ticker and model: in a process pool started before the network trains,
on Dask, or under DDP in shares of the ranks; the same forecasts, in the tasks' order, whichever runs them. Pool
workers take the longest tasks first from a queue, which this process helps empty once the network has trained."""

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
    ticker: str
    model: str
    rows: pd.DataFrame
    blocks: Blocks


def pool_workers(tasks: int, runtime: Runtime | None) -> int:
    """A worker for each usable core the training leaves, at least one, at most one per task."""
    training = torch.get_num_threads() if runtime is None or runtime.device.type == "cpu" else 1
    return max(1, min(tasks, usable_cores() - training))


class BaselineRuns:
    """Entering starts the tasks (on Dask, in a pool started from a thread, or nothing under DDP); `collect`
    runs what is left and waits, stopping on Ctrl-C or SIGTERM; leaving ends whatever still runs."""

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
        """forkserver: workers hold none of this process's threads or locks, end with it, and share one import."""
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
        """Give a worker the next task, as each one ends, under the queue's lock (a task out of it is in `results`)."""
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
        """Without a pool or Dask: this rank's share of the tasks, every rank's gathered on rank 0."""
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
