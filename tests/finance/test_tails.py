"""Expected Shortfall of each model's distribution against numerical integration, and the ES backtests on
simulated returns whose risk is stated right or understated."""

import numpy as np
import pytest
from scipy import integrate
from scipy.stats import norm, t

from usecases.finance.evaluate import acerbi_szekely_z2, mcneil_frey
from usecases.finance.tails import ES_LEVELS, empirical_tails, es_name, normal_tails, student_t_tails


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
    assert mcneil_frey(*right) > 0.05 and abs(acerbi_szekely_z2(right[0], right[1], right[3], 0.025)) < 0.25
    assert mcneil_frey(*understated) < 0.01
    assert acerbi_szekely_z2(understated[0], understated[1], understated[3], 0.025) < -1
    returns, shortfall, sigma, _ = right
    assert np.isnan(mcneil_frey(returns, shortfall, sigma, np.zeros(2000, dtype=bool)))
