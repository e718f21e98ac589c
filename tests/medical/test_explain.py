"""Grad-CAM maps: their shape and range, the layer they are taken at, and that they point where the logit looks."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
import torchvision
from torch import nn

from usecases.medical.explain import (
    grad_cam,
    last_conv_layer,
    overlay_figure,
    pick_examples,
)

SIZE = 16


@pytest.fixture(scope="module")
def resnet() -> nn.Module:
    torch.manual_seed(0)
    return torchvision.models.resnet18(num_classes=2)


def test_grad_cam_on_a_resnet_is_an_image_sized_map_in_unit_range(resnet):
    images = torch.randn(3, 3, 64, 64)
    resnet.train()
    with torch.no_grad():
        maps = grad_cam(resnet, images, torch.tensor([0, 1, 1]))
    assert maps.shape == (3, 64, 64)
    assert np.isfinite(maps).all() and maps.min() >= 0 and maps.max() <= 1
    assert resnet.training


def test_the_default_layer_is_the_last_feature_map_even_inside_a_wrapper(resnet):
    example = torch.randn(1, 3, 64, 64)
    assert last_conv_layer(resnet.eval(), example) is resnet.layer4
    assert last_conv_layer(nn.Sequential(nn.Identity(), resnet), example) is resnet.layer4


class HalfImages(nn.Module):
    """Channel 0 keeps the left half of the feature map, channel 1 the right half."""

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        left = torch.zeros_like(features)
        left[..., : features.shape[-1] // 2] = 1
        return torch.cat([features * left, features * (1 - left)], dim=1)


def half_image_cnn() -> nn.Module:
    """Class 1's logit is the mean of the left half of a 2x2-pooled image, class 0's that of the right half."""
    pool = nn.Conv2d(1, 1, kernel_size=2, stride=2, bias=False)
    head = nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        pool.weight.fill_(0.25)
        head.weight.copy_(torch.tensor([[0.0, 1.0], [1.0, 0.0]]))
    return nn.Sequential(nn.Sequential(pool, nn.ReLU(), HalfImages()), nn.AdaptiveAvgPool2d(1), nn.Flatten(), head)


def test_grad_cam_looks_where_the_logit_looks():
    images = torch.rand(4, 1, SIZE, SIZE, generator=torch.Generator().manual_seed(0))
    model = half_image_cnn()
    for target, looked_at in ((1, slice(0, SIZE // 2)), (0, slice(SIZE // 2, SIZE))):
        maps = grad_cam(model, images, target)
        assert maps.shape == (4, SIZE, SIZE)
        assert (maps[..., looked_at].sum(axis=(1, 2)) > 0.9 * maps.sum(axis=(1, 2))).all()


def test_pick_examples_most_confident_first():
    is_positive = np.array([1, 1, 1, 0, 0, 1, 0], bool)
    predicted = np.array([1, 1, 0, 1, 0, 0, 1], bool)
    scores = np.array([0.7, 0.9, 0.2, 0.8, 0.1, 0.4, 0.6])
    picked = pick_examples(is_positive, predicted, scores, 2)
    assert picked["true positives"].tolist() == [1, 0]
    assert picked["false positives"].tolist() == [3, 6]
    assert picked["false negatives"].tolist() == [2, 5]


def test_overlay_figure_draws_grey_and_colour_rows_and_an_empty_group():
    rng = np.random.default_rng(0)
    grey = rng.integers(0, 256, size=(2, SIZE, SIZE, 1), dtype=np.uint8)
    colour = rng.integers(0, 256, size=(1, SIZE, SIZE, 3), dtype=np.uint8)
    figure = overlay_figure({
        "true positives": (grey, rng.random((2, SIZE, SIZE)), ["p = 0.97", "p = 0.91"]),
        "false positives": (grey[:0], np.empty((0, SIZE, SIZE)), []),
        "false negatives": (colour, rng.random((1, SIZE, SIZE)), ["p = 0.03"]),
    })
    figure.savefig(io.BytesIO(), format="png")
    empty_row = figure.subfigs[1]
    assert [text.get_text() for text in empty_row.axes[0].texts] == ["none"]
