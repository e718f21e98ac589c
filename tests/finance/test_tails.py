"""Expected Shortfall of each model's distribution against numerical integration, and the ES backtests on
simulated returns whose risk is stated right or understated."""

import numpy as np
import pandas as pd
import pytest
from scipy import integrate
import torch
from scipy.stats import genpareto, norm, t

from usecases.finance.evaluate import acerbi_szekely_z2, mcneil_frey
from usecases.finance.tails import (ES_LEVELS, EVT_THRESHOLD, MIN_RESIDUALS, TAIL_COLUMNS, empirical_columns,
                                    empirical_tails, es_name, evt_columns, evt_tails, fz0_loss, normal_tails,
                                    recalibrate, student_t_tails)


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


def test_fz0_by_hand_in_numpy_and_torch():
    """L = −1{y ≤ v}(v − y) / (α e) + v / e + log(−e) − 1, Patton, Ziegel and Chen (2019)."""
    returns, var, shortfall = np.array([-3.0, 0.5]), np.array([-2.0, -2.0]), np.array([-2.5, -2.5])
    breach = -1 * (-2 + 3) / (0.025 * -2.5) + (-2 / -2.5) + np.log(2.5) - 1  # 16 + 0.8 + 0.916 − 1
    calm = -2 / -2.5 + np.log(2.5) - 1
    np.testing.assert_allclose(fz0_loss(returns, var, shortfall, 0.025), [breach, calm])
    assert breach == pytest.approx(16.716290731874155)
    as_tensors = fz0_loss(*(torch.tensor(values) for values in (returns, var, shortfall)), 0.025)
    np.testing.assert_allclose(as_tensors.numpy(), [breach, calm])


def test_fz0_is_smallest_in_expectation_at_the_true_var_and_es():
    sample = np.random.default_rng(1).standard_normal(400_000)
    (quantile, shortfall), _ = normal_tails()
    right = fz0_loss(sample, quantile, shortfall, 0.025).mean()
    for factor in (0.8, 1.2):
        assert fz0_loss(sample, quantile * factor, shortfall, 0.025).mean() > right
        assert fz0_loss(sample, quantile, shortfall * factor, 0.025).mean() > right


def test_evt_tails_of_a_pareto_tailed_sample_are_its_own():
    """Below its 10 % quantile the sample is exactly generalised Pareto (ξ = 0.2, β = 0.6): the fitted tail gives the
    distribution's quantile and ES, which the empirical ones match too."""
    rng = np.random.default_rng(2)
    body = rng.uniform(-1, 3, 180_000)
    tail = -1 - genpareto.rvs(0.2, scale=0.6, size=20_000, random_state=rng)
    sample = np.concatenate([body, tail])
    for (quantile, shortfall), level in zip(evt_tails(sample, ES_LEVELS), ES_LEVELS):
        beyond = genpareto.isf(level / EVT_THRESHOLD, 0.2, scale=0.6)
        assert quantile == pytest.approx(-1 - beyond, rel=0.02)
        assert shortfall == pytest.approx(-1 - beyond - (0.6 + 0.2 * beyond) / 0.8, rel=0.03)
    empirical = empirical_tails(sample)
    for (quantile, shortfall), (expected_q, expected_es) in zip(evt_tails(sample, ES_LEVELS), empirical):
        assert quantile == pytest.approx(expected_q, rel=0.02) and shortfall == pytest.approx(expected_es, rel=0.03)
    assert list(evt_columns(sample)) == TAIL_COLUMNS


def validation_rows(tail_scale: float, seed: int = 4) -> pd.DataFrame:
    """504 days of one ticker's normal returns, forecast with unit variance and normal tails times `tail_scale`."""
    returns = np.random.default_rng(seed).standard_normal(504)
    columns = {name: value * tail_scale for name, value in empirical_columns(
        np.random.default_rng(0).standard_normal(200_000), np.random.default_rng(1).standard_normal(200_000)).items()}
    return pd.DataFrame({"ticker": "a", "date": pd.bdate_range("2009-01-01", periods=504), "ret": returns,
                         "mu": 0.0, "variance": 1.0, **columns})


