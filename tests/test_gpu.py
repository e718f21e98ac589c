"""Checks that need a CUDA GPU; skipped elsewhere (see tests/conftest.py). Run with `make test-gpu`. The one
unmarked test checks on any machine that the CUDA extras install what these tests need."""

import importlib.util
import json
import re
import tomllib
from pathlib import Path

import pytest
import torch

from common.runtime.devices import array_module, make_runtime, select_amp_dtype
from tests.cli_helpers import usecases

gpu = pytest.mark.gpu
EXTRAS = ("cuda13", "cuda12")  # one per CUDA major; the RAPIDS wheels carry the major in their names


@pytest.mark.parametrize("extra", EXTRAS)
def test_each_cuda_extra_installs_the_gpu_stack_of_its_own_major(extra):
    """The Dask engine's cuDF path (`dask_frames: cudf`, the last test here) needs dask-cudf beside cudf and
    dask-cuda: without it that path cannot be installed, whatever the recsys README says."""
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    requirements = pyproject["project"]["optional-dependencies"][extra]
    names = {re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].lower() for requirement in requirements}
    major = extra.removeprefix("cuda")
    assert {f"cudf-cu{major}", f"dask-cudf-cu{major}", "dask-cuda", f"cupy-cuda{major}x"} <= names, sorted(names)
    other = "12" if major == "13" else "13"
    assert not any(name.endswith((f"-cu{other}", f"cuda{other}x")) for name in names), "never mix the CUDA majors"


@gpu
def test_auto_picks_cuda_with_mixed_precision():
    runtime = make_runtime("auto")
    assert runtime.device.type == "cuda"
    assert runtime.amp_dtype == (torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16)
    assert select_amp_dtype(torch.device("cuda"), "fp32") is None


@gpu
@pytest.mark.skipif(importlib.util.find_spec("cupy") is None, reason="the cuda13/cuda12 extra is not installed")
def test_array_module_is_cupy():
    assert array_module().__name__ == "cupy"


@gpu
def test_finance_smoke_on_the_gpu(tmp_path):
    result = usecases("run", "finance", "--preset", "smoke", "--device", "cuda", "--summary", str(tmp_path / "s.json"))
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["device"] == "cuda"
    models = summary["models"]
    # the network learned: on the GJR-GARCH panel it forecasts at least about as well as EWMA (CPU: the same check)
    assert models["neural"]["qlike_sq"] < 1.05 * models["ewma"]["qlike_sq"]


@gpu
def test_medical_smoke_on_the_gpu_holds_the_data_there(tmp_path):
    result = usecases("run", "medical", "--preset", "smoke", "--device", "cuda", "--summary", str(tmp_path / "s.json"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "(in memory)" in result.stderr
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["device"] == "cuda" and summary["models"]["resnet18"]["auc"] > 0.9


@gpu
def test_medical_dataloader_path_on_the_gpu(tmp_path):
    result = usecases("run", "medical", "--preset", "smoke", "--device", "cuda", "--set", "data.in_memory=false",
                      "--set", "train.workers=2", "--summary", str(tmp_path / "s.json"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "DataLoader, 2 workers" in result.stderr


@gpu
def test_recsys_smoke_on_the_gpu(tmp_path):
    result = usecases("run", "recsys", "--preset", "smoke", "--device", "cuda", "--summary", str(tmp_path / "s.json"))
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["device"] == "cuda" and summary["models"]["lightgcn"]["ndcg@10"] > 0.05


@gpu
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
