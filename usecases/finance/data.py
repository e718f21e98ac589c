"""Daily OHLC panels in long format (date, ticker, open, high, low, close, volume), sorted by ticker and date.

Three sources: the S&P 500 and NASDAQ files that `arch` ships, a user's CSV or Parquet file (validated row by
row, so a bad file fails with one line naming the column and row), and a synthetic GJR-GARCH panel.
"""

from __future__ import annotations

import hashlib
import importlib
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from common.errors import UserError
from common.paths import file_sha256
from .config import Data, Synthetic

log = logging.getLogger(__name__)

PRICE_COLUMNS = ["open", "high", "low", "close"]
REQUIRED_COLUMNS = ["date", "high", "low", "close"]
PANEL_COLUMNS = ["date", "ticker", *PRICE_COLUMNS, "volume"]
EXOGENOUS_STALE_DAYS = 7
PRICE_TOLERANCE = 1e-9


@dataclass
class Panel:
    """A long-format frame (PANEL_COLUMNS, plus any exogenous columns) and where it came from."""

    frame: pd.DataFrame
    source: str
    sha256: str
    filled_rows: int = 0

    @property
    def tickers(self) -> list[str]:
        return list(self.frame["ticker"].unique())


def load_panel(config: Data, path: Path | None = None) -> Panel:
    if path is not None:
        panel = load_file(path, config)
    elif config.source == "synthetic":
        panel = synthetic_panel(config.synthetic)
    elif config.source == "file":
        raise UserError("data.source=file needs --data PATH (a CSV or Parquet file in long format)")
    else:
        panel = load_arch(config.series)
    if config.exogenous:
        panel.frame = attach_exogenous(panel.frame, config.exogenous)
        panel.source += f"+{'+'.join(config.exogenous)}"
    return panel


def attach_exogenous(frame: pd.DataFrame, names: list[str]) -> pd.DataFrame:
    """Market-wide daily series from `arch` as extra columns, each row taking the latest value on or before
    its date (never a later one); values older than a week are left missing rather than carried on."""
    joined = frame.sort_values("date", kind="stable")
    for name in names:
        series = importlib.import_module(f"arch.data.{name}").load().iloc[:, 0].dropna()
        values = pd.DataFrame({"date": pd.to_datetime(series.index).astype("datetime64[ns]"),
                               name: series.to_numpy(dtype=float)})
        joined = pd.merge_asof(joined.astype({"date": "datetime64[ns]"}), values, on="date", direction="backward",
                               tolerance=pd.Timedelta(days=EXOGENOUS_STALE_DAYS))
    return joined.sort_values(["ticker", "date"], kind="stable").reset_index(drop=True)


def load_arch(series: list[str]) -> Panel:
    """The daily S&P 500 and NASDAQ (1999-2018) bundled with `arch`: real data that needs no download."""
    frames, files = [], []
    for name in series:
        module = importlib.import_module(f"arch.data.{name}")
        raw = module.load()
        frame = raw.rename(columns=str.lower)[["open", "high", "low", "close", "volume"]]
        frame = frame.rename_axis("date").reset_index().assign(ticker=name)
        frames.append(frame)
        files.extend(sorted(Path(module.__file__).parent.glob("*.csv*")))
    panel = pd.concat(frames, ignore_index=True)[PANEL_COLUMNS].astype({"volume": float})
    return Panel(panel, f"arch:{'+'.join(series)}", file_sha256(*files))


def _read_table(path: Path) -> pd.DataFrame:
    suffixes = "".join(path.suffixes).lower()
    try:
        if suffixes.endswith((".parquet", ".pq")):
            return pd.read_parquet(path).reset_index(drop=True)  # row positions, whatever index was saved
        if ".csv" in suffixes or ".txt" in suffixes:
            return pd.read_csv(path, dtype=str, keep_default_na=True)
    except (ValueError, OSError, pd.errors.ParserError) as exc:
        raise UserError(f"{path}: cannot be read as a table ({str(exc).splitlines()[0]})") from None
    raise UserError(f"{path}: expected a .csv or .parquet file in long format (date, ticker, open, high, low, close)")


