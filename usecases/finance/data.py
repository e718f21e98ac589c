"""Daily OHLC panels in long format, sorted by ticker and date: the S&P 500 and NASDAQ files that `arch` ships, a
user's CSV or Parquet file, or a synthetic GJR-GARCH panel. A user's file is read by `common.tables` and checked
before any run: each problem one line naming the file, the row (in the file's own order), the column or config key,
and what was expected."""

from __future__ import annotations

import difflib
import hashlib
import importlib
import logging
import shlex
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from common.errors import UserError
from common.paths import file_sha256, stored_bytes
from common.tables import Rows, found_columns, read_numbers, read_table
from .config import Data, Synthetic

log = logging.getLogger(__name__)

EXOGENOUS_STALE_DAYS = 7
PRICE_COLUMNS = ["open", "high", "low", "close"]
REQUIRED_COLUMNS = ["date", "high", "low", "close"]
PANEL_COLUMNS = ["date", "ticker", *PRICE_COLUMNS, "volume"]
PRICE_TOLERANCE = 1e-9
EARLIEST_DATE = pd.Timestamp("1900-01-01")
EXPECTED_FILE = "a .csv or .parquet file in long format (date, ticker, open, high, low, close)"
EXPECTED_DATE = "expected a date like 2016-01-28 or 20160128"


@dataclass
class Panel:
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
        frame = panel.frame
        for name in config.exogenous:  # with no value on any day, a constant (its imputed mean) the user did not mean
            if frame[name].isna().all():
                raise UserError(f"{path or panel.source}: data.exogenous={name}: arch's {name} series has no value "
                                f"within {EXOGENOUS_STALE_DAYS} days before any date from {frame['date'].min().date()} "
                                f"to {frame['date'].max().date()}; expected dates that it covers "
                                f"(README: Exogenous inputs)")
        panel.source += f"+{'+'.join(config.exogenous)}"
    return panel


def attach_exogenous(frame: pd.DataFrame, names: list[str]) -> pd.DataFrame:
    """Market-wide daily series from `arch` as columns: the latest value on or before each date, within a week."""
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
        frame = module.load().rename(columns=str.lower)[["open", "high", "low", "close", "volume"]]
        frames.append(frame.rename_axis("date").reset_index().assign(ticker=name))
        files.extend(sorted(Path(module.__file__).parent.glob("*.csv*")))
    panel = pd.concat(frames, ignore_index=True)[PANEL_COLUMNS].astype({"volume": float})
    return Panel(panel, f"arch:{'+'.join(series)}", file_sha256(*files), stored_bytes(*files))


def load_file(path: Path, config: Data) -> Panel:
    frame, filled = read_prices(path, config)
    return Panel(frame, f"file:{path.name}", file_sha256(path), stored_bytes(path), filled)


def synthetic_panel(config: Synthetic) -> Panel:
    """GJR-GARCH(1,1,1) with t shocks and its `true_variance`; each return split into an overnight gap and an
    intraday Brownian bridge (High and Low), so Parkinson misses the gap as on real data. NumPy: one seed, one panel."""
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
    returns, variances = np.empty((days, tickers)), np.empty((days, tickers))
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
    high_move, low_move = np.maximum(bridge.max(axis=2), 0), np.minimum(bridge.min(axis=2), 0)
    log_close = np.log(100.0) + np.cumsum(returns, axis=0) / 100
    log_open = np.vstack([np.full((1, tickers), np.log(100.0)), log_close[:-1]]) + overnight / 100
    dates = pd.bdate_range("2000-01-03", periods=days)
    frame = pd.DataFrame({
        "date": np.repeat(dates.to_numpy()[None, :], tickers, axis=0).ravel(),
        "ticker": np.repeat([f"SYN{i:03d}" for i in range(tickers)], days), "open": np.exp(log_open).T.ravel(),
        "high": np.exp(np.maximum(log_open + high_move / 100, log_close)).T.ravel(),
        "low": np.exp(np.minimum(log_open + low_move / 100, log_close)).T.ravel(),
        "close": np.exp(log_close).T.ravel(), "volume": 1e6})
    digest = hashlib.sha256(pd.util.hash_pandas_object(frame, index=False).to_numpy().tobytes()).hexdigest()
    frame["true_variance"] = variances.T.ravel()
    return Panel(frame, f"synthetic:seed={config.seed},tickers={tickers},days={days},overnight={gap:g}", digest,
                 int(frame.memory_usage(deep=True).sum()))


