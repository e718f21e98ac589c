"""Causal features of a daily OHLC panel: a value at date t uses rows up to t of its ticker only. In pandas (so
cudf.pandas can run them on a GPU), in percent: returns are 100·ln(close_t / close_t-1), variances percent²."""

from __future__ import annotations

import numpy as np
import pandas as pd

HAR_WINDOWS = {"rv_d": 1, "rv_w": 5, "rv_m": 22}
LONG_WINDOW = 66
HISTORY_DAYS = LONG_WINDOW + 1
NEURAL_FEATURES = ["log_rv_m", "rel_rv_d", "rel_rv_w", "rel_rv_q", "rel_sq_ret", "rel_sq_m", "rel_sq_q", "rel_ewma_sq",
                   "rel_ewma_neg", "ret_std", "neg_ret_std"]
EWMA_DECAY = 0.9  # of the GARCH-like inputs: the exponentially weighted squared returns, all and negative ones
EXOGENOUS_FEATURES = {"vix": "rel_vix", "wti": "log_wti_rv"}
VARIANCE_FLOOR = 1e-3  # relative to the monthly average: keeps logs finite on days with High == Low


def feature_names(exogenous: list[str]) -> list[str]:
    """The neural model's inputs: the log 22-day average first (the model's baseline), exogenous ones last."""
    return NEURAL_FEATURES + [EXOGENOUS_FEATURES[name] for name in exogenous]


def parkinson_variance(high: pd.Series, low: pd.Series) -> pd.Series:
    """(100·ln(High/Low))² / (4 ln 2): the range-based daily variance, blind to the unreliable Open."""
    return (100 * np.log(high / low)) ** 2 / (4 * np.log(2))


def add_features(panel: pd.DataFrame, horizon: int = 5) -> pd.DataFrame:
    """Per ticker (its first row dropped): returns, Parkinson variance, HAR averages, scale-free inputs, and the
    look-ahead targets (`target*`, the next day's and the next `horizon` days'), used only as labels."""
    frame = panel.sort_values(["ticker", "date"], kind="stable").reset_index(drop=True)
    by_ticker = frame.groupby("ticker", sort=False)
    frame["ret"] = 100 * np.log(frame["close"] / by_ticker["close"].shift(1))
    frame["parkinson"] = parkinson_variance(frame["high"], frame["low"])
    frame["sq_ret"] = frame["ret"] ** 2
    if "wti" in frame:
        frame["wti_sq_ret"] = (100 * np.log(frame["wti"] / by_ticker["wti"].shift(1))) ** 2
    frame = frame[by_ticker.cumcount() > 0].reset_index(drop=True)
    frame["neg_sq_ret"] = frame["sq_ret"] * (frame["ret"] < 0)
    by_ticker = frame.groupby("ticker", sort=False)
    for name, source in (("ewma_sq", "sq_ret"), ("ewma_neg", "neg_sq_ret")):
        frame[name] = by_ticker[source].ewm(alpha=1 - EWMA_DECAY).mean().reset_index(level=0, drop=True)
    for name, window in {**HAR_WINDOWS, "rv_q": LONG_WINDOW}.items():
        frame[name] = by_ticker["parkinson"].rolling(window).mean().reset_index(level=0, drop=True)
    for name, window in {"sq_m": HAR_WINDOWS["rv_m"], "sq_q": LONG_WINDOW}.items():
        frame[name] = by_ticker["sq_ret"].rolling(window).mean().reset_index(level=0, drop=True)
    floor = VARIANCE_FLOOR * frame["rv_m"]
    frame["log_rv_m"] = np.log(frame["rv_m"])
    for source in ("rv_d", "rv_w", "rv_q", "sq_ret", "sq_m", "sq_q", "ewma_sq", "ewma_neg"):
        frame[f"rel_{source}"] = np.log(np.maximum(frame[source], floor)) - frame["log_rv_m"]
    frame["ret_std"] = frame["ret"] / np.sqrt(frame["rv_m"])
    frame["neg_ret_std"] = np.minimum(frame["ret_std"], 0)
    if "vix" in frame:
        frame["rel_vix"] = np.log(frame["vix"] ** 2 / 252) - frame["log_rv_m"]
    if "wti" in frame:
        wti_rv = by_ticker["wti_sq_ret"].rolling(HAR_WINDOWS["rv_m"], min_periods=15).mean()
        frame["log_wti_rv"] = np.log(wti_rv.reset_index(level=0, drop=True) + VARIANCE_FLOOR)
    frame["target"] = by_ticker["parkinson"].shift(-1)
    frame["target_ret"] = by_ticker["ret"].shift(-1)
    if "true_variance" in frame:  # a synthetic panel's: the variance of each day's return, known the day before
        frame["target_true"] = by_ticker["true_variance"].shift(-1)
    frame["target_date"] = by_ticker["date"].shift(-1)
    frame["target_sq"] = by_ticker["sq_ret"].shift(-1)
    for name, source in (("target_h", "parkinson"), ("target_ret_h", "ret"), ("target_sq_h", "sq_ret")):
        frame[name] = by_ticker[source].rolling(horizon).sum().reset_index(level=0, drop=True)
        frame[name] = frame.groupby("ticker", sort=False)[name].shift(-horizon)
    frame["target_date_h"] = by_ticker["date"].shift(-horizon)
    return frame


def usable(frame: pd.DataFrame) -> pd.Series:
    """Rows whose own features are all defined (after the 66-day warm-up); exogenous gaps are imputed later."""
    return frame[NEURAL_FEATURES].notna().all(axis=1) & np.isfinite(frame[NEURAL_FEATURES]).all(axis=1)
