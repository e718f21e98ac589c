"""The tail model the forecaster serves its VaR and ES by, chosen on the validation period."""

from __future__ import annotations

import logging

import numpy as np
import pandas as pd

from common.job import Job
from .config import Config
from .evaluate import choose_tail_rule, validation_qlike
from .tails import NEURAL_TAIL_RULES, TAIL_COLUMNS, TAIL_RULES

log = logging.getLogger(__name__)


def serve_chosen_tails(frame: pd.DataFrame, mask: pd.Series, validation: pd.Series, config: Config,
                       candidates: dict[str, pd.DataFrame], latest: dict, baselines: pd.DataFrame | None,
                       job: Job) -> tuple[pd.DataFrame, dict]:
    """The tail model chosen on `validation`, never a test day (tag `tails_rule`, metrics `tails_val/...`): the
    test forecasts (`neural`, and each network rule's as `neural_RULE`) and `latest` for the server."""
    horizon, allowed = config.evaluation.horizon, config.evaluation.tail_models
    network = candidates["training"]
    for name in set(TAIL_RULES) - set(candidates):
        rows = None if baselines is None else baselines[baselines["model"] == name]
        if rows is not None and len(rows):
            candidates[name] = rows.drop(columns="model").join(network[["ticker", "date", "date_h", "ret", "ret_h"]],
                                                               how="inner")
    offered = [name for name in allowed if name in candidates]
    rule, backtests = choose_tail_rule({name: candidates[name][validation[candidates[name].index].to_numpy()]
                                        for name in offered})
    log.info("tails: %s, chosen on %d validation days (worst backtest p %s)", rule,
             len(np.unique(frame.loc[validation, "target_date"])),
             ", ".join(f"{name} {backtests[f'{name}/worst_p']:.3f}" for name in offered))
    job.tracker.set_tags({"tails_rule": rule})
    job.tracker.log_metrics({f"tails_val/{name}": value for name, value in backtests.items()})
    chosen = candidates[rule] if rule in NEURAL_TAIL_RULES else restated(candidates[rule], network, horizon)
    latest["validation"] = validation_qlike(chosen[validation[chosen.index].to_numpy()])
    # served: the chosen tails of each ticker's last test day, as evaluated (the head's or GAS's carried on from there)
    tested = np.isfinite(chosen["variance"]) & mask[chosen.index].to_numpy()
    last_days = chosen[tested].groupby("ticker", sort=False).tail(1)
    latest["tails"] = {"rule": rule, "by_ticker": last_days.set_index("ticker")[TAIL_COLUMNS].to_dict("index")}
    if rule == "gas":
        latest["tails"]["gas"] = gas_states(candidates["gas"].loc[last_days.index], frame["date"])
    in_test = mask[network.index].to_numpy()
    test = [chosen[in_test].assign(model="neural")]
    test += [candidates[name][in_test].assign(model=f"neural_{name}") for name in NEURAL_TAIL_RULES]
    return pd.concat(test).drop(columns=["ticker", "date", "date_h", "ret", "ret_h"]), latest


def restated(tails: pd.DataFrame, network: pd.DataFrame, horizon: int) -> pd.DataFrame:
    """The network's forecasts with another model's VaR and ES, restated in the network's standardised units."""
    other = tails.reindex(network.index)
    columns = {}
    for column in TAIL_COLUMNS:
        days, variance = (horizon, "variance_h") if "_h" in column else (1, "variance")
        value = days * other["mu"] + np.sqrt(other[variance]) * other[column]
        columns[column] = (value - days * network["mu"]) / np.sqrt(network[variance])
    return network.assign(**columns)


def gas_states(last_days: pd.DataFrame, origins: pd.Series) -> dict[str, dict[str, float | str]]:
    """Per ticker, what the server filters GAS's scale on from: the last test origin, its κ, β, γ and tails."""
    return {str(row["ticker"]): {"origin": str(origins[index].date()), "log_scale": float(np.log(row["variance"]) / 2),
                                 "beta": float(row["gas_beta"]), "gamma": float(row["gas_gamma"]),
                                 **{name: float(row[name]) for name in TAIL_COLUMNS}}
            for index, row in last_days.iterrows()}
