"""Market volatility and risk: 1-day-ahead variance and Value-at-Risk, walk-forward, against GARCH and HAR."""

from common.usecase import UseCase

from .config import Config


def summary_columns(config: Config) -> list[str]:
    """The metrics printed at the end of a run; summary.json holds them all."""
    return ["qlike_sq", "qlike_parkinson", f"qlike_sq_h{config.evaluation.horizon}", "var1_breaches",
            "christoffersen_cc_p", "es975_z2", "es975_mcneil_frey_p", "es975_fz0", "dm_t_vs_gjr_garch_t"]


USECASE = UseCase.declare(
    __name__,
    description="volatility, VaR and ES forecasting (S&P 500, NASDAQ or your OHLC file) vs EWMA, GARCH, GJR-t, HAR",
    config=Config,
    primary_metric=("qlike_sq", "min"),  # of the served model, on the return scale; the registry's champion by it
    summary_columns=summary_columns,
    requirements=("arch>=7.0",),
    # the results page's backtests of each model's 1 % VaR and 97.5 % ES (the protocol: docs/finance.md#protocol)
    reported_metrics=("kupiec_p", "christoffersen_cc_p", "es975_z2", "es975_mcneil_frey_p", "es975_fz0"),
    evidence=("test_days", "days a series"),  # what the served model's test figure rests on
    scale={"data.synthetic.tickers": 12},  # x 2,500 days each: 12, 48 and 192 tickers for bench scale
)
