"""Which local cluster the Dask engine starts: on a GPU run with dask-cuda installed, dask-cuda's LocalCUDACluster
(one worker per GPU); without dask-cuda, or on a CPU run, a CPU LocalCluster."""

import logging
import sys
import types

import pytest

from common.runtime import engine

distributed = pytest.importorskip("distributed")


def fake_dask_cuda(monkeypatch) -> list[dict]:
    """A dask_cuda module whose LocalCUDACluster records its arguments and starts an in-process cluster."""
    made = []

    def local_cuda_cluster(**kwargs):
        made.append(kwargs)
        threads = {key: value for key, value in kwargs.items() if key != "host"}  # in-process: no TCP host
        return distributed.LocalCluster(processes=False, **{**threads, "dashboard_address": ":0"})

    monkeypatch.setitem(sys.modules, "dask_cuda", types.SimpleNamespace(LocalCUDACluster=local_cuda_cluster))
    monkeypatch.setattr(engine, "_gpu_count", lambda: 2)
    return made


def test_a_gpu_run_gets_one_cuda_worker_per_gpu(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="common.runtime.engine")
    made = fake_dask_cuda(monkeypatch)
    with engine.dask_client(gpus=True) as client:
        assert len(client.scheduler_info()["workers"]) == 2
    assert made[0]["n_workers"] == 2 and made[0]["threads_per_worker"] == 1 and made[0]["host"] == "127.0.0.1"
    assert "a local CUDA cluster of 2 workers" in caplog.text


def test_a_cpu_run_or_no_dask_cuda_gets_a_cpu_cluster(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="common.runtime.engine")
    made = fake_dask_cuda(monkeypatch)
    with engine.dask_client(workers=1) as client:
        assert len(client.scheduler_info()["workers"]) == 1
    monkeypatch.setitem(sys.modules, "dask_cuda", None)  # not installed
    with engine.dask_client(workers=1, gpus=True) as client:
        assert len(client.scheduler_info()["workers"]) == 1
    assert not made and "dask-cuda is not installed" in caplog.text


def test_frames_are_on_cudf_only_where_every_worker_has_a_gpu_and_dask_cudf(dask_client, monkeypatch):
    import importlib.util

    assert engine.worker_frames(dask_client) == "pandas" and engine.client_tags(dask_client)["dask_frames"] == "pandas"
    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *rest: object() if name == "dask_cudf" else
                        found(name, *rest))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # the workers are threads of this process: they see it too
    assert engine.worker_frames(dask_client) == "pandas"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert engine.worker_frames(dask_client) == "cudf"
