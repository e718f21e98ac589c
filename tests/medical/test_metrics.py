"""The clinical metrics against hand-computed values and against MedMNIST's own evaluator."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
from medmnist.evaluator import getACC, getAUC
from scipy.stats import rankdata

from common.errors import UserError
from usecases.medical import evaluate
from usecases.medical.config import Evaluation
from usecases.medical.evaluate import (
    MEDMNIST_TASKS,
    acc,
    auc,
    bootstrap_auc_ci,
    brier,
    evaluate_model,
    expected_calibration_error,
    fit_temperature,
    metric_safe,
    nll,
    probabilities,
    rates,
    reliability_figure,
    resampled_auc,
    roc_pr_figure,
    threshold_for_sensitivity,
)

TASKS = ("binary", "multi-class", "multi-label")
CLASSES = {"binary": ["malignant", "normal, benign"], "multi-class": ["a", "b (c)", "d"],
           "multi-label": ["edema", "mass", "nodule", "effusion"]}


def scored(task: str, count: int, seed: int, strength: float = 1.5) -> tuple[np.ndarray, np.ndarray]:
    """Logits that carry some signal about the labels, (N, C), with int labels (N,) or 0/1 labels (N, L)."""
    rng = np.random.default_rng(seed)
    width = len(CLASSES[task])
    if task == "multi-label":
        labels = rng.integers(0, 2, size=(count, width))
        return strength * (2 * labels - 1) + rng.normal(size=(count, width)), labels
    labels = rng.integers(0, width, size=count)
    return strength * np.eye(width)[labels] + rng.normal(size=(count, width)), labels


def test_threshold_is_the_score_of_the_positive_that_meets_the_target():
    positives = np.linspace(0.1, 1.0, 10)
    negatives = np.array([0.05, 0.25, 0.35, 0.95])
    is_positive = np.r_[np.ones(10, bool), np.zeros(4, bool)]
    scores = np.r_[positives, negatives]
    assert threshold_for_sensitivity(is_positive, scores, 0.8) == pytest.approx(0.3)  # the 8th-highest positive
    assert threshold_for_sensitivity(is_positive, scores, 0.7) == pytest.approx(0.4)  # 0.7 * 10 is 7.000...1
    assert threshold_for_sensitivity(is_positive, scores, 0.75) == pytest.approx(0.3)
    assert threshold_for_sensitivity(is_positive, scores, 1.0) == pytest.approx(0.1)


def test_threshold_with_tied_scores_keeps_the_tie_together():
    is_positive = np.array([1, 1, 1, 1, 1, 0, 0], bool)
    scores = np.array([0.9, 0.8, 0.8, 0.8, 0.5, 0.8, 0.1])
    assert threshold_for_sensitivity(is_positive, scores, 0.4) == 0.8  # meets 0.4 with sensitivity 0.8
    assert threshold_for_sensitivity(is_positive, scores, 0.2) == 0.9
    assert threshold_for_sensitivity(is_positive, scores, 0.85) == 0.5


def test_threshold_needs_positives():
    with pytest.raises(UserError, match="no positive"):
        threshold_for_sensitivity(np.zeros(3, bool), np.array([0.1, 0.2, 0.3]), 0.9)


def test_rates_from_a_hand_made_confusion_matrix():
    # tp 3, fn 1, fp 2, tn 4
    is_positive = np.array([1, 1, 1, 1, 0, 0, 0, 0, 0, 0], bool)
    predicted = np.array([1, 1, 1, 0, 1, 1, 0, 0, 0, 0], bool)
    assert rates(is_positive, predicted) == pytest.approx(
        {"sensitivity": 0.75, "specificity": 4 / 6, "ppv": 3 / 5, "npv": 4 / 5})


def test_a_rate_with_nothing_to_count_is_nan():
    result = rates(np.array([1, 0, 0], bool), np.zeros(3, bool))
    assert result["sensitivity"] == 0 and result["specificity"] == 1 and result["npv"] == 2 / 3
    assert math.isnan(result["ppv"])


def binary_probs(positive: list[float]) -> np.ndarray:
    positive = np.asarray(positive)
    return np.stack([1 - positive, positive], axis=1)


def test_ece_by_hand_with_equal_mass_bins():
    # confidences 0.9 0.8 0.7 0.6, right wrong right wrong: bins {0.6, 0.7} gap 0.15 and {0.8, 0.9} gap 0.35
    probs = binary_probs([0.9, 0.8, 0.3, 0.4])
    assert expected_calibration_error(np.array([1, 0, 0, 1]), probs, "binary", 2) == pytest.approx(0.25)
    # five images in two bins of 3 and 2: 3/5 * |2/3 - 0.61667| + 2/5 * |1/2 - 0.85|
    probs = binary_probs([0.9, 0.8, 0.3, 0.4, 0.55])
    assert expected_calibration_error(np.array([1, 0, 0, 1, 1]), probs, "binary", 2) == pytest.approx(0.17)


def test_ece_by_hand_multi_class_and_multi_label():
    probs = np.array([[0.6, 0.3, 0.1], [0.2, 0.5, 0.3]])
    assert expected_calibration_error(np.array([0, 2]), probs, "multi-class", 1) == pytest.approx(0.05)
    # label 0: confidences 0.9 and 0.7, both right: 0.2; label 1: 0.8 and 0.6, both right: 0.3
    labels, probs = np.array([[1, 0], [0, 0]]), np.array([[0.9, 0.2], [0.3, 0.4]])
    assert expected_calibration_error(labels, probs, "multi-label", 1) == pytest.approx(0.25)


def test_brier_by_hand():
    assert brier(np.array([1, 1]), binary_probs([0.8, 0.4]), "binary") == pytest.approx((0.04 + 0.36) / 2)
    probs = np.array([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8]])
    assert brier(np.array([0, 1]), probs, "multi-class") == pytest.approx((0.14 + 1.46) / 2)
    labels, probs = np.array([[1, 0], [0, 0]]), np.array([[0.9, 0.2], [0.3, 0.4]])
    assert brier(labels, probs, "multi-label") == pytest.approx((0.05 + 0.1) / 2)


@pytest.mark.parametrize("task", TASKS)
def test_temperature_scaling_tames_overconfident_logits(task):
    rng = np.random.default_rng(0)
    true_logits = rng.normal(scale=1.5, size=(2000, len(CLASSES[task])))
    probs = probabilities(true_logits, task)
    if task == "multi-label":
        labels = (rng.random(probs.shape) < probs).astype(int)
    else:
        drawn = (rng.random((len(probs), 1)) > probs.cumsum(axis=1)).sum(axis=1)
        labels = np.minimum(drawn, probs.shape[1] - 1)
    overconfident = 5 * true_logits
    temperature = fit_temperature(overconfident, labels, task)
    assert 3.5 < temperature < 7
    assert nll(overconfident, labels, task, temperature) < nll(overconfident, labels, task)
    assert (expected_calibration_error(labels, probabilities(overconfident, task, temperature), task, 15)
            < expected_calibration_error(labels, probabilities(overconfident, task), task, 15) / 2)


@pytest.mark.parametrize("task", TASKS)
def test_auc_and_acc_are_medmnists(task):
    logits, labels = scored(task, 300, seed=1, strength=0.5)
    probs = probabilities(logits, task)
    assert auc(labels, logits, task) == pytest.approx(getAUC(labels, probs, MEDMNIST_TASKS[task]))
    assert acc(labels, logits, task) == pytest.approx(getACC(labels, probs, MEDMNIST_TASKS[task]))
    assert 0.5 < auc(labels, logits, task) < 1


@pytest.mark.parametrize("task", TASKS)
def test_vectorised_auc_equals_medmnists_with_ties(task):
    logits, labels = scored(task, 200, seed=2, strength=0.5)
    probs = np.round(probabilities(logits, task), 1)
    expected = getAUC(labels, probs, MEDMNIST_TASKS[task])
    assert resampled_auc(labels, probs, task, np.arange(len(labels))[None])[0] == pytest.approx(expected)


def test_vectorised_auc_is_nan_when_a_resample_misses_a_class():
    labels, probs = np.array([0, 0, 1]), binary_probs([0.1, 0.2, 0.9])
    assert np.isnan(resampled_auc(labels, probs, "binary", np.array([[0, 1, 0]]))[0])


def ci_width(count: int) -> tuple[float, float, float]:
    logits, labels = scored("binary", count, seed=3, strength=1.0)
    probs = probabilities(logits, "binary")
    low, high = bootstrap_auc_ci(labels, probs, "binary", 500, seed=0)
    return low, getAUC(labels, probs, "binary-class"), high


def test_bootstrap_interval_brackets_the_auc_and_narrows_with_more_images():
    small_low, small_auc, small_high = ci_width(100)
    large_low, large_auc, large_high = ci_width(1600)
    assert small_low < small_auc < small_high and large_low < large_auc < large_high
    assert large_high - large_low < (small_high - small_low) / 2


def test_bootstrap_ranks_every_resample_at_once_in_bounded_chunks_and_is_reproducible(monkeypatch):
    """Vectorised: a thousand resamples of 150 images are one ranking per class of a (1000, 150) array, not a thousand
    AUC calls (seconds); a test set too large for that is ranked in chunks of BOOTSTRAP_CHUNK_ELEMENTS scores, to the
    same interval."""
    logits, labels = scored("multi-class", 150, seed=4)
    probs = probabilities(logits, "multi-class")
    ranked = []

    def counting_rankdata(values, *args, **kwargs):
        ranked.append(np.shape(values))
        return rankdata(values, *args, **kwargs)

    monkeypatch.setattr(evaluate, "rankdata", counting_rankdata)
    classes = len(CLASSES["multi-class"])
    interval = bootstrap_auc_ci(labels, probs, "multi-class", 1000, seed=7)
    assert ranked == [(1000, 150)] * classes
    assert interval == bootstrap_auc_ci(labels, probs, "multi-class", 1000, seed=7)
    ranked.clear()
    monkeypatch.setattr(evaluate, "BOOTSTRAP_CHUNK_ELEMENTS", 400 * 150)
    assert bootstrap_auc_ci(labels, probs, "multi-class", 1000, seed=7) == interval
    assert ranked == [(400, 150)] * classes * 2 + [(200, 150)] * classes
    assert all(math.isnan(bound) for bound in bootstrap_auc_ci(labels, probs, "multi-class", 0, seed=7))


def test_metric_safe_names():
    assert metric_safe("normal, benign") == "normal_ benign"
    assert metric_safe("Pleural_Thickening-left: 2.5/x") == "Pleural_Thickening-left: 2.5/x"
    assert metric_safe("b (c)") == "b _c_"


REQUIRED = ("auc", "val_auc", "acc", "auc_ci_low", "auc_ci_high", "ece", "brier", "ece_calibrated", "brier_calibrated",
            "temperature", "threshold", "sensitivity_at_threshold", "specificity_at_threshold", "ppv_at_threshold",
            "npv_at_threshold", "test_images")


@pytest.mark.parametrize("task", TASKS)
def test_evaluate_model_reports_every_metric(task):
    val_logits, val_labels = scored(task, 200, seed=5)
    test_logits, test_labels = scored(task, 300, seed=6)
    config = Evaluation(positive_class=1, target_sensitivity=0.9, bootstrap=200)
    metrics, details = evaluate_model(val_logits, val_labels, test_logits, test_labels, task, CLASSES[task], config,
                                      seed=0)
    per_class = [f"{rate}/{metric_safe(name)}" for name in CLASSES[task]
                 for rate in ("sensitivity", "specificity", "ppv", "npv")]
    assert set(metrics) == set(REQUIRED) | set(per_class)
    assert all(math.isfinite(value) for value in metrics.values())
    assert metrics["auc_ci_low"] < metrics["auc"] < metrics["auc_ci_high"] and metrics["test_images"] == 300
    assert metrics["sensitivity_at_threshold"] > 0.75
    assert metrics["auc"] == pytest.approx(auc(test_labels, test_logits, task))
    assert metrics["val_auc"] == pytest.approx(auc(val_labels, val_logits, task))
    assert details.threshold == metrics["threshold"] and details.positive_class == 1
    for figure in (roc_pr_figure(details), reliability_figure(details)):
        figure.savefig(io.BytesIO(), format="png")


def test_evaluate_model_without_bootstrap_leaves_out_the_interval():
    logits, labels = scored("binary", 100, seed=8)
    metrics, _ = evaluate_model(logits, labels, logits, labels, "binary", CLASSES["binary"], Evaluation(bootstrap=0),
                                seed=0)
    assert "auc_ci_low" not in metrics and "auc" in metrics


def test_positive_class_out_of_range_is_a_user_error():
    logits, labels = scored("binary", 50, seed=9)
    with pytest.raises(UserError, match=r"evaluation.positive_class: 3 is not a class index "
                                        r"\(classes: 0 'malignant', 1 'normal, benign'\)"):
        evaluate_model(logits, labels, logits, labels, "binary", CLASSES["binary"], Evaluation(positive_class=3),
                       seed=0)
