"""The neural forecaster as an MLflow pyfunc: a recent OHLC window in, tomorrow's variance and VaR out."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import torch

from common.serving.pyfunc import BadInput, Publication, ServedModel, log_served
from common.usecase import Served
from .features import HAR_WINDOWS, HISTORY_DAYS, add_features
from .gas import log_scale
from .joint import TailHead
from .models import VolatilityMLP, ensemble_forecast

INPUT_COLUMNS = ["date", "ticker", "high", "low", "close"]
EXAMPLE_DAYS = HISTORY_DAYS + 3
MONTH = HAR_WINDOWS["rv_m"]
# The served VaR and ES: output column, and the tail column (`tails.TAIL_COLUMNS`) that gives it as μ + σ·value
SERVED_TAILS = [("var_1pct", "q01"), ("var_2_5pct", "es975_q"), ("var_5pct", "q05"), ("es_2_5pct", "es975"),
                ("es_1pct", "es99")]


class VolatilityForecaster(ServedModel):
    """Input: daily rows (date, ticker, high, low, close and the model's exogenous columns), at least 67 days per
    ticker. Output per ticker: the next day's variance (percent²), the next H days', the volatility, and the one-day
    VaR and ES by the run's tail model as evaluated on the last test day (a ticker's own tails, the joint head's
    from the day's inputs, or the GAS scale filtered on through the rows given)."""

    def load(self, bundle: dict) -> None:
        self.members = []
        self.features, self.exogenous = bundle["features"], bundle["exogenous"]
        for state in bundle["states"]:
            model = VolatilityMLP(len(self.features), **bundle["architecture"])
            model.load_state_dict(state)
            self.members.append(model.eval())
        self.mu, self.tails, self.training_tails = bundle["mu"], bundle["tails"], bundle["training_tails"]
        self.head = None
        if self.tails["rule"] == "fz":
            self.head = TailHead(len(self.features))
            self.head.load_state_dict(bundle["head"])
        self.overnight_factors = bundle["overnight_factors"]
        self.horizon = bundle["architecture"]["horizon"]

    def answer(self, model_input: pd.DataFrame, params: dict | None = None) -> pd.DataFrame:
        frame = pd.DataFrame(model_input).copy()
        expected = INPUT_COLUMNS + self.exogenous
        missing = [column for column in expected if column not in frame.columns]
        if missing:
            raise BadInput(f"input is missing column '{missing[0]}' (expected {', '.join(expected)})")
        if frame.empty:
            raise BadInput("input has no rows")
        frame["date"] = pd.to_datetime(frame["date"], errors="coerce")
        for column in ["high", "low", "close", *self.exogenous]:
            frame[column] = pd.to_numeric(frame[column], errors="coerce")
        if frame[["date", "high", "low", "close"]].isna().any().any():
            raise BadInput("input has missing or non-numeric values in date, high, low or close")
        if (frame[["high", "low", "close"]] <= 0).any().any() or (frame["high"] < frame["low"]).any():
            raise BadInput("input prices must be positive with high >= low")
        short = frame.groupby("ticker").size()
        if (short < HISTORY_DAYS).any():
            raise BadInput(f"ticker '{short.idxmin()}' has {short.min()} rows; at least {HISTORY_DAYS} "
                             f"consecutive trading days are needed")
        frame = frame.sort_values(["ticker", "date"], kind="stable")
        recent = frame.groupby("ticker", sort=False).tail(MONTH)
        ranged = (recent["high"] > recent["low"]).groupby(recent["ticker"], sort=False).any()
        if not ranged.all():  # the monthly range average is the network's baseline: its log must be finite
            raise BadInput(f"ticker '{ranged.index[~ranged][0]}': high equals low on each of its last {MONTH} rows; "
                             f"expected a daily range (high above low) on some of them")
        history = add_features(frame, self.horizon)
        latest = history.groupby("ticker", sort=False).tail(1)
        features = torch.tensor(latest[self.features].to_numpy(), dtype=torch.float32)
        forecast = ensemble_forecast(self.members, features).numpy() * self._factors(history, latest)[:, None]
        variance = forecast[:, 0]
        volatility = np.sqrt(variance)
        tails = pd.DataFrame([self.tails["by_ticker"].get(ticker, self.training_tails) for ticker in latest["ticker"]])
        if self.head is not None:
            joint = self.head.columns(self.members[0].scaled(features))
            tails = tails.assign(**{name: joint[name] for name in ("q01", "es975_q", "es975", "es99")})
        risk = {name: (self.mu + volatility * tails[column].to_numpy()).astype(float) for name, column in SERVED_TAILS}
        if self.tails["rule"] == "gas":
            for row, scale in self.gas_scales(history, latest["ticker"]).items():
                state = self.tails["gas"][latest["ticker"].iloc[row]]
                for name, column in SERVED_TAILS:
                    risk[name][row] = scale * state[column]
        return pd.DataFrame({
            "ticker": latest["ticker"].to_numpy(), "origin_date": latest["date"].dt.strftime("%Y-%m-%d").to_numpy(),
            "variance": variance.astype(float), f"variance_{self.horizon}d": forecast[:, 1].astype(float),
            "volatility": volatility.astype(float), **risk})

    def gas_scales(self, history: pd.DataFrame, tickers: pd.Series) -> dict[int, float]:
        """GAS's scale exp(κ) after each ticker's last row, filtered on from the run's last test origin (or κ = 0)."""
        scales = {}
        for row, ticker in enumerate(tickers):
            state = self.tails["gas"].get(ticker)
            if state is None:
                continue
            rows = history[history["ticker"] == ticker]
            returns = np.nan_to_num(rows["ret"].to_numpy())
            origin = pd.Timestamp(state["origin"])
            params = (state["beta"], state["gamma"], state["es975_q"], state["es975"])
            if (rows["date"] == origin).any():
                kappa = log_scale(returns[(rows["date"] > origin).to_numpy()], params, state["log_scale"])[-1]
            else:
                kappa = log_scale(returns, params)[-1]
            scales[row] = float(np.exp(kappa))
        return scales

    def _factors(self, history: pd.DataFrame, latest: pd.DataFrame) -> np.ndarray:
        """Each ticker's overnight factor: its training window's, else that of the rows given."""
        if not self.overnight_factors:
            return np.ones(len(latest))
        sums = history.groupby("ticker", sort=False)[["sq_ret", "parkinson"]].sum()
        given = sums["sq_ret"] / sums["parkinson"]
        return np.array([self.overnight_factors.get(ticker, given[ticker]) for ticker in latest["ticker"]])


def _floats(columns: dict) -> dict[str, float]:
    return {name: float(value) for name, value in columns.items()}


def input_example(panel: pd.DataFrame, exogenous: list[str]) -> pd.DataFrame:
    recent = panel.sort_values(["ticker", "date"]).groupby("ticker", sort=False).tail(EXAMPLE_DAYS)
    example = recent[INPUT_COLUMNS + exogenous].reset_index(drop=True)
    example["date"] = example["date"].dt.strftime("%Y-%m-%d")
    return example


def forecaster_bundle(latest: dict) -> dict:
    """What the served model loads: the last refit's ensemble and the tails it is served with."""
    return {
        "states": [{key: value.cpu() for key, value in model.state_dict().items()} for model in latest["models"]],
        "architecture": latest["architecture"], "features": latest["features"], "exogenous": latest["exogenous"],
        "mu": latest["mu"],
        "tails": {"rule": latest["tails"]["rule"],
                  "by_ticker": {str(ticker): _floats(tails) for ticker, tails in latest["tails"]["by_ticker"].items()},
                  "gas": latest["tails"].get("gas", {})},
        "training_tails": _floats(latest["training_tails"]),
        "head": {key: value.cpu() for key, value in latest["head"].items()},
        "overnight_factors": {str(ticker): float(value) for ticker, value in latest["overnight_factors"].items()}}


def log_forecaster(latest: dict, panel: pd.DataFrame, job) -> Served | None:
    """Log the last refit's ensemble as `model`, with a signature and a real input example."""
    if not job.tracker.active:
        return None
    bundle = forecaster_bundle(latest)
    served = log_served(VolatilityForecaster.from_bundle(bundle), bundle, input_example(panel, latest["exogenous"]),
                        job.tracker, Publication("neural", __package__, ("torch", "numpy", "pandas", "mlflow")))
    job.tracker.set_tags({"model_trained_until": latest["trained_until"],
                          "model_overnight_factors": json.dumps(bundle["overnight_factors"])})
    return served
