"""The event store behind `POST /events`, SQLite and Redis through the same tests: a user's latest items newest last,
a retraining consumer's pages, one-line refusals, several writer processes at once, and a writer killed mid-stream
(every event it acknowledged is stored).

The Redis cases start their own `redis-server` on a free port and skip, in one line, without the `redis` client or
the server binary. Writers are forked children (`os.fork`): the store must open its own connection in each.
"""

import os
import signal
import sys
import time
import traceback
from pathlib import Path

import pytest

from common.errors import UserError
from tests.cli_helpers import free_port
from usecases.recsys.events import START, BadEvent, Event, SQLiteEventStore, open_event_store

ACKNOWLEDGED_BEFORE_KILL = 100  # appends a killed writer must have acknowledged

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="the writer processes are forked")


@pytest.fixture(params=["sqlite", "redis"])
def location(request, tmp_path) -> str:
    """Where a store is (what a server is told): a fresh SQLite file, or the emptied test Redis."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'events.db'}"
    url = request.getfixturevalue("redis_url")
    emptied = open_event_store(url)
    emptied.client.flushdb()
    emptied.close()
    return url


@pytest.fixture
def store(location):
    opened = open_event_store(location)
    yield opened
    opened.close()


def every_event(store) -> list[Event]:
    """All the store's events, paged through as a retraining job would."""
    events, cursor = [], START
    while True:
        page, cursor = store.read_since(cursor, 10_000)
        if not page:
            return events
        events += page


