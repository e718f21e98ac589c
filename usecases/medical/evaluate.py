"""The clinical evaluation of an image classifier on its test split: MedMNIST's own AUC and accuracy (comparable with
the published benchmarks), and what AUC hides: the rates at a threshold chosen on validation for a target
sensitivity, calibration (adaptive ECE, Brier, before and after temperature scaling) and a bootstrap AUC interval.
Logits (N, C) become probabilities by softmax, or by sigmoid per label for a multi-label task."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from matplotlib.figure import Figure
from medmnist.evaluator import getACC, getAUC
from scipy.optimize import minimize_scalar
from scipy.special import expit, softmax
from scipy.stats import rankdata
from sklearn.calibration import CalibrationDisplay
from sklearn.metrics import PrecisionRecallDisplay, RocCurveDisplay, brier_score_loss, confusion_matrix, roc_curve

from common.errors import UserError
from .config import Evaluation
from .images import Task

MEDMNIST_TASKS = {"binary": "binary-class", "multi-class": "multi-class", "multi-label": "multi-label, binary-class"}
LOG_TEMPERATURE_BOUNDS = (math.log(0.05), math.log(20.0))
BOOTSTRAP_CHUNK_ELEMENTS = 1 << 22  # resampled scores ranked at once: bounds memory on test sets of 20k images
LABEL_THRESHOLD = 0.5
POSITIVE_NAMES = {"malignant", "pneumonia", "abnormal", "tumor", "tumour", "positive", "disease", "1"}  # casefolded


def probabilities(logits: np.ndarray, task: Task, temperature: float = 1.0) -> np.ndarray:
    scaled = np.asarray(logits, dtype=np.float64) / temperature
    return expit(scaled) if task == "multi-label" else softmax(scaled, axis=1)


def auc(labels: np.ndarray, logits: np.ndarray, task: Task) -> float:
    """MedMNIST's AUC: of the positive (last) column for binary tasks, the mean one-vs-rest or per-label AUC else."""
    return float(getAUC(labels, probabilities(logits, task), MEDMNIST_TASKS[task]))


def acc(labels: np.ndarray, logits: np.ndarray, task: Task) -> float:
    """MedMNIST's accuracy: at probability 0.5 for binary tasks and each label, of the argmax for multi-class."""
    return float(getACC(labels, probabilities(logits, task), MEDMNIST_TASKS[task]))


def one_vs_rest(labels: np.ndarray, probs: np.ndarray, task: Task) -> np.ndarray:
    """(N, K) boolean targets per class (per label), the columns of `probs` per-class metrics are taken on."""
    if task == "multi-label":
        return np.asarray(labels).astype(bool)
    return np.asarray(labels)[:, None] == np.arange(probs.shape[1])


def threshold_for_sensitivity(is_positive: np.ndarray, score: np.ndarray, target: float) -> float:
    """The highest (most specific) t at which `score >= t` finds at least `target` of the positives."""
    if not np.any(is_positive):
        raise UserError("evaluation: no positive images to choose the operating threshold on")
    _, sensitivity, thresholds = roc_curve(is_positive, score, drop_intermediate=False)
    return float(thresholds[np.argmax(sensitivity >= target)])


def _ratio(numerator: int, denominator: int) -> float:
    return float(numerator / denominator) if denominator else math.nan


def rates(is_positive: np.ndarray, predicted_positive: np.ndarray) -> dict[str, float]:
    """Sensitivity, specificity, PPV and NPV; a rate with nothing to count (0/0) is NaN."""
    tn, fp, fn, tp = confusion_matrix(is_positive, predicted_positive, labels=[False, True]).ravel()
    return {"sensitivity": _ratio(tp, tp + fn), "specificity": _ratio(tn, tn + fp),
            "ppv": _ratio(tp, tp + fp), "npv": _ratio(tn, tn + fn)}


def metric_safe(name: str) -> str:
    """A class name as MLflow accepts it in a metric name: 'normal, benign' -> 'normal_ benign'."""
    return re.sub(r"[^\w\-. :/]", "_", name)


