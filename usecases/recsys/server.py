"""`usecases serve recsys`: the logged recommender behind a lean ASGI app on uvicorn, one worker per core.

It speaks MLflow's scoring protocol (`GET /ping`, `GET /health`, `GET /version`, `POST /invocations` with
`dataframe_split` or `dataframe_records` and optional `params`), so a client of `mlflow models serve` needs no
change, and adds `POST /events` (one event or a list of `user_id`, `item_id`, `timestamp`): the event store keeps
them for every worker, and the user's next request folds them in. The hot path has no pandas: JSON in and out with
orjson, the request's columns read as lists, the user's seen items and events as arrays; one torch thread a worker.
A request the model cannot answer gets HTTP 400 with one line, as MLflow's server gives; the inputs of both routes
follow one set of rules (`schema.py`). The event store is opened, written and read once before the port is bound
(`serve`): one that cannot be used stops the start in one line, and one that fails later is HTTP 503 with its line,
never a traceback. On a GPU (`--device`) concurrent requests are micro-batched: the first waits at most
`--batch-ms` (default 2) for others, and the batch is scored in one product and one top-k
(`Recommender.recommend_batch`).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import numpy as np
import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from common.errors import UserError
from common.serving.microbatch import MicroBatcher
from common.serving.pyfunc import BadInput
from .events import BadEvent, EventStore, EventStoreUnavailable, open_event_store
from .requests import parse_rows, requested_k
from .schema import shown
from .serving import RecommenderModel

log = logging.getLogger(__name__)

MODEL_VARIABLE = "USECASES_SERVE_MODEL_URI"  # how the supervisor tells each worker process what to load
EVENTS_VARIABLE = "USECASES_SERVE_EVENTS"
DEVICE_VARIABLE = "USECASES_SERVE_DEVICE"
BATCH_VARIABLE = "USECASES_SERVE_BATCH_MS"
RETRIEVAL_VARIABLE = "USECASES_SERVE_RETRIEVAL"
INDEX_VARIABLE = "USECASES_SERVE_ANN_INDEX"
GPU_BATCH_MS = 2.0  # the queueing a request may spend waiting for others on a GPU
JSON = "application/json"


def create_app(model: RecommenderModel, events: EventStore | None, batch_ms: float = 0.0) -> Starlette:
    """The app around a loaded model and an event store (None: no `/events`, requests use `recent_items` only);
    with `batch_ms` above 0, concurrent requests are scored together (`MicroBatcher`)."""
    batcher = MicroBatcher(model.recommend_requests, batch_ms / 1000) if batch_ms > 0 else None

    async def ping(request: Request) -> Response:
        return Response("\n", media_type=JSON)

    async def version(request: Request) -> Response:
        import mlflow

        return Response(mlflow.__version__, media_type="text/plain")

    async def invocations(request: Request) -> Response:
        try:
            columns, n_rows, params = scoring_input(await request.body(), request.headers.get("content-type", JSON))
            k = requested_k(columns, params, model.default_k)
            rows = parse_rows(columns, n_rows)
            stored = [events.recent(row.user_id, model.recommender.max_events) for row in rows] if events else ()
            records = await batcher.submit((rows, k, stored)) if batcher else model.recommend(rows, k, stored)
        except BadInput as refused:
            return bad_request(str(refused))
        except EventStoreUnavailable as failed:
            return unavailable(str(failed))
        return Response(orjson.dumps({"predictions": records}, option=orjson.OPT_SERIALIZE_NUMPY), media_type=JSON)

    async def record_events(request: Request) -> Response:
        if events is None:
            return bad_request("this server keeps no events (start it with --events)")
        try:
            count = events.append(orjson.loads(await request.body()))
        except orjson.JSONDecodeError as error:
            return bad_request(f"the body is not JSON: {error}")
        except BadEvent as refused:
            return bad_request(str(refused))
        except EventStoreUnavailable as failed:
            return unavailable(str(failed))
        return Response(orjson.dumps({"recorded": count}), media_type=JSON)

    routes = [Route("/ping", ping), Route("/health", ping), Route("/version", version),
              Route("/invocations", invocations, methods=["POST"]), Route("/events", record_events, methods=["POST"])]
    app = Starlette(routes=routes)
    app.state.batcher = batcher  # its batch and request counts: the mean batch size a server achieved
    return app


def scoring_input(body: bytes, content_type: str) -> tuple[dict[str, list], int, dict | None]:
    """MLflow's JSON scoring input as columns of lists, the row count and the params."""
    if not content_type.startswith(JSON):
        raise BadInput(f"content type {content_type!r} is not supported here: send application/json")
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError as error:
        raise BadInput(f"the body is not JSON: {error}") from None
    if not isinstance(payload, dict):
        raise BadInput("the body must be a JSON object with dataframe_split or dataframe_records")
    params = payload.get("params")
    if params is not None and not isinstance(params, dict):
        raise BadInput(f"params must be an object such as {{\"k\": 10}}, got {type(params).__name__}")
    if "dataframe_split" in payload:
        return (*_split_columns(payload["dataframe_split"]), params)
    if "dataframe_records" in payload:
        return (*_record_columns(payload["dataframe_records"]), params)
    raise BadInput(f"the body needs dataframe_split or dataframe_records (got keys: {', '.join(payload) or 'none'})")


