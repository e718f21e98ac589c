"""Each model's standardised tail: the α-quantile q and the ES E[Z | Z ≤ q] of its standardised returns Z, at
97.5 % (FRTB) and 99 %; a day's VaR is μ + σ·q and its ES μ + σ·es. Normal (EWMA, GARCH, HAR); Student-t (GJR-t,
McNeil, Frey and Embrechts 2015, §2.3); empirical (the network's filtered historical simulation, of its training
window's returns or of its earlier out-of-sample residuals, `recalibrate`); EVT, a generalised Pareto tail below
the 10 % quantile (McNeil and Frey 2000). The run chooses the served rule on validation (`evaluate.choose_tail_rule`).

FZ0 (Patton, Ziegel and Chen 2019) scores a VaR v and ES e < 0 at level α together, smallest at the true pair:
L(y, v, e) = −1{y ≤ v}(v − y) / (α e) + v / e + log(−e) − 1."""

from __future__ import annotations

import numpy as np
import pandas as pd
from scipy.stats import genpareto, norm, t

VAR_LEVELS = (0.01, 0.05)
ES_LEVELS = (0.025, 0.01)  # tail probabilities: ES at 97.5 % (FRTB) and at 99 %
MIN_RESIDUALS = 250  # a year of out-of-sample residuals before they replace the training window's
# the served forecaster's tail models in order of preference on a tie: the network's rules, then the baselines'
NEURAL_TAIL_RULES = ("training", "out_of_sample", "out_of_sample_evt", "fz")
TAIL_RULES = (*NEURAL_TAIL_RULES, "gas")
EVT_THRESHOLD = 0.10  # the tail share of the residuals the generalised Pareto tail is fitted to


def fz0_loss(returns, var, shortfall, level: float):
    """FZ0 of each day (module docstring), on numpy arrays or torch tensors alike (the network trains on it)."""
    log = (lambda values: values.log()) if hasattr(shortfall, "log") else np.log  # a tensor's, else numpy's
    return (returns <= var) * (returns - var) / (level * shortfall) + var / shortfall + log(-shortfall) - 1


def quantile_column(level: float) -> str:
    return f"q{round(level * 100):02d}"


def es_name(level: float) -> str:
    """97.5 % as es975, 99 % as es99."""
    return f"es{100 * (1 - level):g}".replace(".", "")


def es_columns(level: float, suffix: str = "") -> tuple[str, str]:
    """The columns of the standardised quantile and ES at a level: es975_q and es975 (suffix "_h": H days)."""
    return f"{es_name(level)}{suffix}_q", f"{es_name(level)}{suffix}"


TAIL_COLUMNS = [quantile_column(level) for level in VAR_LEVELS] + [
    name for suffix in ("", "_h") for level in ES_LEVELS for name in es_columns(level, suffix)]


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
    return [(float(quantile), float(values[values <= quantile].mean())) for quantile in np.quantile(values, ES_LEVELS)]


def evt_tails(standardised: np.ndarray, levels) -> list[tuple[float, float]]:
    """(quantile, ES) at each of `levels` (below EVT_THRESHOLD) from a generalised Pareto tail of the excesses."""
    threshold = float(np.quantile(standardised, EVT_THRESHOLD))
    excess = threshold - standardised[standardised < threshold]
    shape, _, scale = genpareto.fit(excess, floc=0)
    shape = min(shape, 0.9)  # a finite ES: ξ < 1
    tails = []
    for level in levels:
        beyond = float(genpareto.isf(level / EVT_THRESHOLD, shape, scale=scale))
        tails.append((threshold - beyond, threshold - beyond - (scale + shape * beyond) / (1 - shape)))
    return tails


def evt_columns(standardised: np.ndarray, standardised_h: np.ndarray | None = None) -> dict[str, float]:
    """Every tail column from GPD tails of the residuals (the H-day ones of `standardised_h`, else the 1-day)."""
    def finite(values):
        values = np.asarray(values, dtype=float)
        return values[np.isfinite(values)]

    tails = evt_tails(finite(standardised), VAR_LEVELS + ES_LEVELS)
    tails_h = None if standardised_h is None else evt_tails(finite(standardised_h), ES_LEVELS)
    return tail_columns([quantile for quantile, _ in tails[:len(VAR_LEVELS)]], tails[len(VAR_LEVELS):], tails_h)


def tail_columns(quantiles, tails: list[tuple[float, float]],
                 tails_h: list[tuple[float, float]] | None = None) -> dict[str, float]:
    """A forecast's tail columns from `quantiles` at VAR_LEVELS and (quantile, ES) pairs at ES_LEVELS."""
    columns = {quantile_column(level): float(quantile) for level, quantile in zip(VAR_LEVELS, quantiles)}
    for suffix, values in (("", tails), ("_h", tails if tails_h is None else tails_h)):
        for level, pair in zip(ES_LEVELS, values):
            columns.update(zip(es_columns(level, suffix), pair))
    return columns


def empirical_columns(standardised: np.ndarray, standardised_h: np.ndarray) -> dict[str, float]:
    """Filtered historical simulation: every tail column from pools of standardised 1-day and H-day returns."""
    return tail_columns(np.quantile(standardised, VAR_LEVELS), empirical_tails(standardised),
                        empirical_tails(standardised_h))


def recalibrate(forecasts: pd.DataFrame, starts: list[pd.Timestamp], horizon: int,
                tails_of=empirical_columns) -> pd.DataFrame:
    """Each ticker's tails renewed at each of `starts` from `tails_of` its earlier out-of-sample residuals."""
    residuals = ((forecasts["ret"] - forecasts["mu"]) / np.sqrt(forecasts["variance"])).to_numpy()
    residuals_h = ((forecasts["ret_h"] - horizon * forecasts["mu"]) / np.sqrt(forecasts["variance_h"])).to_numpy()
    dates, dates_h = forecasts["date"].to_numpy(), forecasts["date_h"].to_numpy()
    columns = {name: forecasts[name].to_numpy(copy=True) for name in TAIL_COLUMNS}
    bounds = [np.datetime64(start) for start in starts] + [np.datetime64("2262-01-01")]
    for rows in forecasts.groupby("ticker", sort=False).indices.values():
        for start, end in zip(bounds, bounds[1:]):
            block = rows[(dates[rows] >= start) & (dates[rows] < end)]
            past = residuals[rows[dates[rows] < start]]
            past_h = residuals_h[rows[dates_h[rows] < start]]
            past, past_h = past[np.isfinite(past)], past_h[np.isfinite(past_h)]
            if len(block) == 0 or len(past) < MIN_RESIDUALS or len(past_h) < MIN_RESIDUALS:
                continue
            for column, value in tails_of(past, past_h).items():
                columns[column][block] = value
    return forecasts.assign(**columns)