def forked(work) -> int:
    """The pid of a forked child running `work()`: it exits 0 once `work` returns, 1 on an exception."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            work()
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stderr.flush()
            os._exit(code)
    return pid


def exit_code(pid: int) -> int:
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def test_recent_is_the_users_latest_items_newest_last_with_repeats_kept(store):
    assert store.append([{"user_id": 1, "item_id": 10, "timestamp": 100}, {"user_id": "1", "item_id": "11"},
                         {"user_id": 2, "item_id": "x9"}, Event("1", "10", 103)]) == 4
    assert store.append({"user_id": 1, "item_id": 12}) == 1
    assert store.append([]) == 0
    assert store.recent(1, 10) == ["10", "11", "10", "12"]  # repeats are the fold-in's to drop
    assert store.recent("1", 2) == ["10", "12"]
    assert store.recent(2, 5) == ["x9"]
    assert store.recent("nobody", 5) == [] and store.recent(1, 0) == []


def test_read_since_pages_through_every_event_once_in_arrival_order(store):
    posted = [Event(str(index % 3), str(index), 1_700_000_000 + index) for index in range(23)]
    store.append(posted)
    pages, cursor = [], START
    while True:
        page, cursor = store.read_since(cursor, 5)
        if not page:
            break
        pages.append(page)
    assert [len(page) for page in pages] == [5, 5, 5, 5, 3]
    assert [event for page in pages for event in page] == posted
    assert store.read_since(cursor, 5) == ([], cursor)
    store.append({"user_id": "u", "item_id": "late", "timestamp": 7})
    assert store.read_since(cursor, 5)[0] == [Event("u", "late", 7)]


def test_an_event_without_a_timestamp_gets_the_time_of_its_append(store):
    before = int(time.time())
    store.append({"user_id": "u", "item_id": "i"})
    [event] = every_event(store)
    assert before <= event.timestamp <= time.time()


def test_a_consumer_restarting_from_its_saved_cursor_reads_its_unfinished_page_again(location, store):
    store.append([Event("u", str(index), index) for index in range(10)])
    _, first = store.read_since(START, 4)
    unfinished, _ = store.read_since(first, 4)  # the job dies before saving the cursor after this page
    restarted = open_event_store(location)
    again, second = restarted.read_since(first, 4)
    assert again == unfinished
    rest, _ = restarted.read_since(second, 4)
    assert [event.item_id for event in rest] == ["8", "9"]
    restarted.close()


BAD_EVENTS = [
    ({"item_id": 1}, "event 1: user_id is missing"),
    ({"user_id": None, "item_id": 1}, "event 1: user_id is missing"),
    ({"user_id": 1.5, "item_id": 1}, "event 1: user_id must be a non-empty string or an integer, got float 1.5"),
    ({"user_id": 1, "item_id": True}, "event 1: item_id must be"),
    ({"user_id": 1, "item_id": ""}, "event 1: item_id must be"),
    ({"user_id": 1, "item_id": [2]}, "event 1: item_id must be"),
    ({"user_id": 1, "item_id": 2, "timestamp": "2024-01-01\n"}, "event 1: timestamp must be whole Unix seconds"),
    ({"user_id": 1, "item_id": 2, "timestamp": 1.7e9}, "event 1: timestamp must be whole Unix seconds"),
    ({"user_id": 1, "item_id": 2, "timestamp": -1}, "event 1: timestamp must be whole Unix seconds"),
    ({"user_id": 1, "item": 2}, "event 1: unknown field 'item'"),
    ("user 1 item 2", "event 1: expected an object"),
]


@pytest.mark.parametrize(("bad", "expected"), BAD_EVENTS, ids=[expected for _, expected in BAD_EVENTS])
def test_a_bad_event_is_refused_in_one_line_naming_it_and_nothing_of_its_list_is_recorded(store, bad, expected):
    with pytest.raises(BadEvent) as refused:
        store.append([{"user_id": 1, "item_id": 1}, bad])
    assert str(refused.value).startswith(expected) and "\n" not in str(refused.value)
    assert store.recent(1, 10) == []


@pytest.mark.parametrize("body", ["user 1 item 2", 5, None])
def test_a_body_that_is_neither_an_event_nor_a_list_is_refused_in_one_line(store, body):
    with pytest.raises(BadEvent, match=r"^events: expected an event .* or a list of them, got \w+"):
        store.append(body)


def test_processes_appending_at_once_lose_nothing(location):
    """Writers that all open the store at the same moment (the SQLite file does not exist yet) and append one event
    at a time, contending for the write lock."""
    writers, per_writer = 4, 150
    start_at = time.monotonic() + 0.3  # the monotonic clock is the machine's: every child waits for the same time

    def write(writer: int):
        time.sleep(max(0.0, start_at - time.monotonic()))
        store = open_event_store(location)
        for index in range(per_writer):
            store.append({"user_id": f"w{writer}", "item_id": index, "timestamp": index})

    pids = [forked(lambda writer=writer: write(writer)) for writer in range(writers)]
    assert [exit_code(pid) for pid in pids] == [0] * writers
    store = open_event_store(location)
    for writer in range(writers):
        assert store.recent(f"w{writer}", 1000) == [str(index) for index in range(per_writer)]
    assert len(every_event(store)) == writers * per_writer


def test_a_store_used_before_a_fork_works_in_the_child_and_after_it(store):
    store.append({"user_id": "u", "item_id": "parent", "timestamp": 1})
    child = forked(lambda: store.append({"user_id": "u", "item_id": "child", "timestamp": 2}))
    assert exit_code(child) == 0
    store.append({"user_id": "u", "item_id": "parent again", "timestamp": 3})
    assert store.recent("u", 10) == ["parent", "child", "parent again"]


def test_a_writer_killed_mid_stream_loses_no_acknowledged_event(location):
    """The child appends one event at a time and acknowledges each on a pipe once `append` returns; SIGKILL lands
    while it writes. Every acknowledged event must be stored: the stored ones are the first N, N >= acknowledged."""
    acknowledgements, acknowledging = os.pipe()

    def write():
        store = open_event_store(location)
        for index in range(1_000_000):
            store.append({"user_id": "writer", "item_id": index, "timestamp": index})
            os.write(acknowledging, b".")

    writer = forked(write)
    os.close(acknowledging)
    acknowledged, deadline = 0, time.monotonic() + 60  # a loaded CI machine syncs the WAL slowly
    try:
        while acknowledged < ACKNOWLEDGED_BEFORE_KILL and time.monotonic() < deadline:
            received = os.read(acknowledgements, 4096)
            assert received, "the writer stopped before it was killed"
            acknowledged += len(received)
    finally:
        os.kill(writer, signal.SIGKILL)
    assert exit_code(writer) == -signal.SIGKILL
    while received := os.read(acknowledgements, 4096):  # those sent before the kill
        acknowledged += len(received)
    os.close(acknowledgements)
    assert acknowledged >= ACKNOWLEDGED_BEFORE_KILL

    store = open_event_store(location)
    stored = [event.item_id for event in every_event(store)]
    assert stored == [str(index) for index in range(len(stored))]  # in order, no gap, nothing twice
    assert acknowledged <= len(stored) <= acknowledged + 1  # at most the append in flight besides
    assert store.append({"user_id": "writer", "item_id": "after", "timestamp": 0}) == 1  # still writable
    store.close()


def test_the_store_is_chosen_by_the_scheme_and_an_unknown_one_is_one_line(tmp_path):
    bare = open_event_store(tmp_path / "sub" / "events.db")
    assert isinstance(bare, SQLiteEventStore) and bare.path == tmp_path / "sub" / "events.db"
    assert bare.append({"user_id": 1, "item_id": 2}) == 1 and (tmp_path / "sub" / "events.db").is_file()
    bare.close()
    relative = open_event_store("sqlite:///events/here.db")
    assert isinstance(relative, SQLiteEventStore) and relative.path == Path("events/here.db")
    for wrong, expected in [("kafka://broker:9092/events", "events: unknown store kafka://"),
                            ("sqlite:///", "events: 'sqlite:///' names no file")]:
        with pytest.raises(UserError) as refused:
            open_event_store(wrong)
        assert str(refused.value).startswith(expected) and "\n" not in str(refused.value)


def test_a_cursor_no_read_returned_is_refused_in_one_line(store):
    with pytest.raises(UserError, match=r"^events: cursor 'next' is not one read_since returned"):
        store.read_since("next")


def test_redis_without_its_client_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "redis", None)  # `import redis` raises ImportError
    with pytest.raises(UserError) as refused:
        open_event_store("redis://127.0.0.1:6379/0")
    assert str(refused.value) == "the redis extra is not installed: pip install redis"


def test_an_unreachable_redis_is_one_line_without_the_password():
    pytest.importorskip("redis", reason="Redis store: the redis client is not installed (pip install redis)")
    with pytest.raises(UserError) as refused:
        open_event_store(f"redis://:secret@127.0.0.1:{free_port()}/0")
    message = str(refused.value)
    assert message.startswith("events: cannot use redis://127.0.0.1:") and "\n" not in message
    assert "secret" not in message
