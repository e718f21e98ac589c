"""Each model's own tail, standardised: the α-quantile q and the Expected Shortfall E[Z | Z ≤ q] of its
distribution of standardised returns Z (mean 0, variance 1), at the FRTB's 97.5 % and at 99 %. A day's VaR is
μ + σ·q and its ES μ + σ·es.

Normal (EWMA, GARCH, HAR): es = −φ(z_α)/α. Student-t with ν degrees of freedom (GJR-t), scaled to unit variance by
√((ν − 2)/ν): es = −(ν + t_α²)/(ν − 1) · f_ν(t_α)/α, times that scale (McNeil, Frey and Embrechts 2015, §2.3).
Empirical (the neural model's filtered historical simulation): the mean of the standardised returns at or below
their α-quantile. Two rules give those returns (NEURAL_TAIL_RULES): `training`, its training window's;
`out_of_sample`, its own earlier out-of-sample residuals once a year of them exists (`recalibrate`);
`out_of_sample_evt` takes a generalised Pareto tail of those (below); `fz` is the network's joint VaR/ES head
(`joint.py`). The run chooses among them and the baselines' tail models (TAIL_RULES) on a validation period before
the test window (`evaluate.choose_tail_rule`).

EVT (GJR-t's filtered historical simulation, `gjr_garch_t_evt`): below the 10 % quantile u of the standardised
residuals, a generalised Pareto tail fitted to the exceedances (McNeil and Frey 2000).

FZ0 (Patton, Ziegel and Chen 2019) scores a VaR v and ES e at a level α together, v and e < 0:
L(y, v, e) = −1{y ≤ v}(v − y) / (α e) + v / e + log(−e) − 1. Its expectation is smallest at the true pair.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from scipy.stats import genpareto, norm, t

VAR_LEVELS = (0.01, 0.05)
ES_LEVELS = (0.025, 0.01)  # tail probabilities: ES at 97.5 % (FRTB) and at 99 %
MIN_RESIDUALS = 250  # a year of out-of-sample residuals before they replace the training window's
# The tail models the served forecaster chooses among on validation, in order of preference when the scores tie: the
# network's own rules (its variance times standardised tails), then the baselines' models of the tails
NEURAL_TAIL_RULES = ("training", "out_of_sample", "out_of_sample_evt", "fz")
TAIL_RULES = (*NEURAL_TAIL_RULES, "gas")
EVT_THRESHOLD = 0.10  # the tail share of the residuals the generalised Pareto tail is fitted to


def fz0_loss(returns, var, shortfall, level: float):
    """FZ0 of each day (module docstring), on numpy arrays or torch tensors alike (the network trains on it)."""
    log = (lambda values: values.log()) if hasattr(shortfall, "log") else np.log  # a tensor's, else numpy's
    return (returns <= var) * (returns - var) / (level * shortfall) + var / shortfall + log(-shortfall) - 1


def quantile_column(level: float) -> str:
    """The column holding the standardised return quantile at a VaR level: q01, q05."""
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
    tails = []
    for level in ES_LEVELS:
        quantile = float(np.quantile(values, level))
        tails.append((quantile, float(values[values <= quantile].mean())))
    return tails


def evt_tails(standardised: np.ndarray, levels) -> list[tuple[float, float]]:
    """(quantile, ES) at each of `levels` (all below EVT_THRESHOLD) from a generalised Pareto tail: the excess x of
    the loss over the threshold at tail probability α is GPD's quantile at α / EVT_THRESHOLD, and the mean excess
    beyond it (β + ξx) / (1 − ξ)."""
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
    """Every tail column from GPD tails of the standardised residuals; the H-day ones from `standardised_h`, the
    standardised H-day sums, or without them the 1-day ones (as the Student-t's: a sum of H days has lighter tails)."""
    def finite(values):
        values = np.asarray(values, dtype=float)
        return values[np.isfinite(values)]

    tails = evt_tails(finite(standardised), VAR_LEVELS + ES_LEVELS)
    tails_h = None if standardised_h is None else evt_tails(finite(standardised_h), ES_LEVELS)
    return tail_columns([quantile for quantile, _ in tails[:len(VAR_LEVELS)]], tails[len(VAR_LEVELS):], tails_h)


def tail_columns(quantiles, tails: list[tuple[float, float]],
                 tails_h: list[tuple[float, float]] | None = None) -> dict[str, float]:
    """A forecast's tail columns: `quantiles` at VAR_LEVELS (q01, q05), `tails` the (quantile, ES) of the model's
    standardised returns at ES_LEVELS (es975_q, es975, ...), and `tails_h` of its standardised H-day sums (es975_h_q,
    ...; the 1-day ones by default: exact for the normal, conservative for the Student-t, a sum of t shocks having
    lighter tails)."""
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
    """The tails of each ticker's forecasts from its own earlier out-of-sample residuals, renewed at every date in
    `starts`: `tails_of` (the empirical columns, or `evt_columns`) of the residuals of the days before it (of the H-day
    sums wholly before it), once MIN_RESIDUALS exist. Rows without a forecast (NaN variance) give no residual.

    `forecasts` holds `date` and `date_h` (the first and last target day), `ret` and `ret_h` (the realised 1-day
    return and H-day sum), `mu`, `variance`, `variance_h`, and the training window's tail columns, kept until then.
    """
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
