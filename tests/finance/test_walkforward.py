"""The walk-forward harness: no look-ahead anywhere, refits on schedule, and a neural model that learns."""

import numpy as np
import pandas as pd
import pytest
import torch

from common.errors import UserError
from common.tracking.runs import Tracker
from tests.finance.rounding import FLOAT64_SLACK, assert_within, gap, risk_gap, tail_error, variance_error
from usecases.finance.config import Config
from usecases.finance.evaluate import qlike
from usecases.finance.features import add_features
from usecases.finance.tails import TAIL_RULES
from usecases.finance.pipeline import (
    baseline_forecasts,
    block_starts,
    evaluation_window,
    neural_forecasts,
    training_window,
    validation_window,
)


@pytest.fixture
def config():
    return Config.model_validate({
        "evaluation": {"test_start": None, "test_end": None, "test_fraction": 0.3, "refit_every": 21},
        "train": {"epochs": 8, "patience": 3, "refit_every": 100},
        "neural": {"hidden": 16},
    })


def served(neural, latest):
    """The served model's rows of `neural_forecasts` (the others: each tail rule's), and its `latest`."""
    return neural[neural["model"] == "neural"], latest


def forecasts(panel, config, job):
    frame = add_features(panel)
    mask = evaluation_window(frame, config)
    neural, _ = neural_forecasts(frame, mask, config, job)
    result = pd.concat([baseline_forecasts(frame, mask, config), neural])
    return result.join(frame[["ticker", "date"]].rename(columns={"date": "origin"}))


@pytest.fixture
def unperturbed(panel, config, cpu_job):
    return forecasts(panel, config, cpu_job)


@pytest.mark.parametrize("schedule", ["baselines", "neural"])
def test_changing_data_after_t_leaves_forecasts_made_at_t_unchanged(panel, config, cpu_job, perturb_after, tmp_path,
                                                                   unperturbed, schedule):
    """t is the origin just before a refit date, where a fit that peeked even one day ahead would show."""
    frame = add_features(panel)
    every = config.evaluation.refit_every if schedule == "baselines" else config.train.refit_every
    refit_date = block_starts(frame, evaluation_window(frame, config), every)[1]
    cutoff = frame.loc[frame["date"] < refit_date, "date"].max()
    cpu_job.checkpoint_dir = tmp_path / "perturbed"
    before, after = unperturbed, forecasts(perturb_after(panel, cutoff), config, cpu_job)
    assert before.index.equals(after.index)
    made_by_t = before["origin"] <= cutoff
    columns = ["variance", "variance_h", "mu", "q01", "q05", "es975_q", "es975", "es99_h_q", "es99_h"]
    for model in before["model"].unique():
        rows = made_by_t & (before["model"] == model)
        np.testing.assert_allclose(after.loc[rows, columns], before.loc[rows, columns], rtol=1e-10, err_msg=model)
        later = ~made_by_t & (before["model"] == model)
        assert not np.allclose(after.loc[later, "variance"], before.loc[later, "variance"]), model


def test_blocks_follow_the_refit_schedule(panel, config):
    frame = add_features(panel)
    mask = evaluation_window(frame, config)
    starts = block_starts(frame, mask, 21)
    test_days = np.sort(frame.loc[mask, "target_date"].unique())
    assert starts[0] == test_days[0]
    assert len(starts) == int(np.ceil(len(test_days) / 21))


def test_the_neural_model_beats_its_untrained_start(panel, config, cpu_job):
    """The untrained network forecasts the 22-day average; training must improve QLIKE on held-out days. (Of the
    range variance it learns: `scaled_range` multiplies that by the overnight factor, tested below.)"""
    frame = add_features(panel)
    mask = evaluation_window(frame, config)
    config.neural.target = "parkinson"
    neural, latest = served(*neural_forecasts(frame, mask, config, cpu_job))
    proxy = frame.loc[neural.index, "target"].to_numpy()
    trained = qlike(proxy, neural["variance"].to_numpy())
    untrained = qlike(proxy, frame.loc[neural.index, "rv_m"].to_numpy())
    assert trained < untrained - 0.005
    proxy_h = frame.loc[neural.index, "target_h"].to_numpy()
    assert qlike(proxy_h, neural["variance_h"].to_numpy()) < qlike(proxy_h, 5 * frame.loc[neural.index, "rv_m"])
    assert latest["training_tails"]["q01"] < latest["training_tails"]["q05"] < 0
    assert latest["overnight_factors"] == {}


