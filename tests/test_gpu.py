"""Checks that need a CUDA GPU; skipped elsewhere (see tests/conftest.py). Run with `make test-gpu`."""

import importlib.util
import json

import pytest
import torch

from common.runtime import array_module, make_runtime, select_amp_dtype
from tests.cli_helpers import usecases

pytestmark = pytest.mark.gpu


def test_auto_picks_cuda_with_mixed_precision():
    runtime = make_runtime("auto")
    assert runtime.device.type == "cuda"
    assert runtime.amp_dtype == (torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16)
    assert select_amp_dtype(torch.device("cuda"), "fp32") is None


@pytest.mark.skipif(importlib.util.find_spec("cupy") is None, reason="the cuda13/cuda12 extra is not installed")
def test_array_module_is_cupy():
    assert array_module().__name__ == "cupy"


def test_finance_smoke_on_the_gpu(tmp_path):
    result = usecases("run", "finance", "--preset", "smoke", "--device", "cuda", "--summary", str(tmp_path / "s.json"))
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["device"] == "cuda"
    models = summary["models"]
    # the network learned: on the GJR-GARCH panel it forecasts at least about as well as EWMA (CPU: the same check)
    assert models["neural"]["qlike_sq"] < 1.05 * models["ewma"]["qlike_sq"]


def test_medical_smoke_on_the_gpu_holds_the_data_there(tmp_path):
    result = usecases("run", "medical", "--preset", "smoke", "--device", "cuda", "--summary", str(tmp_path / "s.json"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "(in memory)" in result.stderr
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["device"] == "cuda" and summary["models"]["resnet18"]["auc"] > 0.9


def test_medical_dataloader_path_on_the_gpu(tmp_path):
    result = usecases("run", "medical", "--preset", "smoke", "--device", "cuda", "--set", "data.in_memory=false",
                      "--set", "train.workers=2", "--summary", str(tmp_path / "s.json"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "DataLoader, 2 workers" in result.stderr


def test_recsys_smoke_on_the_gpu(tmp_path):
    result = usecases("run", "recsys", "--preset", "smoke", "--device", "cuda", "--summary", str(tmp_path / "s.json"))
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["device"] == "cuda" and summary["models"]["lightgcn"]["ndcg@10"] > 0.05


@pytest.mark.skipif(importlib.util.find_spec("dask_cudf") is None, reason="the cuda13/cuda12 extra is not installed")
def test_recsys_on_the_dask_engine_prepares_on_cudf_what_pandas_prepares(tmp_path):
    """A LocalCUDACluster, its frames on cuDF: the same log after de-duplication, so the same popularity scores."""
    from tests.cli_helpers import runs

    for engine in ("pandas", "dask"):
        result = usecases("run", "recsys", "--preset", "smoke", "--device", "cuda", "--engine", engine, "--set",
                          "models=[pop]", "--summary", str(tmp_path / f"{engine}.json"))
        assert result.returncode == 0, result.stderr[-3000:]
    by_engine = {run.data.tags["engine"]: run for run in runs("recsys")}
    assert by_engine["dask"].data.tags["dask_frames"] == "cudf"
    assert by_engine["dask"].data.metrics["test/pop/ndcg@10"] == by_engine["pandas"].data.metrics["test/pop/ndcg@10"]
