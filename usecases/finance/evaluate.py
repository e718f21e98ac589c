"""Forecast evaluation on the test window: losses against two variance proxies, VaR backtests (Kupiec,
Christoffersen, the Basel traffic light), Expected Shortfall backtests (McNeil-Frey, Acerbi-Székely Z2),
Diebold-Mariano tests, and plots.

QLIKE(proxy, forecast) = x − ln x − 1 with x = proxy / forecast (Patton 2011): robust to the noise in the
proxy, so models rank the same as they would against the true variance. Days where a proxy is zero are left out,
and so are the last H − 1 days of the window for the H-day forecasts, whose proxies would reach past it.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from arch.covariance.kernel import Bartlett
from scipy.special import xlogy
from scipy.stats import chi2, norm

from .baselines import VAR_LEVELS, quantile_column
from .tails import ES_LEVELS, es_name

REFERENCE_MODEL = "har"
BASEL_WINDOW = 250  # trading days of the Basel traffic-light backtest
ES_RESAMPLES = 10_000  # of the McNeil-Frey bootstrap


def qlike_losses(proxy: np.ndarray, forecast: np.ndarray) -> np.ndarray:
    ratio = proxy / forecast
    return ratio - np.log(ratio) - 1


def qlike(proxy: np.ndarray, forecast: np.ndarray) -> float:
    keep = proxy > 0
    return float(qlike_losses(proxy[keep], forecast[keep]).mean())


def mse(proxy: np.ndarray, forecast: np.ndarray) -> float:
    keep = proxy > 0
    return float(((proxy[keep] - forecast[keep]) ** 2).mean())


def kupiec_pof(breaches: int, days: int, level: float) -> tuple[float, float]:
    """Kupiec's proportion-of-failures likelihood ratio against χ²(1): is the breach rate the VaR level?"""
    rate = breaches / days
    unrestricted = xlogy(days - breaches, 1 - rate) + xlogy(breaches, rate)
    restricted = xlogy(days - breaches, 1 - level) + xlogy(breaches, level)
    statistic = max(-2 * (restricted - unrestricted), 0.0)
    return statistic, float(chi2.sf(statistic, 1))


def christoffersen(breaches: np.ndarray, level: float) -> tuple[float, float, float, float]:
    """Christoffersen's (1998) likelihood ratios on a day-by-day breach sequence: independence (does a breach make
    the next day's more likely?) against χ²(1), and conditional coverage (Kupiec's rate and independence together)
    against χ²(2). Returns both statistics and their p-values."""
    hits = np.asarray(breaches, dtype=bool)
    before, after = hits[:-1], hits[1:]
    n00, n01 = int((~before & ~after).sum()), int((~before & after).sum())
    n10, n11 = int((before & ~after).sum()), int((before & after).sum())
    p01, p11 = n01 / max(n00 + n01, 1), n11 / max(n10 + n11, 1)
    p = (n01 + n11) / max(n00 + n01 + n10 + n11, 1)
    markov = xlogy(n00, 1 - p01) + xlogy(n01, p01) + xlogy(n10, 1 - p11) + xlogy(n11, p11)
    independent = xlogy(n00 + n10, 1 - p) + xlogy(n01 + n11, p)
    independence = max(-2 * (independent - markov), 0.0)
    coverage = kupiec_pof(int(hits.sum()), len(hits), level)[0] + independence
    return independence, float(chi2.sf(independence, 1)), coverage, float(chi2.sf(coverage, 2))


def traffic_light(breaches: np.ndarray, window: int = BASEL_WINDOW) -> dict[str, float]:
    """The Basel traffic-light zones of the 99 % VaR over every rolling `window`-day window (green: at most 4
    breaches, yellow: 5 to 9, red: 10 or more, as in the Basel Committee's 1996 backtesting framework): how many
    windows fall in each zone; none when the series is shorter than a window."""
    counts = pd.Series(np.asarray(breaches, dtype=float)).rolling(window).sum().dropna().to_numpy()
    return {"basel_green_windows": float((counts <= 4).sum()),
            "basel_yellow_windows": float(((counts >= 5) & (counts <= 9)).sum()),
            "basel_red_windows": float((counts >= 10).sum())}