def test_scaled_range_forecasts_are_the_range_ones_times_each_ticker_s_overnight_factor(panel, config, cpu_job,
                                                                                       tmp_path):
    frame = add_features(panel)
    mask = evaluation_window(frame, config)
    config.neural.target = "parkinson"
    cpu_job.checkpoint_dir = tmp_path / "range"
    ranged, _ = served(*neural_forecasts(frame, mask, config, cpu_job))
    config.neural.target = "scaled_range"
    cpu_job.checkpoint_dir = tmp_path / "scaled"
    scaled, latest = served(*neural_forecasts(frame, mask, config, cpu_job))
    last = frame.loc[scaled.index, "target_date"] >= pd.Timestamp(latest["trained_until"])
    ratio = (scaled["variance"] / ranged["variance"])[last]
    tickers = frame.loc[ratio.index, "ticker"]
    np.testing.assert_allclose(ratio, tickers.map(latest["overnight_factors"]), rtol=1e-5)
    assert all(1.1 < factor < 2.5 for factor in latest["overnight_factors"].values()), "30 % of it is overnight"
    config.neural.target, config.train.lr = "returns", 1e-2  # the offset to learn is large: a faster start
    cpu_job.checkpoint_dir = tmp_path / "returns"
    squared, latest = served(*neural_forecasts(frame, mask, config, cpu_job))
    assert latest["overnight_factors"] == {}
    assert squared["variance"].mean() > 1.4 * ranged["variance"].mean(), "trained on squared returns: their scale"


def test_a_window_without_enough_history_is_a_user_error(panel, config):
    config.evaluation.test_fraction = 0.95
    with pytest.raises(UserError, match="days before the test window"):
        evaluation_window(add_features(panel), config)


def test_a_window_outside_the_data_is_a_user_error(panel, config):
    config.evaluation.test_start, config.evaluation.test_end = "2030-01-01", "2030-12-31"
    with pytest.raises(UserError, match="no trading days between 2030-01-01"):
        evaluation_window(add_features(panel), config)


def prices_2019_to_2024(folder):
    """A user's CSV: two tickers of daily prices from 2019-01-02 to 2024-12-31, in the README's long format."""
    from usecases.finance.config import Synthetic
    from usecases.finance.data import synthetic_panel

    days = pd.bdate_range("2019-01-02", "2024-12-31")
    frame = synthetic_panel(Synthetic(tickers=2, days=len(days), seed=2)).frame
    path = folder / "my_prices.csv"
    frame.assign(date=np.tile(days.strftime("%Y-%m-%d"), 2)).drop(columns="true_variance").to_csv(path, index=False)
    return path


@pytest.mark.parametrize(("overrides", "first", "last"), [
    pytest.param([], None, "2024-12-31", id="from-the-data"),
    pytest.param(["evaluation.test_start=2023-01-03"], "2023-01-03", "2024-12-31", id="start-set"),
    pytest.param(["evaluation.test_end=2023-12-29"], None, "2023-12-29", id="end-set"),
])
def test_a_user_file_is_tested_on_its_own_last_days_unless_the_window_is_set(tmp_path, overrides, first, last):
    """`--data` under the `default` preset took the arch data's 2011-2018 window, so a later file failed (issue 19)."""
    from common.config import load_config
    from usecases import finance
    from usecases.finance.pipeline import load_data

    config = load_config(finance.Config, finance.USECASE.presets_dir, "default", overrides)
    prepared, tags = load_data(config, prices_2019_to_2024(tmp_path))
    frame = prepared.frame
    calendar = np.sort(frame["target_date"].dropna().unique())
    first = first or str(pd.Timestamp(calendar[int(len(calendar) * 0.7)]).date())
    tested = frame.loc[prepared.test, "target_date"]
    assert (str(tested.min().date()), str(tested.max().date())) == (first, last)
    assert tags["test_window"] == f"{first}..{last}"
    assert (config.evaluation.test_start is None) == (first != "2023-01-03"), "the params record the window used"
    validation = tags["tails_validation"].split("..")
    assert pd.Timestamp(validation[1]) < pd.Timestamp(first) < pd.Timestamp(validation[1]) + pd.Timedelta(days=5)


