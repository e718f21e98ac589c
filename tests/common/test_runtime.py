"""Device, precision, array and DataFrame backends, hardware tags and seeding, checked without a GPU."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from common.runtime import devices as runtime
from common.errors import UserError
from common.runtime.devices import (Runtime, array_module, make_runtime, precision_notice, select_amp_dtype,
                                    select_device)
from common.runtime.process import hardware_info, seed_everything, use_gpu_frames

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.fixture
def no_cuda(monkeypatch):
    """Behave as a CPU-only machine even where a GPU is present."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def restore_determinism():
    """seed_everything switches process-wide torch flags; later tests must not inherit them."""
    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.benchmark,
        torch.backends.cudnn.deterministic,
        os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    )
    yield
    enabled, warn_only, benchmark, deterministic, workspace = saved
    torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
    torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = benchmark, deterministic
    if workspace is None:
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    else:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = workspace


@pytest.mark.parametrize("requested", ["auto", "cpu"])
def test_cpu_when_no_gpu(no_cuda, requested):
    assert select_device(requested) == CPU


def test_auto_takes_the_local_rank_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert select_device("auto", local_rank=1) == torch.device("cuda", 1)
    assert select_device("cpu", local_rank=1) == CPU


def test_cuda_without_gpu_is_a_user_error(no_cuda):
    with pytest.raises(UserError, match="--device cuda"):
        select_device("cuda")


def test_unknown_device_is_a_user_error():
    with pytest.raises(UserError, match="tpu"):
        select_device("tpu")


@pytest.mark.parametrize(
    ("device", "native_bf16", "precision", "expected"),
    [
        (CPU, True, "auto", torch.bfloat16),
        (CPU, False, "auto", None),
        (CPU, True, "auto-gpu", None),
        (CPU, True, "fp32", None),
        (CPU, True, "bf16", torch.bfloat16),
        (CPU, False, "bf16", None),
        (CUDA, True, "fp32", None),
        (CUDA, True, "bf16", torch.bfloat16),
        (CUDA, True, "fp16", torch.float16),
    ],
)
def test_amp_dtype_rules(monkeypatch, device, native_bf16, precision, expected):
    """The CPU's BF16 support is faked both ways: the rules must not depend on the machine the tests run on."""
    monkeypatch.setattr(runtime, "cpu_has_native_bf16", lambda: native_bf16)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)
    assert select_amp_dtype(device, precision) is expected


@pytest.mark.parametrize(("native_bf16", "precision", "noticed"),
                         [(False, "bf16", True), (False, "auto", False), (True, "bf16", False)])
def test_only_an_explicit_bf16_on_a_cpu_without_it_gets_a_notice(monkeypatch, native_bf16, precision, noticed):
    """Emulated BF16 is slower than fp32: asking for bf16 there runs fp32 and says so; `auto` falls back silently."""
    monkeypatch.setattr(runtime, "cpu_has_native_bf16", lambda: native_bf16)
    notice = precision_notice(CPU, precision)
    assert (notice is not None and "no native BF16" in notice) == noticed


@pytest.mark.parametrize("precision", ["auto", "auto-gpu"])
@pytest.mark.parametrize(("bf16_supported", "expected"), [(True, torch.bfloat16), (False, torch.float16)])
def test_cuda_auto_prefers_bf16_where_supported(monkeypatch, precision, bf16_supported, expected):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: bf16_supported)
    assert select_amp_dtype(CUDA, precision) is expected


@pytest.mark.parametrize(("precision", "match"), [("fp16", "only on CUDA"), ("int8", "int8")])
def test_bad_cpu_precision_is_a_user_error(precision, match):
    with pytest.raises(UserError, match=match):
        select_amp_dtype(CPU, precision)


@pytest.mark.parametrize(("amp_dtype", "name"), [(None, "fp32"), (torch.bfloat16, "bf16"), (torch.float16, "fp16")])
def test_runtime_precision_name(amp_dtype, name):
    assert Runtime(CPU, amp_dtype).precision == name


def test_make_runtime_single_process_on_cpu(monkeypatch, no_cuda):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(runtime, "cpu_has_native_bf16", lambda: True)
    made = make_runtime("auto", "bf16")
    assert made == Runtime(CPU, torch.bfloat16, 0, 0, 1)
    assert made.is_main and not made.distributed


def fake_cupy(available):
    module = types.ModuleType("cupy")
    module.is_available = available
    return module


def test_array_module_numpy_when_cupy_has_no_gpu(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy(lambda: False))
    assert array_module() is np


