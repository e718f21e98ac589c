"""The one-factor GAS model of VaR and ES (Patton, Ziegel and Chen 2019, "Dynamic semiparametric models for expected
shortfall (and Value-at-Risk)", §2.3): the 2.5 % VaR and ES of the next day's return are a·exp(κ) and b·exp(κ),
b < a < 0, with the log scale κ driven by the day's tail event,

    κ(t+1) = β κ(t) + γ (1{y(t) ≤ v(t)} y(t) / (α e(t)) − 1),

which falls by γ each day the VaR holds and jumps after a breach, the more the deeper the loss. Its four parameters
minimise the mean FZ0 loss (`tails.fz0_loss`) at α = 2.5 % on every return before the refit: fully at the first
refit, then from the previous refit's parameters for at most WARM_EVALUATIONS evaluations (21 more days move them
little, and the walk-forward's 96 refits would otherwise cost a minute). The 1 % VaR and ES and the 5 % VaR are the
same factor times constants: those of the returns over their fitted scale y / exp(κ), which minimise FZ0 for a
constant pair. A semiparametric model of the tails alone: it
forecasts no variance.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.optimize import minimize

from .tails import fz0_loss

LEVEL = 0.025
WARM_EVALUATIONS = 20
LOG_SCALE_BOUND = 50.0  # |κ| beyond this (exp overflow) only ever comes of parameters far from the optimum


def log_scale(returns: np.ndarray, params) -> np.ndarray:
    """κ for each day 0 … n (κ(0) = 0): κ(t) scales the forecast of returns[t], made from the returns before it. A
    Python loop over floats: the recursion is nonlinear (a breach depends on κ), and a day costs well under a µs."""
    beta, gamma, a, b = (float(value) for value in params)
    kappa, current = [0.0], 0.0
    for value in returns.tolist():
        scale = math.exp(current)
        jump = value / (LEVEL * b * scale) if value <= a * scale else 0.0
        current = min(max(beta * current + gamma * (jump - 1.0), -LOG_SCALE_BOUND), LOG_SCALE_BOUND)
        kappa.append(current)
    return np.array(kappa)


def mean_fz0(params, returns: np.ndarray) -> float:
    beta, _, a, b = params
    if not (0 <= beta < 1 and b < a < 0):
        return 1e10
    scale = np.exp(log_scale(returns, params)[:-1])
    return float(fz0_loss(returns, a * scale, b * scale, LEVEL).mean())


def fit(returns: np.ndarray, start: np.ndarray | None = None) -> np.ndarray:
    """(β, γ, a, b) minimising the mean FZ0 by Nelder-Mead: from the returns' own 2.5 % quantile and ES and a
    persistent factor at the first refit; at a later one, from `start` in a small simplex (module docstring)."""
    if start is None:
        quantile = float(np.quantile(returns, LEVEL))
        start = np.array([0.95, 0.02, quantile, float(returns[returns <= quantile].mean())])
        options = {"maxiter": 4000, "xatol": 1e-5, "fatol": 1e-7}
    else:
        steps = np.diag(np.maximum(np.abs(start) * 0.01, 1e-3))
        options = {"initial_simplex": np.vstack([start, start + steps]), "maxfev": WARM_EVALUATIONS}
    return minimize(mean_fz0, start, args=(returns,), method="Nelder-Mead", options=options).x
