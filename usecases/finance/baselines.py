"""The field's standard volatility forecasts, refit on an expanding window at every block start. Each takes one
ticker's features (origins in date order), the blocks of test origins as (first, last) positions and the horizon H,
and gives a row per origin: `variance`, `variance_h` (the next H days' sum), `mu` and the standardised tails."""

from __future__ import annotations

import signal
import threading
import warnings

import numpy as np
import pandas as pd
from arch import arch_model
from arch.utility.exceptions import StartingValueWarning
from scipy.stats import norm
from sklearn.linear_model import LinearRegression
from threadpoolctl import threadpool_limits

from common.runtime.interrupt import stop_point
from . import gas
from .tails import VAR_LEVELS, empirical_tails, evt_columns, normal_tails, student_t_tails, tail_columns

HAR_INPUTS = ["rv_d", "rv_w", "rv_m"]
MIN_VARIANCE = 1e-6

Blocks = list[tuple[int, int]]
ONE_BLAS_THREAD = threading.Lock()  # held while this process's BLAS is limited to one thread


def forecast_frame(frame: pd.DataFrame, positions: np.ndarray, variance, variance_h, mu,
                   tails: dict[str, float]) -> pd.DataFrame:
    """One row per origin in `positions`: the variances, the mean return and the `tail_columns`."""
    out = pd.DataFrame(index=frame.index[positions])
    out["variance"] = np.maximum(np.asarray(variance, dtype=float), MIN_VARIANCE)
    out["variance_h"] = np.maximum(np.asarray(variance_h, dtype=float), MIN_VARIANCE)
    out["mu"] = mu
    return out.assign(**tails)


def ewma(frame: pd.DataFrame, blocks: Blocks, horizon: int, lam: float = 0.94) -> pd.DataFrame:
    """RiskMetrics: σ²(t+1) = λ σ²(t) + (1 − λ) r(t)², flat over the horizon, zero mean, normal quantiles."""
    variance = frame["sq_ret"].ewm(alpha=1 - lam, adjust=False).mean().to_numpy()
    positions = np.concatenate([np.arange(first, last + 1) for first, last in blocks])
    return forecast_frame(frame, positions, variance[positions], horizon * variance[positions], 0.0,
                          tail_columns(norm.ppf(VAR_LEVELS), normal_tails()))


def garch(frame: pd.DataFrame, blocks: Blocks, horizon: int, asymmetric: bool = False,
          dist: str = "normal", evt: str | None = None) -> pd.DataFrame:
    """GARCH(1,1) or GJR-GARCH(1,1,1) by `arch`, fitted at each block start and filtered through the block; with
    `evt`, the same forecasts again as that model's rows, with generalised Pareto tails."""
    returns = frame["ret"].reset_index(drop=True)
    model = arch_model(returns, mean="Constant", vol="GARCH", p=1, o=1 if asymmetric else 0, q=1, dist=dist,
                       rescale=False)
    parts, evt_parts, start_values = [], [], None
    for first, last in blocks:
        stop_point()  # each fit takes a moment: a requested stop need not wait for all of them
        with warnings.catch_warnings():  # a warm start outside the constraints just falls back to arch's own
            warnings.simplefilter("ignore", StartingValueWarning)
            result = model.fit(last_obs=first + 1, disp="off", show_warning=False, starting_values=start_values)
        start_values = result.params.to_numpy()
        forecast = result.forecast(horizon=horizon, start=first, reindex=False, align="origin")
        path = forecast.variance.to_numpy()[: last - first + 1]
        shape = result.params[model.distribution.parameter_names()].to_numpy()
        quantiles = model.distribution.ppf(np.array(VAR_LEVELS), shape)
        tails = student_t_tails(float(shape[0])) if dist == "t" else normal_tails()
        positions = np.arange(first, last + 1)
        parts.append(forecast_frame(frame, positions, path[:, 0], path.sum(axis=1), result.params["mu"],
                                    tail_columns(quantiles, tails)))
        if evt:
            evt_parts.append(parts[-1].assign(**evt_columns(result.std_resid.to_numpy()), model=evt))
    return pd.concat(parts + evt_parts)


