"""The classifier's stem, input handling and on-device augmentation."""

import pytest
import torch

from common.errors import UserError
from usecases.medical.config import Augment
from usecases.medical.models import (ImageClassifier, RandomFlip, RandomShift, build_augment, build_backbone,
                                     use_cifar_stem)


def test_cifar_stem_keeps_28px_resolution_into_the_first_block():
    model = build_backbone("resnet18", 1, 2, cifar_stem=True)
    assert model.conv1.kernel_size == (3, 3) and model.conv1.stride == (1, 1) and model.conv1.in_channels == 1
    assert isinstance(model.maxpool, torch.nn.Identity)
    features = model.layer1(model.relu(model.bn1(model.conv1(torch.zeros(1, 1, 28, 28)))))
    assert features.shape[-1] == 28


def test_imagenet_stem_takes_any_channel_count():
    model = build_backbone("resnet18", 3, 5, cifar_stem=False)
    assert model.conv1.kernel_size == (7, 7) and model(torch.zeros(2, 3, 64, 64)).shape == (2, 5)
    other = build_backbone("densenet121", 1, 3, cifar_stem=False)
    assert other(torch.zeros(2, 1, 32, 32)).shape == (2, 3)


def test_stem_choice_and_bad_names():
    assert use_cifar_stem("auto", "resnet18", 28) and not use_cifar_stem("auto", "resnet18", 224)
    assert not use_cifar_stem("auto", "densenet121", 28)
    with pytest.raises(UserError, match="'resnet19' is not a torchvision classification model"):
        build_backbone("resnet19", 1, 2, cifar_stem=False)
    with pytest.raises(UserError, match="only for the ResNet family"):
        build_backbone("densenet121", 1, 2, cifar_stem=True)


def test_uint8_and_float_pixels_give_the_same_logits():
    torch.manual_seed(0)
    model = ImageClassifier(build_backbone("resnet18", 1, 2, cifar_stem=True), channels_last=True).eval()
    pixels = torch.randint(0, 256, (3, 1, 28, 28), dtype=torch.uint8)
    with torch.no_grad():
        assert torch.allclose(model(pixels), model(pixels.float() / 255), atol=1e-5)


def test_augmentation_only_in_training_mode():
    augment = build_augment(Augment(horizontal_flip=True, vertical_flip=True, shift_pixels=2))
    assert len(augment) == 3
    images = torch.rand(16, 1, 8, 8)
    augment.eval()
    assert torch.equal(augment(images), images)
    augment.train()
    assert not torch.equal(augment(images), images)


def test_flip_flips_whole_images_and_shift_moves_content():
    torch.manual_seed(1)
    images = torch.arange(64, dtype=torch.float32).reshape(1, 1, 8, 8).repeat(200, 1, 1, 1)
    flipped = RandomFlip(-1, p=0.5).train()(images)
    is_flipped = (flipped == images.flip(-1)).flatten(1).all(1)
    is_same = (flipped == images).flatten(1).all(1)
    assert (is_flipped | is_same).all() and 60 < is_flipped.sum() < 140
    shifted = RandomShift(2).train()(images)
    assert shifted.shape == images.shape
    assert set(shifted.flatten().tolist()) <= set(range(64))  # nearest sampling: pixels moved, not blended
    assert not torch.equal(shifted, images)
