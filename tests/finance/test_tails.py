"""Expected Shortfall of each model's distribution against numerical integration, and the ES backtests on
simulated returns whose risk is stated right or understated."""

import numpy as np
import pandas as pd
import pytest
from scipy import integrate
from scipy.stats import norm, t

from usecases.finance.evaluate import acerbi_szekely_z2, mcneil_frey
from usecases.finance.tails import (ES_LEVELS, MIN_RESIDUALS, TAIL_COLUMNS, empirical_columns, empirical_tails,
                                    es_name, normal_tails, recalibrate, student_t_tails)


def shortfall_by_integration(pdf, quantile: float, level: float) -> float:
    return integrate.quad(lambda z: z * pdf(z), -np.inf, quantile)[0] / level


def test_names_of_the_levels():
    assert [es_name(level) for level in ES_LEVELS] == ["es975", "es99"]


def test_normal_and_standardised_student_t_shortfalls_equal_their_integrals():
    for level, (quantile, shortfall) in zip(ES_LEVELS, normal_tails()):
        assert quantile == pytest.approx(norm.ppf(level))
        assert shortfall == pytest.approx(shortfall_by_integration(norm.pdf, quantile, level))
    nu = 5.0
    scale = np.sqrt((nu - 2) / nu)  # unit variance, as arch's Student-t
    for level, (quantile, shortfall) in zip(ES_LEVELS, student_t_tails(nu)):
        pdf = lambda z: t.pdf(z / scale, nu) / scale  # noqa: E731
        assert integrate.quad(pdf, -np.inf, quantile)[0] == pytest.approx(level)
        assert shortfall == pytest.approx(shortfall_by_integration(pdf, quantile, level), rel=1e-6)
        assert shortfall < normal_tails()[ES_LEVELS.index(level)][1], "fatter tails, larger shortfall"


def test_empirical_tails_of_a_large_normal_sample_are_the_normal_ones():
    sample = np.random.default_rng(0).standard_normal(400_000)
    for (quantile, shortfall), (expected_q, expected_es) in zip(empirical_tails(sample), normal_tails()):
        assert quantile == pytest.approx(expected_q, abs=0.02) and shortfall == pytest.approx(expected_es, abs=0.02)


def simulated(sigma_stated: float):
    """2,000 days of normal returns with volatility 1, and the 97.5 % VaR and ES of a model that says sigma_stated."""
    returns = np.random.default_rng(3).standard_normal(2000)
    (quantile, shortfall), _ = normal_tails()
    sigma = np.full(2000, sigma_stated)
    return returns, sigma * shortfall, sigma, returns < sigma * quantile


def test_the_es_backtests_pass_a_right_model_and_reject_an_understated_one():
    right, understated = simulated(1.0), simulated(0.6)
    statistic, p_value = acerbi_szekely_z2(right[0], right[1], right[3], 0.025)
    assert mcneil_frey(*right) > 0.05 and abs(statistic) < 0.25 and p_value > 0.05
    statistic, p_value = acerbi_szekely_z2(understated[0], understated[1], understated[3], 0.025)
    assert mcneil_frey(*understated) < 0.01 and statistic < -1 and p_value < 0.001
    returns, shortfall, sigma, _ = right
    assert np.isnan(mcneil_frey(returns, shortfall, sigma, np.zeros(2000, dtype=bool)))


def test_the_z2_p_value_is_about_uniform_under_a_right_model():
    rng = np.random.default_rng(11)
    (quantile, shortfall), _ = normal_tails()
    p_values = []
    for _ in range(400):
        returns = rng.standard_normal(2000)
        p_values.append(acerbi_szekely_z2(returns, np.full(2000, shortfall), returns < quantile, 0.025)[1])
    assert 0.02 < np.mean(np.array(p_values) < 0.05) < 0.09, "rejects a right model about 5 % of the time"


def residual_frame(days: int = 600) -> pd.DataFrame:
    """One ticker's forecasts of unit variance for days of returns with volatility 2 after day 300."""
    rng = np.random.default_rng(5)
    dates = pd.bdate_range("2020-01-01", periods=days)
    returns = rng.standard_normal(days) * np.where(np.arange(days) < 300, 1.0, 2.0)
    frame = pd.DataFrame({"ticker": "a", "date": dates, "date_h": dates + pd.offsets.BDay(1),
                          "ret": returns, "ret_h": returns + np.roll(returns, -1), "mu": 0.0, "variance": 1.0,
                          "variance_h": 2.0})
    return frame.assign(**empirical_columns(np.array([-1.0, 0.0, 1.0]), np.array([-1.0, 0.0, 1.0])))


def test_recalibration_takes_each_block_s_tails_from_the_residuals_before_it_only():
    frame = residual_frame()
    starts = list(frame["date"][::50])
    out = recalibrate(frame, starts, horizon=2)
    assert MIN_RESIDUALS == 250 and out[frame["date"] < starts[5]].equals(frame[frame["date"] < starts[5]]), \
        "the training window's tails until 250 residuals exist (on the 250th day)"
    block = (frame["date"] >= starts[6]) & (frame["date"] < starts[7])
    past = frame.loc[frame["date"] < starts[6], "ret"].to_numpy()
    assert (out.loc[block, "q01"] == np.quantile(past, 0.01)).all()
    assert np.allclose(out.loc[block, "es975"], past[past <= np.quantile(past, 0.025)].mean())
    changed = frame.assign(ret=np.where(frame["date"] >= starts[8], frame["ret"] * 10, frame["ret"]))
    tails = TAIL_COLUMNS
    assert list(empirical_columns(np.zeros(1), np.zeros(1))) == TAIL_COLUMNS
    early = frame["date"] < starts[9]
    assert recalibrate(changed, starts, horizon=2).loc[early, tails].equals(out.loc[early, tails]), \
        "returns on or after a block start never reach its tails"
    late = frame["date"] >= starts[11]
    assert (out.loc[late, "q01"] < out.loc[block, "q01"].min()).all(), "the wider residuals after day 300 widen it"
