"""Metrics on values checked by hand."""

import math

import numpy as np
import pandas as pd
import pytest

from usecases.finance.evaluate import diebold_mariano, evaluate, kupiec_pof, mse, qlike, value_at_risk


def test_qlike_by_hand():
    assert qlike(np.array([1.0]), np.array([1.0])) == 0
    assert qlike(np.array([2.0]), np.array([1.0])) == pytest.approx(2 - math.log(2) - 1)
    assert qlike(np.array([1.0, 0.0]), np.array([2.0, 5.0])) == pytest.approx(0.5 - math.log(0.5) - 1)


def test_mse_leaves_out_zero_proxies():
    assert mse(np.array([1.0, 0.0, 3.0]), np.array([2.0, 9.0, 1.0])) == pytest.approx((1 + 4) / 2)


def test_kupiec_matches_the_reference_and_the_formula():
    assert kupiec_pof(39, 2012, 0.01)[1] == pytest.approx(0.0002, abs=0.0001)
    assert kupiec_pof(31, 2012, 0.01)[1] == pytest.approx(0.024, abs=0.001)
    assert kupiec_pof(20, 2000, 0.01) == (0.0, 1.0)
    rate = 5 / 100
    expected = -2 * (95 * math.log(0.99) + 5 * math.log(0.01) - 95 * math.log(1 - rate) - 5 * math.log(rate))
    assert kupiec_pof(5, 100, 0.01)[0] == pytest.approx(expected)
    assert kupiec_pof(0, 100, 0.01)[0] == pytest.approx(-2 * 100 * math.log(0.99))


def test_diebold_mariano_without_lags_is_a_plain_t_statistic():
    rng = np.random.default_rng(0)
    reference = rng.exponential(size=500)
    losses = reference + 0.1 + rng.normal(0, 0.5, 500)
    difference = losses - reference
    expected = difference.mean() / math.sqrt(difference.var() / len(difference))
    statistic, p_value = diebold_mariano(losses, reference, lags=0)
    assert statistic == pytest.approx(expected)
    assert p_value < 0.01


def test_diebold_mariano_with_lags_widens_for_autocorrelated_differences():
    rng = np.random.default_rng(1)
    noise = rng.normal(size=2000)
    autocorrelated = np.convolve(noise, np.ones(5) / 5, mode="same") + 0.02
    plain = diebold_mariano(autocorrelated, np.zeros(2000), lags=0)[0]
    robust = diebold_mariano(autocorrelated, np.zeros(2000), lags=5)[0]
    assert abs(robust) < abs(plain)


def test_value_at_risk_is_mean_plus_volatility_times_quantile():
    rows = pd.DataFrame({"mu": [0.1], "variance": [4.0], "q01": [-2.33], "q05": [-1.64]})
    assert value_at_risk(rows, 0.01).iloc[0] == pytest.approx(0.1 - 2 * 2.33)


def test_evaluate_names_metrics_per_series_and_averages_them():
    days = pd.bdate_range("2020-01-01", periods=4)
    rows = []
    for ticker, proxy in (("a", 1.0), ("b", 2.0)):
        for model in ("har", "neural"):
            for day in days:
                rows.append({"model": model, "ticker": ticker, "date": day, "variance": 1.0, "variance_h": 2.0,
                             "mu": 0.0,
                             "q01": -2.33, "q05": -1.64, "parkinson": proxy, "ret": -3.0 if day == days[0] else 0.5})
    results = evaluate(pd.DataFrame(rows), horizon=2, dm_lags=0)
    neural = results["neural"]
    assert neural["qlike_parkinson/a"] == 0
    assert neural["qlike_parkinson/b"] == pytest.approx(2 - math.log(2) - 1)
    assert neural["qlike_parkinson"] == pytest.approx((2 - math.log(2) - 1) / 2)
    assert neural["var1_breach_rate"] == 0.25
    assert neural["qlike_parkinson_h2/a"] == 0, "two days of variance 1 sum to the forecast of 2"
    assert neural["mse_parkinson_h2/b"] == pytest.approx(4.0), "three full two-day windows, each 4 against 2"
    assert "dm_t_vs_har" in neural and "dm_t_vs_har" not in results["har"]
