"""Metrics on values checked by hand."""

import math

import numpy as np
import pandas as pd
import pytest

from usecases.finance.evaluate import (christoffersen, diebold_mariano, evaluate, kupiec_pof, mse, qlike,
                                      series_metrics, traffic_light, value_at_risk)


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


def test_christoffersen_by_hand_and_on_clustered_breaches():
    """Transitions of 0 0 1 1 0 0 0 1 0 0: n00 = 4, n01 = 2, n10 = 2, n11 = 1."""
    hits = np.array([0, 0, 1, 1, 0, 0, 0, 1, 0, 0], dtype=bool)
    p01, p11, p = 2 / 6, 1 / 3, 3 / 9
    markov = 4 * math.log(1 - p01) + 2 * math.log(p01) + 2 * math.log(1 - p11) + math.log(p11)
    independent = 6 * math.log(1 - p) + 3 * math.log(p)
    independence, _, coverage, _ = christoffersen(hits, 0.01)
    assert independence == pytest.approx(-2 * (independent - markov), abs=1e-12)
    assert coverage == pytest.approx(independence + kupiec_pof(3, 10, 0.01)[0])

    rng = np.random.default_rng(1)
    scattered = rng.random(2000) < 0.01
    clustered = np.zeros(2000, dtype=bool)
    clustered[[100, 101, 102, 103, 900, 901, 902, 903, 1500, 1501, 1502, 1503, 1800, 1801, 1802, 1803, 1900,
               1901, 1902, 1903]] = True  # 20 breaches, the rate of a 1 % VaR, in runs of 4
    assert christoffersen(scattered, 0.01)[1] > 0.05
    assert christoffersen(clustered, 0.01)[1] < 1e-6 and christoffersen(clustered, 0.01)[3] < 1e-6
    assert kupiec_pof(20, 2000, 0.01)[1] == 1.0, "the rate is right: only the clustering is caught"


def test_the_traffic_light_counts_rolling_windows_by_zone():
    hits = np.zeros(300, dtype=bool)
    hits[[10, 20, 30, 40, 50]] = True  # five breaches in the first 51 days: yellow while a window holds them all
    zones = traffic_light(hits)
    assert sum(zones.values()) == 51  # windows ending on days 250 to 300
    assert zones == {"basel_green_windows": 40.0, "basel_yellow_windows": 11.0, "basel_red_windows": 0.0}
    hits[100:110] = True
    assert traffic_light(hits)["basel_red_windows"] == 51
    assert traffic_light(hits[:100]) == {"basel_green_windows": 0.0, "basel_yellow_windows": 0.0,
                                         "basel_red_windows": 0.0}


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
        for model in ("har_rv", "neural"):
            for day in days:
                rows.append({"model": model, "ticker": ticker, "date": day, "variance": 1.0, "variance_h": 2.0,
                             "mu": 0.0,
                             "q01": -2.33, "q05": -1.64, "es975_q": -1.96, "es975": -2.34, "es99_q": -2.33,
                             "es99": -2.67, "es975_h_q": -1.96, "es975_h": -2.34, "es99_h_q": -2.33,
                             "es99_h": -2.67, "parkinson": proxy, "ret": -3.0 if day == days[0] else 0.5})
    results = evaluate(pd.DataFrame(rows), horizon=2, dm_lags=0)
    neural = results["neural"]
    assert neural["qlike_parkinson/a"] == 0
    assert neural["qlike_parkinson/b"] == pytest.approx(2 - math.log(2) - 1)
    assert neural["qlike_parkinson"] == pytest.approx((2 - math.log(2) - 1) / 2)
    assert neural["var1_breach_rate"] == 0.25
    assert neural["es975_breaches"] == 1 and neural["es975_mean"] == pytest.approx(-2.34)
    assert neural["es975_z2/a"] == pytest.approx(-3.0 / (4 * 0.025 * 2.34) + 1)
    assert neural["h2_periods/a"] == 2 and neural["var1_h2_breaches/a"] == 0, "days 1+2 sum to -2.5, above -4.66"
    assert neural["qlike_parkinson_h2/a"] == 0, "two days of variance 1 sum to the forecast of 2"
    assert neural["mse_parkinson_h2/b"] == pytest.approx(4.0), "three full two-day windows, each 4 against 2"
    assert "dm_t_vs_har_rv" in neural and "dm_t_vs_har_rv" not in results["har_rv"]
    assert "dm_t_vs_gjr_garch_t" not in neural, "no GJR-t forecasts to test against"


def test_the_h_day_var_uses_the_h_day_variance_and_its_square_root_of_time_baseline_the_one_day_one():
    """Ten origins, every other one starting a 2-day period that loses 5 %; the 2-day variance forecast (9, VaR
    −6.99) covers it, the square-root-of-time one (2 × 1, VaR −3.29) does not."""
    days = pd.bdate_range("2020-01-01", periods=10)
    rows = pd.DataFrame({"date": days, "variance": 1.0, "variance_h": 9.0, "mu": 0.0, "q01": -2.33, "q05": -1.64,
                         "es975_q": -1.96, "es975": -2.34, "es99_q": -2.33, "es99": -2.67, "es975_h_q": -1.96,
                         "es975_h": -2.34, "es99_h_q": -2.33, "es99_h": -2.67, "parkinson": 1.0,
                         "ret": [-3.0, -2.0] * 5})
    metrics = series_metrics(rows, horizon=2)
    assert metrics["h2_periods"] == 5
    assert metrics["var1_h2_breaches"] == 0 and metrics["var1_h2_sqrt_time_breaches"] == 5
    assert metrics["var1_h2_sqrt_time_kupiec_p"] < 0.001
    assert metrics["es975_h2_breaches"] == 0 and metrics["var1_breaches"] == 5
