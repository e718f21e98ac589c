"""The `default` preset on the real S&P 500 and NASDAQ: the issue's acceptance run (about 80 s on 2 cores, so in the
slow suite with the other real-data reproductions; the default suite runs the same pipeline on the smoke preset).

Where $USECASES_REPRODUCE_FROM names a tracking store (CI hands it the demo's, whose finance run is this same `default`
run on arch's copy of the data), the tests check that store's finished run instead of making the same run again."""

import pytest

from tests.cli_helpers import demo_run, preset_summary

pytestmark = pytest.mark.slow

REFERENCE = {  # published for S&P 500 from arch, test 2011-01-03 .. 2018-12-31, 21-day expanding refits
    "ewma": (0.524, 1.731), "garch": (0.566, 1.679), "gjr_garch_t": (0.523, 1.633), "har_rv": (0.425, 1.654),
}


@pytest.fixture(scope="module")
def summary(tmp_path_factory):
    made = demo_run("finance", "default", data_source="arch:sp500+nasdaq")
    return made[0] if made else preset_summary(tmp_path_factory, "finance", "default")


def test_every_model_has_every_metric_per_series(summary):
    assert set(summary["models"]) == {"ewma", "garch", "gjr_garch_t", "gjr_garch_t_evt", "har", "har_rv", "gas",
                                      "neural", "neural_training", "neural_out_of_sample",
                                      "neural_out_of_sample_evt", "neural_fz"}
    for model, metrics in summary["models"].items():
        for metric in ("var1_breach_rate", "kupiec_p", "es975_fz0", "es99_fz0",
                       *(() if model == "gas" else ("qlike_parkinson", "qlike_sq", "mse_parkinson"))):
            assert {metric, f"{metric}/sp500", f"{metric}/nasdaq"} <= set(metrics)


def test_sp500_baselines_match_the_reference_numbers(summary):
    """The published S&P 500 numbers of each baseline, from the run itself (the walk-forward is too long to repeat
    outside it): QLIKE, the test days, the 1 % VaR breaches and the Diebold-Mariano statistics against HAR-RV."""
    models = summary["models"]
    for model, (qlike_parkinson, qlike_sq) in REFERENCE.items():
        metrics = models[model]
        assert metrics["qlike_parkinson/sp500"] == pytest.approx(qlike_parkinson, abs=0.03), model
        assert metrics["qlike_sq/sp500"] == pytest.approx(qlike_sq, abs=0.03), model
    assert models["garch"]["test_days/sp500"] == 2012
    assert abs(models["garch"]["var1_breaches/sp500"] - 39) <= 2
    assert abs(models["gjr_garch_t"]["var1_breaches/sp500"] - 31) <= 2
    assert models["garch"]["dm_t_vs_har_rv/sp500"] == pytest.approx(12.8, abs=0.5)
    assert models["gjr_garch_t"]["dm_t_vs_har_rv/sp500"] == pytest.approx(8.8, abs=0.5)


# The backtests the neural model passes at 5 % on the test window, its tail rule chosen on 2009-2010 (issue 19). With
# the rule chosen on the test window itself, the NASDAQ's 1 % VaR passed Kupiec and conditional coverage too.
PASSED = {"sp500": ("kupiec_p", "christoffersen_cc_p", "es975_z2_p"), "nasdaq": ("es975_z2_p",)}


@pytest.mark.parametrize("series", ["sp500", "nasdaq"])
def test_the_neural_model_meets_the_risk_team_s_bar_on_each_series(summary, series):
    """Issue 13's acceptance: the return-scale forecast beats GJR-t, the range forecast beats HAR, and the 1 % VaR
    and 97.5 % ES backtests do not reject at 5 %, except the NASDAQ's VaR (below)."""
    neural, models = summary["models"]["neural"], summary["models"]
    assert neural[f"qlike_sq/{series}"] < models["gjr_garch_t"][f"qlike_sq/{series}"]
    assert neural[f"dm_t_vs_gjr_garch_t/{series}"] < 0
    assert neural[f"qlike_parkinson/{series}"] < models["har"][f"qlike_parkinson/{series}"]
    for test in PASSED[series]:
        assert neural[f"{test}/{series}"] > 0.05, test


