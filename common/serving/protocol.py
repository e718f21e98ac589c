"""MLflow's scoring protocol for a use case's own ASGI server, so that a client of `mlflow models serve` needs no
change: `/ping`, `/health`, `/version` and `POST /invocations` of JSON (`dataframe_split` or `dataframe_records`, and
`params`) or CSV. The hot path has no pandas: the JSON is read with orjson into columns of lists. `BadInput` is HTTP
400 with its one line in MLflow's error shape; an error of `unavailable_errors` (a store gone after the start) 503."""

from __future__ import annotations

import io
import reprlib
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from common.errors import one_line
from common.serving.pyfunc import BadInput

JSON = "application/json"
CSV = "text/csv"


class ScoringInput(NamedTuple):
    """A request's rows as columns of lists (missing cells None), the row count and MLflow's params (or None)."""

    columns: dict[str, list]
    rows: int
    params: dict | None


class Answer(NamedTuple):
    """What `predict` may return instead of bare predictions: them, and headers to send with them."""

    predictions: Any
    headers: dict[str, str]


Predict = Callable[[ScoringInput], Awaitable[Any]]


def scoring_routes(predict: Predict, version: str | None = None,
                   unavailable_errors: tuple[type[Exception], ...] = ()) -> list[Route]:
    """Routes around `predict`, its answer sent as `{"predictions": ...}`; `/version` answers `version` or MLflow's."""
    if version is None:
        import mlflow
        version = mlflow.__version__

    async def ping(request: Request) -> Response:
        return Response("\n", media_type=JSON)

    async def answer_version(request: Request) -> Response:
        return Response(version, media_type="text/plain")

    async def invocations(request: Request) -> Response:
        try:
            answer = await predict(scoring_input(await request.body(), request.headers.get("content-type", JSON)))
        except BadInput as refused:
            return bad_request(str(refused))
        except unavailable_errors as failed:
            return unavailable(str(failed))
        predictions, headers = answer if isinstance(answer, Answer) else (answer, None)
        return Response(orjson.dumps({"predictions": predictions}, option=orjson.OPT_SERIALIZE_NUMPY), media_type=JSON,
                        headers=headers)

    return [Route("/ping", ping), Route("/health", ping), Route("/version", answer_version),
            Route("/invocations", invocations, methods=["POST"])]


def scoring_input(body: bytes, content_type: str) -> ScoringInput:
    """MLflow's scoring input, JSON or CSV, as columns of lists; `BadInput` naming what cannot be read."""
    if content_type.startswith(CSV):
        return _csv_input(body)
    if not content_type.startswith(JSON):
        raise BadInput(f"content type {content_type!r} is not supported here: send {JSON} or {CSV}")
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError as error:
        raise BadInput(f"the body is not JSON: {one_line(error)}") from None
    if not isinstance(payload, dict):
        raise BadInput("the body must be a JSON object with dataframe_split or dataframe_records")
    params = payload.get("params")
    if params is not None and not isinstance(params, dict):
        raise BadInput(f"params must be an object such as {{\"k\": 10}}, got {type(params).__name__}")
    if "dataframe_split" in payload:
        return ScoringInput(*_split_columns(payload["dataframe_split"]), params)
    if "dataframe_records" in payload:
        return ScoringInput(*_record_columns(payload["dataframe_records"]), params)
    raise BadInput(f"the body needs dataframe_split or dataframe_records (got keys: {', '.join(payload) or 'none'})")


def _split_columns(split) -> tuple[dict[str, list], int]:
    if not isinstance(split, dict) or not isinstance(split.get("columns"), list) or \
            not isinstance(split.get("data"), list):
        raise BadInput("dataframe_split must be an object with lists 'columns' and 'data'")
    names, data = split["columns"], split["data"]
    for name in names:
        if not isinstance(name, str):
            raise BadInput(f"dataframe_split columns must be column names (strings), got "
                           f"{type(name).__name__} {reprlib.repr(name)}")
    if len(set(names)) != len(names):
        raise BadInput(f"dataframe_split columns name a column twice: {', '.join(names)}")
    for row, values in enumerate(data):
        if not isinstance(values, list) or len(values) != len(names):
            raise BadInput(f"dataframe_split data row {row}: expected a list of {len(names)} values (one per column)")
    return {name: [values[index] for values in data] for index, name in enumerate(names)}, len(data)


def _record_columns(records) -> tuple[dict[str, list], int]:
    if not isinstance(records, list) or not all(isinstance(record, dict) for record in records):
        raise BadInput("dataframe_records must be a list of objects, one per row")
    names = list(dict.fromkeys(name for record in records for name in record))
    return {name: [record.get(name) for record in records] for name in names}, len(records)


def _csv_input(body: bytes) -> ScoringInput:
    """A CSV body read by pandas as MLflow's server reads it (cells typed per column), empty cells None."""
    import pandas as pd
    try:
        frame = pd.read_csv(io.BytesIO(body))
    except ValueError as error:  # pandas' ParserError and EmptyDataError, and a bad encoding, are ValueErrors
        raise BadInput(f"the body is not CSV with a header row: {one_line(error)}") from None
    cells = frame.astype(object).where(frame.notna(), None)
    return ScoringInput({str(name): cells[name].tolist() for name in cells.columns}, len(frame), None)


def bad_request(line: str) -> Response:
    return _error(400, "BAD_REQUEST", line)


def unavailable(line: str) -> Response:
    """A service the answer needs failed after the start (Redis gone): the client may retry."""
    return _error(503, "TEMPORARILY_UNAVAILABLE", line)


def _error(status: int, code: str, line: str) -> Response:
    return Response(orjson.dumps({"error_code": code, "message": " ".join(line.splitlines())}), status_code=status,
                    media_type=JSON)
