"""The event store behind `POST /events`, SQLite and Redis through the same tests: a user's latest items newest last,
a retraining consumer's pages, one-line refusals, several writer processes at once, and a writer killed mid-stream
(every event it acknowledged is stored); and every way a store cannot be used stops `usecases serve` at its start in
one line (exit 2, before the port is bound), and a store that fails later is HTTP 503 in one line.

The Redis cases start their own `redis-server` on a free port and skip, in one line, without the `redis` client or
the server binary. Writers are forked children (`os.fork`): the store must open its own connection in each.
"""

import os
import signal
import sqlite3
import sys
import time
import traceback
from contextlib import contextmanager, nullcontext
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from common.errors import UserError
from tests.cli_helpers import free_port
from usecases.recsys.events import START, BadEvent, Event, SQLiteEventStore, open_event_store

ACKNOWLEDGED_BEFORE_KILL = 100  # appends a killed writer must have acknowledged
T0 = 1_700_000_000  # 2023-11-14, in the window of accepted timestamps

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
    assert store.append([{"user_id": 1, "item_id": 10, "timestamp": T0}, {"user_id": "1", "item_id": "11"},
                         {"user_id": 2, "item_id": "x9"}, Event("1", "10", T0 + 3)]) == 4
    assert store.append({"user_id": 1, "item_id": 12}) == 1
    assert store.append([]) == 0
    assert store.recent(1, 10) == ["10", "10", "11", "12"]  # by timestamp; repeats are the fold-in's to drop
    assert store.recent("1", 2) == ["11", "12"]
    assert store.recent(2, 5) == ["x9"]
    assert store.recent("nobody", 5) == [] and store.recent(1, 0) == []


def test_recent_follows_the_timestamps_not_the_arrival_and_starts_after_the_models_watermark(store):
    """Issue 43: an event that arrives late (a phone back online) takes its place in time, and a model's watermark
    (the last timestamp it trained on) leaves out what it knows already; every user of a request in one call."""
    store.append([Event("7", "b", T0 + 20), Event("7", "c", T0 + 30), Event("8", "z", T0 + 5)])
    store.append(Event("7", "a", T0 + 10))  # arrives last, happened first
    assert store.recent(7, 10) == ["a", "b", "c"] and store.recent(7, 2) == ["b", "c"]
    assert store.recent(7, 10, after=T0 + 10) == ["b", "c"]  # the watermark's own second is the model's
    assert store.recent_many(["7", 8, "nobody"], 2, after=T0) == [["b", "c"], ["z"], []]


def test_read_since_pages_through_every_event_once_in_arrival_order(store):
    posted = [Event(str(index % 3), str(index), T0 + index) for index in range(23)]
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
    store.append({"user_id": "u", "item_id": "late", "timestamp": T0 + 7})
    assert store.read_since(cursor, 5)[0] == [Event("u", "late", T0 + 7)]


def test_an_event_without_a_timestamp_gets_the_time_of_its_append(store):
    before = int(time.time())
    store.append({"user_id": "u", "item_id": "i"})
    [event] = every_event(store)
    assert before <= event.timestamp <= time.time()


def test_a_consumer_restarting_from_its_saved_cursor_reads_its_unfinished_page_again(location, store):
    store.append([Event("u", str(index), T0 + index) for index in range(10)])
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
    ({"user_id": 1, "item_id": 2, "timestamp": "2024-01-01\n"}, "event 1: timestamp must be whole seconds"),
    ({"user_id": 1, "item_id": 2, "timestamp": 1.7e9}, "event 1: timestamp must be whole seconds"),
    ({"user_id": 1, "item_id": 2, "timestamp": -1}, "event 1: timestamp -1 is before 1995-01-01"),
    ({"user_id": 1, "item_id": 2, "timestamp": T0 * 1000}, "event 1: timestamp 1700000000000 looks like milliseconds"),
    ({"user_id": 1, "item_id": 2, "timestamp": 2**64 - 1}, "event 1: timestamp 18446744073709551615 is more than"),
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
            store.append({"user_id": f"w{writer}", "item_id": index, "timestamp": T0 + index})

    pids = [forked(lambda writer=writer: write(writer)) for writer in range(writers)]
    assert [exit_code(pid) for pid in pids] == [0] * writers
    store = open_event_store(location)
    for writer in range(writers):
        assert store.recent(f"w{writer}", 1000) == [str(index) for index in range(per_writer)]
    assert len(every_event(store)) == writers * per_writer


