"""Micro-batching for an asyncio server, as Triton's dynamic batcher does (on a GPU one product for 32 users costs about
one user's): a batch's first request waits at most `window_s` (or until `max_size` are queued), then runs in a worker
thread; a batch that fails is retried a request at a time, so that a request that cannot be answered fails alone."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any


class MicroBatcher:
    """`await submit(item)` returns `handle([..., item, ...])`'s entry for that item."""

    def __init__(self, handle: Callable[[Sequence[Any]], Sequence[Any]], window_s: float, max_size: int = 64):
        if window_s < 0 or max_size < 1:
            raise ValueError(f"micro-batching needs a window of at least 0 s and a size of at least 1, got "
                             f"{window_s} and {max_size}")
        self.handle, self.window_s, self.max_size = handle, window_s, max_size
        self.batches = 0  # how many batches ran, and how many requests they held: the mean batch size
        self.requests = 0
        self._pending: list[tuple[Any, asyncio.Future]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._device: asyncio.Lock | None = None  # one batch at a time on the device; made in the server's loop
        self._running: set[asyncio.Task] = set()

    async def submit(self, item: Any) -> Any:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._pending.append((item, future))
        if len(self._pending) >= self.max_size:
            self._flush()
        elif self._timer is None:
            self._timer = loop.call_later(self.window_s, self._flush)
        return await future

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batch, self._pending = self._pending, []
        if batch:
            task = asyncio.ensure_future(self._run(batch))
            self._running.add(task)  # the loop keeps only weak references to tasks
            task.add_done_callback(self._running.discard)

    async def _run(self, batch: list[tuple[Any, asyncio.Future]]) -> None:
        if self._device is None:
            self._device = asyncio.Lock()
        items = [item for item, _ in batch]
        async with self._device:
            self.batches += 1
            self.requests += len(items)
            try:
                results = await asyncio.to_thread(self.handle, items)
            except Exception as error:
                results = [_Failed(error)] if len(items) == 1 else \
                    [await asyncio.to_thread(_alone, self.handle, item) for item in items]
        for (_, future), result in zip(batch, results):
            if future.done():  # the client went away
                continue
            if isinstance(result, _Failed):
                future.set_exception(result.error)
            else:
                future.set_result(result)


class _Failed:
    def __init__(self, error: BaseException):
        self.error = error


def _alone(handle: Callable[[Sequence[Any]], Sequence[Any]], item: Any) -> Any:
    try:
        return handle([item])[0]
    except Exception as error:
        return _Failed(error)

