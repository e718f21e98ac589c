"""A user's daily OHLC file (CSV, compressed CSV or Parquet, long format), read and checked before any run starts.

The file is read by `common.tables`, which every use case reads a user's table with. Every problem is one
`UserError` line naming the file, the row (1 is the first data row, the line after the header, counted in the
file's own order; with the line of a text file it is on), the column or config key, and what was expected.
"""

from __future__ import annotations

import difflib
import logging
import shlex
from pathlib import Path

import numpy as np
import pandas as pd

from common.errors import UserError
from common.tables import Rows, found_columns, read_numbers, read_table
from .config import Data

log = logging.getLogger(__name__)

PRICE_COLUMNS = ["open", "high", "low", "close"]
REQUIRED_COLUMNS = ["date", "high", "low", "close"]
PANEL_COLUMNS = ["date", "ticker", *PRICE_COLUMNS, "volume"]
PRICE_TOLERANCE = 1e-9
EARLIEST_DATE = pd.Timestamp("1900-01-01")
EXPECTED_FILE = "a .csv or .parquet file in long format (date, ticker, open, high, low, close)"
EXPECTED_DATE = "expected a date like 2016-01-28 or 20160128"


def read_prices(path: Path, config: Data) -> tuple[pd.DataFrame, int]:
    """The file as PANEL_COLUMNS sorted by ticker and date, and the number of rows forward-filled.

    The frame keeps the file's row positions as its index through sorting, so that an error names the row of the
    user's file (a date-major file: every ticker on a day, then the next day), not of the ticker-sorted frame."""
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
    """The file's column for each key of data.columns; None for an optional one the file lacks.

    An optional column is refused too when it was set explicitly, or when the file has it in another case or with
    spaces ('Ticker' for 'ticker'): ignoring it would merge every ticker into one, or drop a column the user meant."""
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
    """Calendar days, as a CSV and a Parquet file spell them: text, YYYYMMDD integers (never nanoseconds since
    1970), or timestamps; a time zone is dropped, keeping the day as written, and times of day too."""
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
        bad = frame[key] <= 0
        if bad.any():
            position = rows.first_bad(bad)
            raise rows.error(position, f"prices must be positive, got {frame[key].loc[position]}", columns[key])
    bad = frame["volume"] < 0
    if bad.any():
        position = rows.first_bad(bad)
        raise rows.error(position, f"expected a volume of at least 0, got {frame['volume'].loc[position]}",
                         columns["volume"])
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