def read_prices(path: Path, config: Data) -> tuple[pd.DataFrame, int]:
    """The file as PANEL_COLUMNS by ticker and date (the index: the file's rows), and the rows forward-filled."""
    table = read_table(path, EXPECTED_FILE, dtype=str)
    raw, rows = table.frame, table.rows
    if raw.empty:
        raise UserError(f"{path}: no data rows (expected one row per ticker and day)")
    columns = _find_columns(raw, path, config)
    frame = pd.DataFrame(index=raw.index)
    frame["ticker"] = _read_tickers(raw, rows, columns["ticker"])
    frame["date"] = _read_dates(raw[columns["date"]], rows)
    for key in PRICE_COLUMNS + ["volume"]:
        frame[key] = np.nan if columns[key] is None else read_numbers(raw[columns[key]], rows, columns[key])
    frame = _check_order(frame, rows, columns["date"])
    frame, filled = _fill_gaps(frame, rows, config.max_fill_gap)
    _check_prices(frame, rows, columns)
    return frame[PANEL_COLUMNS].reset_index(drop=True), filled


def _find_columns(raw: pd.DataFrame, path: Path, config: Data) -> dict[str, str | None]:
    """The file's column for each key of data.columns, None for an optional one it lacks; refused when set explicitly
    or present in another spelling ('Ticker'): ignoring it would merge the tickers or drop a column the user meant."""
    names, explicit = config.columns.model_dump(), config.columns.model_fields_set
    found = [str(column) for column in raw.columns]
    columns: dict[str, str | None] = {}
    missing, hints = [], []
    unclaimed = [column for column in found if column not in names.values()]
    for key, name in names.items():
        if name in found:
            columns[key] = name
            continue
        variants = [column for column in unclaimed if column.strip().lower() == name.lower()]
        close = variants or difflib.get_close_matches(name, unclaimed, n=1)
        if key in REQUIRED_COLUMNS or key in explicit or variants:
            missing.append(key)
            hints += [f"--set {shlex.quote(f'data.columns.{key}={close[0]}')}"] if close else []
        columns[key] = None
    if missing:
        key = missing[0]
        suggestion = f"did you mean {' '.join(hints)}?" if hints else f"rename it with --set data.columns.{key}=NAME"
        raise UserError(f"{path}: missing column '{names[key]}' (the {key} column, config key data.columns.{key}; "
                        f"found: {found_columns(raw)}; {suggestion})")
    used = pd.Series({key: column for key, column in columns.items() if column is not None})
    shared = used[used.duplicated(keep=False)]
    if not shared.empty:
        keys = " and ".join(f"data.columns.{key}" for key in shared.index[shared == shared.iloc[0]])
        raise UserError(f"{path}: {keys} name the same column '{shared.iloc[0]}'; expected a column of its own "
                        f"for each")
    return columns


def _read_tickers(raw: pd.DataFrame, rows: Rows, column: str | None) -> pd.Series | str:
    """The ticker column, or the file's name for a file of one series."""
    if column is None:
        return rows.path.stem.split(".")[0]
    tickers = raw[column].astype(str).str.strip()
    missing = raw[column].isna() | (tickers == "")
    if missing.any():
        raise rows.error(rows.first_bad(missing), "missing ticker (expected a name on every row, or no ticker "
                                                  "column for a file of one series)", column)
    return tickers


def _read_dates(values: pd.Series, rows: Rows) -> pd.Series:
    """Calendar days from text, YYYYMMDD integers or timestamps, keeping the day as written."""
    column = values.name
    if pd.api.types.is_bool_dtype(values):
        raise UserError(f"{rows.path}: column '{column}' holds true/false values; {EXPECTED_DATE}")
    if pd.api.types.is_numeric_dtype(values):
        eight_digits = values.where((values % 1 == 0) & values.between(10_000_000, 99_999_999))
        dates = pd.to_datetime(eight_digits.astype("Int64").astype("string"), format="%Y%m%d", errors="coerce")
    elif pd.api.types.is_datetime64_any_dtype(values):
        dates = values
    else:
        dates = _parse_date_text(values, rows)
    bad = dates.isna() & values.notna()
    if bad.any():
        raise rows.at(column, values, bad, f"cannot read '{{value}}' as a date ({EXPECTED_DATE})")
    if dates.isna().any():
        raise rows.error(rows.first_bad(dates.isna()), f"missing date ({EXPECTED_DATE})", column)
    if dates.dt.tz is not None:
        dates = dates.dt.tz_localize(None)
    dates = dates.dt.normalize()
    today = pd.Timestamp.today().normalize()
    implausible = (dates < EARLIEST_DATE) | (dates > today + pd.Timedelta(days=1))
    if implausible.any():
        position = rows.first_bad(implausible)
        raise rows.error(position, f"date {dates.loc[position].date()} is outside {EARLIEST_DATE.date()} to "
                                   f"{today.date()}; expected the day of each row's prices", column)
    return dates


