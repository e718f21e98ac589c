"""The process and its machine: the cores it may use, the DataFrame backend, seeds and determinism, what a run sets
process-wide (and undoes), the hardware a run is tagged with, the peak memory of its process tree. Nothing here
imports pandas: `use_gpu_frames` must run before the first pandas import."""

from __future__ import annotations

import importlib.util
import logging
import os
import platform
import random
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import psutil
import torch

from common.errors import UserError
from common.runtime.devices import cpu_has_native_bf16, distributed_env

log = logging.getLogger(__name__)


def usable_cores() -> int:
    """The cores this process may run on (its affinity, which containers and `taskset` narrow), not the host's."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1  # macOS: none


@contextmanager
def all_cores() -> Iterator[None]:
    """torch's and the BLAS pools' threads raised to this rank's share of the cores, then set back: for the large
    matrix work of a run whose preset keeps one thread for its many small operations."""
    from threadpoolctl import threadpool_limits
    threads = torch.get_num_threads()
    cores = max(1, usable_cores() // int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    torch.set_num_threads(cores)
    try:
        with threadpool_limits(cores):
            yield
    finally:
        torch.set_num_threads(threads)


def use_gpu_frames(frames: str = "auto", device: str = "auto") -> str:
    """Route the pandas API to cuDF where a GPU, cuDF and the run's device allow (before pandas is imported)."""
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
    """Undo what a run sets process-wide (threads, determinism, cuDNN and TF32 flags, RNG states, environment, the
    levels of `loggers`), so that the next run in the same process starts as this one did."""
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
        _deterministic_algorithms(deterministic[0], deterministic[1])
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
    return device.type != "cuda" if setting == "auto" else bool(setting)


def seed_everything(seed: int, deterministic: bool = True) -> None:
    """Seed every generator, and turn deterministic algorithms on or off. Determinism does not fill every new
    tensor with NaN (torch's debugging aid, a write of each allocation): no code here reads memory it did not write."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.backends.cudnn.deterministic = deterministic
    torch.backends.cudnn.benchmark = not deterministic  # the fastest convolution algorithms, picked per shape
    _deterministic_algorithms(deterministic, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = False
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def _deterministic_algorithms(enabled: bool, warn_only: bool) -> None:
    """`torch.use_deterministic_algorithms` where it changes something (`warn_only` means nothing while off). That
    function also sets the compiler's own flag, importing torch._inductor to do so: 2 s of every run on a CPU, where
    determinism is on and nothing compiles. Until the compiler is loaded, only the eager flag is set here;
    `carry_determinism_to_the_compiler` sets the compiler's before a model is compiled."""
    if enabled != torch.are_deterministic_algorithms_enabled() or \
            (enabled and warn_only != torch.is_deterministic_algorithms_warn_only_enabled()):
        if "torch._inductor.config" in sys.modules:
            torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
        else:
            torch._C._set_deterministic_algorithms(enabled, warn_only=warn_only)


def carry_determinism_to_the_compiler() -> None:
    """Before `torch.compile`: the compiler follows the eager setting, as `torch.use_deterministic_algorithms` makes
    it do."""
    torch.use_deterministic_algorithms(torch.are_deterministic_algorithms_enabled(),
                                       warn_only=torch.is_deterministic_algorithms_warn_only_enabled())


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
    info = {"cpu_model": _cpu_model(), "cpu_cores": str(os.cpu_count()),
            "cpu_bf16": str(cpu_has_native_bf16()).lower(),  # whether `auto` precision trains in bf16 on this CPU
            "ram_gb": f"{psutil.virtual_memory().total / 2**30:.1f}", "gpu_count": "0", "gpu_name": "none",
            "torch_version": torch.__version__, "cuda_version": torch.version.cuda or "none"}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu_count=str(torch.cuda.device_count()), gpu_name=props.name,
                    gpu_memory_gb=f"{props.total_memory / 2**30:.1f}")
    return info


def tree_rss_bytes() -> int:
    """Resident memory of this process and every process below it (gone ones count as 0)."""
    process = psutil.Process()
    total = 0
    for member in [process, *process.children(recursive=True)]:
        try:
            total += member.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return total


class PeakMemory:
    """`with PeakMemory() as peak:` ... `peak.bytes`: the largest tree RSS seen while it ran, sampled in a thread
    (Dask and DataLoader workers included): what decides whether a run fits a machine."""

    def __init__(self):
        self.bytes, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._sample, name="peak-memory", daemon=True)

    def _sample(self) -> None:
        while True:
            self.bytes = max(self.bytes, tree_rss_bytes())
            if self._stop.wait(0.25):
                return

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.bytes = max(self.bytes, tree_rss_bytes())