def _split_columns(split) -> tuple[dict[str, list], int]:
    if not isinstance(split, dict) or not isinstance(split.get("columns"), list) or \
            not isinstance(split.get("data"), list):
        raise BadInput("dataframe_split must be an object with lists 'columns' and 'data'")
    names, data = split["columns"], split["data"]
    for name in names:
        if not isinstance(name, str):
            raise BadInput(f"dataframe_split columns must be column names (strings), got {shown(name)}")
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


def bad_request(line: str) -> Response:
    return _error(400, "BAD_REQUEST", line)


def unavailable(line: str) -> Response:
    """The event store failed after the start (a disk full, Redis gone): the client may retry."""
    return _error(503, "TEMPORARILY_UNAVAILABLE", line)


def _error(status: int, code: str, line: str) -> Response:
    return Response(orjson.dumps({"error_code": code, "message": " ".join(line.splitlines())}), status_code=status,
                    media_type=JSON)


def app_from_environment() -> Starlette:
    """Each uvicorn worker's app: the model and event store the supervisor named in the environment."""
    import torch
    from threadpoolctl import threadpool_limits

    torch.set_num_threads(1)  # one worker per core: a second thread per request only contends
    threadpool_limits(1)  # NumPy's BLAS too: a one-user product on two threads of a busy machine took 7.7 ms, not 0.1
    from common.runtime.devices import select_device

    model = loaded_recommender(os.environ[MODEL_VARIABLE])
    device = select_device(os.environ.get(DEVICE_VARIABLE, "auto"))
    model.recommender.to(device)
    with_retrieval(model, os.environ.get(RETRIEVAL_VARIABLE), os.environ.get(INDEX_VARIABLE))
    batch_ms = os.environ.get(BATCH_VARIABLE)
    events = os.environ.get(EVENTS_VARIABLE)
    return create_app(model, open_event_store(events) if events else None,
                      float(batch_ms) if batch_ms else GPU_BATCH_MS if device.type != "cpu" else 0.0)


def loaded_recommender(model_uri: str) -> RecommenderModel:
    import mlflow

    model = mlflow.pyfunc.load_model(model_uri).unwrap_python_model()
    if not isinstance(model, RecommenderModel):
        raise UserError(f"{model_uri} is not a recsys model (it holds {type(model).__name__})")
    return model


