"""Forecast evaluation on the test window: losses against two variance proxies, VaR backtests (Kupiec, Christoffersen,
Basel traffic light), ES backtests (McNeil-Frey, Acerbi-Székely Z2), FZ0, Diebold-Mariano, plots. QLIKE = x − ln x − 1
with x = proxy / forecast (Patton 2011) ranks models as the true variance would. Days with a zero proxy are left out,
and so are the H-day forecasts whose proxies would reach past the window."""

from __future__ import annotations

import numpy as np
import pandas as pd
from arch.covariance.kernel import Bartlett
from matplotlib.figure import Figure
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
    """Christoffersen's (1998) independence (χ²(1)) and conditional coverage (χ²(2)) tests and p-values."""
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


def breach_zones(hits: np.ndarray, window: int = BASEL_WINDOW) -> np.ndarray:
    """Each day's Basel traffic-light zone by its 250-day window's 1 % VaR breaches: green ≤ 4, yellow ≤ 9, else red."""
    counts = pd.Series(np.asarray(hits, dtype=float)).rolling(window, min_periods=1).sum().to_numpy()
    return np.where(counts >= 10, "red", np.where(counts >= 5, "yellow", "green"))


def traffic_light(breaches: np.ndarray, window: int = BASEL_WINDOW) -> dict[str, float]:
    """How many whole rolling windows of 99 % VaR breaches fall in each Basel zone."""
    zones = breach_zones(breaches, window)[window - 1:]
    return {f"basel_{zone}_windows": float((zones == zone).sum()) for zone in ("green", "yellow", "red")}


def mcneil_frey(returns: np.ndarray, shortfall: np.ndarray, sigma: np.ndarray, breaches: np.ndarray) -> float:
    """McNeil and Frey's (2000) ES backtest: the one-sided bootstrap p-value that the exceedance residuals
    (return − ES) / σ on breach days have mean zero; NaN with fewer than 2 breaches."""
    residuals = ((returns - shortfall) / sigma)[breaches]
    if len(residuals) < 2 or residuals.std() == 0:
        return float("nan")
    observed = residuals.mean() / residuals.std(ddof=1) * np.sqrt(len(residuals))
    samples = np.random.default_rng(0).choice(residuals - residuals.mean(), (ES_RESAMPLES, len(residuals)))
    spread = samples.std(axis=1, ddof=1)
    statistics = np.divide(samples.mean(axis=1), spread, out=np.zeros(ES_RESAMPLES), where=spread > 0)
    return float((1 + (statistics * np.sqrt(len(residuals)) <= observed).sum()) / (ES_RESAMPLES + 1))


def acerbi_szekely_z2(returns: np.ndarray, shortfall: np.ndarray, breaches: np.ndarray,
                      level: float) -> tuple[float, float]:
    """Acerbi and Székely's (2014) Z2 = Σ r·1{breach} / (T α |ES|) + 1 (0 when the ES is right) and its one-sided
    p-value from the normal approximation of its null (NaN with fewer than 2 breaches)."""
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
    """values[i] + ... + values[i + days − 1]; NaN past the end."""
    return pd.Series(values).rolling(days).sum().shift(-(days - 1)).to_numpy()


def fz0_losses(forecasts: pd.DataFrame, level: float) -> np.ndarray:
    """FZ0 of each day's VaR and ES at tail probability `level` (one of ES_LEVELS)."""
    sigma = np.sqrt(forecasts["variance"].to_numpy())
    quantile, shortfall = (forecasts["mu"].to_numpy() + sigma * forecasts[column].to_numpy()
                           for column in es_columns(level))
    return fz0_loss(forecasts["ret"].to_numpy(), quantile, shortfall, level)


def series_metrics(forecasts: pd.DataFrame, horizon: int, variance_metrics: bool = True) -> dict[str, float]:
    """Metrics of one model on one ticker in date order, against the realised `parkinson` and `ret` (and a
    synthetic panel's `true_variance`); without `variance_metrics` (a tails-only model) the backtests only."""
    variance, parkinson, returns = (forecasts[column].to_numpy() for column in ("variance", "parkinson", "ret"))
    squared = (returns - returns.mean()) ** 2
    variance_h = forecasts["variance_h"].to_numpy()
    parkinson_h, squared_h = _forward_sum(parkinson, horizon), _forward_sum(squared, horizon)
    metrics = {"qlike_sq": qlike(squared, variance), "qlike_parkinson": qlike(parkinson, variance),
               "mse_sq": mse(squared, variance), "mse_parkinson": mse(parkinson, variance),
               "scale_sq": float(squared.mean() / variance.mean()),
               f"qlike_sq_h{horizon}": qlike(squared_h, variance_h),
               f"qlike_parkinson_h{horizon}": qlike(parkinson_h, variance_h),
               f"mse_parkinson_h{horizon}": mse(parkinson_h, variance_h)}
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
    """The H-day 1 % VaR and ES backtests on non-overlapping periods, and the square-root-of-time 1-day VaR."""
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
    """The scores a tail rule is chosen by, on one ticker in date order: the 1 % VaR's and 97.5 % ES's backtests,
    `worst_p` (their smallest p-value) and `fz0` (the mean FZ0 of the 97.5 % and 99 % pairs together)."""
    returns = rows["ret"].to_numpy()
    hits = (rows["ret"] < value_at_risk(rows, 0.01)).to_numpy()
    metrics = {"var1_breaches": float(hits.sum()), "kupiec_p": kupiec_pof(int(hits.sum()), len(hits), 0.01)[1],
               "christoffersen_cc_p": christoffersen(hits, 0.01)[3], "days": float(len(hits))}
    shortfall = shortfall_metrics(returns, rows["mu"].to_numpy(), np.sqrt(rows["variance"].to_numpy()), rows, "")
    metrics.update({name: shortfall[name] for name in ("es975_z2", "es975_z2_p", "es975_mcneil_frey_p")})
    metrics["worst_p"] = float(np.nanmin([metrics[name] for name in ("kupiec_p", "christoffersen_cc_p", "es975_z2_p",
                                                                    "es975_mcneil_frey_p")]))
    metrics["fz0"] = sum(shortfall[f"{es_name(level)}_fz0"] for level in ES_LEVELS)
    return metrics


