"""The event store behind `POST /events`, where every worker of the server reads what users did since the model
was trained: SQLite for the processes of one machine, Redis Streams for several (`EventStore`: `event_types.py`)."""

import os
import socket
import sqlite3
import threading
import time
import uuid
import weakref
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from common.errors import UserError, one_line
from .event_types import START, BadEvent, Event, EventStore, EventStoreUnavailable, checked_cursor, parse_events

__all__ = ["START", "BadEvent", "Event", "EventStore", "EventStoreUnavailable", "RedisEventStore", "SQLiteEventStore",
           "open_event_store"]

BUSY_TIMEOUT_S = 30.0  # a writer waits this long for another process's write lock (each one takes microseconds)


def open_event_store(url_or_path: str | Path) -> EventStore:
    """`sqlite:///PATH` (relative unless PATH starts with /, as in SQLAlchemy's URLs), a bare path, or
    `redis://HOST:PORT/DB` (`rediss://` with TLS)."""
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


SCHEMA = """
CREATE TABLE IF NOT EXISTS events(
    seq INTEGER PRIMARY KEY AUTOINCREMENT,  -- arrival order, never reused: a consumer's cursor
    user_id TEXT NOT NULL,
    item_id TEXT NOT NULL,
    ts INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS events_by_user ON events(user_id, seq);
CREATE INDEX IF NOT EXISTS events_by_user_time ON events(user_id, ts, seq);
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
    """One SQLite file in WAL mode, shared by the processes of one machine, each with its own connection (a forked
    child too). With NORMAL a commit survives a kill of the process; FULL adds an fsync per commit, which only
    matters when the machine goes down, at 60 times the time."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._connected: sqlite3.Connection | None = None
        self._lock = threading.Lock()
        _SQLITE_STORES.add(self)

    def _forget_parent(self) -> None:
        """In a forked child: a fresh lock, and a connection of its own."""
        if self._connected is not None:
            _INHERITED.append(self._connected)
        self._connected, self._lock = None, threading.Lock()

    def _connect(self) -> sqlite3.Connection:
        """Retried while busy: workers opening a new file at once take locks SQLite's busy handler does not wait for."""
        deadline = time.monotonic() + BUSY_TIMEOUT_S
        while True:
            try:
                return self._open()
            except (OSError, sqlite3.Error) as error:
                busy = isinstance(error, sqlite3.OperationalError) and "locked" in str(error)
                if not busy or time.monotonic() > deadline:
                    raise EventStoreUnavailable(f"{self.path}: cannot open the event store: {one_line(error)}") \
                        from None
                time.sleep(0.01)

    def _open(self) -> sqlite3.Connection:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        connection = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False)
        try:
            tables = [name for name, in connection.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
            foreign = sorted(name for name in tables if name not in OWN_TABLES and not name.startswith("sqlite_"))
            if "events" in tables:
                columns = [row[1] for row in connection.execute("PRAGMA table_info(events)")]
                if columns != ["seq", "user_id", "item_id", "ts"]:
                    foreign.insert(0, f"events of columns {', '.join(columns)}")
            if foreign:  # another program's database (MLflow's tracking store beside it): left as it is
                raise EventStoreUnavailable(f"{self.path}: this SQLite file holds tables that are not the event "
                                            f"store's ({', '.join(foreign[:5])}): give the events a file of their own")
            mode = connection.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if mode != "wal":
                raise EventStoreUnavailable(f"{self.path}: SQLite cannot keep the event store in WAL mode here "
                                            f"(journal mode {mode}); give a file on a local disk")
            connection.execute("PRAGMA synchronous=NORMAL")
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

    def recent(self, user_id: str | int, limit: int, after: int | None = None) -> list[str]:
        return self.recent_many([user_id], limit, after)[0]

    def recent_many(self, user_ids: list, limit: int, after: int | None = None) -> list[list[str]]:
        if limit < 1:
            return [[] for _ in user_ids]
        floor = -(2**63) if after is None else int(after)
        with self._database("read") as connection:
            return [[item for item, in reversed(connection.execute(
                "SELECT item_id FROM events WHERE user_id = ? AND ts > ? ORDER BY ts DESC, seq DESC LIMIT ?",
                (str(user_id), floor, int(limit))).fetchall())] for user_id in user_ids]

    def read_since(self, cursor: str = START, count: int = 1000) -> tuple[list[Event], str]:
        after = int(checked_cursor(cursor, r"\d+"))
        with self._database("read") as connection:
            rows = connection.execute("SELECT seq, user_id, item_id, ts FROM events WHERE seq > ? ORDER BY seq LIMIT ?",
                                      (after, max(1, int(count)))).fetchall()
        if not rows:
            return [], str(after)
        return [Event(user, item, ts) for _, user, item, ts in rows], str(rows[-1][0])

    def check(self) -> None:
        """Checked, written and read once before a server binds its port (the probe's `seq` is never reused)."""
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
        """The process's connection, one caller at a time; SQLite's errors as `EventStoreUnavailable`."""
        with self._lock:
            if self._connected is None:
                self._connected = self._connect()
            try:
                yield self._connected
            except sqlite3.Error as error:
                raise EventStoreUnavailable(f"{self.path}: cannot {doing} the event store: {one_line(error)}") \
                    from None

    def close(self) -> None:
        with self._lock:
            if self._connected is not None:
                self._connected.close()
                self._connected = None


REDIS_TIMEOUT_S = 0.5  # a connect or a reply that takes longer: the store is stalled (a server answers without it)
BOUNDS = {"per_user": 1000, "max_age_days": 0.0, "stream_length": 10_000_000}  # `redis://...?per_user=200`: 0 none


def _bound(value, name: str, where: str) -> float:
    try:
        bound = float(value)
    except ValueError:
        bound = -1.0
    if bound < 0:
        raise UserError(f"events: {where}: {name}={value!r}: expected a number of at least 0 (0: no bound)")
    return bound


class RedisEventStore:
    """Each event is added, in one MULTI/EXEC, to the user's own sorted set, scored by its timestamp (`recent` is one
    ZREVRANGEBYSCORE whatever other users do, in the order things happened, not arrived), and to `PREFIX:events`, the
    stream a retraining job reads through the consumer group `group`. Every call is bounded by `REDIS_TIMEOUT_S`
    and never retried here: a stalled store is an `EventStoreUnavailable` at once, which a server answers around.
    The URL's query bounds what is kept (`BOUNDS`): events a user's set keeps, their age in days, the stream's length;
    redis-py's own options (`socket_timeout`...) pass through."""

    def __init__(self, url: str, prefix: str = "recsys", group: str = "retrain", consumer: str = "retrain-1"):
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError:
            raise UserError("the redis extra is not installed: pip install redis") from None
        parts = urlsplit(url)
        self.where = f"{parts.scheme}://{parts.hostname}:{parts.port or 6379}{parts.path}"  # without a password
        query = dict(parse_qsl(parts.query))
        self.bounds = {name: _bound(query.pop(name, default), name, self.where) for name, default in BOUNDS.items()}
        self.stream, self.user_prefix = f"{prefix}:events", f"{prefix}:recent:"
        self.check_key = f"{prefix}:check:{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex}"  # one a server
        self.group, self.consumer = group, consumer
        self._response_error, self._redis_error = redis.ResponseError, redis.RedisError
        self._has_group = False
        try:
            self.client = redis.Redis.from_url(
                urlunsplit(parts._replace(query=urlencode(query))), decode_responses=True,
                **{"socket_timeout": REDIS_TIMEOUT_S, "socket_connect_timeout": REDIS_TIMEOUT_S,
                   **{key: float(value) for key, value in query.items() if key.endswith("timeout")}},
                retry=Retry(NoBackoff(), 0))
            self.client.ping()
        except (ValueError, redis.RedisError) as error:
            raise EventStoreUnavailable(f"events: cannot use {self.where}: {one_line(error)}") from None

    @contextmanager
    def _redis(self, doing: str):
        try:
            yield
        except self._redis_error as error:
            raise EventStoreUnavailable(f"events: cannot {doing} {self.where}: {one_line(error)}") from None

    def check(self) -> None:
        """A round trip before a server binds its port: the events key is a stream, and a key written is read back
        (a key of this server's own: servers starting together never read each other's)."""
        with self._redis("read"):
            kind = self.client.type(self.stream)
        if kind not in ("stream", "none"):
            raise EventStoreUnavailable(f"events: {self.where}: key {self.stream!r} holds a {kind}, not a stream of "
                                        "events: give the events a Redis database of their own (redis://HOST:PORT/DB)")
        with self._redis("write"):
            token = uuid.uuid4().hex
            self.client.set(self.check_key, token, ex=60)
            read = self.client.get(self.check_key)
            self.client.delete(self.check_key)
            if read != token:
                raise EventStoreUnavailable(f"events: {self.where}: a key written was not read back")

    def append(self, events: Event | dict | list[Event | dict]) -> int:
        checked = parse_events(events)
        if not checked:
            return 0
        per_user, stream_length = int(self.bounds["per_user"]), int(self.bounds["stream_length"])
        max_age_s = int(self.bounds["max_age_days"] * 86400)
        pipeline = self.client.pipeline(transaction=True)
        arrival = f"{time.time_ns():020d}{os.getpid():08d}"  # a member of its own for each event, repeats kept
        for number, event in enumerate(checked):
            key = self.user_prefix + event.user_id
            pipeline.zadd(key, {f"{arrival}{number:06d}:{event.item_id}": event.timestamp})
            if per_user:
                pipeline.zremrangebyrank(key, 0, -per_user - 1)
            if max_age_s:
                pipeline.zremrangebyscore(key, "-inf", f"({int(time.time()) - max_age_s}")
                pipeline.expire(key, max_age_s)
            pipeline.xadd(self.stream, {"user": event.user_id, "item": event.item_id, "ts": event.timestamp},
                          **({"maxlen": stream_length, "approximate": True} if stream_length else {}))
        with self._redis("write"):
            pipeline.execute()
        return len(checked)

    def recent(self, user_id: str | int, limit: int, after: int | None = None) -> list[str]:
        return self.recent_many([user_id], limit, after)[0]

    def recent_many(self, user_ids: list, limit: int, after: int | None = None) -> list[list[str]]:
        """Each user's latest `limit` items after the timestamp `after`, newest last: one round trip for them all."""
        if limit < 1 or not user_ids:
            return [[] for _ in user_ids]
        floor = "-inf" if after is None else f"({int(after)}"
        pipeline = self.client.pipeline(transaction=False)
        for user_id in user_ids:
            pipeline.zrevrangebyscore(self.user_prefix + str(user_id), "+inf", floor, start=0, num=int(limit))
        with self._redis("read"):
            answers = pipeline.execute()
        return [[member.partition(":")[2] for member in reversed(members)] for members in answers]

    def read_since(self, cursor: str = START, count: int = 1000) -> tuple[list[Event], str]:
        """Acknowledges the entries up to `cursor`; reads this consumer's pending ones again, else undelivered ones."""
        cursor, count = checked_cursor(cursor, r"\d+(-\d+)?"), max(1, int(count))
        with self._redis("read"):
            if not self._has_group:
                try:
                    self.client.xgroup_create(self.stream, self.group, id="0", mkstream=True)
                except self._response_error as error:
                    if "BUSYGROUP" not in str(error):
                        raise
                self._has_group = True
            while True:
                self._acknowledge(cursor)
                entries = self._read_group(cursor, count) or self._read_group(">", count)
                if not entries:
                    return [], cursor
                cursor = entries[-1][0]
                events = [Event(fields["user"], fields["item"], int(fields["ts"])) for _, fields in entries if fields]
                if events:  # else every entry was trimmed off the stream while pending: skip past them
                    return events, cursor

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
