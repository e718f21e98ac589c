"""What the servers take in: one set of rules (`schema.py`) for `/invocations`, `/events` and the pyfunc that `mlflow
models serve` runs. Every field is sent every wrong JSON type and is refused with HTTP 400 (the pyfunc: MLflow's
INVALID_PARAMETER_VALUE) and one line naming it, never answered from a coerced value nor recorded; a timestamp
outside its window is refused with a line that says why (milliseconds and the far future each their own), and no
number answers 500."""

import asyncio
import time

import numpy as np
import pandas as pd
import pytest
from mlflow.exceptions import MlflowException

from tests.recsys.test_server import asgi_post
from tests.recsys.test_serving import served
from usecases.recsys.events import SQLiteEventStore
from usecases.recsys.requests import parse_rows
from usecases.recsys.schema import EARLIEST_TIMESTAMP, FUTURE_SLACK_S, MAX_K
from usecases.recsys.server import create_app

NOW = int(time.time())
# every JSON type an id is not (numbers with a fraction, booleans, empty text, lists, objects); JSON's null is "missing"
NOT_IDS = [True, False, 1.5, 2.0, -0.0, 1e300, "", [], [1], ["1"], {}, {"id": 1}]
NOT_KS = [True, False, 0, -1, MAX_K + 1, 2**63, 2.5, 5.0, "4", "ten", "", [3], {"k": 3}]
NOT_LISTS = ["abc", "", 5, 2.5, True, {"items": [1]}]  # for recent_items and recent_timestamps rows
RECENT = 1_764_806_400  # 2025-12-04, fixed: a parameter's id must be the same in every xdist worker
NOT_TIMESTAMPS = [True, 1.5, float(RECENT), str(RECENT), "2026-01-01", [RECENT], {"ts": RECENT}]
OUTSIDE_WINDOW = {  # (value, what the line says)
    "zero": (0, "before 1995-01-01"),
    "negative": (-1, "before 1995-01-01"),
    "the second before 1995": (EARLIEST_TIMESTAMP - 1, "before 1995-01-01"),
    "two days ahead": (NOW + 2 * 86_400, "more than a day ahead"),
    "the year 2100": (4_102_444_800, "more than a day ahead"),
    "milliseconds": (NOW * 1000, "looks like milliseconds since the epoch: send whole seconds"),
    "microseconds": (NOW * 10**6, "looks like microseconds"),
    "nanoseconds": (NOW * 10**9, "looks like nanoseconds"),
    "int64 max": (2**63 - 1, "more than a day ahead"),
    "past int64": (2**63, "more than a day ahead"),
    "uint64 max": (2**64 - 1, "more than a day ahead"),
    "int64 min": (-(2**63), "before 1995-01-01"),
    "past uint64 (a float to JSON parsers)": (10**30, "must be whole seconds since the epoch"),
}
INSIDE_WINDOW = [EARLIEST_TIMESTAMP, NOW - 3600, NOW, NOW + FUTURE_SLACK_S - 60]


@pytest.fixture
def store(tmp_path):
    opened = SQLiteEventStore(tmp_path / "events.db")
    yield opened
    opened.close()


@pytest.fixture
def app(store):
    """The lean server's app on a small item-item model (users 100 and 200, items 11 to 14) and a SQLite store."""
    return create_app(served("item_item"), store)


def post(app, path: str, body) -> tuple[int, dict | list | str]:
    return asyncio.run(asgi_post(app, path, body))


def refused(app, path: str, body, *names: str) -> str:
    """The one JSON line of a 400 that names each of `names`."""
    status, answer = post(app, path, body)
    assert status == 400, (body, status, answer)
    message = answer["message"]
    assert answer["error_code"] == "BAD_REQUEST" and "\n" not in message
    for name in names:
        assert name in message, (body, message)
    return message


def pyfunc_refused(frame: pd.DataFrame, *names: str, params=None) -> str:
    with pytest.raises(MlflowException) as raised:
        served("item_item").predict(None, frame, params)
    assert raised.value.error_code == "INVALID_PARAMETER_VALUE"
    message = raised.value.message
    assert "\n" not in message and all(name in message for name in names), message
    return message


def scoring_bodies(row: dict, params: dict | None = None) -> list[dict]:
    """The row as MLflow's scoring protocol carries it, both ways."""
    extra = {"params": params} if params is not None else {}
    return [{"dataframe_records": [row], **extra},
            {"dataframe_split": {"columns": list(row), "data": [list(row.values())]}, **extra}]


