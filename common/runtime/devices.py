"""Where and how code runs: device, precision, distributed ranks, array and DataFrame backends, seeds.

Nothing here imports pandas: `use_gpu_frames` must run before the first pandas import.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import platform
import random
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from types import ModuleType

import numpy as np
import torch
import torch.distributed as dist

from common.errors import UserError

log = logging.getLogger(__name__)

DEVICE_CHOICES = ("auto", "cpu", "cuda")
PRECISION_CHOICES = ("auto", "auto-gpu", "fp32", "bf16", "fp16")


@dataclass(frozen=True)
class Runtime:
    device: torch.device
    amp_dtype: torch.dtype | None
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    compile: bool = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def precision(self) -> str:
        return {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[self.amp_dtype]


def select_device(requested: str = "auto", local_rank: int = 0) -> torch.device:
    """`auto` takes CUDA when torch can use it; asking for CUDA without a GPU is a user error."""
    if requested not in DEVICE_CHOICES:
        raise UserError(f"--device: expected one of {', '.join(DEVICE_CHOICES)}, got '{requested}'")
    has_cuda = torch.cuda.is_available()
    if requested == "cuda" and not has_cuda:
        raise UserError("--device cuda: no CUDA GPU is visible to torch on this machine (use --device cpu or auto)")
    if requested == "cpu" or not has_cuda:
        return torch.device("cpu")
    return torch.device("cuda", local_rank)


def usable_cores() -> int:
    """The cores this process may run on (its affinity, which containers and `taskset` narrow), not the host's."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1  # macOS: none


