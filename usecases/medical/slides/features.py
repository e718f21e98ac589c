"""Tiles to features, streamed: DataLoader workers read tiles, the device normalises their stain per slide and the
encoder makes a feature row per tile; memory is bounded by the batches in flight. On Dask, a task per slide."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from .reader import SlideHandles
from .tiles import TileGrid, read_tile

PREFETCH_BATCHES = 4  # per reader: tiles decoded ahead while the device works


@dataclass(frozen=True)
class SlideTiles:
    """The tiles of one slide to read: its file and tile grid, which of the grid's tiles, and with which reader."""

    path: Path
    grid: TileGrid
    indices: np.ndarray
    reader: str = "openslide"  # or "cucim"


class TileDataset(Dataset):
    """(tile uint8 3 x H x W, slide position) for every chosen tile of every slide, in slide order."""

    def __init__(self, slides: Sequence[SlideTiles]):
        self.slides = list(slides)
        self.owner = np.concatenate([np.full(len(slide.indices), position, np.int64)
                                     for position, slide in enumerate(self.slides)] or [np.zeros(0, np.int64)])
        self.tile = np.concatenate([slide.indices for slide in self.slides] or [np.zeros(0, np.int64)])
        self.handles = SlideHandles()  # opened in each worker on first use, never the parent's

    def __len__(self) -> int:
        return len(self.owner)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        position = int(self.owner[index])
        slide = self.slides[position]
        pixels = read_tile(self.handles.get(slide.path, slide.reader), slide.grid, int(self.tile[index]))
        return torch.from_numpy(np.ascontiguousarray(pixels.transpose(2, 0, 1))), position


def tile_loader(slides: Sequence[SlideTiles], batch_size: int, readers: int) -> DataLoader:
    """Batches in slide order, read by `readers` worker processes (0: in this process)."""
    options = {"num_workers": readers, "batch_size": batch_size, "shuffle": False}
    if readers:
        options.update(prefetch_factor=PREFETCH_BATCHES, persistent_workers=False)
    return DataLoader(TileDataset(slides), **options)


def read_tiles(slide: SlideTiles) -> torch.Tensor:
    """The chosen tiles of one slide as a uint8 (N, 3, H, W) batch, read in this process."""
    dataset = TileDataset([slide])
    try:
        return torch.stack([dataset[index][0] for index in range(len(dataset))])
    finally:
        dataset.handles.close()


class PooledFeatures:
    """The input of a network's last linear layer (the pooled features of a torchvision classifier), as a hook."""

    def __init__(self, network: nn.Module):
        last = [module for module in network.modules() if isinstance(module, nn.Linear)]
        if not last:
            raise ValueError(f"{type(network).__name__} has no linear layer to take features before")
        self.features: torch.Tensor | None = None
        self.hook = last[-1].register_forward_hook(self._keep)

    def _keep(self, module, inputs, output) -> None:
        self.features = inputs[0].detach()

    def close(self) -> None:
        self.hook.remove()


@torch.no_grad()
def encode_slides(network: nn.Module, slides: Sequence[SlideTiles], normalisers: Sequence, device: torch.device,
                  batch_size: int, readers: int) -> tuple[list[np.ndarray], float]:
    """One float32 (N_tiles, d) feature array per slide, and the tiles per second of read + normalise + encode."""
    network = network.to(device).eval()
    pooled = PooledFeatures(network)
    features: list[list[np.ndarray]] = [[] for _ in slides]
    started, count = time.perf_counter(), 0
    try:
        for tiles, owners in tile_loader(slides, batch_size, readers):
            tiles = tiles.to(device, non_blocking=True)
            for position in owners.unique().tolist():  # a batch spans a slide boundary at most a few times
                rows = (owners == position).nonzero().flatten().to(device)
                normaliser = normalisers[position]
                if normaliser is not None:
                    tiles[rows] = normaliser.normalize(tiles[rows])
            network(tiles)
            rows = pooled.features.float().cpu().numpy()
            for position in owners.unique().tolist():
                features[position].append(rows[(owners == position).numpy()])
            count += len(owners)
    finally:
        pooled.close()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - started
    return [np.concatenate(parts) if parts else np.zeros((0, 0), np.float32) for parts in features], \
        count / max(seconds, 1e-9)


def encode_on_cluster(client, build_network: Callable[[], nn.Module], weights: dict[str, torch.Tensor],
                      slides: Sequence[SlideTiles], normalisers: Sequence, device: torch.device,
                      batch_size: int) -> tuple[list[np.ndarray], float]:
    """`encode_slides` as a task per slide on a Dask `client`'s workers, `weights` sent once."""
    (shipped,) = client.scatter([weights], broadcast=True)
    started = time.perf_counter()
    futures = client.map(encode_slide, slides, normalisers, build_network=build_network, weights=shipped,
                         device_type=device.type, tiles_per_batch=batch_size,
                         pure=False)  # client.map takes a batch_size of its own
    bags = client.gather(futures)
    seconds = time.perf_counter() - started
    return bags, sum(len(slide.indices) for slide in slides) / max(seconds, 1e-9)


def encode_slide(slide: SlideTiles, normaliser, build_network: Callable[[], nn.Module],
                 weights: dict[str, torch.Tensor], device_type: str, tiles_per_batch: int) -> np.ndarray:
    """One slide's features, read and encoded in this (worker) process by its own copy of the network."""
    network = build_network()
    network.load_state_dict(weights)
    (features,), _ = encode_slides(network, [slide], [normaliser], torch.device(device_type), tiles_per_batch,
                                   readers=0)
    return features