def class_rates(labels: np.ndarray, probs: np.ndarray, task: Task, classes: list[str]) -> dict[str, float]:
    """`<rate>/<class>` for every class one-vs-rest at the argmax prediction, or every label at 0.5."""
    targets, decisions = one_vs_rest(labels, probs, task), probs > LABEL_THRESHOLD
    if task != "multi-label":  # the argmax class, as MedMNIST's accuracy decides
        decisions = probs.argmax(axis=1)[:, None] == np.arange(probs.shape[1])
    return {f"{rate}/{metric_safe(name)}": value for index, name in enumerate(classes)
            for rate, value in rates(targets[:, index], decisions[:, index]).items()}


def _top_label(labels: np.ndarray, probs: np.ndarray, task: Task) -> tuple[np.ndarray, np.ndarray]:
    """Confidence in the decision taken and whether it was right: of the argmax (N,), or per label (N, L)."""
    if task == "multi-label":
        decisions = probs > LABEL_THRESHOLD
        return np.where(decisions, probs, 1 - probs), decisions == np.asarray(labels).astype(bool)
    return probs.max(axis=1), probs.argmax(axis=1) == np.asarray(labels)


def _adaptive_ece(confidence: np.ndarray, correct: np.ndarray, bins: int) -> float:
    """Equal-mass bins: equal-width bins leave most bins empty when a model is confident, as medical models are."""
    order = np.argsort(confidence, kind="stable")
    return float(sum(len(members) * abs(correct[members].mean() - confidence[members].mean())
                     for members in np.array_split(order, bins) if len(members)) / len(confidence))


def expected_calibration_error(labels: np.ndarray, probs: np.ndarray, task: Task, bins: int) -> float:
    """ECE of the top-label confidence in equal-mass bins (the mean over labels for multi-label tasks)."""
    confidence, correct = _top_label(labels, probs, task)
    if task == "multi-label":
        return float(np.mean([_adaptive_ece(confidence[:, label], correct[:, label], bins)
                              for label in range(confidence.shape[1])]))
    return _adaptive_ece(confidence, correct, bins)


def brier(labels: np.ndarray, probs: np.ndarray, task: Task) -> float:
    """Binary: of the positive class; multi-class: the original score, in [0, 2]; multi-label: the labels' mean."""
    labels = np.asarray(labels)
    if task == "binary":
        return float(brier_score_loss(labels, probs[:, 1], pos_label=1))
    if task == "multi-class":
        return float(brier_score_loss(labels, probs, labels=np.arange(probs.shape[1])))
    return float(np.mean([brier_score_loss(labels[:, label], probs[:, label], pos_label=1)
                          for label in range(probs.shape[1])]))


def nll(logits: np.ndarray, labels: np.ndarray, task: Task, temperature: float = 1.0) -> float:
    """Mean negative log-likelihood: cross-entropy, or binary cross-entropy averaged over labels."""
    scaled = torch.as_tensor(np.asarray(logits), dtype=torch.float64) / temperature
    targets = torch.as_tensor(np.asarray(labels))
    if task == "multi-label":
        return F.binary_cross_entropy_with_logits(scaled, targets.double()).item()
    return F.cross_entropy(scaled, targets.long()).item()


def fit_temperature(logits: np.ndarray, labels: np.ndarray, task: Task) -> float:
    """Temperature scaling (Guo et al. 2017): the T dividing the logits that minimises the validation NLL."""
    result = minimize_scalar(lambda log_t: nll(logits, labels, task, math.exp(log_t)),
                             bounds=LOG_TEMPERATURE_BOUNDS, method="bounded")
    return math.exp(result.x)


def resampled_auc(labels: np.ndarray, probs: np.ndarray, task: Task, indices: np.ndarray) -> np.ndarray:
    """MedMNIST's AUC on each row of `indices` at once (NaN where a class is missing), by Mann-Whitney mid-ranks."""
    targets, scores = one_vs_rest(labels, probs, task), probs
    if task == "binary":
        targets, scores = targets[:, -1:], scores[:, -1:]
    per_column = []
    for column in range(scores.shape[1]):
        positive = targets[indices, column]
        ranks = rankdata(scores[indices, column], axis=1)
        n_positive = positive.sum(axis=1)
        n_negative = positive.shape[1] - n_positive
        with np.errstate(divide="ignore", invalid="ignore"):
            per_column.append(((ranks * positive).sum(axis=1) - n_positive * (n_positive + 1) / 2)
                              / (n_positive * n_negative))
    return np.mean(per_column, axis=0)