def with_retrieval(model: RecommenderModel, retrieval: str | None, index: str | None) -> RecommenderModel:
    """The model serving by `retrieval` (None: as logged), with the FAISS index file `index` where given (two
    stages)."""
    if index:
        from common.serving.ann import VectorIndex, faiss_module

        faiss_module().omp_set_num_threads(1)
        loaded = VectorIndex.read(index, model.recommender.item_vectors())
        model.recommender.use_retrieval(retrieval or "ann", loaded)
    elif retrieval:
        model.recommender.use_retrieval(retrieval)
    if model.recommender.two_stage is not None:
        from common.serving.ann import faiss_module

        faiss_module().omp_set_num_threads(1)  # one worker per core, as torch's threads
    return model


def bench_requests(loaded, count: int, seed: int) -> list[dict]:
    """For `usecases bench recsys --serve`: `count` one-user requests of known users, K=10 as a param, every other
    one with three recent items (a fold-in on every second request)."""
    model = loaded.unwrap_python_model()
    rng = np.random.default_rng(seed)
    users = rng.choice(np.asarray(model.user_ids[1:]), size=count)
    items = np.asarray(model.item_ids[1:])
    bodies = []
    for index, user in enumerate(users.tolist()):
        if index % 2:
            recent = rng.choice(items, size=3, replace=False).tolist()
            split = {"columns": ["user_id", "recent_items"], "data": [[user, recent]]}
        else:
            split = {"columns": ["user_id"], "data": [[user]]}
        bodies.append({"dataframe_split": split, "params": {"k": 10}})
    return bodies


def default_events(tracking_uri: str) -> str:
    """The embedded default, one SQLite file that the workers share: beside a SQLite tracking store, else in the
    project's mlflow/ folder."""
    from common.tracking.runs import local_store

    sqlite = tracking_uri.startswith("sqlite:///")
    folder = Path(tracking_uri.removeprefix("sqlite:///")).parent if sqlite else local_store()
    return str(folder / "recsys-events.db")


def serve(model_uri: str, host: str, port: int, workers: int, events: str | None, device: str = "auto",
          batch_ms: float | None = None, announce: str | None = None, retrieval: str | None = None,
          ann_index: str | Path | None = None) -> int:
    """Run uvicorn with `workers` processes, each loading `model_uri` on `device`; concurrent requests are
    micro-batched for `batch_ms` (None: 2 ms on a GPU, off on the CPU); `announce` is printed once the store and the
    device are checked, before the port is bound; returns when it stops."""
    from common.runtime.devices import select_device
    from common.serving.workers import run_workers

    if events:  # a store that cannot be used is one line now, before the port is bound, not a 500 per request
        store = open_event_store(events)
        try:
            store.check()
        finally:
            store.close()
    if batch_ms is not None and batch_ms < 0:
        raise UserError(f"--batch-ms must be at least 0, got {batch_ms:g}")
    select_device(device)  # a device this machine lacks is one line now
    if retrieval or ann_index:  # a mode or an index the model cannot serve is one line now, not in every worker
        path, modules = list(sys.path), dict(sys.modules)
        try:
            with_retrieval(loaded_recommender(model_uri), retrieval, str(ann_index) if ann_index else None)
        finally:  # the model's copy of the code goes first on sys.path when it loads: the workers import this tree's
            sys.path[:] = path
            sys.modules.clear()
            sys.modules.update(modules)
    settings = {MODEL_VARIABLE: model_uri, EVENTS_VARIABLE: events, DEVICE_VARIABLE: device,
                BATCH_VARIABLE: None if batch_ms is None else str(batch_ms), RETRIEVAL_VARIABLE: retrieval,
                INDEX_VARIABLE: str(ann_index) if ann_index else None}
    for name, value in settings.items():
        os.environ.pop(name, None)
        if value is not None:
            os.environ[name] = value
    if announce:
        print(announce, flush=True)
    run_workers(f"{__name__}:app_from_environment", host, port, workers, log_level="warning", access_log=False)
    return 0