def mcneil_frey(returns: np.ndarray, shortfall: np.ndarray, sigma: np.ndarray, breaches: np.ndarray,
                resamples: int = ES_RESAMPLES, seed: int = 0) -> float:
    """McNeil and Frey's (2000) ES backtest: on the days the VaR was breached, the exceedance residuals
    (return − ES) / σ have mean zero when the ES is right and a negative one when it understates the loss.
    One-sided bootstrap p-value of their t statistic (resampling the residuals centred on their mean); NaN with
    fewer than 2 breaches."""
    residuals = ((returns - shortfall) / sigma)[breaches]
    if len(residuals) < 2 or residuals.std() == 0:
        return float("nan")
    observed = residuals.mean() / residuals.std(ddof=1) * np.sqrt(len(residuals))
    samples = np.random.default_rng(seed).choice(residuals - residuals.mean(), (resamples, len(residuals)))
    spread = samples.std(axis=1, ddof=1)
    statistics = np.divide(samples.mean(axis=1), spread, out=np.zeros(resamples), where=spread > 0)
    return float((1 + (statistics * np.sqrt(len(residuals)) <= observed).sum()) / (resamples + 1))


def acerbi_szekely_z2(returns: np.ndarray, shortfall: np.ndarray, breaches: np.ndarray, level: float) -> float:
    """Acerbi and Székely's (2014) Z2 = Σ r·1{breach} / (T α |ES|) + 1: 0 when the ES is right, negative when
    the losses beyond the VaR are larger than it says."""
    return float((returns * breaches / np.abs(shortfall)).sum() / (len(returns) * level) + 1)


def diebold_mariano(losses: np.ndarray, reference_losses: np.ndarray, lags: int = 5) -> tuple[float, float]:
    """t statistic of the mean loss difference with a Bartlett (Newey-West) long-run variance; positive = worse."""
    difference = np.asarray(losses) - np.asarray(reference_losses)
    long_run = float(np.squeeze(Bartlett(difference, bandwidth=lags).cov.long_run))
    if long_run <= 0:
        return float("nan"), float("nan")
    statistic = difference.mean() / np.sqrt(long_run / len(difference))
    return float(statistic), float(2 * norm.sf(abs(statistic)))


def value_at_risk(forecasts: pd.DataFrame, level: float) -> pd.Series:
    return forecasts["mu"] + np.sqrt(forecasts["variance"]) * forecasts[quantile_column(level)]


def _forward_sum(values: np.ndarray, days: int) -> np.ndarray:
    """values[i] + ... + values[i + days − 1]; NaN where the window runs past the end."""
    return pd.Series(values).rolling(days).sum().shift(-(days - 1)).to_numpy()


def series_metrics(forecasts: pd.DataFrame, horizon: int) -> dict[str, float]:
    """Metrics of one model on one ticker, its rows in date order; `forecasts` holds the realised `parkinson`
    and `ret` of each target day beside the forecasts. H-day proxies sum H consecutive target days."""
    variance = forecasts["variance"].to_numpy()
    parkinson = forecasts["parkinson"].to_numpy()
    returns = forecasts["ret"].to_numpy()
    squared = (returns - returns.mean()) ** 2
    variance_h = forecasts["variance_h"].to_numpy()
    parkinson_h, squared_h = _forward_sum(parkinson, horizon), _forward_sum(squared, horizon)
    metrics = {
        "qlike_parkinson": qlike(parkinson, variance),
        "qlike_sq": qlike(squared, variance),
        "mse_parkinson": mse(parkinson, variance),
        "mse_sq": mse(squared, variance),
        f"qlike_parkinson_h{horizon}": qlike(parkinson_h, variance_h),
        f"qlike_sq_h{horizon}": qlike(squared_h, variance_h),
        f"mse_parkinson_h{horizon}": mse(parkinson_h, variance_h),
    }
    for level in VAR_LEVELS:
        name = f"var{round(level * 100)}"
        hits = (returns < value_at_risk(forecasts, level)).to_numpy()
        breaches = int(hits.sum())
        metrics[f"{name}_breach_rate"] = breaches / len(returns)
        metrics[f"{name}_breaches"] = float(breaches)
        suffix = "" if level == 0.01 else f"_{name}"
        metrics[f"kupiec_p{suffix}"] = kupiec_pof(breaches, len(returns), level)[1]
        _, metrics[f"christoffersen_ind_p{suffix}"], _, metrics[f"christoffersen_cc_p{suffix}"] = christoffersen(
            hits, level)
        if level == 0.01:
            metrics.update(traffic_light(hits))
    sigma = np.sqrt(variance)
    mu = forecasts["mu"].to_numpy()
    for level in ES_LEVELS:
        name = es_name(level)
        shortfall = mu + sigma * forecasts[name].to_numpy()
        hits = returns < mu + sigma * forecasts[f"{name}_q"].to_numpy()
        metrics[f"{name}_mean"] = float(shortfall.mean())
        metrics[f"{name}_breaches"] = float(hits.sum())
        metrics[f"{name}_z2"] = acerbi_szekely_z2(returns, shortfall, hits, level)
        metrics[f"{name}_mcneil_frey_p"] = mcneil_frey(returns, shortfall, sigma, hits)
    metrics["test_days"] = float(len(returns))
    return metrics


