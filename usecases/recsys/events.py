"""The event store behind `POST /events`: what users did since the model was trained, kept where every worker of the
server reads it, so that the next request of a user folds in their latest items.

Two stores behind one interface (`EventStore`), chosen by `open_event_store(url_or_path)`:
- SQLite (a path, or `sqlite:///PATH`): one file in WAL mode shared by the worker processes of one machine;
- Redis Streams (`redis://HOST:PORT/DB`): for servers on several machines; needs the `redis` client.

What an event is and how it is checked: `event_types.py`. `append` returns once the events are
committed: an acknowledged event survives a kill of the process. Nothing is deduplicated here; the fold-in does that.
A retraining job pages through every event with `read_since`, handing back the cursor it was given to say it has
the events before it.
"""

import os
import sqlite3
import threading
import time
import weakref
from contextlib import contextmanager
from pathlib import Path

from common.errors import UserError, one_line
from .event_types import START, BadEvent, Event, EventStore, EventStoreUnavailable, checked_cursor, parse_events

__all__ = ["START", "BadEvent", "Event", "EventStore", "EventStoreUnavailable", "SQLiteEventStore", "open_event_store"]

BUSY_TIMEOUT_S = 30.0  # a writer waits this long for another process's write lock (each one takes microseconds)


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
        from .redis_events import RedisEventStore

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
        after = int(checked_cursor(cursor, r"\d+"))
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
