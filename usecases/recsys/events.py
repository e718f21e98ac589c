"""The event store behind `POST /events`: what users did since the model was trained, kept where every worker of the
server reads it, so that the next request of a user folds in their latest items.

Two stores behind one interface (`EventStore`), chosen by `open_event_store(url_or_path)`:
- SQLite (a path, or `sqlite:///PATH`): one file in WAL mode shared by the worker processes of one machine;
- Redis Streams (`redis://HOST:PORT/DB`): for servers on several machines; needs the `redis` client.

An event is a user id, an item id (each a string or an integer, kept as text: the served model maps raw ids by
`str`) and a timestamp in whole seconds since the epoch, from 1995-01-01 to a day after now (the time of the append
when left out): the rules of `schema.py`, which `/invocations` follows too. `append` returns once the events are
committed: an acknowledged event survives a kill of the process. Nothing is deduplicated here; the fold-in does that.
A retraining job pages through every event with `read_since`, handing back the cursor it was given to say it has
the events before it.
"""

import os
import re
import reprlib
import sqlite3
import threading
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

from common.errors import UserError, one_line
from .schema import BadField, checked_id, checked_timestamp, refused_as, shown

__all__ = ["START", "BadEvent", "Event", "EventStore", "EventStoreUnavailable", "RedisEventStore", "SQLiteEventStore",
           "open_event_store"]

START = "0"  # the cursor before the first event
FIELDS = ("user_id", "item_id", "timestamp")
BUSY_TIMEOUT_S = 30.0  # a writer waits this long for another process's write lock (each one takes microseconds)
REDIS_RECENT_PER_USER = 1000  # events kept in a user's own stream (approximately: at least this many)
REDIS_STREAM_LENGTH = 10_000_000  # events kept in the stream that retraining reads (approximately)


class BadEvent(UserError):
    """An event that cannot be recorded, said in one line naming its index and field (HTTP 400 on a server)."""


class EventStoreUnavailable(UserError):
    """A store that cannot be opened, written or read, said in one line: a server's start stops on it (`check`), and
    a request that meets it later gets HTTP 503 with the line."""


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

    def check(self) -> None:
        """Open, write and read the store once (a server's start), or `EventStoreUnavailable`."""

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


@refused_as(BadEvent)
def parse_events(events: Any) -> list[Event]:
    """`events` (an event or a list of them, each an `Event` or a dict of `FIELDS`) checked by the servers' rules
    (`schema.py`), as `Event`s."""
    batch = [events] if isinstance(events, (dict, Event)) else events
    if not isinstance(batch, (list, tuple)):
        raise BadField(f"events: expected an event (an object with user_id, item_id and an optional timestamp) "
                       f"or a list of them, got {shown(events)}")
    now = int(time.time())
    return [_parsed(raw, index, now) for index, raw in enumerate(batch)]


