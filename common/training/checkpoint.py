"""Checkpoints of a fit and the random streams they carry.

Under DDP every rank draws its own random numbers (dropout, augmentations, sampled negatives: identical draws on
every rank would repeat each one world-size times an epoch), and its own random state is checkpointed. Rank 0
alone writes checkpoints, possibly to a folder only its machine sees, so rank 0 alone decides whether there is one
to resume and sends its state to the others.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from common.runtime.devices import Runtime
from common.training.callbacks import Callback, FitState

CHECKPOINT_NAME = "last.pt"
RANK_SEED_STRIDE = 0x9E3779B97F4A7C15  # far-apart seeds for the ranks' random streams


def save_atomic(state: dict, path: Path) -> None:
    """Write beside the target, then rename: a kill mid-write never leaves a truncated checkpoint."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    try:
        torch.save(state, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def every_rank(value, runtime: Runtime) -> list:
    """Each rank's `value`, in rank order (a list of one outside DDP): every rank calls this together."""
    if not runtime.distributed:
        return [value]
    values = [None] * runtime.world_size
    dist.all_gather_object(values, value)
    return values


class RankRandomStreams(Callback):
    """A fresh fit gives each DDP rank its own random stream, derived from the seed (rank 0 keeps it, so a one-rank
    job and rank 0 draw alike; DDP's first broadcast still gives every rank rank 0's initial weights); a checkpoint
    holds every rank's state, and a resume gives each rank its own back."""

    def __init__(self, runtime: Runtime):
        self.runtime = runtime

    def on_fit_start(self, trainer: FitState) -> None:
        if trainer.resumed_from is None and self.runtime.distributed and self.runtime.rank:
            torch.manual_seed((torch.initial_seed() + RANK_SEED_STRIDE * self.runtime.rank) % 2**63)

    def state_dict(self) -> dict:
        cuda = torch.cuda.get_rng_state_all() if self.runtime.device.type == "cuda" else []
        return {"torch_rng": every_rank(torch.get_rng_state(), self.runtime),
                "cuda_rng": every_rank(cuda, self.runtime)}

    def load_state_dict(self, checkpoint: dict) -> None:
        """This rank's random state as it was saved (a job restarted on fewer or more ranks reuses them in turn; a
        checkpoint written before the states were per rank holds one state, not a list of them)."""
        states, cuda_states = checkpoint["torch_rng"], checkpoint["cuda_rng"]
        if torch.is_tensor(states):
            states, cuda_states = [states], [cuda_states]
        own = self.runtime.rank % len(states)
        torch.set_rng_state(states[own].cpu())
        if cuda_states[own] and self.runtime.device.type == "cuda":  # dropout, flips, negatives on the GPU
            torch.cuda.set_rng_state_all([rng.cpu() for rng in cuda_states[own]])


class Checkpoint(Callback):
    """Writes the trainer's and every callback's state to `path` once `every_s` seconds of the fit have passed since
    its start or its last checkpoint (0: after every epoch; never in the epoch the fit stops in) and, marked finished,
    at the end of a fit that wrote or resumed one, or lasted `every_s` at least; `read` finds the one to resume from.

    By time, not by epochs: a checkpoint costs the same whatever the epoch's length (a 180 MB network written every
    few seconds of a fast GPU's epochs is most of the run), and an interruption loses at most `every_s` of work. A fit
    shorter than that writes nothing and is trained again on a resume."""

    def __init__(self, path: Path, every_s: float, runtime: Runtime):
        self.path = path
        self.every_s = every_s
        self.runtime = runtime
        self.started = self.last = 0.0
        self.holds_state = False

    def read(self) -> dict | None:
        """The checkpoint to resume from, as rank 0 finds it, on every rank (None where rank 0 has none); its tensors
        on the CPU, from where loading the state dicts copies them to the device."""
        state = None
        if self.runtime.is_main and self.path.is_file():
            state = torch.load(self.path, map_location="cpu", weights_only=True)
        if self.runtime.distributed:
            shared = [state]
            dist.broadcast_object_list(shared, src=0)
            state = shared[0]
        return state

    def load_state_dict(self, checkpoint: dict) -> None:
        self.holds_state = True

    def on_fit_start(self, trainer: FitState) -> None:
        self.started = self.last = self._now()
        self.holds_state = trainer.resumed_from is not None

    def on_epoch_end(self, trainer: FitState, epoch: int, metrics: dict[str, float]) -> None:
        if not trainer.should_stop and self._now() - self.last >= self.every_s:
            self._write(trainer.state_dict(finished=False))

    def on_fit_end(self, trainer: FitState) -> None:
        if self.holds_state or self._now() - self.started >= self.every_s:
            self._write(trainer.state_dict(finished=True))

    def _now(self) -> float:
        """Rank 0's clock, on every rank: the ranks decide together whether to write (the state gathers from all)."""
        now = time.monotonic()
        if self.runtime.distributed:
            shared = torch.tensor([now], dtype=torch.float64, device=self.runtime.device)
            dist.broadcast(shared, src=0)
            now = float(shared)
        return now

    def _write(self, state: dict) -> None:
        if self.runtime.is_main:
            save_atomic(state, self.path)
        self.last, self.holds_state = self._now(), True