def test_the_rule_chosen_is_the_lowest_fz0_of_those_the_backtests_pass():
    from usecases.finance.evaluate import choose_tail_rule

    right, wide, narrow = validation_rows(1.0), validation_rows(1.3), validation_rows(0.6)
    rule, scores = choose_tail_rule({"training": wide, "out_of_sample": right, "fz": narrow})
    assert scores["fz/passes"] == 0 and scores["out_of_sample/passes"] == 1
    assert scores["out_of_sample/fz0"] < scores["training/fz0"]
    assert rule == "out_of_sample"
    assert choose_tail_rule({"training": narrow, "fz": validation_rows(0.5)})[0] == "training", \
        "none passes: the nearest to passing"


def test_the_joint_head_learns_tails_that_move_with_an_input_and_keeps_es_below_var_below_zero():
    """Standardised returns whose tail is twice as wide when the (scaled) input is high: the FZ0-trained head moves
    its VaR and ES with it, from the pooled empirical start."""
    from usecases.finance.joint import fit_heads

    rng = np.random.default_rng(6)
    signal = rng.choice([-1.0, 1.0], 20_000)
    returns = rng.standard_normal(20_000) * np.where(signal > 0, 1.4, 0.7)
    standardised = np.column_stack([returns, returns])
    start = empirical_columns(returns, returns)
    head, other = fit_heads([torch.tensor(signal[:, None], dtype=torch.float32), torch.zeros(300, 1)],
                            [standardised, standardised[:300]], [start, start])
    columns = head.columns(torch.tensor([[-1.0], [1.0]]))
    (quantile, shortfall), _ = normal_tails()
    assert columns["es975_q"] == pytest.approx([0.7 * quantile, 1.4 * quantile], rel=0.15)
    assert columns["es975"] == pytest.approx([0.7 * shortfall, 1.4 * shortfall], rel=0.15)
    for row, regime in enumerate((-1.0, 1.0)):  # the 1 % VaR and ES of each regime's own returns
        days = returns[signal == regime]
        breached = days <= columns["q01"][row]
        assert breached.mean() == pytest.approx(0.01, abs=0.003), "q01 is breached on 1 % of the days"
        assert columns["es99"][row] == pytest.approx(days[breached].mean(), rel=0.1), "es99 their mean"
    assert (columns["es99"] < columns["q01"]).all()
    for level in ("es975", "es99", "es975_h", "es99_h"):
        assert (columns[level] < columns[f"{level}_q"]).all() and (columns[f"{level}_q"] < 0).all()
    others = other.columns(torch.tensor([[-1.0], [1.0]]))
    assert others["es975_q"][0] != pytest.approx(columns["es975_q"][0], rel=0.1), "a refit beside it learns its own"


def test_the_tail_models_a_run_may_serve_are_the_ones_it_chooses_among():
    """`evaluation.tail_models` offers every rule of TAIL_RULES by default; naming gas without running it is refused."""
    from pydantic import ValidationError

    from usecases.finance.config import Config
    from usecases.finance.tails import TAIL_RULES

    assert tuple(Config().evaluation.tail_models) == TAIL_RULES
    assert Config.model_validate({"baselines": {"models": ["ewma"]}}).evaluation.tail_models[-1] == "gas"
    with pytest.raises(ValidationError, match="baselines.models must include gas"):
        Config.model_validate({"evaluation": {"tail_models": ["gas"]}, "baselines": {"models": ["ewma"]}})


def test_evt_recalibration_puts_a_generalised_pareto_tail_on_the_same_residuals():
    frame = residual_frame()
    starts = list(frame["date"][::50])
    out = recalibrate(frame, starts, horizon=2, tails_of=evt_columns)
    block = (frame["date"] >= starts[6]) & (frame["date"] < starts[7])
    past = frame.loc[frame["date"] < starts[6], "ret"].to_numpy()
    past_h = frame.loc[frame["date_h"] < starts[6], "ret_h"].to_numpy() / np.sqrt(2.0)  # variance_h 2
    for column, value in evt_columns(past, past_h).items():
        assert np.allclose(out.loc[block, column], value), column
    assert not np.allclose(out.loc[block, "es99"], recalibrate(frame, starts, horizon=2).loc[block, "es99"])
