"""An ASGI app on several uvicorn worker processes, each on its own socket of one address (SO_REUSEPORT), so that the
kernel spreads the connections (uvicorn's `workers=N` on one socket: one loop took 7 of a bench's 8 connections). A
dead worker is restarted unless they keep dying as they start; without SO_REUSEPORT, or for one worker, uvicorn's."""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from common.errors import UserError

log = logging.getLogger(__name__)

BACKLOG = 2048  # uvicorn's default
RESTART_CHECK_S = 0.5
QUICK_DEATH_S = 20.0  # a worker that dies sooner after its start counts towards giving up
QUICK_DEATHS = 6  # a worker killed once is started again; workers that cannot start are not, forever


def reuseport_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise UserError(f"cannot listen on {host}:{port}: {error.strerror}") from None
    return sock


def run_workers(factory: str, host: str, port: int, workers: int, **settings) -> None:
    """Serve the app `factory` ("module:function") on `workers` processes until SIGTERM or SIGINT."""
    import uvicorn
    if workers == 1 or not hasattr(socket, "SO_REUSEPORT"):
        uvicorn.run(factory, factory=True, host=host, port=port, workers=workers, **settings)
        return
    reserved = reuseport_socket(host, port)  # a port in use is one line now; this socket never listens
    context = multiprocessing.get_context("spawn")
    stopping = threading.Event()
    previous = {number: signal.signal(number, lambda *_: stopping.set()) for number in (signal.SIGTERM, signal.SIGINT)}
    processes, quick_deaths = {}, 0
    try:
        while not stopping.is_set():
            for process, started in list(processes.items()):
                if not process.is_alive():
                    del processes[process]
                    quick_deaths = quick_deaths + 1 if time.monotonic() - started < QUICK_DEATH_S else 0
            if quick_deaths >= QUICK_DEATHS:
                raise UserError(f"the server's workers stop as they start ({quick_deaths} in a row within "
                                f"{QUICK_DEATH_S:g} s): the lines above say why")
            for _ in range(workers - len(processes)):
                process = context.Process(target=_worker, args=(factory, host, port, settings), daemon=False)
                process.start()
                processes[process] = time.monotonic()
            stopping.wait(RESTART_CHECK_S)
    finally:
        for process in processes:
            process.terminate()  # SIGTERM: uvicorn finishes the requests in flight
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
        reserved.close()
        for number, handler in previous.items():
            signal.signal(number, handler)


def _worker(factory: str, host: str, port: int, settings: dict) -> None:
    import uvicorn
    sock = reuseport_socket(host, port)
    sock.listen(BACKLOG)
    config = uvicorn.Config(factory, factory=True, host=host, port=port, **settings)
    uvicorn.Server(config).run(sockets=[sock])


@contextmanager
def shared_folder(variable: str, prefix: str) -> Iterator[Path]:
    """A temporary folder named by the environment variable `variable`, which the worker processes inherit; the
    variable put back and the folder removed afterwards."""
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    previous = os.environ.get(variable)
    os.environ[variable] = str(folder)
    try:
        yield folder
    finally:
        if previous is None:
            os.environ.pop(variable, None)
        else:
            os.environ[variable] = previous
        shutil.rmtree(folder, ignore_errors=True)
