"""`usecases serve recsys`: the logged recommender behind a lean ASGI app on uvicorn, one worker per core.

It speaks MLflow's scoring protocol (`common/serving/protocol.py`), so a client of `mlflow models serve` needs no
change, and adds `POST /events` (`user_id`, `item_id`, `timestamp`): the store keeps them for every worker, and the
user's next request folds them in. The hot path has no pandas (orjson, columns as lists, histories as arrays; one
torch thread a worker). Both routes' inputs follow `schema.py`; a bad request is HTTP 400 in one line. An event
store that fails or stalls after the start is answered around (`live_events.py`: recommendations from the model alone,
marked `X-Events: unavailable`; `/events` 503); one that cannot be used stops the start (`serve`). On a GPU (`--device`) concurrent
requests are micro-batched: the first waits at most `--batch-ms` (default 2); the batch is one product and top-k."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from collections.abc import Callable
from contextlib import asynccontextmanager, closing
from dataclasses import asdict
from pathlib import Path

import numpy as np
import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from common.errors import UserError, one_line
from common.serving.ann import VectorIndex, faiss_module
from common.serving.following import VERSION_HEADER, ServedVersion, follow_alias, resolve_version
from common.serving.metrics import ServerMetrics, shared_across_workers
from common.serving.pyfunc import shared_models
from common.serving.microbatch import MicroBatcher
from common.server_plugin import ServerSettings
from common.serving.protocol import JSON, Answer, ScoringInput, bad_request, scoring_routes, unavailable
from .event_types import BadEvent, EventStore, EventStoreUnavailable
from .events import open_event_store
from .live_events import DEGRADED_HEADER, LiveEvents
from .requests import UserRequest, parse_rows, requested_k
from .serving import RecommenderModel, python_value

GPU_BATCH_MS = 2.0  # the queueing a request may spend waiting for others on a GPU
AUTO_PROBES = 32  # one-user requests a worker times at its start where the run's retrieval was `auto`
RETRIEVALS = ("exact", "ann")  # `--retrieval`: rank every item, or score the candidates of the model's ANN index
FLEET_EVENTS = "redis://redis:6379/0"  # a Redis Service named `redis`, shared by a fleet's pods

log = logging.getLogger(__name__)


class Current:
    """The model served now and the version it is; a new one is swapped in whole, between two requests."""

    def __init__(self, model: RecommenderModel, version: ServedVersion, live: LiveEvents | None,
                 metrics: ServerMetrics):
        self.model, self.version, self.live, self.metrics = model, version, live, metrics
        metrics.serving(version.name or "", version.version or version.uri)

    def swap(self, model: RecommenderModel, version: ServedVersion) -> None:
        before = self.version
        self.model, self.version = model, version  # a request reads both at its start: one or the other
        if self.live is not None:
            self.live.limit, self.live.after = model.recommender.form.max_events, model.events_after
        self.metrics.serving(version.name or "", version.version or version.uri, (before.name or "",
                                                                                  before.version or ""))

    def lifespan(self, load: Callable[[str], RecommenderModel] | None):
        """The app's lifespan: a task following the alias while it serves (`following.py`), where `load` is given."""
        @asynccontextmanager
        async def following(app):
            follower = asyncio.create_task(follow_alias(self.version, load, self.swap)) if load else None
            try:
                yield
            finally:
                if follower is not None:
                    follower.cancel()
        return following


