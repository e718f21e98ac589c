"""Slide-level learning from tile features (a bag: one slide's (N_tiles, d_in)): gated attention MIL (Ilse, Tomczak
& Welling 2018), which finds the few tiles a label rests on and shows where it looked, and a mean-pooled baseline, as
good and far cheaper when the signal spreads over the whole slide; attention heatmaps."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from matplotlib.figure import Figure
from scipy.special import expit
from sklearn.linear_model import LogisticRegression
from sklearn.pipeline import Pipeline, make_pipeline
from sklearn.preprocessing import StandardScaler
from torch import nn

from common.config import TrainConfig
from common.errors import UserError
from ..evaluate import auc, bootstrap_auc_ci, rates, threshold_for_sensitivity

Bag = np.ndarray | torch.Tensor
VAL_AUC = "val/auc"
BASELINE_C_VALUES = (0.001, 0.01, 0.1, 1.0, 10.0)


@dataclass(frozen=True)
class MILSettings:
    """Defaults as CLAM trains on one slide per step: small, heavily regularised, since slides are few."""

    hidden: int = 128
    attention_hidden: int = 128
    dropout: float = 0.25
    lr: float = 2e-4
    weight_decay: float = 1e-5
    epochs: int = 40
    max_tiles: int = 4096  # per training step, for memory; evaluation always uses every tile
    checkpoint_dir: Path | None = None  # where the fit writes its checkpoints, to resume from
    checkpoint_every_s: float = 300
    resume: bool = False


@dataclass
class MILHistory:
    """Per epoch: what chose the returned weights, and what shows whether the epochs were enough."""

    train_loss: list[float] = field(default_factory=list)
    val_auc: list[float] = field(default_factory=list)
    best_epoch: int = -1  # the epoch whose weights the returned model has: the highest validation AUC, first if tied


class GatedAttentionMIL(nn.Module):
    """One bag (N, d_in) -> its logit and its attention over tiles (N,), which sums to 1."""

    def __init__(self, d_in: int, hidden: int = 128, attention_hidden: int = 128, dropout: float = 0.25):
        super().__init__()
        self.embed = nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Dropout(dropout))
        self.attention_content = nn.Sequential(nn.Linear(hidden, attention_hidden), nn.Tanh())
        self.attention_gate = nn.Sequential(nn.Linear(hidden, attention_hidden), nn.Sigmoid())
        self.attention_score = nn.Linear(attention_hidden, 1)
        self.classifier = nn.Linear(hidden, 1)

    def forward(self, bag: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tiles = self.embed(bag)
        scores = self.attention_score(self.attention_content(tiles) * self.attention_gate(tiles)).squeeze(-1)
        attention = torch.softmax(scores, dim=0)
        return self.classifier(attention @ tiles).squeeze(-1), attention


def _as_tensors(bags: Sequence[Bag]) -> list[torch.Tensor]:
    """float32 on the CPU: bags move to the device one at a time, so a cohort need not fit in its memory."""
    return [torch.as_tensor(bag, dtype=torch.float32) for bag in bags]


def binary_auc(labels: np.ndarray, probabilities: np.ndarray) -> float:
    """The medical use case's AUC of slide probabilities (softmax of (log(1-p), log p) gives back (1-p, p))."""
    with np.errstate(divide="ignore"):
        logits = np.log(np.stack([1 - probabilities, probabilities], axis=1))
    return auc(np.asarray(labels), logits, "binary")


def _check_labels(labels: Sequence[int], split: str) -> np.ndarray:
    labels = np.asarray(labels)
    if set(np.unique(labels)) != {0, 1}:
        raise UserError(f"slide MIL: the {split} slides need both labels, 0 and 1 (got {sorted(set(labels.tolist()))})")
    return labels


def _predict(model: GatedAttentionMIL, bags: list[torch.Tensor], device: torch.device) -> tuple[np.ndarray, list]:
    model.eval()
    probabilities, attentions = [], []
    with torch.inference_mode():
        for bag in bags:
            logit, attention = model(bag.to(device))
            probabilities.append(expit(float(logit)))  # in float64: float32 sigmoids tie confident slides at 1
            attentions.append(attention.cpu().numpy())
    return np.array(probabilities), attentions