def test_the_arch_data_keeps_the_reference_window():
    from common.config import load_config
    from usecases import finance

    for preset in ("default", "full"):
        evaluation = load_config(finance.Config, finance.USECASE.presets_dir, preset).evaluation
        assert (str(evaluation.test_start), str(evaluation.test_end)) == ("2011-01-03", "2018-12-31")


def test_exogenous_inputs_are_used_and_gaps_imputed(panel, config, cpu_job):
    """WTI covers the synthetic dates and VIX does not: the model trains and forecasts either way."""
    from usecases.finance.data import attach_exogenous

    config.data.exogenous = ["wti", "vix"]
    frame = add_features(attach_exogenous(panel, config.data.exogenous))
    assert frame["log_wti_rv"].notna().mean() > 0.9 and frame["rel_vix"].isna().all()
    neural, latest = neural_forecasts(frame, evaluation_window(frame, config), config, cpu_job)
    assert latest["features"][-2:] == ["log_wti_rv", "rel_vix"]
    assert np.isfinite(neural[["variance", "variance_h"]].to_numpy()).all()


def test_an_input_unseen_in_training_stays_at_its_mean():
    from usecases.finance.models import VolatilityMLP

    torch.manual_seed(0)
    model = VolatilityMLP(3, hidden=8, layers=1, dropout=0.0)
    torch.nn.init.normal_(model.head.weight)
    training = torch.tensor([[0.0, 1.0, float("nan")], [1.0, 2.0, float("nan")], [0.5, 3.0, float("nan")]])
    model.fit_scaler(training)
    model.eval()
    missing = torch.tensor([[0.2, 1.5, float("nan")]])
    present = torch.tensor([[0.2, 1.5, 20.0]])
    assert torch.equal(model(missing), model(present))
    assert not torch.equal(model(present), model(torch.tensor([[0.2, 2.5, 20.0]])))


def test_neural_training_and_validation_rows_all_precede_the_refit_date(panel, config):
    """Validation-only leaks barely move early stopping, so the forecast comparison above cannot see them."""
    frame = add_features(panel)
    refit_date = block_starts(frame, evaluation_window(frame, config), config.train.refit_every)[1]
    ready = frame[["target", "target_h"]].notna().all(axis=1)
    train_rows, val_rows = training_window(frame, ready, refit_date, 0.15)
    assert frame.loc[np.r_[train_rows, val_rows], "target_date_h"].max() < refit_date
    assert frame.loc[train_rows, "target_date_h"].max() < frame.loc[val_rows, "target_date_h"].min()
    assert 0.1 < len(val_rows) / (len(train_rows) + len(val_rows)) < 0.2
    earlier = frame["target_date_h"] < refit_date - pd.Timedelta(days=30)
    assert ready[earlier].sum() < len(train_rows) + len(val_rows), "the window reaches up to the refit date"


class RecordingTracker(Tracker):
    """Keeps the tags and metrics a run would log."""

    def __init__(self):
        super().__init__(active=False)
        self.tags, self.metrics = {}, {}

    def set_tags(self, tags):
        self.tags.update(tags)

    def log_metrics(self, metrics, step=None):
        self.metrics.update(metrics)


def test_the_validation_period_is_the_stretch_just_before_the_test_window(panel, config):
    frame = add_features(panel)
    mask = evaluation_window(frame, config)
    validation = validation_window(frame, mask, config)
    before = np.sort(frame.loc[frame["target_date"] < frame.loc[mask, "target_date"].min(), "target_date"].unique())
    days = np.sort(frame.loc[validation, "target_date"].unique())
    assert len(days) == len(before) // 2, "504 days asked for, half of the ~700 before the window given"
    np.testing.assert_array_equal(days, before[-len(days):])
    config.evaluation.val_days = 60
    assert frame.loc[validation_window(frame, mask, config), "target_date"].nunique() == 60