def har(frame: pd.DataFrame, blocks: Blocks, horizon: int, proxy: str = "returns") -> pd.DataFrame:
    """HAR (Corsi 2009): OLS of the next day's squared return (`proxy="parkinson"`: HAR-RV) on the 1-, 5- and
    22-day Parkinson averages, the H-day sum directly; a forecast at or below zero becomes its targets' mean."""
    inputs = frame[HAR_INPUTS].to_numpy()
    returns = frame["ret"].to_numpy()
    known = np.isfinite(inputs).all(axis=1)
    targets = ("target_sq", "target_sq_h") if proxy == "returns" else ("target", "target_h")
    parts, tails = [], tail_columns(norm.ppf(VAR_LEVELS), normal_tails())
    for first, last in blocks:
        positions = np.arange(first, last + 1)
        forecasts = []
        for target, lag in zip(targets, (1, horizon)):
            values = frame[target].to_numpy()
            train = known & np.isfinite(values)
            train[first - lag + 1 :] = False
            forecast = LinearRegression().fit(inputs[train], values[train]).predict(inputs[positions])
            forecasts.append(np.where(forecast > 0, forecast, values[train].mean()))
        parts.append(forecast_frame(frame, positions, *forecasts, np.nanmean(returns[: first + 1]), tails))
    return pd.concat(parts)


def gas_model(frame: pd.DataFrame, blocks: Blocks, horizon: int, refit_every: int = 252) -> pd.DataFrame:
    """The GAS model of VaR and ES (`gas.py`), refit every `refit_every` rows: its squared scale as `variance`,
    zero `mu`, and `gas_beta` and `gas_gamma` so a server can filter on from a row."""
    returns = np.nan_to_num(frame["ret"].to_numpy())  # the first day has no return: no breach, κ decays
    parts, params, fitted_at = [], None, None
    for first, last in blocks:
        stop_point()
        if params is None or first - fitted_at >= refit_every:
            params, fitted_at = gas.fit(returns[: first + 1]), first
            kappa = gas.log_scale(returns[: first + 1], params)
            standardised = returns[: first + 1] / np.exp(kappa[: first + 1])
            shortfall_99 = empirical_tails(standardised)[1][1]
            quantiles = np.quantile(standardised, VAR_LEVELS)
            tails = {**tail_columns(quantiles, [(params[2], params[3]), (quantiles[0], shortfall_99)]),
                     "gas_beta": params[0], "gas_gamma": params[1]}
        kappa = gas.log_scale(returns[: last + 1], params)
        scale = np.exp(2 * kappa[first + 1 : last + 2])  # κ(i + 1) is made at origin i
        parts.append(forecast_frame(frame, np.arange(first, last + 1), scale, horizon * scale, 0.0, tails))
    return pd.concat(parts)


BASELINES = {
    "ewma": lambda frame, blocks, horizon, config: ewma(frame, blocks, horizon, config.ewma_lambda),
    "garch": lambda frame, blocks, horizon, config: garch(frame, blocks, horizon),
    "gjr_garch_t": lambda frame, blocks, horizon, config: garch(frame, blocks, horizon, asymmetric=True, dist="t",
                                                                evt="gjr_garch_t_evt"),
    "har": lambda frame, blocks, horizon, config: har(frame, blocks, horizon),
    "har_rv": lambda frame, blocks, horizon, config: har(frame, blocks, horizon, proxy="parkinson"),
    "gas": lambda frame, blocks, horizon, config: gas_model(frame, blocks, horizon, config.gas_refit_every),
}


# Seconds of one ticker's 120 refits in `default` (the validation period's and the test window's; 2 cores, one
# thread, measured 2026-12-05), to start the longest first
FIT_COST = {"gjr_garch_t": 6.3, "gas": 5.8, "garch": 3.9, "har": 0.6, "har_rv": 0.5, "ewma": 0.0}


def fit_baselines(rows: pd.DataFrame, blocks: Blocks, horizon: int, settings, models: list[str]) -> list[pd.DataFrame]:
    """One ticker's forecasts by each of `models`, away from torch; BLAS on one thread (GARCH rounds differently
    with another count), so every engine gives the same forecasts."""
    parts = []
    with ONE_BLAS_THREAD, threadpool_limits(1, user_api="blas"):
        for name in models:
            stop_point()
            forecasts = BASELINES[name](rows, blocks, horizon, settings)
            named = forecasts["model"].fillna(name) if "model" in forecasts else name  # GJR-t's EVT rows are named
            parts.append(forecasts.assign(model=named))
    return parts


def start_pool_worker() -> None:
    """A pool worker ignores Ctrl-C (the run decides when to stop) and dies at once on SIGTERM."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