def create_app(model: RecommenderModel, events: EventStore | None, batch_ms: float = 0.0, max_batch: int = 64,
               version: ServedVersion | None = None, load: Callable[[str], RecommenderModel] | None = None):
    """The app around a loaded model and an event store (None: no `/events`); with `batch_ms` above 0, a batch of
    concurrent requests (`MicroBatcher`) runs `batch_ms` after its first request or once it holds `max_batch`.
    `version` says what `model` is (its answers carry it); given `load`, the app follows its alias (`following.py`)."""
    metrics = ServerMetrics(("/invocations", "/events", "/ping", "/health", "/version", "/metrics"))
    live = LiveEvents(events, model.recommender.form.max_events, model.events_after, metrics) if events else None
    current = Current(model, version or ServedVersion(None, None, "a model in this process"), live, metrics)
    batcher = MicroBatcher(lambda requests: current.model.recommend_requests(requests), batch_ms / 1000,
                           max_batch) if batch_ms > 0 else None

    async def recommend(scoring: ScoringInput) -> Answer:
        model, named = current.model, current.version  # one version for the whole request
        k = requested_k(scoring.columns, scoring.params, model.default_k)
        rows = parse_rows(scoring.columns, scoring.rows)
        stored = await live.recent([row.user_id for row in rows]) if live else ()
        headers = {VERSION_HEADER: named.header, **(dict([DEGRADED_HEADER]) if stored is None else {})}
        predictions = await batcher.submit((rows, k, stored or ())) if batcher else model.recommend(rows, k,
                                                                                                     stored or ())
        return Answer(predictions, headers)

    async def record_events(request: Request) -> Response:
        if live is None:
            return bad_request("this server keeps no events (start it with --events)")
        try:
            count = await live.append(orjson.loads(await request.body()))
        except orjson.JSONDecodeError as error:
            return bad_request(f"the body is not JSON: {one_line(error)}")
        except BadEvent as refused:
            return bad_request(str(refused))
        except EventStoreUnavailable as failed:
            return unavailable(str(failed))
        return Response(orjson.dumps({"recorded": count}), media_type=JSON)

    async def scrape(request: Request) -> Response:
        text, content_type = metrics.exposition()
        return Response(text, headers={"Content-Type": content_type})

    routes = scoring_routes(recommend, unavailable_errors=(EventStoreUnavailable,))
    app = Starlette(routes=[*routes, Route("/events", record_events, methods=["POST"]), Route("/metrics", scrape)],
                    lifespan=current.lifespan(load))
    app.state.batcher = batcher  # its batch and request counts: the mean batch size a server achieved
    app.state.metrics, app.state.current = metrics, current
    return _measured(app, metrics)


def _measured(app: Starlette, metrics: ServerMetrics):
    """`app` counted and timed per request, its `state` still at hand (tests and benchmarks read it)."""
    measured = metrics.measured(app)
    measured.state = app.state
    return measured


def app_from_environment():
    """Each uvicorn worker's app: the model and event store of the settings the supervisor handed down, following
    the model's alias where it names one."""
    import torch
    from threadpoolctl import threadpool_limits

    torch.set_num_threads(1)  # one worker per core: a second thread per request only contends
    threadpool_limits(1)  # NumPy's BLAS too: a one-user product on two threads of a busy machine took 7.7 ms, not 0.1
    from common.runtime.devices import select_device

    settings = ServerSettings.from_environment()
    device = select_device(settings.device)
    named = resolve_version(settings.model_uri)

    def load(uri: str) -> RecommenderModel:
        model = loaded_recommender(uri)
        model.recommender.to(device)
        if settings.retrieval or settings.ann_index:
            return with_retrieval(model, settings.retrieval, settings.ann_index)
        return retrieval_here(with_retrieval(model, None, None))

    batch_ms = settings.batch_ms if settings.batch_ms is not None else GPU_BATCH_MS if device.type != "cpu" else 0.0
    return create_app(load(named.uri), open_event_store(settings.events) if settings.events else None, batch_ms,
                      version=named, load=load if named.alias else None)


def loaded_recommender(model_uri: str) -> RecommenderModel:
    from common.serving.pyfunc import load_served

    model = load_served(model_uri).unwrap_python_model()
    if not isinstance(model, RecommenderModel):
        raise UserError(f"{model_uri} is not a recsys model (it holds {type(model).__name__})")
    return model


def with_retrieval(model: RecommenderModel, retrieval: str | None, index: str | None) -> RecommenderModel:
    """The model serving by `retrieval` (None: as logged), from the FAISS index file `index` where given."""
    if index:
        model.recommender.use_retrieval(retrieval or "ann", VectorIndex.read(index, model.recommender.item_vectors()))
    elif retrieval:
        model.recommender.use_retrieval(retrieval)
    if model.recommender.two_stage is not None:
        faiss_module().omp_set_num_threads(1)  # one worker per core, as torch's threads
    return model