def _first_bad(mask: pd.Series) -> int:
    """Row number as a user counts it in the file: 1 is the first data row (the line after the header).

    The frame keeps the file's row positions as its index through sorting, so a date-major file (every ticker on a
    day, then the next day) gets the row of its own file, not of the ticker-sorted frame."""
    return int(mask.index[mask.to_numpy()].min()) + 1


def load_file(path: Path, config: Data) -> Panel:
    raw = _read_table(path)
    if raw.empty:
        raise UserError(f"{path}: no data rows (expected one row per ticker and day)")
    names = config.columns.model_dump()
    missing = [key for key in REQUIRED_COLUMNS if names[key] not in raw.columns]
    if missing:
        key = missing[0]
        raise UserError(f"{path}: missing column '{names[key]}' (the {key} column; rename it with "
                        f"--set data.columns.{key}=NAME; found: {', '.join(map(str, raw.columns))})")
    frame = pd.DataFrame(index=raw.index)
    frame["ticker"] = raw[names["ticker"]].astype(str) if names["ticker"] in raw.columns else path.stem.split(".")[0]
    dates = pd.to_datetime(raw[names["date"]], errors="coerce")
    bad = dates.isna() & raw[names["date"]].notna()
    if bad.any():
        row = _first_bad(bad)
        raise UserError(f"{path}: column '{names['date']}', row {row}: cannot read "
                        f"'{raw[names['date']].iloc[row - 1]}' as a date")
    if dates.isna().any():
        raise UserError(f"{path}: column '{names['date']}', row {_first_bad(dates.isna())}: missing date")
    frame["date"] = dates
    for key in PRICE_COLUMNS + ["volume"]:
        if names[key] not in raw.columns:
            frame[key] = np.nan
            continue
        values = pd.to_numeric(raw[names[key]], errors="coerce")
        bad = (values.isna() & raw[names[key]].notna()) | np.isinf(values)
        if bad.any():
            row = _first_bad(bad)
            raise UserError(f"{path}: column '{names[key]}', row {row}: expected a number, got "
                            f"'{raw[names[key]].iloc[row - 1]}'")
        frame[key] = values.astype(float)
    frame = _check_order(frame, path, names["date"])
    frame, filled = _fill_gaps(frame, path, config.max_fill_gap)
    _check_prices(frame, path, names)
    return Panel(frame[PANEL_COLUMNS].reset_index(drop=True), f"file:{path.name}", file_sha256(path), filled)


def _check_order(frame: pd.DataFrame, path: Path, date_column: str) -> pd.DataFrame:
    grouped = frame.groupby("ticker", sort=False)["date"]
    duplicated = frame.duplicated(["ticker", "date"])
    if duplicated.any():
        row = _first_bad(duplicated)
        raise UserError(f"{path}: column '{date_column}', row {row}: date {frame['date'].loc[row - 1].date()} "
                        f"appears twice for ticker '{frame['ticker'].loc[row - 1]}'")
    backwards = (grouped.diff() < pd.Timedelta(0)).fillna(False)
    if backwards.any():
        row = _first_bad(backwards)
        raise UserError(f"{path}: column '{date_column}', row {row}: dates are not sorted ascending within ticker "
                        f"'{frame['ticker'].loc[row - 1]}'")
    return frame.sort_values(["ticker", "date"], kind="stable")


def _fill_gaps(frame: pd.DataFrame, path: Path, max_gap: int) -> tuple[pd.DataFrame, int]:
    """Forward-fill runs of at most `max_gap` rows with a missing close, high or low; longer runs are errors."""
    missing = frame[["high", "low", "close"]].isna().any(axis=1)
    if not missing.any():
        return frame, 0
    run_id = (~missing).cumsum()
    run_length = missing.groupby([frame["ticker"], run_id]).transform("sum")
    leading = missing & ((~missing).groupby(frame["ticker"]).cumsum() == 0)
    too_long = missing & ((run_length > max_gap) | leading)
    if too_long.any():
        row = _first_bad(too_long)
        raise UserError(f"{path}: row {row}: {int(run_length.loc[row - 1])} consecutive rows without high, low or "
                        f"close (at most {max_gap} are filled, never the first rows; set data.max_fill_gap)")
    filled = frame.copy()
    filled[PRICE_COLUMNS] = filled.groupby("ticker")[PRICE_COLUMNS].ffill()
    log.info("data: forward-filled %d rows with missing prices in %s (gaps of at most %d rows)",
             int(missing.sum()), path.name, max_gap)
    return filled, int(missing.sum())