def test_well_formed_inputs_are_answered_and_recorded(app, store):
    """So that each case below is refused for its one wrong value: ids as strings or integers, k, timestamps in the
    window, nulls for the optional fields."""
    for body in scoring_bodies({"user_id": 100, "k": 2, "recent_items": [12, "13"], "recent_timestamps": [NOW, NOW]}):
        status, answer = post(app, "/invocations", body)  # items 12 and 13 folded in, 11 seen: 14 is left
        assert status == 200 and [row["item_id"] for row in answer["predictions"]] == [14]
    for body in scoring_bodies({"user_id": "someone", "recent_items": None, "recent_timestamps": None}, {"k": 1}):
        assert post(app, "/invocations", body)[0] == 200
    status, answer = post(app, "/events", [{"user_id": 100, "item_id": 12, "timestamp": stamp}
                                           for stamp in INSIDE_WINDOW] + [{"user_id": "u", "item_id": "i"}])
    assert status == 200 and answer == {"recorded": len(INSIDE_WINDOW) + 1}
    assert len(store.read_since("0", 100)[0]) == len(INSIDE_WINDOW) + 1


@pytest.mark.parametrize("value", NOT_IDS, ids=repr)
def test_an_id_that_is_not_a_string_or_an_integer_is_refused_in_every_field(app, store, value):
    for body in scoring_bodies({"user_id": value}):
        refused(app, "/invocations", body, "user_id row 0 must be a non-empty string or an integer")
    for body in scoring_bodies({"user_id": 100, "recent_items": [12, value]}):
        refused(app, "/invocations", body, "recent_items row 0 item 1 must be a non-empty string or an integer")
    for field in ("user_id", "item_id"):
        event = {"user_id": 100, "item_id": 12, field: value}
        refused(app, "/events", [{"user_id": 100, "item_id": 11}, event], f"event 1: {field} must be")
    assert store.read_since("0", 100)[0] == []  # nothing of a refused list


@pytest.mark.parametrize("value", [*NOT_IDS, np.bool_(True), np.float64(3.0), np.array([1, 2])], ids=repr)
def test_the_pyfunc_refuses_the_same_ids(value):
    pyfunc_refused(pd.DataFrame({"user_id": pd.Series([value], dtype=object)}), "user_id row 0 must be")
    pyfunc_refused(pd.DataFrame({"user_id": [100], "recent_items": [[12, value]]}), "recent_items row 0 item 1")


def test_a_missing_id_is_named(app):
    for body in scoring_bodies({"user_id": None}):
        assert refused(app, "/invocations", body) == "user_id row 0 is missing"
    assert refused(app, "/invocations", {"dataframe_records": [{"user_id": 1, "recent_items": [None]}]}) == \
        "recent_items row 0 item 0 is missing"
    assert refused(app, "/events", {"user_id": 1, "item_id": None}) == "event 0: item_id is missing"
    pyfunc_refused(pd.DataFrame({"user_id": [1.0, float("nan")]}), "user_id row 0 must be")  # pandas's float ids


@pytest.mark.parametrize("value", NOT_KS, ids=repr)
def test_a_k_that_is_not_an_integer_from_1_to_the_cap_is_refused_as_a_column_and_as_a_param(app, value):
    line = f"must be an integer from 1 to {MAX_K}"
    for body in scoring_bodies({"user_id": 100, "k": value}):
        refused(app, "/invocations", body, "k row 0", line)
    for body in scoring_bodies({"user_id": 100}, {"k": value}):
        refused(app, "/invocations", body, "param k", line)
    pyfunc_refused(pd.DataFrame({"user_id": [100], "k": [value]}), "k row 0", line)
    pyfunc_refused(pd.DataFrame({"user_id": [100]}), "param k", line, params={"k": value})


def test_k_comes_from_the_column_then_the_param_then_the_default(app):
    def listed(body) -> int:
        status, answer = post(app, "/invocations", body)
        assert status == 200
        return len(answer["predictions"])

    assert listed({"dataframe_records": [{"user_id": "x"}]}) == 2  # the model's default k
    assert listed({"dataframe_records": [{"user_id": "x"}], "params": {"k": 3}}) == 3
    assert listed({"dataframe_records": [{"user_id": "x", "k": 1}], "params": {"k": 3}}) == 1
    assert listed({"dataframe_records": [{"user_id": "x"}, {"user_id": "y", "k": 1}]}) == 2  # 1 each: the first given


