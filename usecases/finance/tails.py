"""Each model's own tail, standardised: the α-quantile q and the Expected Shortfall E[Z | Z ≤ q] of its
distribution of standardised returns Z (mean 0, variance 1), at the FRTB's 97.5 % and at 99 %. A day's VaR is
μ + σ·q and its ES μ + σ·es.

Normal (EWMA, GARCH, HAR): es = −φ(z_α)/α. Student-t with ν degrees of freedom (GJR-t), scaled to unit variance by
√((ν − 2)/ν): es = −(ν + t_α²)/(ν − 1) · f_ν(t_α)/α, times that scale (McNeil, Frey and Embrechts 2015, §2.3).
Empirical (the neural model's filtered historical simulation): the mean of the standardised returns at or below
their α-quantile.
"""

from __future__ import annotations

import numpy as np
from scipy.stats import norm, t

ES_LEVELS = (0.025, 0.01)  # tail probabilities: ES at 97.5 % (FRTB) and at 99 %


def es_name(level: float) -> str:
    """97.5 % as es975, 99 % as es99."""
    return f"es{100 * (1 - level):g}".replace(".", "")


def normal_tails() -> list[tuple[float, float]]:
    return [(float(norm.ppf(level)), float(-norm.pdf(norm.ppf(level)) / level)) for level in ES_LEVELS]


def student_t_tails(nu: float) -> list[tuple[float, float]]:
    scale = np.sqrt((nu - 2) / nu)
    tails = []
    for level in ES_LEVELS:
        quantile = t.ppf(level, nu)
        shortfall = -(nu + quantile**2) / (nu - 1) * t.pdf(quantile, nu) / level
        tails.append((float(quantile * scale), float(shortfall * scale)))
    return tails


def empirical_tails(standardised: np.ndarray) -> list[tuple[float, float]]:
    values = np.asarray(standardised, dtype=float)
    tails = []
    for level in ES_LEVELS:
        quantile = float(np.quantile(values, level))
        tails.append((quantile, float(values[values <= quantile].mean())))
    return tails
