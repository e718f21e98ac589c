import numpy as np
import pandas as pd
import pytest

from usecases.finance.features import HAR_WINDOWS, NEURAL_FEATURES, add_features, parkinson_variance

LOOK_AHEAD = ["target", "target_ret", "target_date", "target_h", "target_date_h", "target_ret_h", "target_sq",
              "target_sq_h", "target_true"]


def test_parkinson_variance_matches_the_formula():
    high, low = pd.Series([101.0, 100.0]), pd.Series([99.0, 100.0])
    expected = (100 * np.log(101 / 99)) ** 2 / (4 * np.log(2))
    np.testing.assert_allclose(parkinson_variance(high, low), [expected, 0.0])


def test_returns_and_har_averages_by_hand(panel):
    frame = add_features(panel)
    one = panel[panel["ticker"] == "SYN000"].reset_index(drop=True)
    rows = frame[frame["ticker"] == "SYN000"].reset_index(drop=True)
    np.testing.assert_allclose(rows["ret"].iloc[0], 100 * np.log(one["close"].iloc[1] / one["close"].iloc[0]))
    daily = parkinson_variance(one["high"], one["low"]).iloc[1:].reset_index(drop=True)
    np.testing.assert_allclose(rows["rv_m"].iloc[30], daily.iloc[9:31].mean())
    assert set(HAR_WINDOWS) <= set(frame.columns)
    assert rows["target"].iloc[30] == pytest.approx(daily.iloc[31])
    assert rows["target_h"].iloc[30] == pytest.approx(daily.iloc[31:36].sum())
    assert rows["target_date_h"].iloc[30] == rows["date"].iloc[35]


def test_features_are_causal(panel, perturb_after):
    """Changing every price after day t leaves every feature at or before t unchanged."""
    cutoff = panel["date"].sort_values().unique()[600]
    before, after = add_features(panel), add_features(perturb_after(panel, cutoff))
    columns = [c for c in before.columns if c not in LOOK_AHEAD + ["date", "ticker"]]
    early = before["date"] <= cutoff
    pd.testing.assert_frame_equal(before.loc[early, columns], after.loc[early, columns])
    assert not np.allclose(before.loc[~early, "rv_w"].dropna(), after.loc[~early, "rv_w"].dropna())


def test_neural_features_are_finite_after_warm_up(panel):
    frame = add_features(panel)
    warm = frame.groupby("ticker").cumcount() >= 65
    assert np.isfinite(frame.loc[warm, NEURAL_FEATURES].to_numpy()).all()


def test_zero_range_days_keep_features_finite(panel):
    flat = panel.copy()
    flat.loc[100:110, "high"] = flat.loc[100:110, "low"]
    frame = add_features(flat)
    warm = frame.groupby("ticker").cumcount() >= 65
    assert np.isfinite(frame.loc[warm, NEURAL_FEATURES].to_numpy()).all()