def with_gas(frame, mask, config):
    """The GAS baseline's forecasts over the validation period and the test window, as `run` gives them."""
    config.baselines.models = ["gas"]
    return baseline_forecasts(frame, mask, config, workers=0, validation=validation_window(frame, mask, config))


def tail_choice(panel, config, job, folder):
    """The tail model tag and the validation metrics that a walk-forward on `panel` logs."""
    frame = add_features(panel)
    mask = evaluation_window(frame, config)
    job.tracker, job.checkpoint_dir = RecordingTracker(), folder
    neural_forecasts(frame, mask, config, job, with_gas(frame, mask, config))
    return job.tracker.tags["tails_rule"], {name: value for name, value in job.tracker.metrics.items()
                                             if name.startswith("tails_val/")}


def test_the_tail_rule_is_chosen_before_the_test_window_and_logged(panel, config, cpu_job, perturb_after, tmp_path):
    """It was chosen on the test window (issue 19): now test prices cannot move it, validation prices can. Of the
    models that pass the validation backtests (the network's rules and GAS), the lowest FZ0 wins; with none passing,
    the nearest to passing."""
    config.train.epochs, config.train.refit_every = 2, 200  # three walk-forwards: the fewest refits that show it
    frame = add_features(panel)
    mask = evaluation_window(frame, config)
    rule, metrics = tail_choice(panel, config, cpu_job, tmp_path / "base")
    rules = TAIL_RULES
    assert rule in rules
    for name in rules:
        tests = ("var1_breaches", "kupiec_p", "christoffersen_cc_p", "es975_z2_p", "es975_mcneil_frey_p", "fz0")
        assert {f"tails_val/{name}/{test}/SYN000" for test in tests} <= set(metrics)
    passing = [name for name in rules if metrics[f"tails_val/{name}/passes"]]
    if passing:
        assert metrics[f"tails_val/{rule}/fz0"] == min(metrics[f"tails_val/{name}/fz0"] for name in passing)
    else:
        assert metrics[f"tails_val/{rule}/worst_p"] == max(metrics[f"tails_val/{name}/worst_p"] for name in rules)
    test_start = frame.loc[mask, "target_date"].min()
    last_before_test = frame.loc[frame["date"] < test_start, "date"].max()
    assert tail_choice(perturb_after(panel, last_before_test), config, cpu_job, tmp_path / "test") == (rule, metrics)
    validation_start = frame.loc[validation_window(frame, mask, config), "target_date"].min()
    _, moved = tail_choice(perturb_after(panel, validation_start), config, cpu_job, tmp_path / "validation")
    assert moved != metrics
    assert {name: value for name, value in moved.items() if name.startswith("tails_val/gas/")} != \
        {name: value for name, value in metrics.items() if name.startswith("tails_val/gas/")}, "GAS's too"


