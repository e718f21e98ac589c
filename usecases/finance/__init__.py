"""Market volatility and risk: 1-day-ahead variance and Value-at-Risk, walk-forward, against GARCH and HAR."""

from pathlib import Path

from usecases.finance.config import Config

DESCRIPTION = "volatility and VaR forecasting (S&P 500, NASDAQ or your OHLC file) vs EWMA, GARCH, GJR-t, HAR"
PRESETS_DIR = Path(__file__).parent / "presets"
PRIMARY_METRIC = ("qlike_parkinson", "min")  # of the served model; the registry picks its champion by it


def summary_columns(config: Config) -> list[str]:
    """The metrics printed at the end of a run; summary.json holds them all."""
    return ["qlike_parkinson", "qlike_sq", "mse_parkinson", f"qlike_parkinson_h{config.evaluation.horizon}",
            "var1_breach_rate", "kupiec_p", "dm_t_vs_har"]


__all__ = ["Config", "DESCRIPTION", "PRESETS_DIR", "PRIMARY_METRIC", "summary_columns"]
