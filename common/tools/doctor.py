"""`usecases doctor`: can this machine run every use case on its best device, and if not, why and what to do. Each
check is one line: OK, WARN (runs, but slower or with less), FAIL (a use case cannot run as asked) or SKIP, with a fix
for each WARN and FAIL. The probes are arguments, so that tests exercise every message."""

from __future__ import annotations

import importlib.util
import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass

from common.errors import UserError

OK, WARN, FAIL, SKIP = "OK", "WARN", "FAIL", "SKIP"
MIN_PYTHON = (3, 10)
MIN_FREE_DISK_GB = 5  # MedMNIST at 224 px and MovieLens-25M with their caches


@dataclass(frozen=True)
class Check:
    name: str
    status: str
    detail: str
    fix: str = ""

    def line(self) -> str:
        return f"{self.status:4}  {self.name:12} {self.detail}" + (f"  -> {self.fix}" if self.fix else "")


def _major(version: str | None) -> int | None:
    return int(str(version).split(".")[0]) if version else None


def check_python(version: tuple[int, ...] = tuple(sys.version_info[:3])) -> Check:
    text = ".".join(map(str, version))
    if tuple(version[:2]) < MIN_PYTHON:
        return Check("python", FAIL, text, f"use Python {'.'.join(map(str, MIN_PYTHON))} or newer")
    return Check("python", OK, text)


