"""The event store behind `POST /events`: what users did since the model was trained, kept where every worker of the
server reads it, so that the next request of a user folds in their latest items.

Two stores behind one interface (`EventStore`), chosen by `open_event_store(url_or_path)`:
- SQLite (a path, or `sqlite:///PATH`): one file in WAL mode shared by the worker processes of one machine;
- Redis Streams (`redis://HOST:PORT/DB`): for servers on several machines; needs the `redis` client.

An event is a user id, an item id (each a string or an integer, kept as text: the served model maps raw ids by
`str`) and a timestamp in whole seconds (the time of the append when left out). `append` returns once the events are
committed: an acknowledged event survives a kill of the process. Nothing is deduplicated here; the fold-in does that.
A retraining job pages through every event with `read_since`, handing back the cursor it was given to say it has
the events before it.
"""

import numbers
import os
import re
import reprlib
import sqlite3
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

from common.errors import UserError

__all__ = ["START", "BadEvent", "Event", "EventStore", "RedisEventStore", "SQLiteEventStore", "open_event_store"]

START = "0"  # the cursor before the first event
FIELDS = ("user_id", "item_id", "timestamp")
BUSY_TIMEOUT_S = 30.0  # a writer waits this long for another process's write lock (each one takes microseconds)
REDIS_RECENT_PER_USER = 1000  # events kept in a user's own stream (approximately: at least this many)
REDIS_STREAM_LENGTH = 10_000_000  # events kept in the stream that retraining reads (approximately)


class BadEvent(UserError):
    """An event that cannot be recorded, said in one line naming its index and field (HTTP 400 on a server)."""


@dataclass(frozen=True)
class Event:
    """One thing a user did, ids as text (as the served model maps raw ids)."""

    user_id: str
    item_id: str
    timestamp: int


class EventStore(Protocol):
    def append(self, events: Event | dict | list[Event | dict]) -> int:
        """Record one event or a list of them, all or none; the number recorded, once committed."""

    def recent(self, user_id: str | int, limit: int) -> list[str]:
        """The item ids of the user's latest `limit` events, newest last."""

    def read_since(self, cursor: str = START, count: int = 1000) -> tuple[list[Event], str]:
        """Up to `count` events after `cursor`, oldest first, and the cursor to pass next, which says that the events
        up to it are handled; [] when none is new."""

    def close(self) -> None: ...


def open_event_store(url_or_path: str | Path) -> EventStore:
    """The store a server was told to use: `sqlite:///PATH` (PATH relative unless it starts with /, as in
    SQLAlchemy's URLs) or a bare path, or `redis://HOST:PORT/DB` (`rediss://` with TLS)."""
    text = str(url_or_path)
    scheme = text.partition("://")[0].lower() if "://" in text else ""
    if not scheme:
        return SQLiteEventStore(Path(text).expanduser())
    if scheme == "sqlite":
        if not text.startswith("sqlite:///") or text == "sqlite:///":
            raise UserError(f"events: {text!r} names no file: write sqlite:///relative.db or sqlite:////absolute.db")
        return SQLiteEventStore(Path(text.removeprefix("sqlite:///")).expanduser())
    if scheme in ("redis", "rediss"):
        return RedisEventStore(text)
    raise UserError(f"events: unknown store {scheme}:// in {text!r}: give a file path, sqlite:///PATH or "
                    f"redis://HOST:PORT/DB")


def parse_events(events: Any) -> list[Event]:
    """`events` (an event or a list of them, each an `Event` or a dict of `FIELDS`) checked, as `Event`s."""
    batch = [events] if isinstance(events, (dict, Event)) else events
    if not isinstance(batch, (list, tuple)):
        raise BadEvent(f"events: expected an event (an object with user_id, item_id and an optional timestamp) "
                       f"or a list of them, got {_shown(events)}")
    now = int(time.time())
    return [_parsed(raw, index, now) for index, raw in enumerate(batch)]


