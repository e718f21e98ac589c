"""The Redis backend of the event store (`events.py`: the interface and the SQLite backend), for servers on several
machines."""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from urllib.parse import urlsplit

from common.errors import UserError, one_line
from .event_types import START, Event, EventStoreUnavailable, checked_cursor, parse_events

REDIS_RECENT_PER_USER = 1000  # events kept in a user's own stream (approximately: at least this many)
REDIS_STREAM_LENGTH = 10_000_000  # events kept in the stream that retraining reads (approximately)


def _redis_client_module():
    try:
        import redis
    except ImportError:
        raise UserError("the redis extra is not installed: pip install redis") from None
    return redis


class RedisEventStore:
    """Redis Streams, for servers on several machines. Each event is added, in one MULTI/EXEC, to two streams:
    - the user's own (`PREFIX:user:ID`, capped near `REDIS_RECENT_PER_USER`), so that `recent` is one XREVRANGE
      of `limit` entries whatever the traffic of other users (one shared stream would have to be scanned);
    - `PREFIX:events`, every user's events in arrival order (capped near `REDIS_STREAM_LENGTH`), which a
      retraining job reads through the consumer group `group` (XREADGROUP, XACK).

    An event acknowledged is in the Redis server, which a worker's restart does not touch; whether it survives a
    restart of Redis itself is Redis's persistence setting (`--appendonly yes`). The client reconnects by itself
    after a fork.
    """

    def __init__(self, url: str, prefix: str = "recsys", group: str = "retrain", consumer: str = "retrain-1"):
        redis = _redis_client_module()
        parts = urlsplit(url)
        self.where = f"{parts.scheme}://{parts.hostname}:{parts.port or 6379}{parts.path}"  # without a password
        self.stream, self.user_prefix = f"{prefix}:events", f"{prefix}:user:"
        self.check_key = f"{prefix}:check"
        self.group, self.consumer = group, consumer
        self._response_error, self._redis_error = redis.ResponseError, redis.RedisError
        self._has_group = False
        try:
            self.client = redis.Redis.from_url(url, decode_responses=True)
            self.client.ping()
        except (ValueError, redis.RedisError) as error:
            raise EventStoreUnavailable(f"events: cannot use {self.where}: {one_line(error)}") from None

    @contextmanager
    def _redis(self, doing: str):
        """Redis's errors (the server gone, out of memory, a read-only replica) as `EventStoreUnavailable`."""
        try:
            yield
        except self._redis_error as error:
            raise EventStoreUnavailable(f"events: cannot {doing} {self.where}: {one_line(error)}") from None

    def check(self) -> None:
        """A round trip, as a server does before it binds its port: the stream retraining reads is a stream (or not
        there yet), and a key written (expiring in a minute) is read back; a replica that refuses writes, a server
        out of memory or that key taken by something else is one line now rather than HTTP 500 at the first
        request."""
        with self._redis("read"):
            kind = self.client.type(self.stream)
        if kind not in ("stream", "none"):
            raise EventStoreUnavailable(f"events: {self.where}: key {self.stream!r} holds a {kind}, not a stream of "
                                        "events: give the events a Redis database of their own (redis://HOST:PORT/DB)")
        with self._redis("write"):
            token = f"{os.getpid()}:{time.time_ns()}"
            self.client.set(self.check_key, token, ex=60)
            if self.client.get(self.check_key) != token:
                raise EventStoreUnavailable(f"events: {self.where}: a key written was not read back")

    def append(self, events: Event | dict | list[Event | dict]) -> int:
        checked = parse_events(events)
        if not checked:
            return 0
        pipeline = self.client.pipeline(transaction=True)
        for event in checked:
            pipeline.xadd(self.user_prefix + event.user_id, {"item": event.item_id, "ts": event.timestamp},
                          maxlen=REDIS_RECENT_PER_USER, approximate=True)
            pipeline.xadd(self.stream, {"user": event.user_id, "item": event.item_id, "ts": event.timestamp},
                          maxlen=REDIS_STREAM_LENGTH, approximate=True)
        with self._redis("write"):
            pipeline.execute()
        return len(checked)

    def recent(self, user_id: str | int, limit: int) -> list[str]:
        if limit < 1:
            return []
        with self._redis("read"):
            entries = self.client.xrevrange(self.user_prefix + str(user_id), count=int(limit))
        return [fields["item"] for _, fields in reversed(entries)]

    def read_since(self, cursor: str = START, count: int = 1000) -> tuple[list[Event], str]:
        """Through the consumer group: the entries up to `cursor` are acknowledged (XACK), then this consumer's
        entries delivered after it but never acknowledged are read again (a job that restarts from its last saved
        cursor), else the group's next undelivered ones."""
        cursor, count = checked_cursor(cursor, r"\d+(-\d+)?"), max(1, int(count))
        with self._redis("read"):
            return self._read_since(cursor, count)

    def _read_since(self, cursor: str, count: int) -> tuple[list[Event], str]:
        self._create_group()
        while True:
            self._acknowledge(cursor)
            entries = self._read_group(cursor, count) or self._read_group(">", count)
            if not entries:
                return [], cursor
            cursor = entries[-1][0]
            events = [Event(fields["user"], fields["item"], int(fields["ts"])) for _, fields in entries if fields]
            if events:  # else every entry was trimmed off the stream while pending: skip past them
                return events, cursor

    def _create_group(self) -> None:
        if self._has_group:
            return
        try:
            self.client.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        except self._response_error as error:
            if "BUSYGROUP" not in str(error):
                raise
        self._has_group = True

    def _acknowledge(self, cursor: str) -> None:
        while True:
            done = self.client.xpending_range(self.stream, self.group, min="-", max=cursor, count=1000,
                                              consumername=self.consumer)
            if not done:
                return
            self.client.xack(self.stream, self.group, *(entry["message_id"] for entry in done))

    def _read_group(self, after: str, count: int) -> list[tuple[str, dict | None]]:
        answer = self.client.xreadgroup(self.group, self.consumer, {self.stream: after}, count=count)
        streams = answer.values() if isinstance(answer, dict) else (entries for _, entries in answer or [])
        return [(entry_id, fields) for entries in streams for entry_id, fields in entries]

    def close(self) -> None:
        self.client.close()