def retrieval_here(model: RecommenderModel, probes: int = AUTO_PROBES) -> RecommenderModel:
    """Where the run left the choice to `serving.retrieval: auto`, it is made again on the device this process serves
    on: two stages where exact ranking's p95 over `probes` one-user requests here is above the run's
    `auto_above_ms` and the index reached its target recall (exact ranking on a GPU is a product the run's CPU
    never timed)."""
    recommender, index = model.recommender, model.recommender.index
    if model.retrieval_rule != "auto" or index is None:
        return model
    logged = recommender.retrieval
    recommender.use_retrieval("exact")
    users = [model.user_ids[code] for code in range(1, min(probes, len(model.user_ids) - 1) + 1)]
    timings = []
    for user in users:
        started = time.perf_counter()
        model.recommend_requests([([UserRequest(python_value(user))], model.default_k, ())])
        timings.append(time.perf_counter() - started)
    p95_ms = float(np.percentile(timings, 95) * 1000)
    reached = index.recall is None or index.target is None or index.recall >= index.target
    chosen = "ann" if p95_ms > model.auto_above_ms and reached else "exact"
    recommender.use_retrieval(chosen)
    log.warning("retrieval %s served on %s (exact p95 here %.2f ms against auto_above_ms %g; the run served %s)",
                chosen, recommender.form.device, p95_ms, model.auto_above_ms, logged)
    return model


def bench_requests(loaded, count: int, seed: int) -> list[dict]:
    """For `usecases bench serve recsys`: `count` one-user requests, K=10 as a param, every other one with 3 items."""
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
    """One SQLite file the workers share: beside a SQLite tracking store, else in the project's mlflow/ folder."""
    from common.tracking.stores import local_store

    sqlite = tracking_uri.startswith("sqlite:///")
    folder = Path(tracking_uri.removeprefix("sqlite:///")).parent if sqlite else local_store()
    return str(folder / "recsys-events.db")


def serve(settings: ServerSettings) -> int:
    """Run uvicorn's `settings.workers` processes until they stop; what cannot be used is one line before binding."""
    from common.runtime.devices import select_device
    from common.serving.workers import run_workers

    if settings.events:  # a store that cannot be used is one line now, not a 500 per request
        with closing(open_event_store(settings.events)) as store:
            store.check()
    select_device(settings.device)  # a device this machine lacks is one line now
    with shared_across_workers(), shared_models():  # one /metrics for all workers; one copy of each model
        if settings.retrieval or settings.ann_index:  # a mode or an index the model cannot serve: one line now
            _check_retrieval(settings)
        settings.to_environment()
        if settings.announce:
            print(settings.announce, flush=True)
        run_workers(f"{__name__}:app_from_environment", settings.host, settings.port, settings.workers,
                    log_level="warning", access_log=False)
    return 0


def _check_retrieval(settings: ServerSettings) -> None:
    """Load the model and its index in a process of its own, as a worker will: loading puts the model's copy of the
    code first on that process's path, which this one, whose workers import this tree, must not get."""
    import subprocess

    checked = subprocess.run([sys.executable, "-m", __name__, json.dumps(asdict(settings))], capture_output=True,
                             text=True)
    if checked.returncode != 0:
        lines = checked.stderr.strip().splitlines() or [f"exit code {checked.returncode}"]
        raise UserError(lines[-1].removeprefix("error: "))


def _check_main(argv: list[str]) -> int:
    """`python -m usecases.recsys.server SETTINGS_JSON`: exit 0 when its model serves by its retrieval."""
    settings = ServerSettings(**json.loads(argv[0]))
    try:
        with_retrieval(loaded_recommender(resolve_version(settings.model_uri).uri), settings.retrieval,
                       settings.ann_index)
    except UserError as refused:
        print(f"error: {refused}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(_check_main(sys.argv[1:]))