def test_a_store_used_before_a_fork_works_in_the_child_and_after_it(store):
    store.append({"user_id": "u", "item_id": "parent", "timestamp": T0})
    child = forked(lambda: store.append({"user_id": "u", "item_id": "child", "timestamp": T0 + 1}))
    assert exit_code(child) == 0
    store.append({"user_id": "u", "item_id": "parent again", "timestamp": T0 + 2})
    assert store.recent("u", 10) == ["parent", "child", "parent again"]


def test_a_writer_killed_mid_stream_loses_no_acknowledged_event(location):
    """The child appends one event at a time and acknowledges each on a pipe once `append` returns; SIGKILL lands
    while it writes. Every acknowledged event must be stored: the stored ones are the first N, N >= acknowledged."""
    acknowledgements, acknowledging = os.pipe()

    def write():
        store = open_event_store(location)
        for index in range(1_000_000):
            store.append({"user_id": "writer", "item_id": index, "timestamp": T0 + index})
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
    assert store.append({"user_id": "writer", "item_id": "after", "timestamp": T0}) == 1  # still writable
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


NOBODY = 65534  # the unprivileged user of Linux distributions


@contextmanager
def unprivileged():
    """What follows runs as a user file modes apply to: root, whom they do not stop, becomes nobody meanwhile
    (effective uid only: it comes back)."""
    if os.geteuid() != 0:
        yield
        return
    os.seteuid(NOBODY)
    try:
        yield
    finally:
        os.seteuid(0)


def sqlite_file(path: Path, statements: str = "", events: int = 0) -> Path:
    """A SQLite file made by `statements`, or an event store holding `events` events, checkpointed whole into the
    file (its WAL emptied, as after a clean stop)."""
    if events:
        store = SQLiteEventStore(path)
        store.append([{"user_id": index % 7, "item_id": index, "timestamp": T0 + index} for index in range(events)])
        store.close()
    connection = sqlite3.connect(path)
    connection.executescript(statements)
    connection.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    connection.close()
    return path


def damaged(path: Path) -> Path:
    """An event store whose fourth page (an index or table page of its events) is overwritten with noise."""
    store = bytearray(sqlite_file(path, events=3000).read_bytes())
    page = int.from_bytes(store[16:18], "big")
    store[3 * page:3 * page + 512] = np.random.default_rng(0).bytes(512)
    path.write_bytes(bytes(store))
    return path