def evaluate(forecasts: pd.DataFrame, horizon: int = 5, dm_lags: int = 5) -> dict[str, dict[str, float]]:
    """Per model: each metric per ticker as `METRIC/ticker`, and its mean over tickers as `METRIC`.

    Every model is also tested against HAR-RV (Diebold-Mariano on QLIKE against Parkinson variance).
    """
    results: dict[str, dict[str, float]] = {}
    reference = forecasts[forecasts["model"] == REFERENCE_MODEL].set_index(["ticker", "date"])
    for model, by_model in forecasts.groupby("model", sort=False):
        per_ticker: dict[str, dict[str, float]] = {}
        for ticker, rows in by_model.groupby("ticker", sort=False):
            metrics = series_metrics(rows.sort_values("date"), horizon)
            if model != REFERENCE_MODEL and len(reference):
                paired = rows.set_index(["ticker", "date"]).join(
                    reference["variance"].rename("variance_reference"), how="inner")
                paired = paired[paired["parkinson"] > 0]
                losses = qlike_losses(paired["parkinson"].to_numpy(), paired["variance"].to_numpy())
                reference_losses = qlike_losses(paired["parkinson"].to_numpy(),
                                                paired["variance_reference"].to_numpy())
                metrics["dm_t_vs_har"], metrics["dm_p_vs_har"] = diebold_mariano(losses, reference_losses, dm_lags)
            per_ticker[ticker] = metrics
        names = list(next(iter(per_ticker.values())))
        combined = {name: float(np.mean([metrics[name] for metrics in per_ticker.values()])) for name in names}
        for ticker, metrics in per_ticker.items():
            combined.update({f"{name}/{ticker}": value for name, value in metrics.items()})
        results[model] = combined
    return results


def forecast_figure(forecasts: pd.DataFrame, ticker: str, models: list[str]):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(12, 4.5))
    rows = forecasts[forecasts["ticker"] == ticker]
    realised = rows[rows["model"] == models[0]]
    axis.plot(realised["date"], realised["parkinson"], color="0.75", lw=0.6, label="Parkinson variance")
    for model in models:
        selected = rows[rows["model"] == model]
        axis.plot(selected["date"], selected["variance"], lw=1.0, label=model)
    axis.set_yscale("log")
    axis.set_ylabel("daily variance (%²)")
    axis.set_title(f"{ticker}: 1-day-ahead variance forecasts on the test window")
    axis.legend(loc="upper right", ncol=len(models) + 1, fontsize=8)
    figure.tight_layout()
    return figure


def var_figure(forecasts: pd.DataFrame, ticker: str, model: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = forecasts[(forecasts["ticker"] == ticker) & (forecasts["model"] == model)]
    figure, axis = plt.subplots(figsize=(12, 4.5))
    axis.plot(rows["date"], rows["ret"], color="0.5", lw=0.5, label="return (%)")
    for level, color in ((0.05, "tab:orange"), (0.01, "tab:red")):
        var = value_at_risk(rows, level)
        axis.plot(rows["date"], var, color=color, lw=0.9, label=f"{level:.0%} VaR")
        breached = rows["ret"] < var
        axis.scatter(rows["date"][breached], rows["ret"][breached], color=color, s=10, zorder=3)
    axis.set_title(f"{ticker}: {model} Value-at-Risk and its breaches")
    axis.legend(loc="lower left", fontsize=8)
    figure.tight_layout()
    return figure
