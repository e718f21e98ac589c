"""A user's daily OHLC file (CSV, compressed CSV or Parquet, long format), read and checked before any run starts.

Every problem is one `UserError` line naming the file, the row (1 is the first data row, the line after the header,
counted in the file's own order), the column or config key, and what was expected.
"""

from __future__ import annotations

import difflib
import logging
import shlex
from pathlib import Path

import numpy as np
import pandas as pd

from common.errors import UserError
from .config import Data

log = logging.getLogger(__name__)

PRICE_COLUMNS = ["open", "high", "low", "close"]
REQUIRED_COLUMNS = ["date", "high", "low", "close"]
PANEL_COLUMNS = ["date", "ticker", *PRICE_COLUMNS, "volume"]
PRICE_TOLERANCE = 1e-9
EARLIEST_DATE = pd.Timestamp("1900-01-01")
COMPRESSED_SUFFIXES = (".gz", ".bz2", ".xz", ".zst", ".zip")
# What a file that is no CSV text usually is, by its first bytes, and what to do about it.
FILE_SIGNATURES = {b"PK\x03\x04": "a zip archive or an Excel workbook (export it as CSV)",
                   b"\x1f\x8b": "gzip-compressed (name it .csv.gz)", b"PAR1": "a Parquet file (name it .parquet)"}
DELIMITERS = (";", "\t", "|")
EXPECTED_DATE = "expected a date like 2016-01-28 or 20160128"


def read_prices(path: Path, config: Data) -> tuple[pd.DataFrame, int]:
    """The file as PANEL_COLUMNS sorted by ticker and date, and the number of rows forward-filled."""
    raw = _read_table(path)
    if raw.empty:
        raise UserError(f"{path}: no data rows (expected one row per ticker and day)")
    columns = _find_columns(raw, path, config)
    frame = pd.DataFrame(index=raw.index)
    frame["ticker"] = _read_tickers(raw, path, columns["ticker"])
    frame["date"] = _read_dates(raw[columns["date"]], path)
    for key in PRICE_COLUMNS + ["volume"]:
        frame[key] = np.nan if columns[key] is None else _read_numbers(raw[columns[key]], path)
    frame = _check_order(frame, path, columns["date"])
    frame, filled = _fill_gaps(frame, path, config.max_fill_gap)
    _check_prices(frame, path, columns)
    return frame[PANEL_COLUMNS].reset_index(drop=True), filled


def _read_table(path: Path) -> pd.DataFrame:
    suffixes = "".join(path.suffixes).lower()
    parquet = suffixes.endswith((".parquet", ".pq"))
    if path.is_dir() and not parquet:  # a Parquet data set may be a folder of parts; a CSV file is one file
        raise UserError(f"{path}: is a folder; expected one .csv or .parquet file in long format")
    if not parquet and ".csv" not in suffixes and ".txt" not in suffixes:
        raise UserError(f"{path}: expected a .csv or .parquet file in long format (date, ticker, open, high, low, "
                        f"close)")
    try:
        return pd.read_parquet(path).reset_index(drop=True) if parquet else _read_csv(path)  # row positions
    except UnicodeDecodeError as exc:
        raise UserError(f"{path}: not UTF-8 text (byte {exc.object[exc.start]:#04x} at position {exc.start}); "
                        f"expected a CSV file saved as UTF-8") from None
    except pd.errors.ParserError as exc:  # its line numbers count the header as line 1
        raise UserError(f"{path}: cannot be read as a table ({str(exc).splitlines()[0]}; line 1 is the header); "
                        f"expected the same number of comma-separated fields on every line") from None
    except (ValueError, OSError, ImportError) as exc:  # ImportError: a compression whose library is missing
        raise UserError(f"{path}: cannot be read as a table ({str(exc).splitlines()[0]}); expected a "
                        f"{'Parquet' if parquet else 'comma-separated'} file") from None


def _read_csv(path: Path) -> pd.DataFrame:
    if not path.suffix.lower().endswith(COMPRESSED_SUFFIXES):  # pandas decompresses those by their suffix
        with path.open("rb") as file:
            head = file.read(4)
        for signature, what in FILE_SIGNATURES.items():
            if head.startswith(signature):
                raise UserError(f"{path}: this is {what}; expected comma-separated text")
    raw = pd.read_csv(path, dtype=str)
    # Excel's "CSV UTF-8" starts with a byte-order mark: pandas' own parser drops it, and this keeps it off the first
    # column's name (where it would hide 'date') whatever read the file.
    raw = raw.rename(columns={raw.columns[0]: str(raw.columns[0]).removeprefix("\ufeff")})
    if len(raw.columns) == 1:
        separator = next((mark for mark in DELIMITERS if mark in str(raw.columns[0])), None)
        if separator is not None:
            raise UserError(f"{path}: one column {str(raw.columns[0])!r}, its fields separated by {separator!r}; "
                            f"expected comma-separated columns")
    return raw


def _first_bad(mask: pd.Series) -> int:
    """Row number as a user counts it in the file: 1 is the first data row (the line after the header).

    The frame keeps the file's row positions as its index through sorting, so a date-major file (every ticker on a
    day, then the next day) gets the row of its own file, not of the ticker-sorted frame."""
    return int(mask.index[mask.to_numpy()].min()) + 1


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
                        f"found: {', '.join(map(repr, found))}; {suggestion})")
    used = pd.Series({key: column for key, column in columns.items() if column is not None})
    shared = used[used.duplicated(keep=False)]
    if not shared.empty:
        keys = " and ".join(f"data.columns.{key}" for key in shared.index[shared == shared.iloc[0]])
        raise UserError(f"{path}: {keys} name the same column '{shared.iloc[0]}'; expected a column of its own "
                        f"for each")
    return columns