def cut_short(path: Path) -> Path:
    data = sqlite_file(path, events=3000).read_bytes()
    path.write_bytes(data[:len(data) // 3])
    return path


def read_only(path: Path) -> Path:
    sqlite_file(path, events=5)
    path.chmod(0o444)
    return path


def in_read_only_folder(folder: Path) -> Path:
    folder.mkdir()
    folder.chmod(0o555)
    return folder / "events.db"


MLFLOW_TABLES = "CREATE TABLE experiments(experiment_id INTEGER, name TEXT); CREATE TABLE runs(run_uuid TEXT);"
UNUSABLE_SQLITE = {  # name: (what makes it, in a folder; what the line says; whether it needs an unprivileged user)
    "a text file": (lambda folder: write(folder / "events.db", b"user_id,item_id\n1,2\n" * 50),
                    "file is not a database", False),
    "random bytes": (lambda folder: write(folder / "events.db", np.random.default_rng(1).bytes(8192)),
                     "file is not a database", False),
    "a folder": (lambda folder: mkdir(folder / "events.db"), "unable to open database file", False),
    "a path under a file": (lambda folder: write(folder / "store", b"x") / "events.db", "cannot open the event store",
                            False),
    "a damaged store": (lambda folder: damaged(folder / "events.db"), "is damaged (SQLite's quick_check: Page", False),
    "a store cut short": (lambda folder: cut_short(folder / "events.db"), "malformed", False),
    "another program's database": (lambda folder: sqlite_file(folder / "mlflow.db", MLFLOW_TABLES),
                                   "holds tables that are not the event store's (experiments, runs)", False),
    "an events table of another shape": (lambda folder: sqlite_file(folder / "events.db",
                                                                    "CREATE TABLE events(id INTEGER, what TEXT);"),
                                         "holds tables that are not the event store's (events of columns id, what)",
                                         False),
    "a store the server cannot write": (lambda folder: read_only(folder / "events.db"),
                                        "attempt to write a readonly database", True),
    "a folder the server cannot write": (lambda folder: in_read_only_folder(folder / "locked"),
                                         "unable to open database file", True),
}


def write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def mkdir(path: Path) -> Path:
    path.mkdir()
    return path


def serve_refuses(capsys, monkeypatch, events: str) -> str:
    """`usecases serve recsys --events EVENTS` as a user types it: exit 2 and one `error:` line, before uvicorn is
    started (so before the port is bound)."""
    import uvicorn

    from tests.cli_helpers import user_error

    monkeypatch.setattr(uvicorn, "run", lambda *args, **kwargs: pytest.fail("the server started"))
    return user_error(capsys, "serve", "recsys", "--model-uri", "runs:/0/model", "--events", events)


@pytest.mark.parametrize("case", UNUSABLE_SQLITE)
def test_serve_stops_in_one_line_on_a_sqlite_store_it_cannot_use(capsys, monkeypatch, open_folder, case):
    make, says, as_user = UNUSABLE_SQLITE[case]
    path = make(open_folder)
    before = path.read_bytes() if path.is_file() else None
    if as_user:  # the store's check as a user its modes stop; the project and its MLflow store may be root's only
        check = SQLiteEventStore.check

        def check_unprivileged(store):
            with unprivileged():
                check(store)

        monkeypatch.setattr(SQLiteEventStore, "check", check_unprivileged)
    line = serve_refuses(capsys, monkeypatch, str(path))
    assert says in line and str(path) in line, line
    if before is not None:
        assert path.read_bytes() == before, "the store was changed"


def test_a_usable_store_passes_the_check_and_keeps_its_events(capsys, monkeypatch, open_folder):
    """A new file, and a store of earlier events: the server starts (its workers are run), the probe of the write
    check leaves no event behind, and the next append follows the last event."""
    from common.serving import workers
    from tests.cli_helpers import in_process

    started = []
    monkeypatch.setattr(workers, "run_workers", lambda *args, **kwargs: started.append(args))
    kept = sqlite_file(open_folder / "kept.db", events=20)
    for path in (open_folder / "new" / "events.db", kept):
        result = in_process(capsys, "serve", "recsys", "--model-uri", "runs:/0/model", "--events", str(path))
        assert result.returncode == 0, result.stderr
    assert len(started) == 2
    store = open_event_store(kept)
    events, cursor = store.read_since(START, 100)
    assert [event.item_id for event in events] == [str(index) for index in range(20)]
    store.append({"user_id": "u", "item_id": "next", "timestamp": T0})
    assert [event.item_id for event in store.read_since(cursor, 10)[0]] == ["next"]
    store.close()


def redis_case(name: str, tmp_path, redis_url):
    """(the --events URL, what the line says) of each Redis a server cannot use; a context of the servers it
    starts."""
    from tests.recsys.conftest import redis_server

    if name == "unreachable":
        return nullcontext((f"redis://127.0.0.1:{free_port()}/0", "cannot use redis://127.0.0.1:"))
    if name == "a database index out of range":
        return nullcontext((redis_url.rsplit("/", 1)[0] + "/99", "index is out of range"))
    if name == "the events key of another type":
        import redis

        client = redis.Redis.from_url(redis_url.rsplit("/", 1)[0] + "/3")
        client.set("recsys:events", "not a stream")
        client.close()
        return nullcontext((redis_url.rsplit("/", 1)[0] + "/3", "key 'recsys:events' holds a string"))
    options = {"a password it was not given": ("--requirepass", "secret"),
               "a read-only replica": ("--replicaof", "127.0.0.1", str(free_port())),
               "out of memory": ("--maxmemory", "1", "--maxmemory-policy", "noeviction")}[name]
    says = {"a password it was not given": "authenticated", "a read-only replica": "read only replica",
            "out of memory": "maxmemory"}[name]

    @contextmanager
    def started():
        with redis_server(tmp_path, *options) as url:
            yield url, says

    return started()


@pytest.mark.parametrize("case", ["unreachable", "a database index out of range", "the events key of another type",
                                  "a password it was not given", "a read-only replica", "out of memory"])
def test_serve_stops_in_one_line_on_a_redis_it_cannot_use(capsys, monkeypatch, tmp_path, redis_url, case):
    with redis_case(case, tmp_path, redis_url) as (url, says):
        line = serve_refuses(capsys, monkeypatch, url)
    assert says in line and line.startswith("error: events: ") and "secret" not in line, line


def test_a_store_failing_after_the_start_is_503_for_events_and_recommendations_go_on_without_it(tmp_path):
    """The file damaged under a running server: /events answers 503 with the store's line, not 500 with a
    traceback; /invocations answers from the model alone, marked `X-Events: unavailable` and counted."""
    import asyncio

    from tests.recsys.test_server import asgi_post
    from tests.recsys.test_serving import served
    from usecases.recsys.server import create_app

    store = SQLiteEventStore(tmp_path / "events.db")
    app = create_app(served("item_item"), store)
    assert asyncio.run(asgi_post(app, "/events", {"user_id": 1, "item_id": 12, "timestamp": T0}))[0] == 200
    store.close()
    (tmp_path / "events.db").write_bytes(b"no longer a database" * 100)
    status, answer = asyncio.run(asgi_post(app, "/events", {"user_id": 1, "item_id": 12}))
    assert status == 503 and answer["error_code"] == "TEMPORARILY_UNAVAILABLE", (status, answer)
    assert "events.db" in answer["message"] and "\n" not in answer["message"]
    status, answer, headers = asyncio.run(asgi_post(app, "/invocations", {"dataframe_records": [{"user_id": 1}]},
                                                    with_headers=True))
    assert status == 200 and headers["x-events"] == "unavailable", "recommended from the model alone, and said so"
    assert answer["predictions"] and headers["x-model-version"] == "a model in this process"
    assert app.state.metrics.registry.get_sample_value("usecases_degraded_answers_total") == 1


def test_redis_keeps_what_its_url_bounds_and_each_server_checks_a_key_of_its_own(redis_url):
    """Issue 43: `per_user` and `max_age_days` in the URL bound each user's set (a user's events never pile up), and
    servers starting together check keys of their own (one never reads another's token) and leave none behind."""
    bounded = open_event_store(f"{redis_url}?per_user=3&max_age_days=30")
    other = open_event_store(redis_url)
    try:
        bounded.client.delete("recsys:recent:bounded")
        now = int(time.time())
        bounded.append([Event("bounded", str(item), now - 100 + item) for item in range(6)])
        assert bounded.recent("bounded", 10) == ["3", "4", "5"]
        bounded.append(Event("bounded", "old", now - 40 * 86400))  # past the age bound: trimmed at once
        assert bounded.recent("bounded", 10) == ["3", "4", "5"]
        assert 0 < bounded.client.ttl("recsys:recent:bounded") <= 30 * 86400
        assert bounded.check_key != other.check_key
        bounded.check()
        other.check()
        assert not bounded.client.exists(bounded.check_key, other.check_key)
    finally:
        bounded.close()
        other.close()
    with pytest.raises(UserError, match=r"per_user='many': expected a number of at least 0"):
        open_event_store(f"{redis_url}?per_user=many")


def test_a_server_folds_in_only_the_stored_events_after_its_models_watermark(tmp_path):
    """Issue 43: events up to the model's watermark (the last timestamp it trained on) are in the model already; a
    server folding them in again would count them twice, so it reads only the later ones."""
    import asyncio

    from tests.recsys.test_server import asgi_post
    from tests.recsys.test_serving import served
    from usecases.recsys.server import create_app

    model = served("factors")
    model.events_after = T0 + 100
    app = create_app(model, SQLiteEventStore(tmp_path / "events.db"))
    ask = {"dataframe_records": [{"user_id": 100}], "params": {"k": 1}}

    def top() -> int:
        return asyncio.run(asgi_post(app, "/invocations", ask))[1]["predictions"][0]["item_id"]

    first = top()
    asyncio.run(asgi_post(app, "/events", {"user_id": 100, "item_id": first, "timestamp": T0 + 50}))
    assert top() == first, "an event the model trained on is not folded in again"
    asyncio.run(asgi_post(app, "/events", {"user_id": 100, "item_id": first, "timestamp": T0 + 150}))
    assert top() != first


def test_the_served_models_watermark_is_the_last_timestamp_it_knows():
    from usecases.recsys.served import latest_timestamp

    frames = (pd.DataFrame({"timestamp": [T0, T0 + 9]}), None, pd.DataFrame({"timestamp": [T0 + 4]}))
    assert latest_timestamp(frames) == T0 + 9 and latest_timestamp((None,)) is None
