"""Batch transforms that run on the device, inside the model's forward pass.

A per-image transform in a DataLoader worker is what starves a GPU on small images; here a whole batch is
flipped or shifted at once wherever the model runs, so the in-memory and the DataLoader paths augment alike.
Each transform is a small module, composed with `nn.Sequential`, active only in training mode.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import Augment


class RandomFlip(nn.Module):
    """Flip each image along `dim` (-1: horizontal, -2: vertical) with probability `p`."""

    def __init__(self, dim: int, p: float = 0.5):
        super().__init__()
        self.dim, self.p = dim, p

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return images
        flip = torch.rand(len(images), device=images.device) < self.p
        return torch.where(flip[:, None, None, None], images.flip(self.dim), images)


class RandomShift(nn.Module):
    """Translate each image by up to `pixels` in each direction, reflecting at the border."""

    def __init__(self, pixels: int):
        super().__init__()
        self.pixels = pixels

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if not self.training or self.pixels == 0:
            return images
        count, _, height, width = images.shape
        shift = torch.randint(-self.pixels, self.pixels + 1, (count, 2), device=images.device).float()
        theta = torch.zeros(count, 2, 3, device=images.device)
        theta[:, 0, 0] = theta[:, 1, 1] = 1
        theta[:, 0, 2] = 2 * shift[:, 0] / width
        theta[:, 1, 2] = 2 * shift[:, 1] / height
        grid = F.affine_grid(theta, list(images.shape), align_corners=False)
        return F.grid_sample(images, grid, mode="nearest", padding_mode="reflection", align_corners=False)


def build_augment(config: Augment) -> nn.Module:
    steps: list[nn.Module] = []
    if config.horizontal_flip:
        steps.append(RandomFlip(-1))
    if config.vertical_flip:
        steps.append(RandomFlip(-2))
    if config.shift_pixels:
        steps.append(RandomShift(config.shift_pixels))
    return nn.Sequential(*steps)