def _check_prices(frame: pd.DataFrame, path: Path, names: dict[str, str]) -> None:
    for key in ["high", "low", "close", "open"]:
        bad = frame[key] <= 0
        if bad.any():
            row = _first_bad(bad)
            raise UserError(f"{path}: column '{names[key]}', row {row}: prices must be positive, got "
                            f"{frame[key].loc[row - 1]}")
    bad = frame["high"] < frame["low"]
    if bad.any():
        row = _first_bad(bad)
        raise UserError(f"{path}: row {row}: {names['high']} {frame['high'].loc[row - 1]} is below "
                        f"{names['low']} {frame['low'].loc[row - 1]}")
    slack = PRICE_TOLERANCE * frame["close"]  # rounding in the file, not a data error
    bad = (frame["close"] > frame["high"] + slack) | (frame["close"] < frame["low"] - slack)
    if bad.any():
        row = _first_bad(bad)
        raise UserError(f"{path}: row {row}: {names['close']} {frame['close'].loc[row - 1]} is outside "
                        f"[{names['low']}, {names['high']}] = [{frame['low'].loc[row - 1]}, "
                        f"{frame['high'].loc[row - 1]}]")


def synthetic_panel(config: Synthetic) -> Panel:
    """GJR-GARCH(1,1,1) with standardised-t shocks.

    The close-to-close return is the end point of a Brownian bridge over `intraday_steps` steps, whose
    extremes give High and Low, so Parkinson variance carries the same conditional variance as the returns.
    Drawn with NumPy on every machine, so that one seed gives one panel (and one data_sha256) on a CPU and a GPU.
    """
    rng = np.random.RandomState(config.seed)
    days, tickers, steps = config.days, config.tickers, config.intraday_steps
    scale = np.sqrt((config.nu - 2) / config.nu)
    shocks = rng.standard_normal((days, tickers)) / np.sqrt(rng.chisquare(config.nu, (days, tickers)) / config.nu)
    shocks = shocks * scale
    persistence = config.alpha + config.gamma / 2 + config.beta
    if persistence >= 1:
        raise UserError(f"data.synthetic: alpha + gamma/2 + beta must be below 1 for a stationary panel, "
                        f"got {persistence:.3f}")
    variance = np.full(tickers, config.omega / (1 - persistence))
    returns = np.empty((days, tickers))
    variances = np.empty((days, tickers))
    for day in range(days):
        variances[day] = variance
        returns[day] = np.sqrt(variance) * shocks[day]
        negative = returns[day] < 0
        variance = config.omega + (config.alpha + config.gamma * negative) * returns[day] ** 2 + config.beta * variance
    walk = np.cumsum(rng.standard_normal((days, tickers, steps)), axis=2) * np.sqrt(variances / steps)[..., None]
    fraction = np.arange(1, steps + 1) / steps
    bridge = walk - fraction * walk[..., -1:] + fraction * returns[..., None]
    high_move = np.maximum(bridge.max(axis=2), 0)
    low_move = np.minimum(bridge.min(axis=2), 0)
    log_close = np.log(100.0) + np.cumsum(returns, axis=0) / 100
    log_open = np.vstack([np.full((1, tickers), np.log(100.0)), log_close[:-1]])
    dates = pd.bdate_range("2000-01-03", periods=days)
    frame = pd.DataFrame({
        "date": np.repeat(dates.to_numpy()[None, :], tickers, axis=0).ravel(),
        "ticker": np.repeat([f"SYN{i:03d}" for i in range(tickers)], days),
        "open": np.exp(log_open).T.ravel(),
        "high": np.exp(np.maximum(log_open + high_move / 100, log_close)).T.ravel(),
        "low": np.exp(np.minimum(log_open + low_move / 100, log_close)).T.ravel(),
        "close": np.exp(log_close).T.ravel(),
        "volume": 1e6,
    })
    digest = hashlib.sha256(pd.util.hash_pandas_object(frame, index=False).to_numpy().tobytes()).hexdigest()
    return Panel(frame, f"synthetic:seed={config.seed},tickers={tickers},days={days}", digest)