def predict_bags(model: GatedAttentionMIL, bags: Sequence[Bag],
                 device: torch.device | str) -> tuple[np.ndarray, list[np.ndarray]]:
    """Each slide's probability (N_slides,) and its attention over all its tiles (N_tiles,), in evaluation mode."""
    device = torch.device(device)
    return _predict(model.to(device), _as_tensors(bags), device)


class BagBatches:
    """One slide a step in a seeded order each epoch; a seeded sample of `max_tiles` tiles of a larger slide."""

    def __init__(self, bags: list[torch.Tensor], labels: torch.Tensor, max_tiles: int, seed: int):
        self.bags, self.labels, self.max_tiles, self.seed, self.epoch = bags, labels, max_tiles, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.bags)

    def __iter__(self):
        rng = np.random.default_rng([self.seed, self.epoch])
        for index in rng.permutation(len(self.bags)):
            bag = self.bags[index]
            if len(bag) > self.max_tiles:
                bag = bag[np.sort(rng.choice(len(bag), self.max_tiles, replace=False))]
            yield bag[None], self.labels[index:index + 1]


def bag_loss(model: GatedAttentionMIL, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    bag, label = batch
    logit, _ = model(bag[0])
    return nn.functional.binary_cross_entropy_with_logits(logit.reshape(1), label)


bag_loss.predict = lambda model, batch: model(batch[0][0])[0]  # what serving runs, for the workload facts


def fit_attention_mil(train_bags: Sequence[Bag], train_labels: Sequence[int], val_bags: Sequence[Bag],
                      val_labels: Sequence[int], settings: MILSettings, device: torch.device | str,
                      seed: int) -> tuple[GatedAttentionMIL, MILHistory]:
    """One slide per step through the shared Trainer in fp32 on one process; the weights of the epoch with the best
    validation AUC (the first if tied). The same seed gives the same model; the global random state is kept."""
    from common.runtime.devices import Runtime
    from common.training.loop import Trainer
    from common.training.spec import TrainSpec

    device = torch.device(device)
    train_targets = torch.as_tensor(_check_labels(train_labels, "training"), dtype=torch.float32)
    val_labels = _check_labels(val_labels, "validation")
    train, val = _as_tensors(train_bags), _as_tensors(val_bags)

    def validate(model: GatedAttentionMIL) -> dict[str, float]:
        return {VAL_AUC: binary_auc(val_labels, _predict(model, val, device)[0])}

    loop = TrainConfig(epochs=settings.epochs, batch_size=1, lr=settings.lr,
                       checkpoint_every_s=settings.checkpoint_every_s)
    spec = TrainSpec(loop, monitor=VAL_AUC, mode="max", checkpoint_dir=settings.checkpoint_dir, name="attention_mil")
    with torch.random.fork_rng(devices=range(torch.cuda.device_count()) if device.type == "cuda" else []):
        torch.manual_seed(seed)
        model = GatedAttentionMIL(train[0].shape[1], settings.hidden, settings.attention_hidden, settings.dropout)
        optimizer = torch.optim.Adam(model.parameters(), lr=settings.lr, weight_decay=settings.weight_decay)
        trainer = Trainer(model, optimizer, bag_loss, Runtime(device, None), spec)
        result = trainer.fit(BagBatches(train, train_targets, settings.max_tiles, seed), validate,
                             resume=settings.resume)
    history = MILHistory([epoch["train/loss"] for epoch in result.history],
                         [epoch[VAL_AUC] for epoch in result.history], result.best_epoch)
    return trainer.module.eval(), history


def mean_pooled(bags: Sequence[Bag]) -> np.ndarray:
    """(N_slides, d_in): each slide as the mean of its tiles, the baseline's whole view of it."""
    return np.stack([np.asarray(bag, dtype=np.float64).mean(axis=0) for bag in bags])


def fit_pooled_baseline(train_bags: Sequence[Bag], train_labels: Sequence[int], val_bags: Sequence[Bag],
                        val_labels: Sequence[int], c_values: Sequence[float] = BASELINE_C_VALUES) -> Pipeline:
    """Standardised logistic regression on mean-pooled tiles, its C of `c_values` chosen on validation AUC."""
    train_features, train_labels = mean_pooled(train_bags), _check_labels(train_labels, "training")
    val_features, val_labels = mean_pooled(val_bags), _check_labels(val_labels, "validation")
    best_model, best_auc = None, -math.inf
    for c in c_values:
        model = make_pipeline(StandardScaler(), LogisticRegression(C=c, max_iter=2000))
        model.fit(train_features, train_labels)
        val_auc = binary_auc(val_labels, model.predict_proba(val_features)[:, 1])
        if val_auc > best_auc:
            best_model, best_auc = model, val_auc
    return best_model


def pooled_probabilities(model: Pipeline, bags: Sequence[Bag]) -> np.ndarray:
    return model.predict_proba(mean_pooled(bags))[:, 1]


def slide_metrics(val_labels: np.ndarray, val_probabilities: np.ndarray, test_labels: np.ndarray,
                  test_probabilities: np.ndarray, target_sensitivity: float = 0.95, bootstrap: int = 1000,
                  seed: int = 0) -> dict[str, float]:
    """Test AUC with its bootstrap interval, and the rates at the threshold chosen on validation."""
    val_labels, val_probabilities = np.asarray(val_labels), np.asarray(val_probabilities, dtype=np.float64)
    test_labels, test_probabilities = np.asarray(test_labels), np.asarray(test_probabilities, dtype=np.float64)
    threshold = threshold_for_sensitivity(val_labels == 1, val_probabilities, target_sensitivity)
    metrics = {"auc": binary_auc(test_labels, test_probabilities),
               "val_auc": binary_auc(val_labels, val_probabilities), "threshold": threshold}
    if bootstrap:
        two_columns = np.stack([1 - test_probabilities, test_probabilities], axis=1)
        metrics["auc_ci_low"], metrics["auc_ci_high"] = bootstrap_auc_ci(test_labels, two_columns, "binary",
                                                                          bootstrap, seed)
    for rate, value in rates(test_labels == 1, test_probabilities >= threshold).items():
        metrics[f"{rate}_at_threshold"] = value
    return metrics


def attention_heatmap(coords: np.ndarray, attention: np.ndarray, tile_size_level0: int,
                      thumbnail_shape: tuple[int, ...], downsample: float) -> np.ndarray:
    """A grid of `thumbnail_shape[:2]`, each tile's area painted with its attention over the slide's highest."""
    coords, attention = np.asarray(coords, dtype=np.float64), np.asarray(attention, dtype=np.float64)
    height, width = thumbnail_shape[:2]
    heatmap = np.zeros((height, width))
    peak = attention.max(initial=0.0)
    if peak <= 0:
        return heatmap
    starts = np.rint(coords / downsample).astype(int)
    stops = np.maximum(np.rint((coords + tile_size_level0) / downsample).astype(int), starts + 1)
    for index in np.argsort(attention, kind="stable"):  # the highest painted last
        (left, top), (right, bottom) = np.maximum(starts[index], 0), stops[index]
        heatmap[top:bottom, left:right] = attention[index] / peak
    return heatmap


def save_heatmap_png(thumbnail_rgb: np.ndarray, heatmap: np.ndarray, path: str | Path) -> Path:
    """The heatmap over the slide's thumbnail, untiled areas left clear, as a PNG (Agg, no display needed)."""
    path = Path(path)
    heatmap_figure(thumbnail_rgb, heatmap).savefig(path, dpi=100)
    return path


def heatmap_figure(thumbnail_rgb: np.ndarray, heatmap: np.ndarray) -> Figure:
    """The heatmap over the slide's thumbnail, untiled areas left clear."""
    height, width = heatmap.shape
    figure = Figure(figsize=(8, 8 * height / width + 0.6), layout="constrained")
    axes = figure.subplots()
    axes.imshow(thumbnail_rgb)
    overlay = axes.imshow(np.ma.masked_equal(heatmap, 0), cmap="inferno", alpha=0.5, vmin=0, vmax=1)
    figure.colorbar(overlay, ax=axes, label="attention / the slide's highest", shrink=0.8)
    axes.set_axis_off()
    return figure