@pytest.mark.parametrize("value", NOT_LISTS, ids=repr)
def test_recent_items_and_timestamps_that_are_not_lists_are_refused(app, value):
    for body in scoring_bodies({"user_id": 100, "recent_items": value}):
        refused(app, "/invocations", body, "recent_items row 0 must be a list of item ids")
    for body in scoring_bodies({"user_id": 100, "recent_items": [12], "recent_timestamps": value}):
        refused(app, "/invocations", body, "recent_timestamps row 0 must be a list of 1 timestamps")
    pyfunc_refused(pd.DataFrame({"user_id": [100], "recent_items": [value]}), "recent_items row 0 must be a list")


def test_nested_lists_and_timestamps_that_do_not_match_the_items_are_refused(app):
    refused(app, "/invocations", {"dataframe_records": [{"user_id": 1, "recent_items": [[12, 13]]}]},
            "recent_items row 0 item 0 must be")
    refused(app, "/invocations", {"dataframe_records": [{"user_id": 1, "recent_items": [12, 13],
                                                         "recent_timestamps": [NOW]}]},
            "recent_timestamps row 0 must be a list of 2 timestamps")
    refused(app, "/invocations", {"dataframe_records": [{"user_id": 1, "recent_timestamps": [NOW]}]},
            "recent_timestamps needs the column recent_items")
    refused(app, "/invocations", {"dataframe_split": {"columns": ["user_id", 7], "data": [[1, 2]]}},
            "dataframe_split columns must be column names (strings), got int 7")
    refused(app, "/invocations", {"dataframe_split": {"columns": ["user_id", "user_id"], "data": [[1, 2]]}},
            "name a column twice")


@pytest.mark.parametrize("value", NOT_TIMESTAMPS, ids=repr)
def test_a_timestamp_that_is_not_whole_seconds_is_refused_in_events_and_recent_timestamps(app, store, value):
    refused(app, "/events", {"user_id": 1, "item_id": 2, "timestamp": value},
            "event 0: timestamp must be whole seconds since the epoch, from 1995-01-01 to a day after now")
    for body in scoring_bodies({"user_id": 100, "recent_items": [12], "recent_timestamps": [value]}):
        refused(app, "/invocations", body, "recent_timestamps row 0 item 0 must be whole seconds since the epoch")
    assert store.read_since("0", 100)[0] == []


@pytest.mark.parametrize("case", OUTSIDE_WINDOW)
def test_a_timestamp_outside_the_window_is_refused_with_why(app, store, case):
    value, why = OUTSIDE_WINDOW[case]
    line = refused(app, "/events", {"user_id": 1, "item_id": 2, "timestamp": value}, "event 0: timestamp", why)
    if why.startswith("looks like"):
        assert line.endswith(f"send whole seconds ({NOW})")
    for body in scoring_bodies({"user_id": 100, "recent_items": [12], "recent_timestamps": [value]}):
        refused(app, "/invocations", body, "recent_timestamps row 0 item 0", why)
    assert store.read_since("0", 100)[0] == []


def magnitudes() -> list[int | float]:
    """Numbers of every size and sign a client might send: powers of two and ten around each, and floats."""
    values = {sign * (base ** power + offset) for base, top in ((2, 70), (10, 25)) for power in range(top)
              for offset in (-1, 0, 1) for sign in (1, -1)}
    return sorted(values) + [0.5, -0.5, 1e-300, 1e300, 1.7e9, 1.7e12]


def test_no_number_as_a_timestamp_answers_500_and_only_the_window_is_recorded(app, store):
    latest = int(time.time()) + FUTURE_SLACK_S
    for value in magnitudes():
        status, answer = post(app, "/events", {"user_id": "sweep", "item_id": 1, "timestamp": value})
        inside = isinstance(value, int) and EARLIEST_TIMESTAMP <= value <= latest
        assert status == (200 if inside else 400), (value, status, answer)
        status, answer = post(app, "/invocations", {"dataframe_records": [
            {"user_id": 100, "recent_items": [12], "recent_timestamps": [value]}]})
        assert status == (200 if inside else 400), (value, status, answer)
    assert all(EARLIEST_TIMESTAMP <= event.timestamp <= latest for event in store.read_since("0", 10_000)[0])


def test_timestamps_order_the_recent_items_oldest_first():
    rows = parse_rows({"user_id": [1], "recent_items": [[7, 8, 9]], "recent_timestamps": [[NOW, NOW - 20, NOW - 10]]},
                      1)
    assert rows[0].recent_items == (8, 9, 7)