def _parsed(raw: Any, index: int, now: int) -> Event:
    if isinstance(raw, Event):
        raw = {"user_id": raw.user_id, "item_id": raw.item_id, "timestamp": raw.timestamp}
    if not isinstance(raw, dict):
        raise BadField(f"event {index}: expected an object with user_id, item_id and an optional timestamp, "
                       f"got {shown(raw)}")
    unknown = [str(key) for key in raw if key not in FIELDS]
    if unknown:
        raise BadField(f"event {index}: unknown field {reprlib.repr(unknown[0])}: an event has {', '.join(FIELDS)}")
    user_id, item_id = (str(checked_id(raw.get(field), f"event {index}: {field}")) for field in ("user_id", "item_id"))
    timestamp = raw.get("timestamp")
    if timestamp is None:
        return Event(user_id, item_id, now)
    return Event(user_id, item_id, checked_timestamp(timestamp, f"event {index}: timestamp", now))


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
OWN_TABLES = ("events", "sqlite_sequence")  # and SQLite's other sqlite_* tables

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
                    raise EventStoreUnavailable(f"{self.path}: cannot open the event store: {one_line(error)}") \
                        from None
                time.sleep(0.01)
            except (OSError, sqlite3.Error) as error:
                raise EventStoreUnavailable(f"{self.path}: cannot open the event store: {one_line(error)}") from None

    def _open(self) -> sqlite3.Connection:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        connection = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False)
        try:
            foreign = _foreign_tables(connection)
            if foreign:  # another program's database (MLflow's tracking store beside it): left as it is
                raise EventStoreUnavailable(f"{self.path}: this SQLite file holds tables that are not the event "
                                            f"store's ({foreign}): give the events a file of their own")
            mode = connection.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if mode != "wal":
                raise EventStoreUnavailable(f"{self.path}: SQLite cannot keep the event store in WAL mode here "
                                            f"(journal mode {mode}); give a file on a local disk")
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
        with self._database("write") as connection, connection:  # commits, or rolls back on an error: all or none
            connection.execute("BEGIN IMMEDIATE")
            connection.executemany("INSERT INTO events(user_id, item_id, ts) VALUES (?, ?, ?)", rows)
        return len(rows)

    def recent(self, user_id: str | int, limit: int) -> list[str]:
        if limit < 1:
            return []
        with self._database("read") as connection:
            rows = connection.execute("SELECT item_id FROM events WHERE user_id = ? ORDER BY seq DESC LIMIT ?",
                                      (str(user_id), int(limit))).fetchall()
        return [item for item, in reversed(rows)]

    def read_since(self, cursor: str = START, count: int = 1000) -> tuple[list[Event], str]:
        after = int(_checked_cursor(cursor, r"\d+"))
        with self._database("read") as connection:
            rows = connection.execute("SELECT seq, user_id, item_id, ts FROM events WHERE seq > ? ORDER BY seq LIMIT ?",
                                      (after, max(1, int(count)))).fetchall()
        if not rows:
            return [], str(after)
        return [Event(user, item, ts) for _, user, item, ts in rows], str(rows[-1][0])

    def check(self) -> None:
        """Opened, checked, written and read once, as a server does before it binds its port: a file that is no
        SQLite database or holds another program's tables, a damaged one, a folder or file this process cannot write
        is one line now rather than HTTP 500 at the first request. The write is a probe event inserted, read back and
        deleted in one committed transaction (its `seq` is never reused: cursors skip it). SQLite's quick_check reads
        the whole file: a store of millions of events adds seconds to the start."""
        with self._database("check") as connection:
            problems = [line for row, in connection.execute("PRAGMA quick_check") for line in str(row).splitlines()
                        if not line.startswith("***")]
        if problems != ["ok"]:
            raise EventStoreUnavailable(f"{self.path}: the event store is damaged (SQLite's quick_check: "
                                        f"{'; '.join(problems[:2])}): move it away to start a new one")
        with self._database("write") as connection, connection:
            connection.execute("BEGIN IMMEDIATE")
            probe = connection.execute("INSERT INTO events(user_id, item_id, ts) VALUES ('', '', 0)").lastrowid
            connection.execute("SELECT user_id, item_id, ts FROM events WHERE seq = ?", (probe,)).fetchone()
            connection.execute("DELETE FROM events WHERE seq = ?", (probe,))

    @contextmanager
    def _database(self, doing: str):
        """The process's connection, one caller at a time; SQLite's errors (a disk full, a file gone read-only) as
        `EventStoreUnavailable`, saying what failed (`doing`: read, write, check)."""
        with self._lock:
            connection = self._connection()
            try:
                yield connection
            except sqlite3.Error as error:
                raise EventStoreUnavailable(f"{self.path}: cannot {doing} the event store: {one_line(error)}") \
                    from None

    def close(self) -> None:
        with self._lock:
            if self._connected is not None:
                self._connected.close()
                self._connected = None


def _foreign_tables(connection: sqlite3.Connection) -> str:
    """The tables of the file that are not the store's, and an `events` table of other columns, said briefly ("" for
    an event store or an empty file), read before anything is written."""
    tables = [name for name, in connection.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
    foreign = sorted(name for name in tables if name not in OWN_TABLES and not name.startswith("sqlite_"))
    if "events" in tables:
        columns = [row[1] for row in connection.execute("PRAGMA table_info(events)")]
        if columns != ["seq", "user_id", "item_id", "ts"]:
            foreign.insert(0, f"events of columns {', '.join(columns)}")
    return ", ".join(foreign[:5])


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
        cursor, count = _checked_cursor(cursor, r"\d+(-\d+)?"), max(1, int(count))
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
