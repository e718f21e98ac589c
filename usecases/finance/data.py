"""Daily OHLC panels in long format (date, ticker, open, high, low, close, volume), sorted by ticker and date.

Three sources: the S&P 500 and NASDAQ files that `arch` ships, a user's CSV or Parquet file (validated row by
row in `files.py`, so a bad file fails with one line naming the column and row), and a synthetic GJR-GARCH panel.
"""

from __future__ import annotations

import hashlib
import importlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from common.errors import UserError
from common.paths import file_sha256, stored_bytes
from .config import Data, Synthetic
from .files import PANEL_COLUMNS, read_prices

EXOGENOUS_STALE_DAYS = 7


@dataclass
class Panel:
    """A long-format frame (PANEL_COLUMNS, plus any exogenous columns) and where it came from."""

    frame: pd.DataFrame
    source: str
    sha256: str
    stored_size: int  # bytes of the files read; a generated panel's frame in memory (data_bytes)
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
        _check_exogenous_overlap(panel.frame, config.exogenous, path or panel.source)
        panel.source += f"+{'+'.join(config.exogenous)}"
    return panel


def _check_exogenous_overlap(frame: pd.DataFrame, names: list[str], where: Path | str) -> None:
    """An input with no value on any day of the panel would be a constant (its imputed mean) the user did not mean."""
    for name in names:
        if frame[name].isna().all():
            raise UserError(f"{where}: data.exogenous={name}: arch's {name} series has no value within "
                            f"{EXOGENOUS_STALE_DAYS} days before any date from {frame['date'].min().date()} to "
                            f"{frame['date'].max().date()}; expected dates that it covers (README: Exogenous inputs)")


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
    return Panel(panel, f"arch:{'+'.join(series)}", file_sha256(*files), stored_bytes(*files))


def load_file(path: Path, config: Data) -> Panel:
    """A user's CSV or Parquet file, checked row by row in `files.read_prices`."""
    frame, filled = read_prices(path, config)
    return Panel(frame, f"file:{path.name}", file_sha256(path), stored_bytes(path), filled)


def synthetic_panel(config: Synthetic) -> Panel:
    """GJR-GARCH(1,1,1) with standardised-t shocks, and its true conditional variance as `true_variance`.

    Each day's close-to-close return r is split into an overnight gap (close to open) and the intraday move, given r
    as a Gaussian split would be (gap = g·r + √(g(1 − g))·σ·e, g = `overnight`): the two are uncorrelated, with
    variances g·σ² and (1 − g)·σ², and r keeps its GJR-t law, so GJR-t is the correctly specified model. The intraday
    move is the end point of a Brownian bridge over `intraday_steps` steps from the open, whose extremes give High
    and Low: Parkinson variance then measures (1 − g)·σ² (a little less, the path being sampled in steps), the
    scale bias that a model of range variance carries into a forecast of returns.
    Drawn with NumPy on every machine, so that one seed gives one panel (and one data_sha256) on a CPU and a GPU.
    """
    rng = np.random.RandomState(config.seed)
    days, tickers, steps, gap = config.days, config.tickers, config.intraday_steps, config.overnight
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
    overnight = gap * returns + np.sqrt(gap * (1 - gap) * variances) * rng.standard_normal((days, tickers))
    intraday = returns - overnight
    walk = np.cumsum(rng.standard_normal((days, tickers, steps)), axis=2)
    walk *= np.sqrt((1 - gap) * variances / steps)[..., None]
    fraction = np.arange(1, steps + 1) / steps
    bridge = walk - fraction * walk[..., -1:] + fraction * intraday[..., None]
    high_move = np.maximum(bridge.max(axis=2), 0)
    low_move = np.minimum(bridge.min(axis=2), 0)
    log_close = np.log(100.0) + np.cumsum(returns, axis=0) / 100
    log_open = np.vstack([np.full((1, tickers), np.log(100.0)), log_close[:-1]]) + overnight / 100
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
    frame["true_variance"] = variances.T.ravel()
    return Panel(frame, f"synthetic:seed={config.seed},tickers={tickers},days={days},overnight={gap:g}", digest,
                 int(frame.memory_usage(deep=True).sum()))
