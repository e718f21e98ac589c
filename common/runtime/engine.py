"""The execution engine for work that outgrows one process: pandas in this process, or a Dask cluster.

`runtime.engine: dask` connects to the scheduler at `runtime.cluster` (or `$DASK_SCHEDULER_ADDRESS`), else starts a
`LocalCluster` on this machine: `runtime.workers` processes (one per core by default; on a GPU run with dask-cuda
installed, a `LocalCUDACluster` of one per GPU) of one thread each, each with an equal share of the free memory as
its limit, spilling to disk under the project's cache before it is reached. Where every worker has a GPU and
dask-cudf, the DataFrame steps run on cuDF (`worker_frames`), the rest as NumPy on the workers' CPUs.
Dask is an optional extra (`pip install 'gpu-usecases[dask]'`); the pandas engine needs nothing more.
"""

from __future__ import annotations

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


def scheduler_address(configured: str | None) -> str | None:
    return configured or os.environ.get("DASK_SCHEDULER_ADDRESS") or None


@contextmanager
def quiet_distributed() -> Iterator[None]:
    """distributed logs every worker start and stop at INFO: kept to warnings while the run uses it."""
    logger = logging.getLogger("distributed")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


@contextmanager
def dask_client(cluster: str | None = None, workers: int | None = None, gpus: bool = False) -> Iterator[Any]:
    """A `distributed.Client` on the scheduler at `cluster`, else on a local cluster sized to this machine (with
    `gpus` and dask-cuda installed, a `LocalCUDACluster`: one worker per GPU); closed (and the local cluster shut
    down) on exit."""
    try:
        import distributed  # configures its loggers on import: before they are quietened
    except ImportError:
        raise UserError("runtime.engine=dask needs Dask: pip install 'gpu-usecases[dask]' "
                        "(dask and distributed)") from None
    with quiet_distributed():
        yield from _client(distributed, cluster, workers, gpus)


def _client(distributed, cluster: str | None, workers: int | None, gpus: bool) -> Iterator[Any]:
    address = scheduler_address(cluster)
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
    cuda = _local_cuda_cluster() if gpus else None
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


def _local_cuda_cluster():
    """dask-cuda's `LocalCUDACluster` (one worker process per GPU, each seeing its own), where installed; the
    `cuda12`/`cuda13` extras bring it."""
    try:
        from dask_cuda import LocalCUDACluster
    except ImportError:
        log.info("dask: dask-cuda is not installed (the cuda13 or cuda12 extra): a CPU cluster")
        return None
    return LocalCUDACluster


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def _has_gpu_frames() -> bool:
    """On a worker: dask-cudf installed and a GPU assigned (dask-cuda's workers each see their own)."""
    import importlib.util

    return importlib.util.find_spec("dask_cudf") is not None and os.environ.get("CUDA_VISIBLE_DEVICES", "-1") \
        not in ("", "-1")


def worker_frames(client: Any) -> str:
    """The DataFrame library the workers' frames are on: "cudf" when every worker has a GPU and dask-cudf (and
    this process dask-cudf, for the graph's metadata), else "pandas"."""
    answers = client.run(_has_gpu_frames)
    import importlib.util

    here = importlib.util.find_spec("dask_cudf") is not None
    return "cudf" if here and answers and all(answers.values()) else "pandas"


def client_tags(client: Any) -> dict[str, str]:
    """What the run records of the cluster it used."""
    workers = client.scheduler_info()["workers"].values()
    return {"engine": "dask", "dask_workers": str(len(workers)), "dask_dashboard": str(client.dashboard_link),
            "dask_threads": str(sum(worker["nthreads"] for worker in workers)), "dask_frames": worker_frames(client)}