def test_the_nasdaq_var_chosen_before_the_test_window_breaches_too_often(summary):
    """The README's honest result: out-of-sample tails chosen on 2009-2010 breach 33 times for 20 expected on the
    NASDAQ, which Kupiec rejects; still fewer breaches than GJR-t's."""
    neural, gjr = summary["models"]["neural"], summary["models"]["gjr_garch_t"]
    assert 20 < neural["var1_breaches/nasdaq"] < gjr["var1_breaches/nasdaq"]
    assert neural["kupiec_p/nasdaq"] < 0.05


def test_the_tails_are_chosen_on_validation_and_the_served_ones_still_fail_the_nasdaq_var(summary):
    """Issue 35: of the five tail models, `out_of_sample`, `out_of_sample_evt` and `gas` pass every validation backtest
    on 2009-2010 and `out_of_sample` has the lowest FZ0 there, so it is served (the rows `neural` and
    `neural_out_of_sample` agree); on the test window its NASDAQ 1 % VaR still fails Kupiec and conditional coverage
    and McNeil-Frey rejects its ES on both series."""
    models = summary["models"]
    neural = models["neural"]
    for metric in ("var1_breaches/nasdaq", "es975_fz0/sp500", "es975_mcneil_frey_p/nasdaq"):
        assert neural[metric] == models["neural_out_of_sample"][metric]
    assert neural["kupiec_p/nasdaq"] < 0.05 and neural["christoffersen_cc_p/nasdaq"] < 0.05
    assert neural["es975_mcneil_frey_p/sp500"] < 0.05 and neural["es975_mcneil_frey_p/nasdaq"] < 0.05


def test_gas_passes_on_the_sp500_and_breaches_too_rarely_on_the_nasdaq_and_fhs_evt_beats_gjr_t_s_own(summary):
    """Reported, and a candidate not chosen: the one-factor GAS model passes Kupiec, conditional coverage, Z2 and
    McNeil-Frey on the S&P 500; on the NASDAQ its VaR is breached about half as often as it should be, which Kupiec
    rejects, with its ES on the safe side on both (Z2 > 0) and the worst 97.5 % FZ0 of the tail models. FHS with a GPD
    tail on GJR-t's residuals breaches less and scores a lower FZ0 than GJR-t's Student-t tail."""
    gas, evt, gjr = (summary["models"][name] for name in ("gas", "gjr_garch_t_evt", "gjr_garch_t"))
    for test in ("kupiec_p", "christoffersen_cc_p", "es975_z2_p", "es975_mcneil_frey_p"):
        assert gas[f"{test}/sp500"] > 0.05, test
    assert gas["var1_breaches/nasdaq"] < 15 and gas["kupiec_p/nasdaq"] < 0.05
    for series in ("sp500", "nasdaq"):
        assert gas[f"es975_z2/{series}"] > 0 and gas[f"dm_t_fz0_es975/{series}"] > 0
        assert evt[f"var1_breaches/{series}"] < gjr[f"var1_breaches/{series}"]
        assert evt[f"es975_fz0/{series}"] < gjr[f"es975_fz0/{series}"]


@pytest.mark.parametrize("series", ["sp500", "nasdaq"])
def test_the_neural_fz0_at_97_5_is_below_fhs_evt_s_but_not_significantly(summary, series):
    """The served tails and the joint FZ0 head both score a lower 97.5 % FZ0 than FHS-EVT on GJR-t, with
    Diebold-Mariano t between -1.5 and 0 (not significant at 5 %)."""
    for model in ("neural", "neural_fz"):
        metrics = summary["models"][model]
        assert metrics[f"es975_fz0/{series}"] < summary["models"]["gjr_garch_t_evt"][f"es975_fz0/{series}"], model
        assert -1.5 < metrics[f"dm_t_fz0_es975/{series}"] < 0 and metrics[f"dm_p_fz0_es975/{series}"] > 0.05, model