def choose_tail_rule(candidates: dict[str, pd.DataFrame]) -> tuple[str, dict[str, float]]:
    """The tail rule with the lowest mean FZ0 among those no backtest rejects at PASS_P, else the nearest to
    passing; ties to the first of TAIL_RULES. Returns it and every candidate's scores (`RULE/METRIC/TICKER`)."""
    backtests, passing = {}, {}
    for rule, forecasts in candidates.items():
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
    """`val_qlike_sq` (and per ticker): what the registry compares versions by, so no test day chooses."""
    per_ticker = {}
    for ticker, rows in forecasts[np.isfinite(forecasts["variance"])].groupby("ticker", sort=False):
        returns = rows["ret"].to_numpy()
        per_ticker[f"val_qlike_sq/{ticker}"] = qlike((returns - returns.mean()) ** 2, rows["variance"].to_numpy())
    return {"val_qlike_sq": float(np.mean(list(per_ticker.values()))), **per_ticker}


def evaluate(forecasts: pd.DataFrame, horizon: int = 5, dm_lags: int = 5) -> dict[str, dict[str, float]]:
    """Per model: each metric per ticker as `METRIC/ticker` and its mean as `METRIC`, with Diebold-Mariano tests
    against DM_TESTS (`dm_t_vs_REFERENCE`) and FZ0_REFERENCE (`dm_t_fz0_es975`); TAIL_ONLY models on FZ0 alone."""
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
    """DM of one model's QLIKE against the reference's, on the days both forecast and the proxy is positive."""
    paired = rows.set_index(["ticker", "date"]).join(reference["variance"].rename("variance_reference"), how="inner")
    values = (paired["ret"] - paired["ret"].mean()).to_numpy() ** 2 if proxy == "sq" else paired["parkinson"].to_numpy()
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


def forecast_figure(forecasts: pd.DataFrame, ticker: str, models: list[str]) -> Figure:
    figure = Figure(figsize=(12, 4.5), layout="tight")
    axis = figure.subplots()
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
    return figure


def risk_figure(forecasts: pd.DataFrame, ticker: str, model: str) -> Figure:
    """Returns with the 1 % VaR, the 97.5 % VaR-to-ES band and the 99 % ES; breaches coloured by traffic-light zone."""
    rows = forecasts[(forecasts["ticker"] == ticker) & (forecasts["model"] == model)].sort_values("date")
    sigma = np.sqrt(rows["variance"])
    var = value_at_risk(rows, 0.01)
    (var975, es975), (_, es99) = ([rows["mu"] + sigma * rows[column] for column in es_columns(level)]
                                  for level in (0.025, 0.01))
    figure = Figure(figsize=(12, 4.5), layout="tight")
    axis = figure.subplots()
    axis.plot(rows["date"], rows["ret"], color="0.55", lw=0.5, label="return (%)")
    axis.fill_between(rows["date"], var975, es975, color="tab:purple", alpha=0.3, lw=0, label="97.5% VaR to ES")
    axis.plot(rows["date"], es99, color="tab:purple", lw=0.7, ls=":", label="99% ES")
    axis.plot(rows["date"], var, color="tab:blue", lw=0.9, label="1% VaR")
    hits = (rows["ret"] < var).to_numpy()
    zones = breach_zones(hits)
    for zone, colour in {"green": "tab:green", "yellow": "gold", "red": "tab:red"}.items():
        chosen = hits & (zones == zone)
        axis.scatter(rows["date"][chosen], rows["ret"][chosen], color=colour, s=14, zorder=3, edgecolors="0.2",
                     linewidths=0.3, label=f"breach, {zone} zone ({int(chosen.sum())})")
    axis.set_ylabel("daily return (%)")
    axis.set_title(f"{ticker}: {model} VaR and ES, 1% VaR breaches by Basel traffic-light zone (250-day window)")
    axis.legend(loc="lower left", ncol=3, fontsize=8)
    return figure
