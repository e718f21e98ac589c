"""Grad-CAM (Selvaraju et al. 2017) through captum: where in the image the network looked for its decision. A
clinician trusts an AUC more when the heat sits on the lesion rather than on a ruler, a marker or the border."""

from __future__ import annotations

import numpy as np
import torch
from captum.attr import LayerAttribution, LayerGradCam
from matplotlib.figure import Figure
from torch import nn

from common.errors import UserError

HEATMAP_ALPHA = 0.4
EXAMPLE_GROUPS = ("true positives", "false positives", "false negatives")


def last_conv_layer(model: nn.Module, example: torch.Tensor) -> nn.Module:
    """The last module holding a Conv2d to output a feature map: Grad-CAM's usual layer, through any wrapper."""
    finished: list[nn.Module] = []

    def record(module: nn.Module, inputs, output) -> None:
        if isinstance(output, torch.Tensor) and output.dim() == 4:
            finished.append(module)

    holders = [module for module in model.modules() if any(isinstance(m, nn.Conv2d) for m in module.modules())]
    handles = [module.register_forward_hook(record) for module in holders]
    try:
        with torch.no_grad():
            model(example)
    finally:
        for handle in handles:
            handle.remove()
    if not finished:
        raise UserError("Grad-CAM: the model has no 2D convolution that outputs a feature map")
    return finished[-1]


def grad_cam(model: nn.Module, images: torch.Tensor, target: int | torch.Tensor) -> np.ndarray:
    """Grad-CAM maps (N, H, W) in [0, 1] for the `target` class, in fp32 and eval mode whatever the context."""
    was_training = model.training
    model.eval()
    try:
        with torch.enable_grad(), torch.autocast(images.device.type, enabled=False):
            gradcam = LayerGradCam(model, last_conv_layer(model, images[:1]))
            cams = gradcam.attribute(images, target=target, relu_attributions=True)
            cams = LayerAttribution.interpolate(cams.detach().float(), tuple(images.shape[-2:]), "bilinear")
    finally:
        model.train(was_training)
    cams = cams[:, 0].cpu().numpy()
    low = cams.min(axis=(1, 2), keepdims=True)
    span = cams.max(axis=(1, 2), keepdims=True) - low
    return np.divide(cams - low, span, out=np.zeros_like(cams), where=span > 0)


def pick_examples(is_positive: np.ndarray, predicted_positive: np.ndarray, scores: np.ndarray,
                  count: int) -> dict[str, np.ndarray]:
    """Up to `count` true positives, false positives and false negatives each, the most confident first."""
    is_positive, predicted_positive = np.asarray(is_positive, bool), np.asarray(predicted_positive, bool)
    order = np.argsort(-np.asarray(scores), kind="stable")
    groups = (order[(is_positive & predicted_positive)[order]], order[(~is_positive & predicted_positive)[order]],
              order[(is_positive & ~predicted_positive)[order]][::-1])
    return {name: indices[:count] for name, indices in zip(EXAMPLE_GROUPS, groups)}


def overlay_figure(rows: dict[str, tuple[np.ndarray, np.ndarray, list[str]]]) -> Figure:
    """A row per group of uint8 (N, H, W, C) images with their (N, H, W) heatmaps over them, one title per image."""
    columns = max([1] + [len(titles) for _, _, titles in rows.values()])
    figure = Figure(figsize=(2.2 * columns, 2.6 * len(rows)), layout="constrained")
    for subfigure, (group, (images, heatmaps, titles)) in zip(figure.subfigures(len(rows), 1, squeeze=False)[:, 0],
                                                              rows.items()):
        subfigure.suptitle(group)
        axes_row = subfigure.subplots(1, columns, squeeze=False)[0]
        for axes in axes_row:
            axes.set_axis_off()
        if not len(titles):
            axes_row[0].text(0.5, 0.5, "none", ha="center", va="center", transform=axes_row[0].transAxes)
        for axes, image, heatmap, title in zip(axes_row, images, heatmaps, titles):
            if image.shape[-1] == 1:
                axes.imshow(image[..., 0], cmap="gray", vmin=0, vmax=255)
            else:
                axes.imshow(image)
            axes.imshow(heatmap, cmap="jet", alpha=HEATMAP_ALPHA, vmin=0, vmax=1)
            axes.set_title(title, fontsize="small")
    return figure
