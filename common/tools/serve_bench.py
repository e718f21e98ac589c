"""`usecases bench serve NAME`: the use case's own server against MLflow's scoring server on the same model, the
same requests, at several concurrencies, one server at a time, from a load generator in another process
(`loadgen.py`); requests per second, p50 and p99 and errors for each, and the ratio, logged as a NAME-serve run.

The use case's server module gives `bench_requests(model, count, seed)`: the request bodies (MLflow's JSON scoring
input) for the model `mlflow.pyfunc.load_model` returns.
"""

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

import mlflow
import pandas as pd

from common.config import ConfigModel
from common.errors import UserError
from common.runtime.process import usable_cores
from common.serving.pyfunc import load_served
from common.usecase import UseCase

log = logging.getLogger(__name__)

BATCHED = "ours+batch"  # our server micro-batching, where --batch-ms asks for it
START_TIMEOUT_S = 180
REQUEST_BODIES = 512
P99_MS = 30.0  # the latency target a server's capacity is stated at


def serve_bench(usecase: UseCase, settings: ServeBench) -> pd.DataFrame:
    """Both servers at every concurrency (and ours micro-batching for `batch_ms`, ours then unbatched; or, with
    `retrieval`, ours serving by each mode, e.g. exact and ann, instead of MLflow's); each server's capacity per
    core at `p99_ms`. Returns the table that was logged and printed."""
    own = usecase.server()
    if own is None:
        raise UserError(f"use case '{usecase.name}' has no server of its own to compare with MLflow's")
    servers = _servers(settings)
    settings = settings.model_copy(update={"workers": settings.workers or usable_cores()})
    bodies = own.bench_requests(load_served(settings.model_uri), REQUEST_BODIES, 0)
    rows = []
    with tempfile.TemporaryDirectory(prefix="serve-bench-") as folder:
        requests = Path(folder) / "bodies.json"
        requests.write_text(json.dumps(bodies))
        for server, options in servers.items():
            rows += _measure(usecase.name, server, options, settings, requests, Path(folder))
    table = pd.DataFrame(rows)
    _log(usecase.name, table, settings)
    _print(table, settings)
    return table


def _servers(settings: ServeBench) -> dict[str, list[str]]:
    """Each server measured, by name, with its `usecases serve` options; a setting out of range is one line."""
    batch_ms, retrievals = settings.batch_ms, settings.retrieval
    if any(level < 1 for level in settings.concurrency) or settings.seconds <= 0:
        raise UserError(f"--concurrency takes positive integers and --seconds a positive time (got "
                        f"{','.join(map(str, settings.concurrency))} and {settings.seconds:g})")
    if batch_ms is not None and batch_ms <= 0:
        raise UserError(f"--batch-ms must be above 0 to compare micro-batching, got {batch_ms:g}")
    if settings.p99_ms <= 0:
        raise UserError(f"--p99-ms must be above 0, got {settings.p99_ms:g}")
    if retrievals and (set(retrievals) - {"exact", "ann"} or len(set(retrievals)) < len(retrievals)):
        raise UserError(f"--retrieval {','.join(retrievals)}: expected distinct modes of exact and ann, e.g. exact,ann")
    if retrievals:  # the same server, retrieving one way each
        return {mode: ["--retrieval", mode, *(["--batch-ms", f"{batch_ms:g}"] if batch_ms is not None else [])]
                for mode in retrievals}
    return {"ours": [] if batch_ms is None else ["--batch-ms", "0"],
            **({BATCHED: ["--batch-ms", f"{batch_ms:g}"]} if batch_ms is not None else {}), "mlflow": ["--mlflow"]}


def _compared(settings: ServeBench) -> tuple[str, str]:
    """The two servers whose requests per second the headline ratio divides: the second retrieval mode over the
    first, else ours over MLflow's."""
    retrievals = settings.retrieval
    return tuple(retrievals[::-1]) if retrievals and len(retrievals) == 2 else ("ours", "mlflow")