def check_driver(torch, nvml) -> Check:
    """The driver must support the CUDA version torch was built for (a newer driver runs older CUDA builds)."""
    if nvml is None:
        return Check("driver", SKIP, "no NVML (nvidia-ml-py not installed, or no NVIDIA driver)")
    try:
        nvml.nvmlInit()
        driver, cuda = nvml.nvmlSystemGetDriverVersion(), nvml.nvmlSystemGetCudaDriverVersion()
    except Exception as exc:
        return Check("driver", SKIP, f"NVML found no driver ({type(exc).__name__})")
    supported = f"{cuda // 1000}.{cuda % 1000 // 10}"
    built = torch.version.cuda
    if built and (cuda // 1000, cuda % 1000 // 10) < tuple(int(part) for part in built.split(".")[:2]):
        return Check("driver", FAIL, f"{driver}, supports CUDA {supported} but torch is built for CUDA {built}",
                     f"update the NVIDIA driver to one for CUDA {built}, or install a torch built for CUDA "
                     f"{supported} or older")
    return Check("driver", OK, f"{driver}, supports CUDA {supported}")


def check_gpus(torch, device: str) -> list[Check]:
    if device == "cpu":
        return [Check("gpu", SKIP, "--device cpu")]
    if not torch.cuda.is_available():
        fix = ("this is a CPU-only torch: pip install torch --index-url https://download.pytorch.org/whl/cu130 (or "
               "the CUDA major you need)") if not torch.version.cuda else \
            "check nvidia-smi and CUDA_VISIBLE_DEVICES; or run with --device cpu"
        return [Check("gpu", FAIL, "no CUDA GPU visible to torch: the GPU checks are skipped", fix)]
    checks = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        bf16 = "bf16" if props.major >= 8 else "no bf16 (fp16 with a gradient scaler)"
        tf32 = "TF32" if props.major >= 8 else "no TF32"
        checks.append(Check(f"gpu {index}", OK, f"{props.name}, {props.total_memory / 2**30:.1f} GiB, compute "
                                                f"capability {props.major}.{props.minor}, {bf16}, {tf32}"))
    if torch.distributed.is_available() and torch.distributed.is_nccl_available():
        version = ".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else "present"
        checks.append(Check("nccl", OK, f"{version}, for torchrun on several GPUs"))
    else:
        checks.append(Check("nccl", WARN, "not in this torch build: torchrun on GPUs cannot use NCCL",
                            "install torch's CUDA build for Linux, which ships NCCL"))
    return checks


def check_cupy(torch, has_gpu: bool, find=importlib.util.find_spec, load=importlib.import_module) -> Check:
    if not has_gpu:
        return Check("cupy", SKIP, "no GPU: NumPy is used")
    extra = f"cuda{_major(torch.version.cuda)}"
    if find("cupy") is None:
        return Check("cupy", WARN, "not installed: array code runs on NumPy", f"pip install -e '.[{extra}]'")
    cupy = load("cupy")
    try:
        available, runtime = cupy.is_available(), cupy.cuda.runtime.runtimeGetVersion()
    except Exception as exc:
        return Check("cupy", FAIL, f"installed but cannot reach the GPU ({type(exc).__name__})",
                     f"install the CuPy of torch's CUDA major: pip install -e '.[{extra}]'")
    major = runtime // 1000
    if not available or major != _major(torch.version.cuda):
        return Check("cupy", FAIL, f"built for CUDA {major}, torch for CUDA {torch.version.cuda}",
                     f"never mix CUDA majors: pip uninstall cupy-cuda{major}x, then pip install -e '.[{extra}]'")
    return Check("cupy", OK, f"{cupy.__version__}, CUDA {major} as torch")


def check_cudf(torch, has_gpu: bool, find=importlib.util.find_spec, run=subprocess.run) -> Check:
    """cudf.pandas is tried in a child process: it must install before pandas is imported, as it is here already."""
    if not has_gpu:
        return Check("cudf", SKIP, "no GPU: DataFrames stay on pandas")
    extra = f"cuda{_major(torch.version.cuda)}"
    if find("cudf") is None:
        return Check("cudf", WARN, "not installed: DataFrames stay on pandas", f"pip install -e '.[{extra}]'")
    code = "import cudf.pandas; cudf.pandas.install(); import pandas; print(type(pandas.DataFrame).__module__)"
    result = run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    if result.returncode != 0 or "cudf" not in result.stdout:
        reason = (result.stderr.strip().splitlines() or ["no cuDF proxy"])[-1][:120]
        return Check("cudf", FAIL, f"cudf.pandas does not engage ({reason})",
                     f"reinstall the RAPIDS packages of torch's CUDA major: pip install -e '.[{extra}]'")
    return Check("cudf", OK, "cudf.pandas engages")


def check_nvml_package(has_gpu: bool, find=importlib.util.find_spec) -> Check:
    if not has_gpu:
        return Check("nvidia-ml-py", SKIP, "no GPU")
    if find("pynvml") is None:
        return Check("nvidia-ml-py", WARN, "not installed: runs log no GPU system metrics", "pip install nvidia-ml-py")
    return Check("nvidia-ml-py", OK, "GPU utilisation and memory go to each run's system metrics")


def check_disk(folder, usage=shutil.disk_usage) -> Check:
    probe = folder
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = usage(probe).free / 2**30
    if free < MIN_FREE_DISK_GB:
        return Check("disk", WARN, f"{free:.1f} GiB free for the data caches in {folder}",
                     f"free at least {MIN_FREE_DISK_GB} GiB, or point XDG_CACHE_HOME at a larger disk")
    return Check("disk", OK, f"{free:.0f} GiB free for the data caches in {folder}")


def check_tracking(uri: str, reach: Callable[[str], None]) -> Check:
    try:
        reach(uri)
    except UserError as error:
        return Check("tracking", FAIL, str(error),
                     "start the server, or unset MLFLOW_TRACKING_URI to use the local store")
    if uri.startswith("sqlite:///"):
        folder = os.path.dirname(uri.removeprefix("sqlite:///"))
        if not os.access(folder, os.W_OK):
            return Check("tracking", FAIL, f"{uri}: {folder} is not writable", "fix its permissions")
    return Check("tracking", OK, uri)


def run_checks(device: str = "auto") -> list[Check]:
    import psutil
    import torch

    from common.paths import cache_dir
    from common.runtime.devices import cpu_has_native_bf16
    from common.tracking.stores import check_reachable, tracking_uri

    try:
        import pynvml as nvml
    except ImportError:
        nvml = None
    has_gpu = device != "cpu" and torch.cuda.is_available()
    build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU-only build"
    bf16 = ("native BF16 (AVX512-BF16 or AMX): CPU training uses bf16 where presets say auto" if cpu_has_native_bf16()
            else "no native BF16: CPU training runs fp32 (convolutional networks train slower)")
    ram_gb = psutil.virtual_memory().total / 2**30
    return [check_python(), Check("torch", OK, f"{torch.__version__}, {build}"), check_driver(torch, nvml),
            *check_gpus(torch, device), check_cupy(torch, has_gpu), check_cudf(torch, has_gpu),
            check_nvml_package(has_gpu), check_disk(cache_dir("")), check_tracking(tracking_uri(), check_reachable),
            Check("cpu", OK, f"{platform.machine()}, {os.cpu_count()} cores, {ram_gb:.0f} GiB RAM, {bf16}")]


def verdict(checks: list[Check]) -> tuple[bool, str]:
    failed = [check for check in checks if check.status == FAIL]
    if not failed:
        return True, "doctor: this machine can run every use case as asked"
    return False, "doctor: " + "; ".join(f"{check.name}: {check.detail}" for check in failed)
