"""The event store as a server's requests use it: off the event loop, each call bounded in time, and answered around
when it stalls or is gone. A recommender that cannot read the latest events still answers from the model (marked
`X-Events: unavailable` and counted); only events it cannot store are refused (503). Nothing here restarts: the
store's client reconnects on the first call after the store is back."""

from __future__ import annotations

import asyncio
import time

from common.serving.metrics import ServerMetrics
from .event_types import EventStore, EventStoreUnavailable

READ_WAIT_S = 1.0  # a request waits this long for its users' events, then answers from the model alone
WRITE_WAIT_S = 1.5  # `/events` waits this long for its write, then answers 503
RETRY_AFTER_S = 1.0  # after a failed read, requests skip the store this long (one then tries it again)
DEGRADED_HEADER = ("X-Events", "unavailable")  # on an answer made without the stored events


class EventMetrics:
    """What the store did for this worker's requests, in the server's `/metrics`."""

    def __init__(self, metrics: ServerMetrics):
        self.degraded = metrics.counter("degraded_answers", "Answers made without the stored events (store down)")
        self.seconds = metrics.histogram("event_store_seconds", "Seconds an event-store call took", ("operation",))
        self.failures = metrics.counter("event_store_failures", "Event-store calls failed or stalled", ("operation",))


class LiveEvents:
    """`store` for requests: reads of `limit` events a user after the model's watermark `after`, or None while the
    store is not answering; writes that fail or stall as `EventStoreUnavailable` in one line."""

    def __init__(self, store: EventStore, limit: int, after: int | None, metrics: ServerMetrics):
        self.store, self.limit, self.after = store, limit, after
        self.metrics = EventMetrics(metrics)
        self._failed_at = -float("inf")

    async def recent(self, user_ids: list) -> list[list[str]] | None:
        """Each user's stored events, newest last; None (counted as degraded) when the store failed or stalled."""
        if time.monotonic() - self._failed_at < RETRY_AFTER_S:
            self.metrics.degraded.inc()
            return None
        try:
            return await self._call("read", READ_WAIT_S, self.store.recent_many, user_ids, self.limit, self.after)
        except EventStoreUnavailable:
            self._failed_at = time.monotonic()
            self.metrics.degraded.inc()
            return None

    async def append(self, body) -> int:
        """The events of `body` recorded, all or none (the store's transaction), or `EventStoreUnavailable`."""
        return await self._call("write", WRITE_WAIT_S, self.store.append, body)

    async def _call(self, operation: str, wait_s: float, function, *args):
        """`function(*args)` on a thread, timed; a stall past `wait_s` is `EventStoreUnavailable` too."""
        started = time.perf_counter()
        try:
            return await asyncio.wait_for(asyncio.to_thread(function, *args), wait_s)
        except asyncio.TimeoutError:
            self.metrics.failures.labels(operation).inc()
            raise EventStoreUnavailable(f"events: the event store gave no answer within {wait_s:g} s"
                                        + ("" if operation == "read" else ": nothing was acknowledged (a write is "
                                           "recorded all or none)")) from None
        except EventStoreUnavailable:
            self.metrics.failures.labels(operation).inc()
            raise
        finally:
            self.metrics.seconds.labels(operation).observe(time.perf_counter() - started)
