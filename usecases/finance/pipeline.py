"""The finance job: an expanding-window walk-forward, every model in one harness. A forecast for day d is made at
the previous close (the origin) from data up to it; models refit at each block start (the baselines every
`evaluation.refit_every` days, the network every `train.refit_every`). Both walks start on a validation period
before the test window, where the served tail model is chosen; the test window only measures it."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from common.errors import UserError
from common.job import Job
from common.runtime.devices import Runtime
from common.usecase import RunResult
from .baselines import forecast_frame
from .choice import serve_chosen_tails
from .config import Config
from .data import Panel, load_panel
from .ensemble import Fit, train_ensemble
from .evaluate import evaluate, forecast_figure, risk_figure
from .features import add_features, feature_names, usable
from .parallel import BaselineRuns, BaselineTask
from .serving import log_forecaster
from .joint import fit_heads
from .tails import empirical_columns, evt_columns, recalibrate

log = logging.getLogger(__name__)

MIN_HISTORY = 250
DATA_SCHEMA = "date:datetime,ticker:string,open:double,high:double,low:double,close:double,volume:double"


@dataclass
class Prepared:
    """The validated panel, its features, and which rows are test origins: all that a run needs."""

    panel: Panel
    frame: pd.DataFrame
    test: pd.Series


def load_data(config: Config, path: Path | None, client=None) -> tuple[Prepared, dict[str, str]]:
    """Everything that can be wrong with the data is found here, before an MLflow run starts."""
    if path is not None:  # each end of the `arch` data's test window not set explicitly becomes null (the file's
        # last `test_fraction`, or its end), in the config itself so the run's params record it
        for end in ("test_start", "test_end"):
            if end not in config.evaluation.model_fields_set:
                setattr(config.evaluation, end, None)
    panel = load_panel(config.data, path)
    frame = features_per_ticker(panel.frame, config.evaluation.horizon, client)
    test = evaluation_window(frame, config, str(path) if path else panel.source)
    validation = validation_window(frame, test, config)
    return Prepared(panel, frame, test), {
        "data_source": panel.source, "data_sha256": panel.sha256, "data_filled_rows": panel.filled_rows,
        "data_bytes": panel.stored_size, "data_samples": len(frame),
        **({"data_path": str(path)} if path else {}), "data_schema": DATA_SCHEMA,
        "test_window": _span(frame, test), "tails_validation": _span(frame, validation)}


def _span(frame: pd.DataFrame, rows: pd.Series) -> str:
    dates = frame.loc[rows, "target_date"]
    return f"{dates.min().date()}..{dates.max().date()}"


def features_per_ticker(panel: pd.DataFrame, horizon: int, client=None) -> pd.DataFrame:
    """`add_features`, on Dask one task per ticker, joined in `add_features`' order so both engines agree."""
    if client is None:
        return add_features(panel, horizon)
    tickers = panel["ticker"].drop_duplicates().sort_values(kind="stable")
    parts = client.scatter([panel[panel["ticker"] == ticker] for ticker in tickers])
    return pd.concat(client.gather(client.map(add_features, parts, horizon=horizon, pure=False)), ignore_index=True)


AUTO_DASK_TICKERS = 50  # runtime.engine=auto fits the baselines on Dask above this many tickers


def large_data(config: Config, path: Path | None) -> str | None:
    """For `runtime.engine: auto`: a synthetic panel of more than AUTO_DASK_TICKERS tickers."""
    tickers = config.data.synthetic.tickers
    if path is None and config.data.source == "synthetic" and tickers > AUTO_DASK_TICKERS:
        return f"{tickers} tickers (more than {AUTO_DASK_TICKERS})"
    return None


