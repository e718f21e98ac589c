"""What the event store keeps, whatever the backend (`events.py`): user and item ids as text (the served model maps
raw ids by `str`) and a timestamp (the append's time when left out), checked by the rules of `schema.py`."""

from __future__ import annotations

import re
import reprlib
import time
from dataclasses import dataclass
from typing import Any, Protocol

from common.errors import UserError
from .schema import BadField, checked_id, checked_timestamp, refused_as, shown

START = "0"  # the cursor before the first event
FIELDS = ("user_id", "item_id", "timestamp")


class BadEvent(UserError):
    """An event that cannot be recorded, said in one line naming its index and field (HTTP 400 on a server)."""


class EventStoreUnavailable(UserError):
    """A store that cannot be opened, written or read, in one line (HTTP 503 on a server)."""


@dataclass(frozen=True)
class Event:
    """One thing a user did, ids as text (as the served model maps raw ids)."""

    user_id: str
    item_id: str
    timestamp: int


class EventStore(Protocol):
    def append(self, events: Event | dict | list[Event | dict]) -> int:
        """Record one event or a list of them, all or none; the number recorded, once committed."""

    def recent(self, user_id: str | int, limit: int, after: int | None = None) -> list[str]:
        """The item ids of the user's latest `limit` events by timestamp, newest last; with `after`, only those of
        a later timestamp (a model's watermark: what it trained on is not folded in again)."""

    def recent_many(self, user_ids: list, limit: int, after: int | None = None) -> list[list[str]]:
        """`recent` of each user, in one round trip to the store."""

    def read_since(self, cursor: str = START, count: int = 1000) -> tuple[list[Event], str]:
        """Up to `count` events after `cursor` (which says the events up to it are handled), and the next cursor."""

    def check(self) -> None:
        """Open, write and read the store once (a server's start), or `EventStoreUnavailable`."""

    def close(self) -> None: ...


@refused_as(BadEvent)
def parse_events(events: Any) -> list[Event]:
    """An event or a list of them, each an `Event` or a dict of `FIELDS`, checked, as `Event`s."""
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


def checked_cursor(cursor: str | None, shape: str) -> str:
    """`cursor` if it has the `shape` (a regular expression) of the store's cursors."""
    cursor = START if cursor is None else str(cursor)
    if not re.fullmatch(shape, cursor):
        raise UserError(f"events: cursor {reprlib.repr(cursor)} is not one read_since returned (or {START!r})")
    return cursor
