"""Where work that outgrows one process runs: pandas here, or a Dask cluster (`pip install 'gpu-usecases[dask]'`): the
scheduler at `runtime.cluster`, else a local cluster of one-thread workers (one per GPU with dask-cuda), each given an
equal share of the free memory and spilling under the project's cache; cuDF on workers with a GPU and dask-cudf."""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psutil

from common.errors import UserError
from common.paths import cache_dir

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5
WORKERS_TIMEOUT_S = 30
MEMORY_SHARE = 0.8  # of the free memory, split among the local workers: the rest for this process and the OS


@contextmanager
def dask_client(cluster: str | None = None, workers: int | None = None, gpus: bool = False) -> Iterator[Any]:
    """A `distributed.Client` on `cluster` or a local cluster, closed on exit; distributed's INFO lines (every worker's
    start and stop) are kept to warnings meanwhile."""
    try:
        import distributed  # configures its loggers on import: before they are quietened
    except ImportError:
        raise UserError("runtime.engine=dask needs Dask: pip install 'gpu-usecases[dask]' "
                        "(dask and distributed)") from None
    logger = logging.getLogger("distributed")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield from _client(distributed, cluster, workers, gpus)
    finally:
        logger.setLevel(level)


def _client(distributed, cluster: str | None, workers: int | None, gpus: bool) -> Iterator[Any]:
    address = cluster or os.environ.get("DASK_SCHEDULER_ADDRESS") or None
    if address is not None:
        try:
            client = distributed.Client(address, timeout=f"{CONNECT_TIMEOUT_S}s")
        except (OSError, TimeoutError, ValueError) as exc:
            raise UserError(f"runtime.cluster {address}: no Dask scheduler answers there within "
                            f"{CONNECT_TIMEOUT_S} s ({type(exc).__name__})") from None
        with client:
            try:
                client.wait_for_workers(1, timeout=WORKERS_TIMEOUT_S)
            except TimeoutError:
                raise UserError(f"runtime.cluster {address}: the scheduler has no workers after {WORKERS_TIMEOUT_S} "
                                f"s (start some with `dask worker {address}`)") from None
            log.info("dask: %d workers at %s (dashboard %s)", len(client.scheduler_info()["workers"]), address,
                     client.dashboard_link)
            yield client
        return
    cuda = None
    if gpus:
        try:
            from dask_cuda import LocalCUDACluster as cuda  # the cuda12/cuda13 extras bring it
        except ImportError:
            log.info("dask: dask-cuda is not installed (the cuda13 or cuda12 extra): a CPU cluster")
    count = workers or (_gpu_count() if cuda else os.cpu_count()) or 1
    memory_limit = int(psutil.virtual_memory().available * MEMORY_SHARE / count)
    make = cuda or distributed.LocalCluster
    cluster_here = make(n_workers=count, threads_per_worker=1, memory_limit=memory_limit,
                        dashboard_address="127.0.0.1:0", host="127.0.0.1",
                        local_directory=str(cache_dir("dask-spill")), silence_logs=logging.WARNING)
    with cluster_here, distributed.Client(cluster_here) as client:
        log.info("dask: a local %scluster of %d workers, %.1f GB each (dashboard %s)", "CUDA " if cuda else "", count,
                 memory_limit / 2**30, client.dashboard_link)
        yield client


def _gpu_count() -> int:
    import torch
    return torch.cuda.device_count()


def _has_gpu_frames() -> bool:
    """On a worker: dask-cudf installed and a GPU assigned (dask-cuda's workers each see their own)."""
    return importlib.util.find_spec("dask_cudf") is not None and os.environ.get("CUDA_VISIBLE_DEVICES", "-1") \
        not in ("", "-1")


def worker_frames(client: Any) -> str:
    """"cudf" when every worker has a GPU and dask-cudf, and this process dask-cudf (the graph's metadata)."""
    answers = client.run(_has_gpu_frames)
    here = importlib.util.find_spec("dask_cudf") is not None
    return "cudf" if here and answers and all(answers.values()) else "pandas"


def client_tags(client: Any) -> dict[str, str]:
    workers = client.scheduler_info()["workers"].values()
    return {"engine": "dask", "dask_workers": str(len(workers)), "dask_dashboard": str(client.dashboard_link),
            "dask_threads": str(sum(worker["nthreads"] for worker in workers)), "dask_frames": worker_frames(client)}