def evaluation_window(frame: pd.DataFrame, config: Config, where: str = "data") -> pd.Series:
    """Origins whose target day lies in the test window, checked to be fit before and scored in."""
    evaluation = config.evaluation
    dates = frame["target_date"]
    if evaluation.test_start is None:
        calendar = np.sort(dates.dropna().unique())
        start = calendar[int(len(calendar) * (1 - evaluation.test_fraction))]
    else:
        start = pd.Timestamp(evaluation.test_start)
    end = pd.Timestamp(evaluation.test_end) if evaluation.test_end else dates.max()
    mask = (dates >= start) & (dates <= end)
    if not mask.any():
        raise UserError(f"{where}: evaluation.test_start/test_end: no trading days between "
                        f"{pd.Timestamp(start).date()} and {end.date()} (the data runs from "
                        f"{frame['date'].min().date()} to {frame['date'].max().date()})")
    history = frame[dates < start].groupby("ticker").size().reindex(frame["ticker"].unique(), fill_value=0)
    if (history < MIN_HISTORY).any():
        ticker = history.index[history < MIN_HISTORY][0]
        raise UserError(f"{where}: ticker '{ticker}': only {history[ticker]} days before the test window starts on "
                        f"{pd.Timestamp(start).date()}; at least {MIN_HISTORY} are needed to fit the models "
                        f"(set evaluation.test_start or evaluation.test_fraction)")
    _check_prices_move(frame[dates < start], "before the test window", frame["ret"], frame["parkinson"], where)
    _check_prices_move(frame[mask], "in the test window", frame["target_ret"], frame["target"], where)
    _check_first_refit(frame, mask, config, where)
    return mask


def _check_prices_move(rows: pd.DataFrame, part: str, returns: pd.Series, parkinson: pd.Series, where: str) -> None:
    """A ticker whose close never changes, or whose range is always 0, has no variance to fit or to score against."""
    for ticker, days in rows.groupby("ticker", sort=False).groups.items():
        span = f"{part} ({rows['date'].loc[days].min().date()} to {rows['date'].loc[days].max().date()})"
        if (returns.loc[days] == 0).all():
            raise UserError(f"{where}: ticker '{ticker}': its close never changes {span}; expected prices "
                            f"that move from day to day")
        if (parkinson.loc[days] == 0).all():
            raise UserError(f"{where}: ticker '{ticker}': its high equals its low on every day {span}; expected "
                            f"a daily range (high above low) on some days")


def _check_first_refit(frame: pd.DataFrame, mask: pd.Series, config: Config, where: str) -> None:
    """The network's first refit has the fewest pairs (the windows expand): it needs some to train and stop on."""
    first = walk_starts(frame, validation_window(frame, mask, config), mask, config.train.refit_every)[0]
    train_rows, val_rows = training_window(frame, trainable(frame), first, config.train.val_fraction)
    if len(train_rows) == 0 or len(val_rows) == 0:
        horizon = config.evaluation.horizon
        raise UserError(f"{where}: evaluation.horizon={horizon}: {len(train_rows)} training and {len(val_rows)} "
                        f"validation pairs whose {horizon} target days all precede the network's first refit on "
                        f"{first.date()}; expected some of each (a shorter evaluation.horizon or a later "
                        f"evaluation.test_start gives more)")


