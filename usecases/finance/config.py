"""The finance config schema; presets in presets/*.yaml set a subset of these keys."""

from __future__ import annotations

from datetime import date
from typing import Literal

from pydantic import Field, model_validator

from common.config import ConfigModel, RuntimeConfig, TrackingConfig, TrainConfig


class Columns(ConfigModel):
    """Column names in a user's long-format CSV or Parquet file."""

    date: str = "date"
    ticker: str = "ticker"
    open: str = "open"
    high: str = "high"
    low: str = "low"
    close: str = "close"
    volume: str = "volume"


class Synthetic(ConfigModel):
    """A GJR-GARCH-t panel with known parameters; an overnight gap, then an intraday path that gives High and Low."""

    tickers: int = Field(4, ge=1)
    days: int = Field(1500, ge=300)
    seed: int = 0
    omega: float = Field(0.02, gt=0)
    alpha: float = Field(0.03, ge=0)
    gamma: float = Field(0.10, ge=0)
    beta: float = Field(0.90, ge=0)
    nu: float = Field(8.0, gt=2)
    intraday_steps: int = Field(32, ge=2)
    overnight: float = Field(0.3, ge=0, lt=1, description="the share of each day's return variance that falls between "
                             "the close and the next open, which the High-Low range cannot see")


class Data(ConfigModel):
    source: Literal["arch", "file", "synthetic"] = "arch"
    series: list[Literal["sp500", "nasdaq"]] = ["sp500", "nasdaq"]
    exogenous: list[Literal["vix", "wti"]] = Field(
        [], description="market-wide inputs from arch, joined by date: VIX (2014-2018) and WTI crude (1986-2018)")
    columns: Columns = Columns()
    max_fill_gap: int = Field(3, ge=0, description="forward-fill at most this many consecutive missing rows")
    synthetic: Synthetic = Synthetic()


class Evaluation(ConfigModel):
    """The `arch` data's test window; with --data, each end not set is the file's (`pipeline.load_data`)."""

    test_start: date | None = date(2011, 1, 3)
    test_end: date | None = date(2018, 12, 31)
    test_fraction: float = Field(0.3, gt=0, lt=1, description="used when test_start is null")
    val_days: int = Field(504, ge=1, description="trading days just before the test window on which the neural model's "
                          "tail rule is chosen and its val_qlike_sq measured (at most half of the days before it)")
    refit_every: int = Field(21, ge=1, description="trading days between baseline refits")
    tail_models: list[Literal["training", "out_of_sample", "out_of_sample_evt", "fz", "gas"]] = Field(
        ["training", "out_of_sample", "out_of_sample_evt", "fz", "gas"], min_length=1,
        description="the tail models the served VaR and ES are chosen among on the validation period: the network's "
        "rules (its variance times standardised tails) and the GAS model of the tails alone (README: tails)")
    horizon: int = Field(5, ge=2, description="the longer horizon in trading days, forecast beside the next day")
    dm_lags: int = Field(5, ge=0)


class Baselines(ConfigModel):
    models: list[Literal["ewma", "garch", "gjr_garch_t", "har", "har_rv", "gas"]] = Field(
        ["ewma", "garch", "gjr_garch_t", "har", "har_rv", "gas"], description="gjr_garch_t brings gjr_garch_t_evt, "
        "the same fits with tails by filtered historical simulation with a generalised Pareto tail")
    ewma_lambda: float = Field(0.94, gt=0, lt=1)
    gas_refit_every: int = Field(252, ge=1, description="trading days between fits of the GAS model's parameters "
                                 "(its scale is filtered every day)")


class Neural(ConfigModel):
    hidden: int = Field(64, ge=1)
    layers: int = Field(2, ge=1)
    dropout: float = Field(0.1, ge=0, lt=1)
    ensemble: int = Field(1, ge=1, description="members trained with different seeds, forecasts averaged")
    target: Literal["scaled_range", "returns", "parkinson"] = Field(
        "scaled_range", description="scaled_range: trained on Parkinson variance, times each ticker's overnight "
        "factor; returns: trained on squared returns; parkinson: range variance, unscaled (README: Neural model)")


class Train(TrainConfig):
    """The common loop's keys with this model's defaults, and the walk-forward's."""

    epochs: int = Field(60, ge=1)
    batch_size: int = Field(256, ge=1)
    patience: int | None = Field(8, ge=1)
    grad_clip: float | None = Field(1.0, gt=0)
    weight_decay: float = Field(1e-4, ge=0)
    val_fraction: float = Field(0.15, gt=0, lt=1)
    refit_every: int = Field(252, ge=1, description="trading days between refits of the neural model")


class Config(ConfigModel):
    data: Data = Data()
    evaluation: Evaluation = Evaluation()
    baselines: Baselines = Baselines()
    neural: Neural = Neural()
    train: Train = Train()
    runtime: RuntimeConfig = RuntimeConfig()
    tracking: TrackingConfig = TrackingConfig()

    @model_validator(mode="after")
    def _tail_models_are_run(self) -> Config:
        chosen = "tail_models" in self.evaluation.model_fields_set  # by default gas is a candidate where it runs
        if chosen and "gas" in self.evaluation.tail_models and "gas" not in self.baselines.models:
            raise ValueError("evaluation.tail_models includes gas: baselines.models must include gas too")
        return self
