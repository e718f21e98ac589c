"""`usecases bench serve NAME`: the use case's own server against MLflow's on the same model and requests (the
plug-in's `bench_requests`) at several concurrencies, one server at a time, driven from another process
(`loadgen.py`): requests per second, p50, p99 and errors for each, and the ratio, logged as a NAME-serve run."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pandas as pd

from common.config import ConfigModel
from common.errors import UserError
from common.runtime.process import hardware_info, usable_cores
from common.server_plugin import check_retrieval
from common.serving.pyfunc import load_served
from common.tools.scale_bench import log_plotted
from common.usecase import UseCase

log = logging.getLogger(__name__)

BATCHED = "ours+batch"  # our server micro-batching, where --batch-ms asks for it
START_TIMEOUT_S = 180
REQUEST_BODIES = 512
P99_MS = 30.0  # the latency target a server's capacity is stated at


def serve_bench(usecase: UseCase, settings: ServeBench) -> pd.DataFrame:
    """Both servers at every concurrency (and ours micro-batched for `batch_ms`; or ours by each `retrieval` mode
    instead of MLflow's), and each one's capacity per core at `p99_ms`: the table logged and printed."""
    own = usecase.server()
    if own is None:
        raise UserError(f"use case '{usecase.name}' has no server of its own to compare with MLflow's")
    servers = _servers(settings, own)
    settings = settings.model_copy(update={"workers": settings.workers or usable_cores()})
    bodies = own.bench_requests(load_served(settings.model_uri), REQUEST_BODIES, 0)
    rows = []
    with tempfile.TemporaryDirectory(prefix="serve-bench-") as folder:
        requests = Path(folder) / "bodies.json"
        requests.write_text(json.dumps(bodies))
        for server, options in servers.items():
            rows += _measure(usecase.name, server, options, settings, requests, Path(folder))
    table = pd.DataFrame(rows)
    _report(usecase.name, table, settings, servers)
    return table


def _servers(settings: ServeBench, own) -> dict[str, list[str]]:
    """Each server measured, by name, with its `usecases serve` options; a setting out of range is one line."""
    batch_ms, retrievals = settings.batch_ms, settings.retrieval
    if any(level < 1 for level in settings.concurrency) or settings.seconds <= 0:
        raise UserError(f"--concurrency takes positive integers and --seconds a positive time (got "
                        f"{','.join(map(str, settings.concurrency))} and {settings.seconds:g})")
    if batch_ms is not None and batch_ms <= 0:
        raise UserError(f"--batch-ms must be above 0 to compare micro-batching, got {batch_ms:g}")
    if settings.p99_ms <= 0:
        raise UserError(f"--p99-ms must be above 0, got {settings.p99_ms:g}")
    if retrievals:  # the same server, retrieving one way each
        check_retrieval(own, retrievals)
        if len(set(retrievals)) < len(retrievals):
            raise UserError(f"--retrieval {','.join(retrievals)}: expected distinct modes")
        return {mode: ["--retrieval", mode, *(["--batch-ms", f"{batch_ms:g}"] if batch_ms is not None else [])]
                for mode in retrievals}
    return {"ours": [] if batch_ms is None else ["--batch-ms", "0"],
            **({BATCHED: ["--batch-ms", f"{batch_ms:g}"]} if batch_ms is not None else {}), "mlflow": ["--mlflow"]}


def _report(name: str, table: pd.DataFrame, settings: ServeBench, servers: dict[str, list[str]]) -> None:
    """The NAME-serve run, and printed: each server's speed and tail per concurrency, the ratios, the capacity, table
    and plot; each server's `usecases serve` options as the tag `serve_options`, what a fleet sized on it runs."""
    from common.tracking.runs import tracked_run

    cpu, retrievals = hardware_info()["cpu_model"], settings.retrieval
    # the headline ratio: the second retrieval mode over the first, else ours over MLflow's
    over, under = tuple(retrievals[::-1]) if retrievals and len(retrievals) == 2 else ("ours", "mlflow")
    ratios, batch_ratios = _ratios(table, over, under), _ratios(table, BATCHED, "ours")
    capacity = capacity_per_core(table, settings.p99_ms, settings.workers)
    tags = {"preset": "serve", "model_uri": settings.model_uri, "workers": str(settings.workers), "cpu_model": cpu,
            "concurrency": ",".join(map(str, settings.concurrency)), "serve_options": json.dumps(servers)}
    with tracked_run(f"{name}-serve", settings, tags, run_name=f"{name}-serve",
                     description=f"{name}: its own server against MLflow's scoring server.") as tracker:
        for row in table.to_dict("records"):
            tracker.log_metrics({f"serve/{row['server']}/c{row['concurrency']}/{metric}": row[metric]
                                 for metric in ("requests_per_s", "p50_ms", "p99_ms", "errors")})
        tracker.log_metrics({f"serve/ratio/c{level}": ratio for level, ratio in ratios.items()})
        tracker.log_metrics({f"serve/{server}/capacity_rps_per_core": value for server, value in capacity.items()})
        tracker.log_metrics({f"serve/batch_ratio/c{level}": ratio for level, ratio in batch_ratios.items()})
        log_plotted(table, "server", ("concurrency", "concurrent clients"),
                    {"requests_per_s": "requests per second", "p99_ms": "p99 latency (ms)"}, ("serve.csv", "serve.png"),
                    log_y=False)
    print(table.to_string(index=False), flush=True)
    named = "MLflow's" if under == "mlflow" else under
    print(f"requests per second, {over} over {named}: " +
          ", ".join(f"{ratio:.1f}x at concurrency {level}" for level, ratio in ratios.items()), flush=True)
    print(f"capacity at p99 <= {settings.p99_ms:g} ms, requests/s per core ({settings.workers} worker(s), "
          f"{cpu}): " + ", ".join(f"{server} {value:,.0f}" for server, value in capacity.items()), flush=True)
    if settings.batch_ms is not None:
        print(f"micro-batched ({settings.batch_ms:g} ms) over unbatched: " +
              ", ".join(f"{ratio:.2f}x at concurrency {level}" for level, ratio in batch_ratios.items()), flush=True)


class ServeBench(ConfigModel):
    """The bench's settings, logged as the run's params."""

    model_uri: str
    concurrency: list[int]
    seconds: float
    workers: int | None
    batch_ms: float | None = None
    retrieval: list[str] | None = None
    p99_ms: float = P99_MS
    request_bodies: int = REQUEST_BODIES


def capacity_per_core(table: pd.DataFrame, p99_ms: float, workers: int) -> dict[str, float]:
    """Per server, the most requests/s at a concurrency whose p99 met `p99_ms` error-free, per worker (core); or 0."""
    met = table[(table["p99_ms"] <= p99_ms) & (table["errors"] == 0)]
    best = met.groupby("server")["requests_per_s"].max()
    return {server: float(best.get(server, 0.0)) / workers for server in table["server"].unique()}


def _ratios(table: pd.DataFrame, over: str = "ours", under: str = "mlflow") -> dict[int, float]:
    """Requests per second of server `over` divided by `under`'s, per concurrency (none where either is absent)."""
    speeds = table.pivot(index="concurrency", columns="server", values="requests_per_s")
    if over not in speeds or under not in speeds:
        return {}
    return {int(level): float(row[over] / row[under]) for level, row in speeds.iterrows() if row[under] > 0}


def _measure(name: str, server: str, options: list[str], settings: ServeBench, requests: Path,
             folder: Path) -> list[dict]:
    """Start one server (`usecases serve` with `options`), drive it at each concurrency, stop it."""
    port = free_port()
    command = [sys.executable, "-m", "usecases", "serve", name, "--model-uri", settings.model_uri, "--port", str(port),
               *options]
    if server != "mlflow":
        command += ["--events", str(folder / "events.db"), "--workers", str(settings.workers)]
    log.info("serve bench: starting %s server", server)
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        _wait_ready(process, port, server)
        rows = []
        for level in settings.concurrency:
            log.info("serve bench: %s server, concurrency %d, %g s", server, level, settings.seconds)
            rows.append({"server": server, **_drive(port, requests, level, settings.seconds)})
        return rows
    finally:
        stop_process_group(process)


def stop_process_group(process: subprocess.Popen, timeout_s: float = 30) -> None:
    """SIGTERM to a server started with `start_new_session=True` and its workers; SIGKILL after `timeout_s`."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=timeout_s)
    except ProcessLookupError:  # already gone
        pass


def _drive(port: int, requests: Path, concurrency: int, seconds: float) -> dict:
    done = subprocess.run([sys.executable, "-m", "common.tools.loadgen", f"http://127.0.0.1:{port}/invocations",
                           str(requests), "--concurrency", str(concurrency), "--seconds", str(seconds)],
                          capture_output=True, text=True, timeout=seconds + 120)
    if done.returncode != 0:
        raise UserError(f"the load generator failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return {key: result[key] for key in ("concurrency", "requests", "requests_per_s", "p50_ms", "p99_ms", "errors")}


def _wait_ready(process: subprocess.Popen, port: int, server: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            last = (process.stderr.read().strip().splitlines() or ["(no output)"])[-1]
            raise UserError(f"the {server} server stopped before it answered: {last}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=2) as answer:
                if answer.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise UserError(f"the {server} server did not answer /ping within {START_TIMEOUT_S} s")


def free_port() -> int:
    """A port nothing listens on now, on the loopback."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