def test_gas_tails_are_served_as_evaluated_and_filtered_on_from_the_last_test_day(panel, config, cpu_job):
    """With `evaluation.tail_models: [gas]` the served VaR and ES are GAS's: for rows up to the last test origin, those
    `neural` was scored with that day (GAS's, over the network's variance); with a day more, GAS's scale filtered
    through that day's return, as the walk-forward would have; from rows that miss the last test origin, filtered
    from its unconditional level."""
    from usecases.finance import gas
    from usecases.finance.serving import SERVED_TAILS, VolatilityForecaster, forecaster_bundle

    config.evaluation.tail_models = ["gas"]
    frame = add_features(panel)
    mask = evaluation_window(frame, config)
    baselines = with_gas(frame, mask, config)
    neural, latest = served(*neural_forecasts(frame, mask, config, cpu_job, baselines))
    assert latest["tails"]["rule"] == "gas"
    model = VolatilityForecaster.from_bundle(forecaster_bundle(latest))
    last = neural.join(frame[["ticker", "date"]]).sort_values("date").groupby("ticker").tail(1).set_index("ticker")
    given = panel.assign(date=panel["date"].dt.strftime("%Y-%m-%d"))
    answer = model.answer(given[panel["date"] <= last["date"].max()]).set_index("ticker")
    sigma = np.sqrt(last["variance"])
    for output, column in SERVED_TAILS:  # GAS's values through the network's σ and back: float64 rounding alone
        np.testing.assert_allclose(answer.loc[last.index, output], last["mu"] + sigma * last[column],
                                   rtol=FLOAT64_SLACK, err_msg=output)
    ahead = model.answer(given).set_index("ticker")
    end = panel["date"].max()
    earlier = (panel["date"] > end - pd.Timedelta(days=300)) & (panel["date"] <= end - pd.Timedelta(days=30))
    before = model.answer(given[earlier]).set_index("ticker")
    for ticker, state in latest["tails"]["gas"].items():
        returns = np.nan_to_num(frame.loc[frame["ticker"] == ticker, "ret"].to_numpy())
        params = (state["beta"], state["gamma"], state["es975_q"], state["es975"])
        assert np.exp(gas.log_scale(returns[:-1], params)[-1]) == pytest.approx(np.exp(state["log_scale"]))
        scale = np.exp(gas.log_scale(returns, params)[-1])
        assert ahead.loc[ticker, "var_2_5pct"] == pytest.approx(scale * state["es975_q"], rel=1e-9)
        assert ahead.loc[ticker, "es_1pct"] == pytest.approx(scale * state["es99"], rel=1e-9)
        window = frame[(frame["ticker"] == ticker) & frame["date"].isin(panel.loc[earlier, "date"])]
        recent_returns = window["ret"].to_numpy()[1:]  # the first day given has no return
        scale = np.exp(gas.log_scale(recent_returns, params)[-1])
        assert before.loc[ticker, "var_2_5pct"] == pytest.approx(scale * state["es975_q"], rel=1e-9)


def test_the_joint_head_is_served_as_it_was_evaluated_on_the_last_test_day(panel, config, cpu_job):
    """With the `fz` rule, the served model's VaR and ES are those `neural_fz` was scored with on the last test day:
    the last refit's head on that day's inputs (the smoke run's end-to-end test covers the rule it chooses)."""
    from usecases.finance.serving import SERVED_TAILS, VolatilityForecaster, forecaster_bundle
    from usecases.finance.tails import TAIL_COLUMNS

    frame = add_features(panel)
    neural, latest = neural_forecasts(frame, evaluation_window(frame, config), config, cpu_job)
    joint = neural[neural["model"] == "neural_fz"].join(frame[["ticker", "date"]])
    last = joint.sort_values("date").groupby("ticker").tail(1)
    origins = torch.tensor(frame.loc[last.index, latest["features"]].to_numpy(), dtype=torch.float32)
    last = last.set_index("ticker")
    latest["tails"] = {"rule": "fz", "by_ticker": last[TAIL_COLUMNS].to_dict("index")}
    model = VolatilityForecaster.from_bundle(forecaster_bundle(latest))
    rows = panel[panel["date"] <= last["date"].max()]
    answer = model.answer(rows.assign(date=rows["date"].dt.strftime("%Y-%m-%d"))).set_index("ticker").loc[last.index]
    # the network and the head in float32, summed in another order on the server's few rows: apart by rounding alone
    variance_gap = gap(variance_error(model.members, origins))[:, 0]
    column_gap = gap(tail_error(model.head, model.members[0].scaled(origins)))
    assert_within(answer["variance"], last["variance"], variance_gap * last["variance"], "variance")
    sigma = np.sqrt(last["variance"])
    for output, column in SERVED_TAILS:
        assert_within(answer[output], last["mu"] + sigma * last[column],
                      risk_gap(last["mu"], last["variance"], last[column], variance_gap, column_gap), output)
    assert not np.allclose(last["q01"], latest["training_tails"]["q01"]), "the head's, not the window's constant"