@contextmanager
def all_cores() -> Iterator[None]:
    """torch's intra-op threads and the BLAS pools raised to the cores this process may use (shared with the other
    ranks of this machine under torchrun), then set back: for the large matrix work of a run whose preset keeps one
    thread for its many small operations."""
    from threadpoolctl import threadpool_limits

    threads = torch.get_num_threads()
    cores = max(1, usable_cores() // int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    torch.set_num_threads(cores)
    try:
        with threadpool_limits(cores):
            yield
    finally:
        torch.set_num_threads(threads)


def cpu_has_native_bf16() -> bool:
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def select_amp_dtype(device: torch.device, precision: str = "auto") -> torch.dtype | None:
    """The autocast dtype, or None for fp32.

    `auto` takes mixed precision wherever the device computes it natively: bf16 on a GPU that has it (else fp16),
    bf16 on a CPU with AVX512-BF16 or AMX, fp32 on other CPUs (emulated BF16 is slower than fp32). `auto-gpu` is
    the same on a GPU and fp32 on every CPU. An explicit `bf16` on a CPU without it runs fp32 too, and
    `precision_notice` says so.
    """
    if precision not in PRECISION_CHOICES:
        raise UserError(f"precision: expected one of {', '.join(PRECISION_CHOICES)}, got '{precision}'")
    if precision == "fp32":
        return None
    if device.type == "cpu":
        if precision == "fp16":
            raise UserError("precision fp16: only on CUDA; on CPU use bf16 or fp32")
        if precision == "auto-gpu" or not cpu_has_native_bf16():
            return None
        return torch.bfloat16
    if precision == "fp16" or (precision in ("auto", "auto-gpu") and not torch.cuda.is_bf16_supported()):
        return torch.float16
    return torch.bfloat16


def precision_notice(device: torch.device, precision: str) -> str | None:
    """One line for a precision that was asked for explicitly and not given; printed once the input is checked."""
    if precision == "bf16" and device.type == "cpu" and not cpu_has_native_bf16():
        return ("precision bf16: this CPU has no native BF16 (AVX512-BF16 or AMX), so it would run slower than fp32; "
                "running fp32")
    return None


def distributed_env() -> tuple[int, int, int]:
    """Rank, local rank and world size as torchrun sets them (a single process otherwise)."""
    return (
        int(os.environ.get("RANK", 0)),
        int(os.environ.get("LOCAL_RANK", 0)),
        int(os.environ.get("WORLD_SIZE", 1)),
    )


DDP_TIMEOUT_MIN = 60


def collective_timeout() -> timedelta:
    """How long a rank waits in a collective: an hour (`$USECASES_DDP_TIMEOUT_MIN`), not NCCL's 10 minutes,
    because at the end of a job the other ranks wait at a barrier while rank 0 alone logs and registers the model,
    which with a remote store and a large model can pass 10 minutes. The work itself is shared out
    (common/runtime/sharding.py), so no rank waits long for another's computation."""
    return timedelta(minutes=float(os.environ.get("USECASES_DDP_TIMEOUT_MIN", DDP_TIMEOUT_MIN)))


def make_runtime(device: str = "auto", precision: str = "auto", cpu_threads: int | None = None,
                 tf32: bool = False, compile: bool = False) -> Runtime:
    """Resolve the device and precision, and join the process group when started by torchrun.

    `cpu_threads=1` suits small models, whose steps are shorter than the cost of waking a second thread. `tf32`
    lets fp32 matrix products and convolutions use TF32 tensor cores on GPUs that have them (compute capability 8+).
    """
    rank, local_rank, world_size = distributed_env()
    chosen = select_device(device, local_rank)
    if cpu_threads:
        torch.set_num_threads(cpu_threads)
    if chosen.type == "cuda":
        torch.cuda.set_device(chosen)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32
    if world_size > 1 and not dist.is_initialized():
        importlib.import_module("torch.distributed.nn")  # before the group exists: see `shutdown`

        dist.init_process_group(backend="nccl" if chosen.type == "cuda" else "gloo", timeout=collective_timeout())
    return Runtime(chosen, select_amp_dtype(chosen, precision), rank, local_rank, world_size, compile)


def shutdown(runtime: Runtime) -> None:
    """Leave the process group, after the ranks' last collective (a rank that leaves closes its connections, and a
    collective another rank is still in fails). The backend itself closes once no DDP model holds the group either.

    `make_runtime` imports `torch.distributed.nn` before it creates the group, because that module's functions take
    `group=group.WORLD` as a default argument: imported later (DDP's constructor does, through torch._dynamo), they
    hold the group forever, `destroy_process_group` cannot free it, and gloo's worker and socket threads run on into
    interpreter shutdown, where the group is freed with the module and the rank aborts now and then (SIGABRT,
    "terminate called without an active exception") after a run that had finished well."""
    if runtime.distributed and dist.is_initialized():
        dist.destroy_process_group()


def array_module() -> ModuleType:
    """CuPy when it can really reach a GPU, else NumPy: a successful import alone proves nothing."""
    try:
        import cupy
    except ImportError:
        return np
    try:
        return cupy if cupy.is_available() else np
    except Exception:  # a broken CUDA install raises from inside cupy
        return np


def use_gpu_frames(frames: str = "auto", device: str = "auto") -> str:
    """Route the pandas API to cuDF when a GPU and cuDF are present and the run may use the GPU (`--device cpu`
    keeps every part of it on the CPU); returns the backend in use.

    Must run before pandas is first imported, which is why the CLI calls it first.
    """
    if frames not in ("auto", "pandas"):
        raise UserError(f"--frames: expected auto or pandas, got '{frames}'")
    if frames == "pandas" or device == "cpu" or not torch.cuda.is_available():
        return "pandas"
    if importlib.util.find_spec("cudf") is None:
        return "pandas"
    if "cudf.pandas" in sys.modules:
        return "cudf.pandas"  # installed by an earlier run in this process (usecases demo)
    if "pandas" in sys.modules:
        log.warning("pandas was imported before cudf.pandas could be installed; DataFrames stay on the CPU")
        return "pandas"
    torch.cuda.set_device(distributed_env()[1])  # under torchrun, cuDF's memory pool goes on this rank's GPU
    import cudf.pandas

    cudf.pandas.install()
    return "cudf.pandas"


@contextmanager
def isolated_process_state(loggers: tuple[str, ...] = ()) -> Iterator[None]:
    """Undo what a run sets process-wide (torch threads, deterministic algorithms, cuDNN and TF32 flags, RNG states,
    environment variables, the levels of `loggers`), so the next run in the same process starts as this one did."""
    threads = torch.get_num_threads()
    deterministic = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
                     torch.utils.deterministic.fill_uninitialized_memory)
    cudnn = (torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic, torch.backends.cudnn.allow_tf32,
             torch.backends.cuda.matmul.allow_tf32)
    rng = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    environment = dict(os.environ)
    levels = {name: logging.getLogger(name).level for name in loggers}
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic[0], warn_only=deterministic[1])
        torch.utils.deterministic.fill_uninitialized_memory = deterministic[2]
        (torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic, torch.backends.cudnn.allow_tf32,
         torch.backends.cuda.matmul.allow_tf32) = cudnn
        random.setstate(rng[0])
        np.random.set_state(rng[1])
        torch.set_rng_state(rng[2])
        for name in set(os.environ) - set(environment):
            del os.environ[name]
        os.environ.update(environment)
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


def deterministic_on(setting: bool | str, device: torch.device) -> bool:
    """`runtime.deterministic` as a run on `device` takes it: `auto` is deterministic on a CPU only."""
    return device.type != "cuda" if setting == "auto" else bool(setting)


def seed_everything(seed: int, deterministic: bool = True) -> None:
    """Seed every generator, and turn deterministic algorithms on or, for `deterministic=False`, off (cuDNN then
    benchmarks its algorithms per shape). Determinism does not fill every new tensor with NaN (torch's debugging aid,
    a write of each allocation): no code here reads memory it did not write."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.backends.cudnn.deterministic = deterministic
    torch.backends.cudnn.benchmark = not deterministic  # the fastest convolution algorithms, picked per shape
    torch.use_deterministic_algorithms(deterministic, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = False
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def hardware_info() -> dict[str, str]:
    """What the run ran on, as MLflow tags: enough to compare runs across instance types."""
    import psutil

    info = {
        "cpu_model": _cpu_model(),
        "cpu_cores": str(os.cpu_count()),
        "cpu_bf16": str(cpu_has_native_bf16()).lower(),  # whether `auto` precision trains in bf16 on this CPU
        "ram_gb": f"{psutil.virtual_memory().total / 2**30:.1f}",
        "gpu_count": "0",
        "gpu_name": "none",
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda or "none",
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(
            gpu_count=str(torch.cuda.device_count()),
            gpu_name=props.name,
            gpu_memory_gb=f"{props.total_memory / 2**30:.1f}",
        )
    return info