def test_array_module_cupy_when_it_reaches_a_gpu(monkeypatch):
    module = fake_cupy(lambda: True)
    monkeypatch.setitem(sys.modules, "cupy", module)
    assert array_module() is module


def test_array_module_numpy_when_cupy_is_broken(monkeypatch):
    def broken():
        raise RuntimeError("CUDA driver version is insufficient")

    monkeypatch.setitem(sys.modules, "cupy", fake_cupy(broken))
    assert array_module() is np


def test_array_module_numpy_without_cupy(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)
    assert array_module() is np


def test_frames_pandas_when_asked():
    assert use_gpu_frames("pandas") == "pandas"


def test_frames_auto_stays_pandas_without_gpu(no_cuda):
    assert use_gpu_frames("auto") == "pandas"


def test_frames_auto_stays_pandas_when_pandas_came_first(monkeypatch, caplog):
    """cudf.pandas cannot take over an already imported pandas, so it must not be installed then."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(runtime.importlib.util, "find_spec", lambda name, package=None: object())
    monkeypatch.setitem(sys.modules, "pandas", sys.modules.get("pandas") or types.ModuleType("pandas"))
    assert use_gpu_frames("auto") == "pandas"
    assert "imported before cudf.pandas" in caplog.text


def test_frames_stay_pandas_on_a_cpu_run_beside_a_gpu(monkeypatch):
    """`--device cpu` runs everything on the CPU: cudf.pandas is not installed although a GPU and cuDF are there."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(runtime.importlib.util, "find_spec", lambda name, package=None: object())
    monkeypatch.setitem(sys.modules, "cudf.pandas", types.ModuleType("cudf.pandas"))
    assert use_gpu_frames("auto", "cpu") == "pandas"
    assert use_gpu_frames("auto", "auto") == "cudf.pandas"


def test_bad_frames_is_a_user_error():
    with pytest.raises(UserError, match="cudf"):
        use_gpu_frames("cudf")


def test_hardware_info_tags():
    info = hardware_info()
    expected = {"cpu_model", "cpu_cores", "ram_gb", "gpu_count", "gpu_name", "torch_version", "cuda_version"}
    assert expected <= set(info)
    assert all(isinstance(value, str) for value in info.values()), "MLflow tags are strings"
    assert info["cpu_cores"] == str(os.cpu_count()) and info["torch_version"] == torch.__version__
    assert float(info["ram_gb"]) > 0
    if not torch.cuda.is_available():
        assert (info["gpu_count"], info["gpu_name"]) == ("0", "none")


def test_seed_everything_repeats_every_generator(restore_determinism):
    def draw():
        return torch.randn(5), np.random.rand(3), random.random()

    seed_everything(7)
    first = draw()
    seed_everything(7)
    second = draw()
    seed_everything(8)
    other = draw()
    assert torch.equal(first[0], second[0]) and np.array_equal(first[1], second[1]) and first[2] == second[2]
    assert not torch.equal(first[0], other[0])
    assert torch.are_deterministic_algorithms_enabled()


def test_make_test_no_bf16_fakes_a_cpu_without_native_bf16_in_every_process():
    """`make test-no-bf16` runs the suite as such a CPU would; its fake must reach the CLI's own processes."""
    import subprocess
    import sys
    from pathlib import Path

    folder = Path(__file__).resolve().parents[1] / "cpu_without_bf16"
    code = ("import torch; from common.runtime.devices import cpu_has_native_bf16, select_amp_dtype; "
            "print(cpu_has_native_bf16(), select_amp_dtype(torch.device('cpu'), 'auto'))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(folder)})
    assert result.stdout.split() == ["False", "None"], result.stderr


def test_determinism_on_a_cpu_run_loads_no_compiler_and_a_compiled_model_still_gets_it():
    """The compiler's import costs every run 2 s: a fresh process that only seeds leaves it unloaded, determinism on;
    a model compiled afterwards gets the compiler's own flag too, as `torch.use_deterministic_algorithms` sets it."""
    script = ("import sys, torch\n"
              "from common.runtime.process import carry_determinism_to_the_compiler, seed_everything\n"
              "seed_everything(0, True)\n"
              "print('torch._inductor.config' in sys.modules, torch.are_deterministic_algorithms_enabled(), "
              "torch.is_deterministic_algorithms_warn_only_enabled())\n"
              "carry_determinism_to_the_compiler()\n"
              "import torch._inductor.config as compiler\nprint(compiler.deterministic)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["False", "True", "True", "True"]