def _read_tickers(raw: pd.DataFrame, path: Path, column: str | None) -> pd.Series | str:
    """The ticker column, or the file's name for a file of one series."""
    if column is None:
        return path.stem.split(".")[0]
    tickers = raw[column].astype(str).str.strip()
    missing = raw[column].isna() | (tickers == "")
    if missing.any():
        raise UserError(f"{path}: column '{column}', row {_first_bad(missing)}: missing ticker (expected a name "
                        f"on every row, or no ticker column for a file of one series)")
    return tickers


def _read_dates(values: pd.Series, path: Path) -> pd.Series:
    """Calendar days, as a CSV and a Parquet file spell them: text, YYYYMMDD integers (never nanoseconds since
    1970), or timestamps; a time zone is dropped, keeping the day as written, and times of day too."""
    column = values.name
    if pd.api.types.is_bool_dtype(values):
        raise UserError(f"{path}: column '{column}' holds true/false values; {EXPECTED_DATE}")
    if pd.api.types.is_numeric_dtype(values):
        eight_digits = values.where((values % 1 == 0) & values.between(10_000_000, 99_999_999))
        dates = pd.to_datetime(eight_digits.astype("Int64").astype("string"), format="%Y%m%d", errors="coerce")
    elif pd.api.types.is_datetime64_any_dtype(values):
        dates = values
    else:
        dates = _parse_date_text(values, path)
    bad = dates.isna() & values.notna()
    if bad.any():
        row = _first_bad(bad)
        raise UserError(f"{path}: column '{column}', row {row}: cannot read '{values.iloc[row - 1]}' as a date "
                        f"({EXPECTED_DATE})")
    if dates.isna().any():
        raise UserError(f"{path}: column '{column}', row {_first_bad(dates.isna())}: missing date ({EXPECTED_DATE})")
    if dates.dt.tz is not None:
        dates = dates.dt.tz_localize(None)
    dates = dates.dt.normalize()
    today = pd.Timestamp.today().normalize()
    implausible = (dates < EARLIEST_DATE) | (dates > today + pd.Timedelta(days=1))
    if implausible.any():
        row = _first_bad(implausible)
        raise UserError(f"{path}: column '{column}', row {row}: date {dates.iloc[row - 1].date()} is outside "
                        f"{EARLIEST_DATE.date()} to {today.date()}; expected the day of each row's prices")
    return dates


def _parse_date_text(values: pd.Series, path: Path) -> pd.Series:
    try:
        return pd.to_datetime(values, errors="coerce")
    except ValueError:  # pandas refuses offsets that differ between rows
        parsed = values.map(lambda text: pd.to_datetime(text, errors="coerce"))
        offsets = parsed.map(lambda stamp: None if pd.isna(stamp) else stamp.utcoffset())
        first = _first_bad(offsets.notna())
        row = _first_bad(offsets.notna() & (offsets != offsets.iloc[first - 1]))
        raise UserError(f"{path}: column '{values.name}', row {row}: '{values.iloc[row - 1]}' has another time zone "
                        f"than row {first}'s '{values.iloc[first - 1]}'; expected dates in one time zone, or "
                        f"none") from None


def _read_numbers(values: pd.Series, path: Path) -> pd.Series:
    if pd.api.types.is_bool_dtype(values):
        raise UserError(f"{path}: column '{values.name}' holds true/false values; expected numbers")
    numbers = pd.to_numeric(values, errors="coerce")
    bad = (numbers.isna() & values.notna()) | np.isinf(numbers)
    if bad.any():
        row = _first_bad(bad)
        raise UserError(f"{path}: column '{values.name}', row {row}: expected a number, got '{values.iloc[row - 1]}'")
    return numbers.astype(float)


def _check_order(frame: pd.DataFrame, path: Path, date_column: str) -> pd.DataFrame:
    grouped = frame.groupby("ticker", sort=False)["date"]
    duplicated = frame.duplicated(["ticker", "date"])
    if duplicated.any():
        row = _first_bad(duplicated)
        raise UserError(f"{path}: column '{date_column}', row {row}: date {frame['date'].loc[row - 1].date()} "
                        f"appears twice for ticker '{frame['ticker'].loc[row - 1]}' (expected one row per day)")
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


def _check_prices(frame: pd.DataFrame, path: Path, columns: dict[str, str | None]) -> None:
    for key in ["high", "low", "close", "open"]:
        bad = frame[key] <= 0
        if bad.any():
            row = _first_bad(bad)
            raise UserError(f"{path}: column '{columns[key]}', row {row}: prices must be positive, got "
                            f"{frame[key].loc[row - 1]}")
    bad = frame["volume"] < 0
    if bad.any():
        row = _first_bad(bad)
        raise UserError(f"{path}: column '{columns['volume']}', row {row}: expected a volume of at least 0, got "
                        f"{frame['volume'].loc[row - 1]}")
    bad = frame["high"] < frame["low"]
    if bad.any():
        row = _first_bad(bad)
        raise UserError(f"{path}: row {row}: {columns['high']} {frame['high'].loc[row - 1]} is below "
                        f"{columns['low']} {frame['low'].loc[row - 1]}")
    slack = PRICE_TOLERANCE * frame["close"]  # rounding in the file, not a data error
    bad = (frame["close"] > frame["high"] + slack) | (frame["close"] < frame["low"] - slack)
    if bad.any():
        row = _first_bad(bad)
        raise UserError(f"{path}: row {row}: {columns['close']} {frame['close'].loc[row - 1]} is outside "
                        f"[{columns['low']}, {columns['high']}] = [{frame['low'].loc[row - 1]}, "
                        f"{frame['high'].loc[row - 1]}]")

