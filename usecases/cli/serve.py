"""`usecases serve`: a use case's registered champion over REST, with the use case's own server where it has one,
else MLflow's scoring server."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from common.errors import UserError
from usecases.cli import options

OWN_SERVER_OPTIONS = ("workers", "events", "batch_ms", "retrieval", "ann_index")  # and --device other than auto


def register(commands) -> None:
    serve = options.add_command(commands, "serve", serve_command, help="serve a use case's champion model over REST",
                                description="Serve the registered champion of a use case (or any model URI): with "
                                            "the use case's own server where it has one (several workers, POST "
                                            "/events), else `mlflow models serve --env-manager local`; POST JSON to "
                                            "/invocations either way.")
    serve.add_argument("name", help="use case (see `usecases list`)")
    serve.add_argument("--model-uri", help="default: models:/gpu-usecases-NAME@champion, the champion on the data "
                                           "trained on last")
    serve.add_argument("--data-sha256", metavar="SHA256",
                       help="serve the champion on this data instead (a run's data_sha256 tag, or its first 12 digits)")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    serve.add_argument("--port", type=int, default=5001, help="port (default: 5001)")
    serve.add_argument("--workers", type=int, help="worker processes of the use case's own server (default: one per "
                                                   "core)")
    serve.add_argument("--events", metavar="URL_OR_PATH",
                       help="the use case's own server: where POST /events keeps events, a SQLite file (default: "
                            "beside the local tracking store) or redis://HOST:PORT/DB for servers on several machines")
    serve.add_argument("--mlflow", action="store_true", help="MLflow's scoring server even where the use case has "
                                                             "its own")
    serve.add_argument("--device", default="auto", choices=options.DEVICES,
                       help="the use case's own server: where each worker scores (default: a GPU where there is one)")
    serve.add_argument("--batch-ms", type=float, metavar="MS",
                       help="the use case's own server: score concurrent requests together, the first waiting at most "
                            "MS milliseconds for others (default: 2 on a GPU, 0 (off) on the CPU)")
    serve.add_argument("--retrieval", metavar="MODE",
                       help="the use case's own server: one of the ways its server retrieves, as it declares them "
                            "(e.g. exact ranks every item, ann scores the candidates of an ANN index; default: as "
                            "the run chose)")
    serve.add_argument("--ann-index", type=Path, metavar="FILE",
                       help="the use case's own server: serve by two stages with this FAISS index (faiss.write_index) "
                            "over the model's item vectors instead of the model's own")


def serve_command(args: argparse.Namespace) -> int:
    """Serve with the use case's own server, else replace this process with MLflow's scoring server; the first line
    says which data set's champion it is."""
    from common.tracking.registry import served_model
    from common.tracking.stores import tracking_uri

    usecase = options.usecase(args.name)
    usecase.require()
    own = None if args.mlflow else usecase.server()
    if args.workers is not None and args.workers < 1:
        raise UserError(f"--workers must be at least 1, got {args.workers}")
    if own is None and (args.device != "auto" or any(getattr(args, key) for key in OWN_SERVER_OPTIONS)):
        raise UserError(f"--workers, --events, --device, --batch-ms, --retrieval and --ann-index need the use case's "
                        f"own server ('{args.name}' is served by MLflow's scoring server here)")
    model_uri, what = served_model(usecase, args.model_uri, args.data_sha256)
    uri = tracking_uri()
    if own is not None:
        return _own_server(own, args, model_uri, what, uri)
    from common.serving.pyfunc import SERVER_SCRATCH, process_scratch

    print(f"Serving {what} on http://{args.host}:{args.port}/invocations; Ctrl-C to stop", flush=True)
    os.execve(sys.executable, [sys.executable, "-m", "mlflow", "models", "serve", "-m", model_uri, "--env-manager",
                               "local", "--host", args.host, "--port", str(args.port)],
              {**os.environ, "MLFLOW_TRACKING_URI": uri, "TMPDIR": str(process_scratch(SERVER_SCRATCH)),
               # MLflow starts `uvicorn` by name: this venv's first
               "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])})


def _own_server(own, args: argparse.Namespace, model_uri: str, what: str, uri: str) -> int:
    from common.runtime.process import usable_cores
    from common.server_plugin import ServerSettings, check_retrieval

    check_retrieval(own, [args.retrieval] if args.retrieval else [])
    workers = args.workers or usable_cores()
    events = args.events or own.default_events(uri)
    os.environ["MLFLOW_TRACKING_URI"] = uri
    settings = ServerSettings(model_uri, args.host, args.port, workers, events, device=args.device,
                              batch_ms=args.batch_ms, retrieval=args.retrieval, ann_index=args.ann_index,
                              announce=f"Serving {what} on http://{args.host}:{args.port}/invocations with {workers} "
                                       f"worker(s), events in {events}; Ctrl-C to stop")
    return own.serve(settings)