def validation_window(frame: pd.DataFrame, mask: pd.Series, config: Config) -> pd.Series:
    """Origins whose target day is in the validation period (where the tail rule is chosen and `val_qlike_sq`
    measured): the `evaluation.val_days` days before the test window, at most half of those before it."""
    dates = frame["target_date"]
    start = dates[mask].min()
    calendar = np.sort(dates[dates < start].unique())
    return (dates >= calendar[-min(config.evaluation.val_days, len(calendar) // 2)]) & (dates < start)


def block_starts(frame: pd.DataFrame, mask: pd.Series, every: int) -> list[pd.Timestamp]:
    """Refit dates: every `every`-th trading day of the test window, on the calendar of all tickers."""
    calendar = np.sort(frame.loc[mask, "target_date"].unique())
    return [pd.Timestamp(date) for date in calendar[::every]]


def walk_starts(frame: pd.DataFrame, validation: pd.Series, mask: pd.Series, every: int) -> list[pd.Timestamp]:
    """Refit dates over the validation period, then the test window, each cut from its own first day."""
    return block_starts(frame, validation, every) + block_starts(frame, mask, every)


def ticker_blocks(rows: pd.DataFrame, mask: pd.Series, starts: list[pd.Timestamp]) -> list[tuple[int, int]]:
    """The origins of one ticker to forecast (`mask`), cut at the refit dates, as (first, last) positions in `rows`."""
    positions = np.flatnonzero(mask.to_numpy())
    block_index = np.searchsorted(np.array(starts, dtype="datetime64[ns]"),
                                  rows["target_date"].to_numpy()[positions], side="right")
    return [(int(chunk[0]), int(chunk[-1])) for chunk in np.split(positions, np.flatnonzero(np.diff(block_index)) + 1)
            if len(chunk)]


def baseline_runs(frame: pd.DataFrame, mask: pd.Series, config: Config, runtime: Runtime | None = None,
                  client=None, workers: int | None = None, validation: pd.Series | None = None) -> BaselineRuns:
    """Every baseline's walk-forward, a task per ticker and baseline, to start (`with`) and `collect`
    (`parallel.py`); with `validation`, the walk starts there, cut as the network's."""
    rows_forecast = mask if validation is None else validation | mask
    starts = (block_starts(frame, mask, config.evaluation.refit_every) if validation is None
              else walk_starts(frame, validation, mask, config.evaluation.refit_every))
    tasks = [BaselineTask(ticker, model, rows, blocks) for ticker, rows in frame.groupby("ticker", sort=False)
             for blocks in [ticker_blocks(rows, rows_forecast[rows.index], starts)]
             for model in config.baselines.models]
    return BaselineRuns(tasks, config.evaluation.horizon, config.baselines, runtime, client, workers)


def baseline_forecasts(frame: pd.DataFrame, mask: pd.Series, config: Config, runtime: Runtime | None = None,
                       client=None, workers: int | None = None,
                       validation: pd.Series | None = None) -> pd.DataFrame | None:
    """Every baseline's walk-forward forecasts, on rank 0 (None on the other ranks)."""
    with baseline_runs(frame, mask, config, runtime, client, workers, validation) as runs:
        return runs.collect()


def trainable(frame: pd.DataFrame) -> pd.Series:
    """Pairs the network can learn from: its inputs defined, and every target positive (QLIKE needs them so)."""
    positive = frame[["target", "target_h", "target_sq", "target_sq_h"]].gt(0).all(axis=1)
    return usable(frame) & positive


def training_window(frame: pd.DataFrame, ready: pd.Series, refit_date: pd.Timestamp,
                    val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """Pairs whose H target days all precede the refit, to train on and (the latest `val_fraction`) to stop on."""
    known = ready & (frame["target_date_h"] < refit_date)
    dates = np.sort(frame.loc[known, "target_date_h"].unique())
    val_start = dates[int(len(dates) * (1 - val_fraction))] if len(dates) else refit_date
    return (np.flatnonzero(known & (frame["target_date_h"] < val_start)),
            np.flatnonzero(known & (frame["target_date_h"] >= val_start)))


def overnight_factors(frame: pd.DataFrame, rows: np.ndarray) -> pd.Series:
    """Per ticker, squared returns over Parkinson variance in `rows`: turns a range forecast into a return's."""
    window = frame.iloc[rows]
    sums = window.groupby("ticker", sort=False)[["target_sq", "target"]].sum()
    return sums["target_sq"] / sums["target"]


def neural_walk(frame: pd.DataFrame, mask: pd.Series, config: Config, job: Job) -> tuple[dict[str, pd.DataFrame], dict]:
    """The network's walk over the validation period and the test window, every refit trained at once: each
    tail rule's forecasts (with the realised `ret` and `ret_h`) and the last refit, for serving."""
    device, horizon, target = job.runtime.device, config.evaluation.horizon, config.neural.target
    names = feature_names(config.data.exogenous)
    features = torch.tensor(frame[names].to_numpy(), dtype=torch.float32)
    proxies = ["target_sq", "target_sq_h"] if target == "returns" else ["target", "target_h"]
    targets = torch.tensor(frame[proxies].to_numpy(), dtype=torch.float32)
    ready = trainable(frame)
    validation = validation_window(frame, mask, config)
    starts = walk_starts(frame, validation, mask, config.train.refit_every)
    tested = len(block_starts(frame, mask, config.train.refit_every))
    # refits seeded from the test window's first, the validation ones after: the test forecasts stay the same
    blocks = [*range(tested, len(starts)), *range(tested)]
    windows = [training_window(frame, ready, start, config.train.val_fraction) for start in starts]
    fits = [Fit(config.runtime.seed + 1000 * block + member, train_rows, val_rows)
            for block, (train_rows, val_rows) in zip(blocks, windows) for member in range(config.neural.ensemble)]
    with job.phase("fit/neural", "device"):
        ensemble = train_ensemble(fits, features, targets, config, job)
    parts, windows_seen, inputs_ahead, latest, refit = _each_refit(frame, ensemble, features, starts, windows,
                                                                   validation | mask, config, device)
    latest["models"] = [ensemble.member(fit) for fit in refit.tolist()]  # the last refit's members: served
    with job.phase("fit/tails", "serial"):  # every refit's joint VaR/ES head, on its own window (`joint.py`)
        heads = fit_heads(*map(list, zip(*windows_seen)))
    latest["head"] = heads[-1].state_dict()
    joint_parts = [part.assign(**head.columns(scaled)) for part, head, scaled in zip(parts, heads, inputs_ahead)]
    outcomes = frame[["ticker", "target_date", "target_date_h", "target_ret", "target_ret_h"]].set_axis(
        ["ticker", "date", "date_h", "ret", "ret_h"], axis=1)
    forecasts = pd.concat(parts).join(outcomes)
    renewals = walk_starts(frame, validation, mask, config.evaluation.refit_every)
    return {"training": forecasts, "out_of_sample": recalibrate(forecasts, renewals, horizon),
            "out_of_sample_evt": recalibrate(forecasts, renewals, horizon, evt_columns),
            "fz": pd.concat(joint_parts).join(outcomes)}, latest


def _each_refit(frame: pd.DataFrame, ensemble, inputs: torch.Tensor, starts: list, windows: list,
                forecast_rows: pd.Series, config: Config, device: torch.device):
    """Per refit: its block's forecasts, its window's scaled inputs, standardised returns and tails (what the joint
    head trains on), its block's scaled inputs; and the last refit's description and members, served."""
    horizon, target, names = config.evaluation.horizon, config.neural.target, feature_names(config.data.exogenous)
    members = config.neural.ensemble
    features = inputs.to(device)
    parts, windows_seen, inputs_ahead, latest, refit = [], [], [], {}, None
    for position, (start, (train_rows, val_rows)) in enumerate(zip(starts, windows)):
        end = starts[position + 1] if position + 1 < len(starts) else pd.Timestamp.max
        refit = torch.arange(position * members, (position + 1) * members, device=device)  # its fits in `fits`
        fitted_rows = np.union1d(train_rows, val_rows)
        factors = overnight_factors(frame, fitted_rows) if target == "scaled_range" else None
        predict_rows = np.flatnonzero(forecast_rows & (frame["target_date"] >= start) & (frame["target_date"] < end))
        fitted, forecast = (_scaled(ensemble.forecast(features[rows], refit).cpu().numpy(),
                                    frame["ticker"].to_numpy()[rows], factors) for rows in (fitted_rows, predict_rows))
        realised = frame[["target_ret", "target_ret_h"]].to_numpy()[fitted_rows]
        mu = float(realised[:, 0].mean())
        standardised = np.column_stack([realised[:, 0] - mu, realised[:, 1] - horizon * mu]) / np.sqrt(fitted)
        tails = empirical_columns(standardised[:, 0], standardised[:, 1])
        parts.append(forecast_frame(frame, predict_rows, forecast[:, 0], forecast[:, 1], mu, tails))
        scaler = ensemble.member(int(refit[0]))  # a refit's members share its window's scaler
        windows_seen.append((scaler.scaled(inputs[fitted_rows]), standardised, tails))
        inputs_ahead.append(scaler.scaled(inputs[predict_rows]))
        latest = {"features": names, "exogenous": config.data.exogenous,
                  "architecture": {**config.neural.model_dump(exclude={"ensemble", "target"}), "horizon": horizon},
                  "overnight_factors": {} if factors is None else factors.to_dict(),
                  "mu": mu, "trained_until": str(start.date()), "training_tails": tails}
    return parts, windows_seen, inputs_ahead, latest, refit


def neural_forecasts(frame: pd.DataFrame, mask: pd.Series, config: Config, job: Job,
                     baselines: pd.DataFrame | None = None) -> tuple[pd.DataFrame, dict]:
    """`neural_walk` with its tails chosen among its rules and the tail models of `baselines`."""
    return serve_chosen_tails(frame, mask, validation_window(frame, mask, config), config,
                              *neural_walk(frame, mask, config, job), baselines, job)


def _scaled(forecast: np.ndarray, tickers: np.ndarray, factors: pd.Series | None) -> np.ndarray:
    return forecast if factors is None else forecast * factors.reindex(tickers).to_numpy()[:, None]


def run(config: Config, data: Prepared, job: Job) -> RunResult:
    """The baselines start (in a pool or on Dask) before the network trains and are collected after."""
    frame, mask = data.frame, data.test
    validation = validation_window(frame, mask, config)
    with baseline_runs(frame, mask, config, job.runtime, job.dask, validation=validation) as runs:
        walk = neural_walk(frame, mask, config, job)
        with job.phase("baselines", "cores"):  # what is left of them once the network has trained
            baselines = runs.collect()
    if not job.runtime.is_main:
        return RunResult({})
    with job.phase("choose_tails", "serial"):
        neural, latest = serve_chosen_tails(frame, mask, validation, config, *walk, baselines, job)
    baselines = baselines[mask[baselines.index].to_numpy()].drop(columns=["gas_beta", "gas_gamma"], errors="ignore")
    names = {"ticker": "ticker", "target_date": "date", "target": "parkinson", "target_ret": "ret",
             "target_true": "true_variance"}
    realised = frame[[name for name in names if name in frame]].rename(columns=names)
    forecasts = pd.concat([baselines, neural]).join(realised)
    with job.phase("evaluate", "serial"):
        models = evaluate(forecasts, config.evaluation.horizon, config.evaluation.dm_lags)
        models["neural"].update(latest["validation"])
    for name, metrics in models.items():
        job.model_done(name, metrics)
    with job.phase("plots", "serial"):
        _log_artifacts(forecasts, job)
    with job.phase("serving_bundle", "serial"):
        served = log_forecaster(latest, data.panel.frame, job)
    return RunResult(models, served=served)


def _log_artifacts(forecasts: pd.DataFrame, job: Job) -> None:
    tracker = job.tracker
    compared = [name for name in ("har", "gjr_garch_t", "neural") if name in set(forecasts["model"])]
    for ticker in forecasts["ticker"].unique():
        tracker.log_figure(forecast_figure(forecasts, ticker, compared), f"plots/forecast_{ticker}.png")
        tracker.log_figure(risk_figure(forecasts, ticker, "neural"), f"plots/risk_{ticker}.png")
    table = forecasts.reset_index(drop=True)[["model", "ticker", "date", "variance", "variance_h", "mu", "q01",
                                              "q05", "es975_q", "es975", "es99_q", "es99", "parkinson", "ret"]]
    tracker.log_text(table.to_csv(index=False), "forecasts.csv")
