"""Where code runs: the device, the precision, the DDP environment and process group, the array backend."""

from __future__ import annotations

import importlib.util
import logging
import os
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
    return torch.device("cpu") if requested == "cpu" or not has_cuda else torch.device("cuda", local_rank)


def cpu_has_native_bf16() -> bool:
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def select_amp_dtype(device: torch.device, precision: str = "auto") -> torch.dtype | None:
    """The autocast dtype, or None for fp32: `auto` where the device computes it natively (emulated BF16 is slower than
    fp32), `auto-gpu` never on a CPU; `bf16` on a CPU without it runs fp32 too (`precision_notice`)."""
    if precision not in PRECISION_CHOICES:
        raise UserError(f"precision: expected one of {', '.join(PRECISION_CHOICES)}, got '{precision}'")
    if precision == "fp32":
        return None
    if device.type == "cpu":
        if precision == "fp16":
            raise UserError("precision fp16: only on CUDA; on CPU use bf16 or fp32")
        return None if precision == "auto-gpu" or not cpu_has_native_bf16() else torch.bfloat16
    if precision == "fp16" or (precision in ("auto", "auto-gpu") and not torch.cuda.is_bf16_supported()):
        return torch.float16
    return torch.bfloat16


def precision_notice(device: torch.device, precision: str) -> str | None:
    """One line for a precision that was asked for explicitly and not given."""
    if precision == "bf16" and device.type == "cpu" and not cpu_has_native_bf16():
        return ("precision bf16: this CPU has no native BF16 (AVX512-BF16 or AMX), so it would run slower than fp32; "
                "running fp32")
    return None


def distributed_env() -> tuple[int, int, int]:
    """Rank, local rank and world size as torchrun sets them (a single process otherwise)."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def make_runtime(device: str = "auto", precision: str = "auto", cpu_threads: int | None = None,
                 tf32: bool = False, compile: bool = False) -> Runtime:
    """Resolve the device and precision, and join the process group when started by torchrun."""
    rank, local_rank, world_size = distributed_env()
    chosen = select_device(device, local_rank)
    if cpu_threads:
        torch.set_num_threads(cpu_threads)
    if chosen.type == "cuda":
        torch.cuda.set_device(chosen)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32
    if world_size > 1 and not dist.is_initialized():
        importlib.import_module("torch.distributed.nn")  # before the group exists: see `shutdown`
        # An hour ($USECASES_DDP_TIMEOUT_MIN), not NCCL's 10 minutes: at the end of a job the other ranks wait at a
        # barrier while rank 0 alone logs and registers the model, which with a remote store can pass 10 minutes.
        timeout = timedelta(minutes=float(os.environ.get("USECASES_DDP_TIMEOUT_MIN", 60)))
        dist.init_process_group(backend="nccl" if chosen.type == "cuda" else "gloo", timeout=timeout)
    return Runtime(chosen, select_amp_dtype(chosen, precision), rank, local_rank, world_size, compile)


def shutdown(runtime: Runtime) -> None:
    """Leave the process group, after the ranks' last collective. `make_runtime` imports `torch.distributed.nn` before
    it creates the group: imported later (by DDP), its `group=group.WORLD` defaults hold the group forever, gloo's
    threads run on into interpreter shutdown, and the rank aborts now and then (SIGABRT) after a good run."""
    if runtime.distributed and dist.is_initialized():
        dist.destroy_process_group()


def array_module() -> ModuleType:
    """CuPy when it can really reach a GPU, else NumPy: a successful import alone proves nothing."""
    try:
        import cupy
        return cupy if cupy.is_available() else np
    except Exception:  # not installed, or a broken CUDA install raising from inside cupy
        return np
