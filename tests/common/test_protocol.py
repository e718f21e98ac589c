"""MLflow's scoring protocol as any use case's server speaks it (`common/serving/protocol.py`), served around a toy
predict that echoes what it was given: every body format reaches it as the same columns, params pass through, and a
body that cannot be read, a column it lacks, a content type it is not, or a store gone each get MLflow's error shape
with one line naming what was wrong."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
from starlette.applications import Starlette

from common.serving.protocol import ScoringInput, scoring_routes
from common.serving.pyfunc import BadInput

JSON = "application/json"


class StoreGone(Exception):
    """What a toy store raises once it fails after the start."""


async def echo(scoring: ScoringInput) -> dict:
    """The toy model: its input back, with NumPy values (as a real model answers); it needs the column `x`."""
    if "x" not in scoring.columns:
        raise BadInput(f"input is missing column 'x'\n(got {', '.join(scoring.columns) or 'no columns'})")
    if scoring.params and scoring.params.get("fail"):
        raise StoreGone("the toy store is gone:\ntry again")
    return {"columns": scoring.columns, "rows": np.int64(scoring.rows), "params": scoring.params,
            "doubled": np.asarray(scoring.columns["x"]) * 2,  # JSON writes NaN as null too: count the real Nones
            "missing": {name: sum(value is None for value in values) for name, values in scoring.columns.items()}}


@pytest.fixture(scope="module")
def app() -> Starlette:
    return Starlette(routes=scoring_routes(echo, version="toy-1", unavailable_errors=(StoreGone,)))


def call(app, method: str, path: str, body: bytes | dict = b"", content_type: str = JSON) -> tuple[int, object]:
    """(status, the answer parsed where it is JSON, else its text) of one request through the ASGI app."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
             "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"",
             "headers": [(b"content-type", content_type.encode())], "client": ("127.0.0.1", 1),
             "server": ("127.0.0.1", 80)}
    messages, sent = [], [{"type": "http.request", "body": data, "more_body": False}]

    async def receive():
        return sent.pop() if sent else {"type": "http.disconnect"}

    async def send(message):
        messages.append(message)

    asyncio.run(app(scope, receive, send))
    start = next(message for message in messages if message["type"] == "http.response.start")
    text = b"".join(message.get("body", b"") for message in messages if message["type"] == "http.response.body")
    try:
        return start["status"], json.loads(text)
    except json.JSONDecodeError:  # /ping's blank line, /version's text
        return start["status"], text.decode()


def predictions(app, body, content_type: str = JSON) -> dict:
    status, answer = call(app, "POST", "/invocations", body, content_type)
    assert status == 200, answer
    return answer["predictions"]


def refused(app, body, content_type: str = JSON) -> str:
    """The one line of a 400 in MLflow's error shape."""
    status, answer = call(app, "POST", "/invocations", body, content_type)
    assert status == 400 and answer["error_code"] == "BAD_REQUEST", answer
    assert "\n" not in answer["message"]
    return answer["message"]


def test_every_body_format_reaches_predict_as_the_same_columns(app):
    columns = {"x": [1, 2, 3], "name": ["a", None, "c"]}
    split = predictions(app, {"dataframe_split": {"columns": ["x", "name"], "data": [[1, "a"], [2, None], [3, "c"]]}})
    records = predictions(app, {"dataframe_records": [{"x": 1, "name": "a"}, {"x": 2}, {"x": 3, "name": "c"}]})
    csv = predictions(app, b"x,name\n1,a\n2,\n3,c\n", "text/csv; charset=utf-8")
    for answer in (split, records, csv):
        assert (answer["columns"], answer["rows"], answer["doubled"]) == (columns, 3, [2, 4, 6])
        assert answer["missing"] == {"x": 0, "name": 1}


def test_params_pass_through_to_predict(app):
    split = {"columns": ["x"], "data": [[1]]}
    assert predictions(app, {"dataframe_split": split, "params": {"k": 3, "mode": "fast"}})["params"] == \
        {"k": 3, "mode": "fast"}
    assert predictions(app, {"dataframe_records": [{"x": 1}], "params": {"k": 5}})["params"] == {"k": 5}
    assert predictions(app, {"dataframe_split": split})["params"] is None


def test_ping_health_and_version_answer_as_mlflows_server(app):
    assert call(app, "GET", "/ping")[0] == call(app, "GET", "/health")[0] == 200
    assert call(app, "GET", "/version") == (200, "toy-1")


def test_version_defaults_to_the_installed_mlflows():
    import mlflow

    assert call(Starlette(routes=scoring_routes(echo)), "GET", "/version") == (200, mlflow.__version__)


@pytest.mark.parametrize(("body", "content_type", "named"), [
    (b"{not json", JSON, "the body is not JSON"),
    (b"[1, 2]", JSON, "the body must be a JSON object"),
    ({"inputs": [1]}, JSON, "needs dataframe_split or dataframe_records (got keys: inputs)"),
    ({"dataframe_split": {"columns": ["x"], "data": [[1]]}, "params": [3]}, JSON, "params must be an object"),
    ({"dataframe_split": {"columns": ["x"]}}, JSON, "dataframe_split must be an object with lists 'columns' and 'data'"),
    ({"dataframe_split": {"columns": [1], "data": [[1]]}}, JSON, "columns must be column names (strings), got int 1"),
    ({"dataframe_split": {"columns": ["x", "x"], "data": []}}, JSON, "name a column twice: x, x"),
    ({"dataframe_split": {"columns": ["x", "y"], "data": [[1, 2], [3]]}}, JSON, "data row 1: expected a list of 2"),
    ({"dataframe_records": {"x": 1}}, JSON, "dataframe_records must be a list of objects"),
    (b"x,y\n1,2\n3,4,5\n", "text/csv", "the body is not CSV with a header row: Error tokenizing data"),
    (b"", "text/csv", "the body is not CSV with a header row: No columns to parse"),
    (b"x\n\xff\n", "text/csv", "the body is not CSV with a header row: 'utf-8' codec can't decode"),
    (b"x\n1\n", "text/plain", "content type 'text/plain' is not supported here: send application/json or text/csv"),
])
def test_a_body_that_cannot_be_read_is_a_400_naming_what_was_wrong(app, body, content_type, named):
    assert named in refused(app, body, content_type)


def test_what_predict_refuses_is_a_400_with_its_line(app):
    message = refused(app, {"dataframe_records": [{"y": 1}]})
    assert message == "input is missing column 'x' (got y)"


def test_a_failure_the_client_may_retry_is_a_503_with_its_line(app):
    status, answer = call(app, "POST", "/invocations", {"dataframe_records": [{"x": 1}], "params": {"fail": True}})
    assert (status, answer) == (503, {"error_code": "TEMPORARILY_UNAVAILABLE",
                                      "message": "the toy store is gone: try again"})
