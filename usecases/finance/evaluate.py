"""Forecast evaluation on the test window: losses against two variance proxies, VaR backtests (Kupiec,
Christoffersen, the Basel traffic light), Expected Shortfall backtests (McNeil-Frey, Acerbi-Székely Z2), the FZ0
loss of each VaR and ES pair (`tails.fz0_loss`), Diebold-Mariano tests, and plots.

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

from .tails import ES_LEVELS, TAIL_RULES, VAR_LEVELS, es_columns, es_name, fz0_loss, quantile_column

# Diebold-Mariano tests: each model's QLIKE against a proxy, paired with a reference model's on the same days. The
# headline is the return scale against GJR-t; HAR-RV on Parkinson variance is the published protocol's.
DM_TESTS = {"gjr_garch_t": "sq", "har_rv": "parkinson"}
FZ0_REFERENCE = "gjr_garch_t_evt"  # the industry's tails (FHS with EVT on GJR-t): each model's FZ0 is tested against it
TAIL_ONLY = ("gas",)  # models of the tails alone: no variance metrics
PASS_P = 0.05  # a tail model passes the validation backtests when none rejects it at this level
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


def acerbi_szekely_z2(returns: np.ndarray, shortfall: np.ndarray, breaches: np.ndarray,
                      level: float) -> tuple[float, float]:
    """Acerbi and Székely's (2014) Z2 = Σ r·1{breach} / (T α |ES|) + 1: 0 when the ES is right, negative when the
    losses beyond the VaR are larger than it says or come more often. With its one-sided p-value from the normal
    approximation of its null distribution: under a right VaR and ES each day adds a term of mean −α and variance
    α·m − α², m the mean of (r / ES)² on a breach, estimated from the breaches seen (NaN with fewer than 2)."""
    hits = np.asarray(breaches, dtype=bool)
    ratios = returns / np.abs(shortfall)
    statistic = float(ratios[hits].sum() / (len(returns) * level) + 1)
    if hits.sum() < 2:
        return statistic, float("nan")
    spread = np.sqrt(max((ratios[hits] ** 2).mean() - level, 1e-12) / (len(returns) * level))
    return statistic, float(norm.cdf(statistic / spread))


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


def tail_pair(forecasts: pd.DataFrame, level: float) -> tuple[np.ndarray, np.ndarray]:
    """The VaR and ES at tail probability `level` (one of ES_LEVELS) of each day."""
    sigma = np.sqrt(forecasts["variance"].to_numpy())
    quantile, shortfall = (forecasts["mu"].to_numpy() + sigma * forecasts[column].to_numpy()
                           for column in es_columns(level))
    return quantile, shortfall


def fz0_losses(forecasts: pd.DataFrame, level: float) -> np.ndarray:
    return fz0_loss(forecasts["ret"].to_numpy(), *tail_pair(forecasts, level), level)


def series_metrics(forecasts: pd.DataFrame, horizon: int, variance_metrics: bool = True) -> dict[str, float]:
    """Metrics of one model on one ticker, its rows in date order; `forecasts` holds the realised `parkinson`
    and `ret` of each target day beside the forecasts (and `true_variance` for a synthetic panel). H-day proxies
    sum H consecutive target days. Without `variance_metrics` (a model of the tails alone) the backtests only."""
    variance = forecasts["variance"].to_numpy()
    parkinson = forecasts["parkinson"].to_numpy()
    returns = forecasts["ret"].to_numpy()
    squared = (returns - returns.mean()) ** 2
    variance_h = forecasts["variance_h"].to_numpy()
    parkinson_h, squared_h = _forward_sum(parkinson, horizon), _forward_sum(squared, horizon)
    metrics = {
        "qlike_sq": qlike(squared, variance),
        "qlike_parkinson": qlike(parkinson, variance),
        "mse_sq": mse(squared, variance),
        "mse_parkinson": mse(parkinson, variance),
        "scale_sq": float(squared.mean() / variance.mean()),
        f"qlike_sq_h{horizon}": qlike(squared_h, variance_h),
        f"qlike_parkinson_h{horizon}": qlike(parkinson_h, variance_h),
        f"mse_parkinson_h{horizon}": mse(parkinson_h, variance_h),
    }
    if "true_variance" in forecasts:
        truth = forecasts["true_variance"].to_numpy()
        metrics.update({"qlike_true": qlike(truth, variance), "qlike_sq_oracle": qlike(squared, truth)})
    if not variance_metrics:
        metrics = {}
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
    mu = forecasts["mu"].to_numpy()
    metrics.update(shortfall_metrics(returns, mu, np.sqrt(variance), forecasts, ""))
    metrics.update(horizon_metrics(forecasts, returns, mu, horizon))
    metrics["test_days"] = float(len(returns))
    return metrics


def shortfall_metrics(returns: np.ndarray, mu: np.ndarray, sigma: np.ndarray, forecasts: pd.DataFrame,
                      suffix: str, name_suffix: str = "") -> dict[str, float]:
    """The ES backtests at each of ES_LEVELS, for returns over one day or (suffix "_h") H days."""
    metrics = {}
    for level in ES_LEVELS:
        quantile_name, shortfall_name = es_columns(level, suffix)
        name = es_name(level) + name_suffix
        shortfall = mu + sigma * forecasts[shortfall_name].to_numpy()
        quantile = mu + sigma * forecasts[quantile_name].to_numpy()
        hits = returns < quantile
        metrics[f"{name}_mean"] = float(shortfall.mean())
        metrics[f"{name}_breaches"] = float(hits.sum())
        metrics[f"{name}_z2"], metrics[f"{name}_z2_p"] = acerbi_szekely_z2(returns, shortfall, hits, level)
        metrics[f"{name}_mcneil_frey_p"] = mcneil_frey(returns, shortfall, sigma, hits)
        metrics[f"{name}_fz0"] = float(fz0_loss(returns, quantile, shortfall, level).mean())
    return metrics


def horizon_metrics(forecasts: pd.DataFrame, returns: np.ndarray, mu: np.ndarray, horizon: int) -> dict[str, float]:
    """The H-day VaR (1 %) and ES backtests on non-overlapping H-day periods (every H-th origin, so the breaches of
    successive periods share no day): from the model's H-day variance and tails, and, as the labelled baseline, the
    square-root-of-time scaling of its 1-day VaR."""
    realised = _forward_sum(returns, horizon)[::horizon]
    keep = np.isfinite(realised)
    periods = forecasts.iloc[::horizon][keep]
    realised, drift = realised[keep], horizon * mu[::horizon][keep]
    sigma_h = np.sqrt(periods["variance_h"].to_numpy())
    one_percent = es_columns(0.01, "_h")[0]
    metrics = {}
    for name, var in ((f"var1_h{horizon}", drift + sigma_h * periods[one_percent].to_numpy()),
                      (f"var1_h{horizon}_sqrt_time",
                       drift + np.sqrt(horizon * periods["variance"].to_numpy()) * periods["q01"].to_numpy())):
        breaches = int((realised < var).sum())
        metrics[f"{name}_breaches"] = float(breaches)
        metrics[f"{name}_kupiec_p"] = kupiec_pof(breaches, len(realised), 0.01)[1]
    metrics[f"h{horizon}_periods"] = float(len(realised))
    metrics.update(shortfall_metrics(realised, drift, sigma_h, periods, "_h", f"_h{horizon}"))
    return metrics


def tail_backtests(rows: pd.DataFrame) -> dict[str, float]:
    """The scores a tail rule is chosen by, on one ticker's forecasts in date order (with the realised `ret`): the
    1 % VaR's breaches, Kupiec and conditional coverage p-values, the 97.5 % ES's Z2 and McNeil-Frey p-values,
    `worst_p`, the smallest of those p-values (NaN ones left out): how near the rule comes to being rejected, and
    `fz0`, the mean FZ0 loss of the 97.5 % and the 99 % VaR and ES pairs together."""
    returns = rows["ret"].to_numpy()
    hits = (rows["ret"] < value_at_risk(rows, 0.01)).to_numpy()
    metrics = {"var1_breaches": float(hits.sum()), "kupiec_p": kupiec_pof(int(hits.sum()), len(hits), 0.01)[1],
               "christoffersen_cc_p": christoffersen(hits, 0.01)[3], "days": float(len(hits))}
    sigma = np.sqrt(rows["variance"].to_numpy())
    quantile, shortfall = tail_pair(rows, 0.025)
    metrics["es975_z2"], metrics["es975_z2_p"] = acerbi_szekely_z2(returns, shortfall, returns < quantile, 0.025)
    metrics["es975_mcneil_frey_p"] = mcneil_frey(returns, shortfall, sigma, returns < quantile)
    metrics["worst_p"] = float(np.nanmin([metrics[name] for name in ("kupiec_p", "christoffersen_cc_p", "es975_z2_p",
                                                                    "es975_mcneil_frey_p")]))
    metrics["fz0"] = float(sum(fz0_losses(rows, level).mean() for level in ES_LEVELS))
    return metrics


def choose_tail_rule(candidates: dict[str, pd.DataFrame]) -> tuple[str, dict[str, float]]:
    """The tail rule chosen on the validation period: of the rules that no backtest rejects at PASS_P on any ticker
    (`worst_p`), the one with the lowest FZ0 (averaged over the tickers), the score that ranks VaR and ES pairs;
    when every rule is rejected somewhere, the one that comes nearest to passing (the largest mean `worst_p`). A
    tie goes to the first of TAIL_RULES. `candidates` are each rule's validation forecasts (`ticker`, `date`,
    `ret`, `mu`, `variance` and the tail columns; NaN variance for a ticker not yet listed at a refit); returns the
    rule and every candidate's scores as `RULE/METRIC/TICKER`, with `RULE/worst_p`, `RULE/fz0` their means and
    `RULE/passes` 1 or 0."""
    backtests, passing = {}, {}
    for rule in candidates:
        forecasts = candidates[rule]
        forecasts = forecasts[np.isfinite(forecasts["variance"])]
        scores = []
        for ticker, rows in forecasts.groupby("ticker", sort=False):
            metrics = tail_backtests(rows.sort_values("date"))
            backtests.update({f"{rule}/{name}/{ticker}": value for name, value in metrics.items()})
            scores.append((metrics["worst_p"], metrics["fz0"]))
        worst, fz0 = np.array(scores).T
        backtests[f"{rule}/worst_p"], backtests[f"{rule}/fz0"] = float(worst.mean()), float(fz0.mean())
        passing[rule] = backtests[f"{rule}/passes"] = float((worst >= PASS_P).all())
    rules = [rule for rule in TAIL_RULES if rule in candidates]
    if any(passing.values()):
        return min((rule for rule in rules if passing[rule]), key=lambda rule: backtests[f"{rule}/fz0"]), backtests
    return max(rules, key=lambda rule: backtests[f"{rule}/worst_p"]), backtests


def validation_qlike(forecasts: pd.DataFrame) -> dict[str, float]:
    """The served model's QLIKE against the squared return (demeaned as in `series_metrics`) on the validation
    period, per ticker as `val_qlike_sq/TICKER` and averaged as `val_qlike_sq`: the registry compares versions by it,
    so that no test value chooses what is served."""
    per_ticker = {}
    for ticker, rows in forecasts[np.isfinite(forecasts["variance"])].groupby("ticker", sort=False):
        returns = rows["ret"].to_numpy()
        per_ticker[f"val_qlike_sq/{ticker}"] = qlike((returns - returns.mean()) ** 2, rows["variance"].to_numpy())
    return {"val_qlike_sq": float(np.mean(list(per_ticker.values()))), **per_ticker}


def evaluate(forecasts: pd.DataFrame, horizon: int = 5, dm_lags: int = 5) -> dict[str, dict[str, float]]:
    """Per model: each metric per ticker as `METRIC/ticker`, and its mean over tickers as `METRIC`.

    Every model is also tested against the DM_TESTS references (Diebold-Mariano on QLIKE against their proxy) as
    `dm_t_vs_REFERENCE` and `dm_p_vs_REFERENCE`, and on its FZ0 at each of ES_LEVELS against FZ0_REFERENCE's as
    `dm_t_fz0_es975` and `dm_p_fz0_es975` (`es99`); the TAIL_ONLY models on their FZ0 alone.
    """
    results: dict[str, dict[str, float]] = {}
    references = {name: forecasts[forecasts["model"] == name].set_index(["ticker", "date"])
                  for name in (*DM_TESTS, FZ0_REFERENCE)}
    for model, by_model in forecasts.groupby("model", sort=False):
        per_ticker: dict[str, dict[str, float]] = {}
        for ticker, rows in by_model.groupby("ticker", sort=False):
            metrics = series_metrics(rows.sort_values("date"), horizon, model not in TAIL_ONLY)
            for name, proxy in DM_TESTS.items():
                if model != name and len(references[name]) and model not in TAIL_ONLY:
                    metrics[f"dm_t_vs_{name}"], metrics[f"dm_p_vs_{name}"] = _paired_dm(
                        rows, references[name], proxy, dm_lags)
            if model != FZ0_REFERENCE and len(references[FZ0_REFERENCE]):
                metrics.update(_paired_fz0_dm(rows, references[FZ0_REFERENCE], dm_lags))
            per_ticker[ticker] = metrics
        names = list(next(iter(per_ticker.values())))
        combined = {name: float(np.mean([metrics[name] for metrics in per_ticker.values()])) for name in names}
        for ticker, metrics in per_ticker.items():
            combined.update({f"{name}/{ticker}": value for name, value in metrics.items()})
        results[model] = combined
    return results


def _paired_dm(rows: pd.DataFrame, reference: pd.DataFrame, proxy: str, lags: int) -> tuple[float, float]:
    """DM of one model's QLIKE against the reference's, on the days both forecast and the proxy is positive; the
    squared return is demeaned over those days as `series_metrics` does."""
    paired = rows.set_index(["ticker", "date"]).join(reference["variance"].rename("variance_reference"), how="inner")
    if proxy == "sq":
        values = (paired["ret"] - paired["ret"].mean()).to_numpy() ** 2
    else:
        values = paired["parkinson"].to_numpy()
    keep = values > 0
    losses = qlike_losses(values[keep], paired["variance"].to_numpy()[keep])
    reference_losses = qlike_losses(values[keep], paired["variance_reference"].to_numpy()[keep])
    return diebold_mariano(losses, reference_losses, lags)


def _paired_fz0_dm(rows: pd.DataFrame, reference: pd.DataFrame, lags: int) -> dict[str, float]:
    """DM of one model's FZ0 against the reference's at each of ES_LEVELS, on the days both forecast."""
    columns = ["ret", "mu", "variance", *[name for level in ES_LEVELS for name in es_columns(level)]]
    paired = rows.set_index(["ticker", "date"])[columns].join(reference[columns].add_suffix("_reference"), how="inner")
    theirs = paired[[f"{name}_reference" for name in columns]].set_axis(columns, axis=1)
    metrics = {}
    for level in ES_LEVELS:
        name = es_name(level)
        metrics[f"dm_t_fz0_{name}"], metrics[f"dm_p_fz0_{name}"] = diebold_mariano(
            fz0_losses(paired, level), fz0_losses(theirs, level), lags)
    return metrics


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


ZONE_COLOURS = {"green": "tab:green", "yellow": "gold", "red": "tab:red"}


def breach_zones(hits: np.ndarray, window: int = BASEL_WINDOW) -> np.ndarray:
    """The traffic-light zone of the 250-day window that ends on each day (a shorter one at the start), by its
    count of 1 % VaR breaches."""
    counts = pd.Series(np.asarray(hits, dtype=float)).rolling(window, min_periods=1).sum().to_numpy()
    return np.where(counts >= 10, "red", np.where(counts >= 5, "yellow", "green"))


def risk_figure(forecasts: pd.DataFrame, ticker: str, model: str):
    """Returns with the 1 % VaR, the 97.5 % band from VaR to ES (the tail whose mean the ES is) and the 99 % ES;
    each breach of the 1 % VaR coloured by the traffic-light zone of the 250-day window it closes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = forecasts[(forecasts["ticker"] == ticker) & (forecasts["model"] == model)].sort_values("date")
    sigma = np.sqrt(rows["variance"])
    var = value_at_risk(rows, 0.01)
    (var975, es975), (_, es99) = ([rows["mu"] + sigma * rows[column] for column in es_columns(level)]
                                  for level in (0.025, 0.01))
    figure, axis = plt.subplots(figsize=(12, 4.5))
    axis.plot(rows["date"], rows["ret"], color="0.55", lw=0.5, label="return (%)")
    axis.fill_between(rows["date"], var975, es975, color="tab:purple", alpha=0.3, lw=0, label="97.5% VaR to ES")
    axis.plot(rows["date"], es99, color="tab:purple", lw=0.7, ls=":", label="99% ES")
    axis.plot(rows["date"], var, color="tab:blue", lw=0.9, label="1% VaR")
    hits = (rows["ret"] < var).to_numpy()
    zones = breach_zones(hits)
    for zone, colour in ZONE_COLOURS.items():
        chosen = hits & (zones == zone)
        axis.scatter(rows["date"][chosen], rows["ret"][chosen], color=colour, s=14, zorder=3, edgecolors="0.2",
                     linewidths=0.3, label=f"breach, {zone} zone ({int(chosen.sum())})")
    axis.set_ylabel("daily return (%)")
    axis.set_title(f"{ticker}: {model} VaR and ES, 1% VaR breaches by Basel traffic-light zone (250-day window)")
    axis.legend(loc="lower left", ncol=3, fontsize=8)
    figure.tight_layout()
    return figure
