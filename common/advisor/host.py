"""The host's side of a step on a GPU, and the time of a run's phases that no roofline covers.

Eager PyTorch runs every operator through Python, the dispatcher and a kernel launch on the host while the GPU runs
the kernels queued before it. A step of small kernels is then bound by the host: its time is the operators counted by
the run's probe (`train_ops_per_step`, `infer_ops_per_batch`) plus those the probe does not see (the optimizer's
step, the loop's slicing), each at `HOST_SECONDS_PER_OP`. A host synchronisation (`host_syncs_per_step`: a value read
back, a data-dependent shape) drains the GPU's queue, so host and device no longer overlap in that step.

`HOST_SECONDS_PER_OP` is fitted (`calibrate_host`) to the small-batch inference latencies NVIDIA DeepLearningExamples
publishes for ResNet-50 v1.5 in eager PyTorch (catalog/host_bound.csv): from batch 1 up, the latency stays flat
while the host is the bound (10.4 ms on a V100 and on a T4 alike, whose GPUs differ fivefold), and that latency over
the forward pass's operators, counted as a run counts them, is the host's time per operator: 45-49 µs, on the
hosts of 2021 (DGX-1, PyTorch 21.03). Its fast end is assumed: a newer host and PyTorch dispatch an operator in
5-25 µs (https://jiahuanglin.xyz/all_lessons/gpu_kernel_serving/18_pytorch_to_kernel.html). The other constants
are counted here or assumed, each said where it is defined; `tests/common/test_advisor.py` recomputes the fitted
and counted ones.
"""

from __future__ import annotations

import math

# Levels as everywhere in the estimator: (slow, expected, fast).
# Fitted to catalog/host_bound.csv (`calibrate_host`): the envelope rounded up to 1 µs, the geometric mean; the
# fast end assumed (see the module docstring).
HOST_SECONDS_PER_OP = (50e-6, 46e-6, 20e-6)
# What a training step dispatches beside the counted forward and backward: Adam's step (foreach) and zero_grad
# dispatch 17 operators for 2 parameter tensors (BPR's tables) and 137 for 62 (ResNet-18), counted on a CPU with
# the probe's counter; plus the loop's own 4 (the batch's slices, the loss's detach and sum). The expected is their
# geometric mean: where the run logged `optimizer_ops_per_step`, that count is taken instead.
LOOP_OPS = 4
OPTIMIZER_OPS = (137 + LOOP_OPS, round(math.sqrt((17 + LOOP_OPS) * (137 + LOOP_OPS))), 17 + LOOP_OPS)
# A served or evaluated batch: the loop around the model (the batch's slice, the answer's copy back), assumed.
INFER_LOOP_OPS = (20, 8, 4)
# Assumed: a synchronisation's round trip once the queue is empty (cudaStreamSynchronize or a small copy back:
# 10-20 µs on current drivers, more on a busy host), and a kernel's least time on the device, launch to completion.
SYNC_SECONDS = (50e-6, 20e-6, 10e-6)
KERNEL_SECONDS = (5e-6, 3e-6, 2e-6)
# Assumed: an eager operator on a CPU costs the host about 15 µs beside its arithmetic (the dispatch without a
# launch), so work of tiny operators can take HOST_SECONDS_PER_OP[0] / that longer on a GPU than on the CPU.
CPU_SECONDS_PER_OP = 15e-6
DEVICE_SLOWDOWN = HOST_SECONDS_PER_OP[0] / CPU_SECONDS_PER_OP
# Assumed: another machine's host runs single-core work (Python, NumPy, files, MLflow) from 1.3x slower to 1.4x
# faster than the run's (a cloud vCPU against the run's core).
HOST_SPEED = (1 / 1.3, 1.0, 1.4)
# What a run on a GPU spends once that a CPU run does not, seconds: the CUDA context and the first tensor (1-2 s,
# https://github.com/pytorch/pytorch/issues/39005 ; 4 s with Python's start,
# https://github.com/pytorch/pytorch/issues/22583), cuBLAS and cuDNN loaded, cuDNN's benchmark of each new
# convolution shape: assumed.
GPU_STARTUP_S = (10.0, 4.0, 1.5)
# The command before the run's clock starts (Python, torch and the use case imported; `time/total_s` leaves it
# out): 2.9 to 3.6 s for the use cases' runs measured on the machine of the README, with HOST_SPEED's spread;
# up to 8 s assumed where a CUDA build of torch loads its libraries at import.
PROCESS_START_S = (8.0, 3.5, 2.5)