def _parsed(raw: Any, index: int, now: int) -> Event:
    if isinstance(raw, Event):
        raw = {"user_id": raw.user_id, "item_id": raw.item_id, "timestamp": raw.timestamp}
    if not isinstance(raw, dict):
        raise BadEvent(f"event {index}: expected an object with user_id, item_id and an optional timestamp, "
                       f"got {_shown(raw)}")
    unknown = [str(key) for key in raw if key not in FIELDS]
    if unknown:
        raise BadEvent(f"event {index}: unknown field {reprlib.repr(unknown[0])}: an event has {', '.join(FIELDS)}")
    user_id, item_id = (_id(raw, field, index) for field in ("user_id", "item_id"))
    timestamp = raw.get("timestamp")
    if timestamp is None:
        return Event(user_id, item_id, now)
    if not isinstance(timestamp, numbers.Integral) or isinstance(timestamp, bool) or timestamp < 0:
        raise BadEvent(f"event {index}: timestamp must be whole Unix seconds (an integer, 0 or more), "
                       f"got {_shown(timestamp)}")
    return Event(user_id, item_id, int(timestamp))


def _id(raw: dict, field: str, index: int) -> str:
    if field not in raw or raw[field] is None:
        raise BadEvent(f"event {index}: {field} is missing")
    value = raw[field]
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return str(int(value))
    if isinstance(value, str) and value:
        return value
    raise BadEvent(f"event {index}: {field} must be a non-empty string or an integer, got {_shown(value)}")


def _shown(value: Any) -> str:
    """A value as an error line quotes it: short, and on one line (`repr` escapes newlines)."""
    return f"{type(value).__name__} {reprlib.repr(value)}"


def _checked_cursor(cursor: str | None, shape: str) -> str:
    """`cursor` if it has the `shape` (a regular expression) of the store's cursors."""
    cursor = START if cursor is None else str(cursor)
    if not re.fullmatch(shape, cursor):
        raise UserError(f"events: cursor {reprlib.repr(cursor)} is not one read_since returned (or {START!r})")
    return cursor


SCHEMA = """
CREATE TABLE IF NOT EXISTS events(
    seq INTEGER PRIMARY KEY AUTOINCREMENT,  -- arrival order, never reused: a consumer's cursor
    user_id TEXT NOT NULL,
    item_id TEXT NOT NULL,
    ts INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS events_by_user ON events(user_id, seq);
"""

_SQLITE_STORES: "weakref.WeakSet[SQLiteEventStore]" = weakref.WeakSet()
_INHERITED: list[sqlite3.Connection] = []  # a parent's connections in a forked child: SQLite forbids using them,
# closing included, so the child keeps them unused for its lifetime


def _forget_parent_connections() -> None:
    for store in _SQLITE_STORES:
        store._forget_parent()


os.register_at_fork(after_in_child=_forget_parent_connections)