def _parse_date_text(values: pd.Series, rows: Rows) -> pd.Series:
    try:
        return pd.to_datetime(values, errors="coerce")
    except ValueError:  # pandas refuses offsets that differ between rows
        parsed = values.map(lambda text: pd.to_datetime(text, errors="coerce"))
        offsets = parsed.map(lambda stamp: None if pd.isna(stamp) else stamp.utcoffset())
        first = rows.first_bad(offsets.notna())
        position = rows.first_bad(offsets.notna() & (offsets != offsets.loc[first]))
        raise rows.error(position, f"'{values.loc[position]}' has another time zone than row {first + 1}'s "
                                   f"'{values.loc[first]}'; expected dates in one time zone, or none",
                         values.name) from None


def _check_order(frame: pd.DataFrame, rows: Rows, date_column: str) -> pd.DataFrame:
    grouped = frame.groupby("ticker", sort=False)["date"]
    duplicated = frame.duplicated(["ticker", "date"])
    if duplicated.any():
        position = rows.first_bad(duplicated)
        raise rows.error(position, f"date {frame['date'].loc[position].date()} appears twice for ticker "
                                   f"'{frame['ticker'].loc[position]}' (expected one row per day)", date_column)
    backwards = (grouped.diff() < pd.Timedelta(0)).fillna(False)
    if backwards.any():
        position = rows.first_bad(backwards)
        raise rows.error(position, f"dates are not sorted ascending within ticker '{frame['ticker'].loc[position]}'",
                         date_column)
    return frame.sort_values(["ticker", "date"], kind="stable")


def _fill_gaps(frame: pd.DataFrame, rows: Rows, max_gap: int) -> tuple[pd.DataFrame, int]:
    """Forward-fill runs of at most `max_gap` rows with a missing close, high or low; longer runs are errors."""
    missing = frame[["high", "low", "close"]].isna().any(axis=1)
    if not missing.any():
        return frame, 0
    run_id = (~missing).cumsum()
    run_length = missing.groupby([frame["ticker"], run_id]).transform("sum")
    leading = missing & ((~missing).groupby(frame["ticker"]).cumsum() == 0)
    too_long = missing & ((run_length > max_gap) | leading)
    if too_long.any():
        position = rows.first_bad(too_long)
        raise rows.error(position, f"{int(run_length.loc[position])} consecutive rows without high, low or close "
                                   f"(at most {max_gap} are filled, never the first rows; set data.max_fill_gap)")
    filled = frame.copy()
    filled[PRICE_COLUMNS] = filled.groupby("ticker")[PRICE_COLUMNS].ffill()
    log.info("data: forward-filled %d rows with missing prices in %s (gaps of at most %d rows)",
             int(missing.sum()), rows.path.name, max_gap)
    return filled, int(missing.sum())


def _check_prices(frame: pd.DataFrame, rows: Rows, columns: dict[str, str | None]) -> None:
    for key in ["high", "low", "close", "open"]:
        if (frame[key] <= 0).any():
            raise rows.at(columns[key], frame[key], frame[key] <= 0, "prices must be positive, got {value}")
    if (frame["volume"] < 0).any():
        raise rows.at(columns["volume"], frame["volume"], frame["volume"] < 0,
                      "expected a volume of at least 0, got {value}")
    high, low, close = (frame[key] for key in ("high", "low", "close"))
    bad = high < low
    if bad.any():
        position = rows.first_bad(bad)
        raise rows.error(position, f"{columns['high']} {high.loc[position]} is below {columns['low']} "
                                   f"{low.loc[position]}")
    slack = PRICE_TOLERANCE * close  # rounding in the file, not a data error
    bad = (close > high + slack) | (close < low - slack)
    if bad.any():
        position = rows.first_bad(bad)
        raise rows.error(position, f"{columns['close']} {close.loc[position]} is outside [{columns['low']}, "
                                   f"{columns['high']}] = [{low.loc[position]}, {high.loc[position]}]")
