"""The one-factor GAS model of VaR and ES (Patton, Ziegel and Chen 2019, "Dynamic semiparametric models for expected
shortfall (and Value-at-Risk)", §2.3): the 2.5 % VaR and ES are a·exp(κ) and b·exp(κ), b < a < 0, with

    κ(t+1) = β κ(t) + γ (1{y(t) ≤ v(t)} y(t) / (α e(t)) − 1),

falling by γ each day the VaR holds and jumping after a breach. The parameters minimise the mean FZ0 loss on every
return before the refit (no warm start: a fit depends on its data alone); between fits κ is filtered forward. The
other levels are constants of the returns over their fitted scale. A model of the tails alone: no variance."""

from __future__ import annotations

import math

import numpy as np
from scipy.optimize import minimize

from .tails import fz0_loss

LEVEL = 0.025
LOG_SCALE_BOUND = 50.0  # |κ| beyond this (exp overflow) only ever comes of parameters far from the optimum


def log_scale(returns: np.ndarray, params, start: float = 0.0) -> np.ndarray:
    """κ for each day 0 … n from κ(0) = `start`: κ(t) scales the forecast of returns[t]. A Python loop over floats:
    the recursion is nonlinear, and a day costs well under a µs."""
    beta, gamma, a, b = (float(value) for value in params)
    kappa, current = [start], start
    for value in returns.tolist():
        scale = math.exp(current)
        jump = value / (LEVEL * b * scale) if value <= a * scale else 0.0
        current = min(max(beta * current + gamma * (jump - 1.0), -LOG_SCALE_BOUND), LOG_SCALE_BOUND)
        kappa.append(current)
    return np.array(kappa)


def mean_fz0(params, returns: np.ndarray) -> float:
    beta, gamma, a, b = params
    if not (0 <= beta < 1 and gamma >= 0 and b < a < 0):  # γ < 0 would lower the scale after a breach
        return 1e10
    scale = np.exp(log_scale(returns, params)[:-1])
    return float(fz0_loss(returns, a * scale, b * scale, LEVEL).mean())


def fit(returns: np.ndarray) -> np.ndarray:
    """(β, γ, a, b) minimising the mean FZ0 by Nelder-Mead, from the returns' own 2.5 % quantile and ES."""
    quantile = float(np.quantile(returns, LEVEL))
    start = np.array([0.95, 0.02, quantile, float(returns[returns <= quantile].mean())])
    options = {"maxiter": 4000, "xatol": 1e-5, "fatol": 1e-7}
    return minimize(mean_fz0, start, args=(returns,), method="Nelder-Mead", options=options).x
