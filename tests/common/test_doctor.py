"""`usecases doctor`: every check's messages, with torch, NVML, CuPy and cuDF faked, and the command on this machine."""

from __future__ import annotations

import subprocess
import types

import pytest
import torch

from common.tools import doctor
from common.tools.doctor import FAIL, OK, SKIP, WARN, Check, verdict
from common.errors import UserError
from tests.cli_helpers import in_process


def fake_torch(cuda: str | None = "13.0", gpus: list[tuple[str, int]] = (), nccl: bool = True):
    """A stand-in for torch with `gpus` as (name, compute capability major) pairs."""
    props = [types.SimpleNamespace(name=name, major=major, minor=0, total_memory=80 * 2**30) for name, major in gpus]
    return types.SimpleNamespace(
        __version__="2.14.1", version=types.SimpleNamespace(cuda=cuda),
        cuda=types.SimpleNamespace(is_available=lambda: bool(gpus), device_count=lambda: len(gpus),
                                   get_device_properties=lambda index: props[index],
                                   nccl=types.SimpleNamespace(version=lambda: (2, 27, 3))),
        distributed=types.SimpleNamespace(is_available=lambda: True, is_nccl_available=lambda: nccl))


def fake_nvml(cuda_driver: int | None):
    def init():
        if cuda_driver is None:
            raise RuntimeError("NVML Shared Library Not Found")

    return types.SimpleNamespace(nvmlInit=init, nvmlSystemGetDriverVersion=lambda: "580.95",
                                 nvmlSystemGetCudaDriverVersion=lambda: cuda_driver)


def test_python_too_old_fails_with_the_version_to_use():
    assert doctor.check_python((3, 9, 18)).status == FAIL and "3.10" in doctor.check_python((3, 9, 18)).fix
    assert doctor.check_python((3, 11, 7)).status == OK


@pytest.mark.parametrize(("driver", "status", "text"), [
    (13000, OK, "supports CUDA 13.0"), (12080, FAIL, "supports CUDA 12.8 but torch is built for CUDA 13.0"),
    (None, SKIP, "NVML found no driver")])
def test_the_driver_must_support_torchs_cuda_build(driver, status, text):
    check = doctor.check_driver(fake_torch("13.0"), fake_nvml(driver))
    assert check.status == status and text in check.detail
    assert doctor.check_driver(fake_torch(), None).status == SKIP


def test_no_gpu_fails_with_a_fix_that_depends_on_the_torch_build():
    cpu_build = doctor.check_gpus(fake_torch(cuda=None), "auto")
    assert cpu_build[0].status == FAIL and "CPU-only torch" in cpu_build[0].fix
    cuda_build = doctor.check_gpus(fake_torch(cuda="13.0"), "auto")
    assert cuda_build[0].status == FAIL and "nvidia-smi" in cuda_build[0].fix
    assert doctor.check_gpus(fake_torch(cuda="13.0"), "cpu")[0].status == SKIP


def test_each_gpu_is_listed_with_bf16_and_tf32_by_compute_capability_and_nccl_checked():
    checks = doctor.check_gpus(fake_torch(gpus=[("NVIDIA H200", 9), ("Tesla T4", 7)], nccl=False), "auto")
    assert "bf16, TF32" in checks[0].detail and "compute capability 9.0" in checks[0].detail
    assert "no bf16" in checks[1].detail and "no TF32" in checks[1].detail
    assert checks[2].name == "nccl" and checks[2].status == WARN


def fake_cupy(runtime_version: int, available: bool = True, broken: bool = False):
    def version():
        if broken:
            raise RuntimeError("CUDA driver version is insufficient")
        return runtime_version

    return types.SimpleNamespace(__version__="13.6.0", is_available=lambda: available,
                                 cuda=types.SimpleNamespace(runtime=types.SimpleNamespace(runtimeGetVersion=version)))


@pytest.mark.parametrize(("installed", "cupy", "status", "text"), [
    (False, None, WARN, "not installed"),
    (True, fake_cupy(13000), OK, "CUDA 13 as torch"),
    (True, fake_cupy(12080), FAIL, "built for CUDA 12, torch for CUDA 13.0"),
    (True, fake_cupy(13000, broken=True), FAIL, "cannot reach the GPU"),
])
def test_cupy_must_match_torchs_cuda_major(installed, cupy, status, text):
    check = doctor.check_cupy(fake_torch("13.0"), True, find=lambda name: object() if installed else None,
                              load=lambda name: cupy)
    assert check.status == status and text in check.detail
    assert status == OK or "cuda13" in check.fix
    assert doctor.check_cupy(fake_torch(), False).status == SKIP


@pytest.mark.parametrize(("stdout", "returncode", "status"), [
    ("cudf.pandas.fast_slow_proxy\n", 0, OK), ("", 1, FAIL), ("pandas.core.frame\n", 0, FAIL)])
def test_cudf_pandas_is_tried_in_a_child_process(stdout, returncode, status):
    def run(*args, **kwargs):
        return subprocess.CompletedProcess(args, returncode, stdout, "ImportError: libcudf.so: cannot open")

    check = doctor.check_cudf(fake_torch("13.0"), True, find=lambda name: object(), run=run)
    assert check.status == status
    assert doctor.check_cudf(fake_torch("13.0"), True, find=lambda name: None).status == WARN


def test_low_disk_and_an_unreachable_server_are_reported(tmp_path):
    low = doctor.check_disk(tmp_path / "cache", usage=lambda path: types.SimpleNamespace(free=2**30))
    assert low.status == WARN and "1.0 GiB free" in low.detail

    def unreachable(uri):
        raise UserError(f"MLFLOW_TRACKING_URI {uri}: the tracking server cannot be reached (refused)")

    down = doctor.check_tracking("http://127.0.0.1:9", unreachable)
    assert down.status == FAIL and "cannot be reached" in down.detail
    assert doctor.check_tracking(f"sqlite:///{tmp_path / 'mlflow.db'}", lambda uri: None).status == OK


def test_the_verdict_is_one_line_naming_each_failure():
    checks = [Check("python", OK, "3.11"), Check("gpu", FAIL, "no CUDA GPU", "fix"), Check("cupy", FAIL, "mixed")]
    ready, line = verdict(checks)
    assert not ready and line == "doctor: gpu: no CUDA GPU; cupy: mixed" and "\n" not in line
    assert verdict([Check("python", OK, "3.11"), Check("cupy", WARN, "absent")])[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer of a machine without a GPU")
def test_doctor_on_a_machine_without_a_gpu_exits_2_and_0_with_device_cpu(capsys):
    auto = in_process(capsys, "doctor")
    assert auto.returncode == 2
    lines = auto.stdout.strip().splitlines()
    assert {line.split()[1] for line in lines[:-1]} >= {"python", "torch", "gpu", "cupy", "cudf", "disk", "tracking",
                                                        "cpu"}
    assert lines[-1].startswith("doctor: gpu: no CUDA GPU")
    cpu = in_process(capsys, "doctor", "--device", "cpu")
    assert cpu.returncode == 0 and cpu.stdout.strip().splitlines()[-1].endswith("can run every use case as asked")
