"""A user's interaction log (CSV or Parquet) read into a `RawLog`, the form every source is read into.

Every mistake in a log is one `UserError` line naming the file, the column and the row (1 is the first data row).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from common.errors import UserError
from common.paths import file_sha256
from .config import Columns

EPOCH = pd.Timestamp(0, tz="UTC")


@dataclass
class RawLog:
    """A log before filtering: columns user and item (raw ids: int64, or str where any id is not an integer),
    rating (float, NaN where missing) and timestamp (int64 Unix seconds, 0 when the log has none)."""

    frame: pd.DataFrame
    titles: pd.Series | None  # title by raw item id
    source: str
    sha256: str
    has_timestamps: bool


def _read_table(path: Path) -> pd.DataFrame:
    suffixes = "".join(path.suffixes).lower()
    try:
        if suffixes.endswith((".parquet", ".pq")):
            return pd.read_parquet(path)
        if ".csv" in suffixes or ".tsv" in suffixes or ".txt" in suffixes:
            return pd.read_csv(path, sep="\t" if ".tsv" in suffixes else ",")
    except pd.errors.EmptyDataError:
        return pd.DataFrame()
    except (ValueError, OSError, pd.errors.ParserError) as exc:
        raise UserError(f"{path}: cannot be read as a table ({str(exc).splitlines()[0][:120]})") from None
    raise UserError(f"{path}: expected a .csv or .parquet interaction log (one row per user and item)")


def _first_bad(mask: pd.Series) -> int:
    """Row number as a user counts it in the file: 1 is the first data row."""
    return int(np.flatnonzero(np.asarray(mask))[0]) + 1


def read_log(path: Path, columns: Columns) -> RawLog:
    """A CSV or Parquet log with `columns`' names; absent optional columns (rating, timestamp, title) are none.

    Ids are read as integers when every one is an integer, else as text.
    """
    table = _read_table(path)
    if table.empty:
        raise UserError(f"{path}: no data rows (expected one row per interaction with columns '{columns.user}' "
                        f"and '{columns.item}')")
    for key in ("user", "item"):
        name = getattr(columns, key)
        if name not in table.columns:
            raise UserError(f"{path}: missing column '{name}' (the {key} column; rename it with "
                            f"--set data.columns.{key}=NAME; found: {', '.join(map(str, table.columns))})")
    users, items = table[columns.user], table[columns.item]
    if not pd.api.types.is_numeric_dtype(users) and not pd.api.types.is_numeric_dtype(items):
        header = (users.astype(str) == columns.user) & (items.astype(str) == columns.item)
        if header.any():
            raise UserError(f"{path}: duplicated header at row {_first_bad(header)} (a second "
                            f"'{columns.user}', '{columns.item}' header line inside the data; remove it)")
    frame = pd.DataFrame({"user": _ids(users, path, columns.user), "item": _ids(items, path, columns.item)})
    has = {key: getattr(columns, key) is not None and getattr(columns, key) in table.columns
           for key in ("rating", "timestamp", "title")}
    frame["rating"] = _ratings(table[columns.rating], path, columns.rating) if has["rating"] else np.nan
    frame["timestamp"] = _seconds(table[columns.timestamp], path, columns.timestamp) if has["timestamp"] else 0
    frame["timestamp"] = frame["timestamp"].astype("int64")
    titles = None
    if has["title"]:
        titles = table[columns.title].groupby(frame["item"]).first().fillna("").astype(str)
    return RawLog(frame, titles, f"file:{path.name}", file_sha256(path), has_timestamps=has["timestamp"])


def _ids(values: pd.Series, path: Path, column: str) -> pd.Series:
    missing = values.isna()
    if missing.any():
        raise UserError(f"{path}: column '{column}', row {_first_bad(missing)}: missing id")
    numeric = pd.api.types.is_numeric_dtype(values) and not pd.api.types.is_bool_dtype(values)
    if numeric and (values == values.round()).all():
        return values.astype("int64")
    return values.astype(str)


def _ratings(values: pd.Series, path: Path, column: str) -> pd.Series:
    """Numbers; an empty cell is no rating (NaN), text is an error."""
    numbers = pd.to_numeric(values, errors="coerce").astype("float64")
    bad = (numbers.isna() & values.notna()) | np.isinf(numbers)
    if bad.any():
        row = _first_bad(bad)
        raise UserError(f"{path}: column '{column}', row {row}: expected a number, got '{values.iloc[row - 1]}'")
    return numbers


def _seconds(values: pd.Series, path: Path, column: str) -> pd.Series:
    """Unix seconds from integer seconds or from anything pandas reads as a date (UTC when it names no zone)."""
    missing = values.isna()
    if missing.any():
        raise UserError(f"{path}: column '{column}', row {_first_bad(missing)}: missing timestamp")
    if pd.api.types.is_datetime64_any_dtype(values):
        dates = values.dt.tz_localize("UTC") if values.dt.tz is None else values.dt.tz_convert("UTC")
        return (dates - EPOCH) // pd.Timedelta(seconds=1)
    numbers = pd.to_numeric(values, errors="coerce")
    if numbers.notna().mean() >= 0.5:
        bad = ~np.isfinite(numbers)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "could not infer format": the mixed parse below copes
            dates = pd.to_datetime(values, errors="coerce", utc=True)
            if dates.isna().any():
                dates = pd.to_datetime(values, errors="coerce", utc=True, format="mixed")
        bad = dates.isna()
        numbers = (dates - EPOCH) // pd.Timedelta(seconds=1)
    if bad.any():
        row = _first_bad(bad)
        raise UserError(f"{path}: column '{column}', row {row}: cannot read '{values.iloc[row - 1]}' as a timestamp "
                        "(expected Unix seconds or a date)")
    return numbers.round().astype("int64")
