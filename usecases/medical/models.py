"""The classifier: a torchvision model behind on-device preprocessing and augmentation, taking uint8 images (or
floats in [0, 1]) as (N, C, H, W), so the data stays uint8 until it is on the device and the logged model takes raw
pixels."""

from __future__ import annotations

import difflib
import warnings
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
import torchvision
from torch import nn

from common.errors import UserError, one_line

if TYPE_CHECKING:  # config imports this module to check model.name
    from .config import Augment

CIFAR_STEM_BELOW = 64
SHAPE_ERRORS = (AssertionError, RuntimeError, ValueError)


def model_names() -> list[str]:
    """What `model.name` accepts: torchvision's registry of classification models (no detection or video)."""
    return torchvision.models.list_models(module=torchvision.models)


def unknown_model_hint(name: str) -> str:
    """The closest names first, as a typo is the usual cause."""
    names = model_names()
    closest = difflib.get_close_matches(name, names, n=4, cutoff=0.6) or ["resnet18", "resnet50", "densenet121",
                                                                         "efficientnet_b0"]
    return (f"'{name}' is not a torchvision classification model; expected one of the {len(names)} names of "
            f"torchvision.models.list_models(module=torchvision.models), such as {', '.join(closest)}")


def _first_conv(model: nn.Module) -> tuple[nn.Module, str, nn.Conv2d]:
    for parent in model.modules():
        for name, child in parent.named_children():
            if isinstance(child, nn.Conv2d):
                return parent, name, child
    raise UserError("model.name: the model has no 2D convolution to take the images")


def build_backbone(name: str, in_channels: int, num_classes: int, cifar_stem: bool) -> nn.Module:
    """A torchvision model from scratch; the CIFAR stem (3x3 stride 1, no max-pool) keeps 28 px images whole."""
    if name not in model_names():
        raise UserError(f"model.name: {unknown_model_hint(name)}")
    model = torchvision.models.get_model(name, weights=None, num_classes=num_classes)
    parent, attribute, conv = _first_conv(model)
    if cifar_stem:
        if not hasattr(model, "maxpool"):
            raise UserError(f"model.cifar_stem: only for the ResNet family, not '{name}'")
        model.maxpool = nn.Identity()
        setattr(parent, attribute, nn.Conv2d(in_channels, conv.out_channels, 3, 1, 1, bias=False))
    elif conv.in_channels != in_channels:
        setattr(parent, attribute, nn.Conv2d(in_channels, conv.out_channels, conv.kernel_size, conv.stride,
                                             conv.padding, bias=conv.bias is not None))
    return model


def check_backbone_fits(name: str, in_channels: int, num_classes: int, cifar_stem: bool, size: int) -> None:
    """A forward pass on the meta device, so a network that cannot take the data's images stops before a run."""
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torchvision's init notices come again when the network is really built
        try:
            backbone = build_backbone(name, in_channels, num_classes, cifar_stem)
        except NotImplementedError:  # built from computed values (the RegNets): checked when it is trained
            return
        try:
            scores = backbone.train()(torch.empty(2, in_channels, size, size))
        except SHAPE_ERRORS as error:
            raise UserError(f"model.name: '{name}' cannot take the data's {size}x{size} images with {in_channels} "
                            f"channel(s) ({one_line(error)}); use larger images (data.files.image_size, "
                            f"data.medmnist.size) or a model for small images such as resnet18") from None
    if not isinstance(scores, torch.Tensor):
        raise UserError(f"model.name: '{name}' returns {type(scores).__name__} in training, not one tensor of class "
                        f"scores; choose another model")


def use_cifar_stem(setting: bool | str, name: str, image_size: int) -> bool:
    if setting == "auto":
        return name.startswith(("resnet", "resnext", "wide_resnet")) and image_size < CIFAR_STEM_BELOW
    return bool(setting)


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
    """Whole batches augmented on the device: per-image transforms in workers starve a GPU on small images."""
    steps: list[nn.Module] = []
    if config.horizontal_flip:
        steps.append(RandomFlip(-1))
    if config.vertical_flip:
        steps.append(RandomFlip(-2))
    if config.shift_pixels:
        steps.append(RandomShift(config.shift_pixels))
    return nn.Sequential(*steps)


class ImageClassifier(nn.Module):
    """Scales pixels to [-1, 1] (the MedMNIST normalisation), augments in training mode, then the backbone."""

    def __init__(self, backbone: nn.Module, augment: nn.Module | None = None, channels_last: bool = False):
        super().__init__()
        self.backbone = backbone
        self.augment = augment if augment is not None else nn.Identity()
        self.channels_last = channels_last
        if channels_last:
            self.backbone.to(memory_format=torch.channels_last)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        pixels = images.float() / 255 if images.dtype == torch.uint8 else images.float()
        pixels = (pixels - 0.5) / 0.5
        if self.training:
            pixels = self.augment(pixels)
        if self.channels_last:
            pixels = pixels.contiguous(memory_format=torch.channels_last)
        return self.backbone(pixels)


def architecture(name: str, in_channels: int, num_classes: int, cifar_stem: bool, channels_last: bool) -> dict:
    """What it takes to rebuild the network for serving, without the training-only augmentation."""
    return {"name": name, "in_channels": in_channels, "num_classes": num_classes, "cifar_stem": cifar_stem,
            "channels_last": channels_last}


def build_classifier(arch: dict, augment: nn.Module | None = None) -> ImageClassifier:
    backbone = build_backbone(arch["name"], arch["in_channels"], arch["num_classes"], arch["cifar_stem"])
    return ImageClassifier(backbone, augment, arch["channels_last"])