class SQLiteEventStore:
    """One SQLite file in WAL mode, shared by every process of one machine: readers never wait for the writer, and
    writers from several processes take turns on the write lock (`BUSY_TIMEOUT_S`).

    Each process opens its own connection on first use, a forked child too (it never touches its parent's); the
    threads of a process share it, one call at a time. `synchronous=NORMAL` by default: a commit is written to the
    WAL file before `append` returns, so it survives a kill of the process (the test kills one mid-stream). FULL adds
    an fsync per commit, which only matters when the machine itself goes down (power loss, a kernel crash; there
    NORMAL may lose the last commits, never corrupt the file) and costs 60 times the time: a one-event append took
    50-70 µs at the median with NORMAL and 4.0 ms with FULL (2 cores, ext4, 2026-12). Pass "FULL" for that case.
    """

    def __init__(self, path: Path, synchronous: str = "NORMAL"):
        if synchronous not in ("NORMAL", "FULL"):
            raise UserError(f"events: synchronous must be NORMAL or FULL, got {synchronous!r}")
        self.path, self.synchronous = Path(path), synchronous
        self._connected: sqlite3.Connection | None = None
        self._lock = threading.Lock()
        _SQLITE_STORES.add(self)

    def _forget_parent(self) -> None:
        """In a forked child, where the forking thread is the only one: a fresh lock, and a connection of its own."""
        if self._connected is not None:
            _INHERITED.append(self._connected)
        self._connected, self._lock = None, threading.Lock()

    def _connection(self) -> sqlite3.Connection:
        """The process's connection (call under `_lock`)."""
        if self._connected is None:
            self._connected = self._connect()
        return self._connected

    def _connect(self) -> sqlite3.Connection:
        """Several processes (a server's workers) may open a new file at once: switching it to WAL and creating the
        table take locks that SQLite's busy handler does not wait for, so a busy open is retried until
        BUSY_TIMEOUT_S."""
        deadline = time.monotonic() + BUSY_TIMEOUT_S
        while True:
            try:
                return self._open()
            except sqlite3.OperationalError as error:
                if "locked" not in str(error) or time.monotonic() > deadline:
                    raise UserError(f"{self.path}: cannot open the event store: {error}") from None
                time.sleep(0.01)
            except (OSError, sqlite3.Error) as error:
                raise UserError(f"{self.path}: cannot open the event store: {error}") from None

    def _open(self) -> sqlite3.Connection:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        connection = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False)
        try:
            mode = connection.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if mode != "wal":
                raise UserError(f"{self.path}: SQLite cannot keep the event store in WAL mode here (journal mode "
                                f"{mode}); give a file on a local disk")
            connection.execute(f"PRAGMA synchronous={self.synchronous}")
            connection.executescript(SCHEMA)
        except BaseException:
            connection.close()
            raise
        return connection

    def append(self, events: Event | dict | list[Event | dict]) -> int:
        rows = [(event.user_id, event.item_id, event.timestamp) for event in parse_events(events)]
        if not rows:
            return 0
        with self._lock:
            connection = self._connection()
            with connection:  # commits on the way out, rolls back on an error: all the events or none
                connection.execute("BEGIN IMMEDIATE")
                connection.executemany("INSERT INTO events(user_id, item_id, ts) VALUES (?, ?, ?)", rows)
        return len(rows)

    def recent(self, user_id: str | int, limit: int) -> list[str]:
        if limit < 1:
            return []
        with self._lock:
            rows = self._connection().execute("SELECT item_id FROM events WHERE user_id = ? ORDER BY seq DESC LIMIT ?",
                                              (str(user_id), int(limit))).fetchall()
        return [item for item, in reversed(rows)]

    def read_since(self, cursor: str = START, count: int = 1000) -> tuple[list[Event], str]:
        after = int(_checked_cursor(cursor, r"\d+"))
        with self._lock:
            rows = self._connection().execute("SELECT seq, user_id, item_id, ts FROM events WHERE seq > ? "
                                              "ORDER BY seq LIMIT ?", (after, max(1, int(count)))).fetchall()
        if not rows:
            return [], str(after)
        return [Event(user, item, ts) for _, user, item, ts in rows], str(rows[-1][0])

    def close(self) -> None:
        with self._lock:
            if self._connected is not None:
                self._connected.close()
                self._connected = None


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
        self.group, self.consumer = group, consumer
        self._response_error = redis.ResponseError
        self._has_group = False
        try:
            self.client = redis.Redis.from_url(url, decode_responses=True)
            self.client.ping()
        except (ValueError, redis.RedisError) as error:
            raise UserError(f"events: cannot use {self.where}: {' '.join(str(error).split())}") from None

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
        pipeline.execute()
        return len(checked)

    def recent(self, user_id: str | int, limit: int) -> list[str]:
        if limit < 1:
            return []
        entries = self.client.xrevrange(self.user_prefix + str(user_id), count=int(limit))
        return [fields["item"] for _, fields in reversed(entries)]

    def read_since(self, cursor: str = START, count: int = 1000) -> tuple[list[Event], str]:
        """Through the consumer group: the entries up to `cursor` are acknowledged (XACK), then this consumer's
        entries delivered after it but never acknowledged are read again (a job that restarts from its last saved
        cursor), else the group's next undelivered ones."""
        cursor, count = _checked_cursor(cursor, r"\d+(-\d+)?"), max(1, int(count))
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