def _log(name: str, table: pd.DataFrame, settings: ServeBench) -> None:
    """The NAME-serve run: each server's speed and tail per concurrency, the ratios, the capacity, table and plot."""
    from common.tracking.runs import tracked_run

    tags = {"preset": "serve", "model_uri": settings.model_uri, "workers": str(settings.workers),
            "cpu_model": cpu_model(), "concurrency": ",".join(map(str, settings.concurrency))}
    with tracked_run(f"{name}-serve", settings, tags, run_name=f"{name}-serve",
                     description=f"{name}: its own server against MLflow's scoring server.") as tracker:
        for row in table.to_dict("records"):
            tracker.log_metrics({f"serve/{row['server']}/c{row['concurrency']}/{metric}": row[metric]
                                 for metric in ("requests_per_s", "p50_ms", "p99_ms", "errors")})
        tracker.log_metrics({f"serve/ratio/c{level}": ratio
                             for level, ratio in _ratios(table, *_compared(settings)).items()})
        tracker.log_metrics({f"serve/{server}/capacity_rps_per_core": value
                             for server, value in capacity_per_core(table, settings.p99_ms, settings.workers).items()})
        tracker.log_metrics({f"serve/batch_ratio/c{level}": ratio
                             for level, ratio in _ratios(table, BATCHED, "ours").items()})
        with tempfile.TemporaryDirectory() as out:
            table.to_csv(Path(out) / "serve.csv", index=False)
            _plot(table, Path(out) / "serve.png")
            mlflow.log_artifacts(out)


def _print(table: pd.DataFrame, settings: ServeBench) -> None:
    over, under = _compared(settings)
    capacity = capacity_per_core(table, settings.p99_ms, settings.workers)
    print(table.to_string(index=False), flush=True)
    named = {"mlflow": "MLflow's"}
    print(f"requests per second, {over} over {named.get(under, under)}: " +
          ", ".join(f"{ratio:.1f}x at concurrency {level}" for level, ratio in _ratios(table, over, under).items()),
          flush=True)
    print(f"capacity at p99 <= {settings.p99_ms:g} ms, requests/s per core ({settings.workers} worker(s), "
          f"{cpu_model()}): " + ", ".join(f"{server} {value:,.0f}" for server, value in capacity.items()), flush=True)
    if settings.batch_ms is not None:
        print(f"micro-batched ({settings.batch_ms:g} ms) over unbatched: " + ", ".join(
            f"{ratio:.2f}x at concurrency {level}" for level, ratio in _ratios(table, BATCHED, "ours").items()),
            flush=True)


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
    """Per server, the most requests per second at a concurrency whose p99 met `p99_ms` without errors, per worker
    (a worker per core); 0 where none met it."""
    met = table[(table["p99_ms"] <= p99_ms) & (table["errors"] == 0)]
    best = met.groupby("server")["requests_per_s"].max()
    return {server: float(best.get(server, 0.0)) / workers for server in table["server"].unique()}


def cpu_model() -> str:
    """The CPU's model name, as the runs' tags give it."""
    from common.runtime.process import hardware_info

    return hardware_info()["cpu_model"]


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
    """SIGTERM to a server started in a session of its own (`start_new_session=True`) and its workers; SIGKILL
    after `timeout_s`."""
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


def _plot(table: pd.DataFrame, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    figure, (speed, tail) = plt.subplots(1, 2, figsize=(10, 4))
    for server, rows in table.groupby("server"):
        speed.plot(rows["concurrency"], rows["requests_per_s"], marker="o", label=server)
        tail.plot(rows["concurrency"], rows["p99_ms"], marker="o", label=server)
    for axis, label in ((speed, "requests per second"), (tail, "p99 latency (ms)")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("concurrent clients")
        axis.set_ylabel(label)
        axis.grid(True, alpha=0.3)
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