def bootstrap_auc_ci(labels: np.ndarray, probs: np.ndarray, task: Task, resamples: int, seed: int,
                     level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of the AUC over test images; resamples missing a class are skipped."""
    rng = np.random.default_rng(seed)
    count = len(labels)
    per_chunk = max(1, BOOTSTRAP_CHUNK_ELEMENTS // count)
    aucs = np.concatenate([np.empty(0)] + [
        resampled_auc(labels, probs, task, rng.integers(0, count, size=(min(per_chunk, resamples - start), count)))
        for start in range(0, resamples, per_chunk)])
    aucs = aucs[~np.isnan(aucs)]
    if not len(aucs):
        return math.nan, math.nan
    low, high = np.percentile(aucs, [50 * (1 - level), 50 * (1 + level)])
    return float(low), float(high)


@dataclass
class EvaluationDetails:
    """What the figures and the Grad-CAM examples need beside the metrics; all on the test split."""

    task: Task
    classes: list[str]
    labels: np.ndarray
    probabilities: np.ndarray
    calibrated: np.ndarray
    temperature: float
    positive_class: int
    threshold: float
    target_sensitivity: float
    bins: int

    @property
    def is_positive(self) -> np.ndarray:
        return one_vs_rest(self.labels, self.probabilities, self.task)[:, self.positive_class]

    @property
    def score(self) -> np.ndarray:
        """The probability of the positive class: what the threshold applies to."""
        return self.probabilities[:, self.positive_class]

    @property
    def predicted_positive(self) -> np.ndarray:
        return self.score >= self.threshold


def conventional_positive(classes: list[str]) -> int | None:
    """The one class named as clinicians name a finding (malignant, pneumonia, ...; any case), else None."""
    named = [index for index, name in enumerate(classes) if name.strip().casefold() in POSITIVE_NAMES]
    return named[0] if len(named) == 1 else None


def positive_class_index(setting: int | str | None, classes: list[str], task: Task, own_data: bool = False) -> int:
    """`evaluation.positive_class` as a class index; unset, the class with a conventional positive name, else class
    1, except on your own binary data, where a wrong guess would silently report the healthy class."""
    listed = ", ".join(f"{index} '{name}'" for index, name in enumerate(classes))
    if isinstance(setting, int):
        if setting >= len(classes):
            raise UserError(f"evaluation.positive_class: {setting} is not a class index (classes: {listed})")
        return setting
    if isinstance(setting, str):
        if setting in classes:
            return classes.index(setting)
        matches = [index for index, name in enumerate(classes) if name.casefold() == setting.strip().casefold()]
        if len(matches) == 1:
            return matches[0]
        raise UserError(f"evaluation.positive_class: '{setting}' is not a class name nor index (classes: {listed})")
    named = conventional_positive(classes)
    if named is not None:
        return named
    if own_data and task == "binary":
        raise UserError(f"evaluation.positive_class: cannot tell which of {listed} is the positive class (the one "
                        f"the threshold and sensitivity are for); name it with --set evaluation.positive_class=NAME")
    return 1


def evaluate_model(val_logits: np.ndarray, val_labels: np.ndarray, test_logits: np.ndarray, test_labels: np.ndarray,
                   task: Task, classes: list[str], config: Evaluation,
                   seed: int) -> tuple[dict[str, float], EvaluationDetails]:
    """The test metrics (and `val_auc`), flat for MLflow; the threshold and temperature fitted on validation."""
    positive = positive_class_index(config.positive_class, classes, task)
    val_probs, test_probs = probabilities(val_logits, task), probabilities(test_logits, task)
    temperature = fit_temperature(val_logits, val_labels, task)
    calibrated = probabilities(test_logits, task, temperature)
    threshold = threshold_for_sensitivity(one_vs_rest(val_labels, val_probs, task)[:, positive],
                                          val_probs[:, positive], config.target_sensitivity)
    details = EvaluationDetails(task, list(classes), np.asarray(test_labels), test_probs, calibrated, temperature,
                                positive, threshold, config.target_sensitivity, config.calibration_bins)
    metrics = {
        "auc": auc(test_labels, test_logits, task),
        "val_auc": auc(val_labels, val_logits, task),  # what the registry compares versions by, not the test value
        "acc": acc(test_labels, test_logits, task),
        "ece": expected_calibration_error(test_labels, test_probs, task, config.calibration_bins),
        "brier": brier(test_labels, test_probs, task),
        "ece_calibrated": expected_calibration_error(test_labels, calibrated, task, config.calibration_bins),
        "brier_calibrated": brier(test_labels, calibrated, task), "temperature": temperature, "threshold": threshold,
        "test_images": float(len(test_labels))}
    if config.bootstrap:
        metrics["auc_ci_low"], metrics["auc_ci_high"] = bootstrap_auc_ci(test_labels, test_probs, task,
                                                                          config.bootstrap, seed)
    for rate, value in rates(details.is_positive, details.predicted_positive).items():
        metrics[f"{rate}_at_threshold"] = value
    metrics.update(class_rates(test_labels, test_probs, task, classes))
    return metrics, details


def roc_pr_figure(details: EvaluationDetails) -> Figure:
    """ROC and precision-recall curves one-vs-rest, with the operating point of the positive class marked."""
    figure = Figure(figsize=(11, 5), layout="constrained")
    roc_axes, pr_axes = figure.subplots(1, 2)
    targets, scores = one_vs_rest(details.labels, details.probabilities, details.task), details.probabilities
    curves = [index for index in range(targets.shape[1]) if 0 < targets[:, index].sum() < len(targets)]
    if details.task == "binary":  # the positive class alone; else every class with both outcomes in the test split
        curves = [details.positive_class]
    for index in curves:
        name = details.classes[index]
        RocCurveDisplay.from_predictions(targets[:, index], scores[:, index], name=name, ax=roc_axes)
        PrecisionRecallDisplay.from_predictions(targets[:, index], scores[:, index], name=name, ax=pr_axes)
    operating = rates(details.is_positive, details.predicted_positive)
    label = (f"threshold {details.threshold:.3g} on {details.classes[details.positive_class]} "
             f"(target sensitivity {details.target_sensitivity:g} on validation)")
    roc_axes.plot(1 - operating["specificity"], operating["sensitivity"], "k*", markersize=14, label=label)
    pr_axes.plot(operating["sensitivity"], operating["ppv"], "k*", markersize=14, label=label)
    roc_axes.plot([0, 1], [0, 1], ":", color="grey")
    roc_axes.set(title="ROC (test)", xlabel="1 - specificity", ylabel="sensitivity")
    pr_axes.set(title="precision-recall (test)", xlabel="sensitivity (recall)", ylabel="PPV (precision)")
    for axes in (roc_axes, pr_axes):
        axes.legend(fontsize="small", loc="lower right" if axes is roc_axes else "lower left")
    return figure


def reliability_figure(details: EvaluationDetails) -> Figure:
    """Accuracy against top-label confidence in equal-mass bins, before and after temperature scaling."""
    figure = Figure(figsize=(5.5, 5), layout="constrained")
    axes = figure.subplots()
    for name, probs, reference_line in (("uncalibrated", details.probabilities, True),
                                        (f"temperature {details.temperature:.2f}", details.calibrated, False)):
        confidence, correct = _top_label(details.labels, probs, details.task)
        ece = expected_calibration_error(details.labels, probs, details.task, details.bins)
        CalibrationDisplay.from_predictions(correct.ravel().astype(int), confidence.ravel(), n_bins=details.bins,
                                            strategy="quantile", pos_label=1, name=f"{name} (ECE {ece:.3f})",
                                            ax=axes, ref_line=reference_line)
    axes.set_xlabel("confidence in the decision")
    axes.set_ylabel("fraction correct")
    axes.set_title("reliability (test)")
    axes.legend(fontsize="small", loc="upper left")
    return figure
