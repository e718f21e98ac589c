"""A user's interaction log read into a `RawLog`, the form every source is read into, and the column checks
MovieLens's files share; every mistake is one `UserError` line naming the file, the column and the row."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from common.errors import UserError
from common.paths import file_sha256
from common.tables import (Rows, csv_separator, found_columns, is_parquet, numbers_or_text, read_numbers,
                           read_table, value_kind)
from .config import Columns

EPOCH = pd.Timestamp(0, tz="UTC")
DATE_KINDS = ("date", "datetime", "datetime64")  # Python dates in an object column (Parquet's date32, for one)
EXPECTED = "a .csv, .tsv or .parquet interaction log (one row per user and item) or a MovieLens folder"


@dataclass
class RawLog:
    """A log before filtering: user and item (raw ids), rating (NaN where missing) and timestamp (Unix seconds)."""

    frame: pd.DataFrame
    titles: pd.Series | None  # title by raw item id
    source: str
    sha256: str
    has_timestamps: bool


def read_log(path: Path, columns: Columns) -> RawLog:
    """A CSV or Parquet log; an optional column named explicitly must be there (not silently dropped)."""
    if csv_separator(path) is None and not is_parquet(path) and path.name.lower().endswith(".zip"):
        raise UserError(f"{path}: a zip archive; unzip it and pass the log, or a MovieLens zip's unzipped folder")
    table = read_table(path, EXPECTED)
    if table.frame.empty:
        raise no_rows(path, columns)
    names = check_columns(table.frame, columns, path)
    frame, titles = log_frame(table.frame, columns, names, table.rows)
    if titles is not None:
        titles = titles.fillna("").astype(str)
    return RawLog(frame, titles, f"file:{path.name}", file_sha256(path), has_timestamps="timestamp" in names)


def no_rows(path: Path, columns: Columns) -> UserError:
    return UserError(f"{path}: no data rows (expected one row per interaction with columns '{columns.user}' and "
                     f"'{columns.item}')")


def log_frame(table: pd.DataFrame, columns: Columns, names: dict[str, str], rows: Rows
              ) -> tuple[pd.DataFrame, pd.Series | None]:
    """The checked columns of a log, or of a part of one, as a `RawLog` holds them, and each item's first title."""
    users, items = table[columns.user], table[columns.item]
    if not pd.api.types.is_numeric_dtype(users) and not pd.api.types.is_numeric_dtype(items):
        header = (users.astype(str) == columns.user) & (items.astype(str) == columns.item)
        if header.any():
            row = rows.first + rows.first_bad(header) + 1
            raise UserError(f"{rows.path}: duplicated header at row {row} (a second '{columns.user}', "
                            f"'{columns.item}' header line inside the data; remove it; {rows.counting(row)})")
    frame = pd.DataFrame({"user": read_ids(users, rows, columns.user), "item": read_ids(items, rows, columns.item)})
    frame["rating"] = read_ratings(table[names["rating"]], rows, names["rating"]) if "rating" in names else np.nan
    frame["timestamp"] = (read_seconds(table[names["timestamp"]], rows, names["timestamp"])
                          if "timestamp" in names else 0)
    titles = table[names["title"]].groupby(frame["item"]).first() if "title" in names else None
    return frame, titles


def check_columns(table: pd.DataFrame, columns: Columns, path: Path) -> dict[str, str]:
    """The log's column for each key of data.columns it has."""
    found = found_columns(table)
    if columns.user == columns.item:
        raise UserError(f"data.columns.user and data.columns.item both name '{columns.user}' in {path}; the user "
                        f"and item ids must be two columns (found: {found})")
    names = {}
    for key, name in columns.model_dump().items():
        if name in table.columns:
            names[key] = name
        elif key in ("user", "item") or (name is not None and key in columns.model_fields_set):
            raise UserError(f"{path}: missing column '{name}' (the {key} column, config key data.columns.{key}: "
                            f"{_rename_hint(table, key)}; found: {found})")
    return names


def _rename_hint(table: pd.DataFrame, key: str) -> str:
    if {"userId", "movieId"} <= set(table.columns):
        return "this is a MovieLens ratings.csv: pass its folder as --data"
    optional = "" if key in ("user", "item") else f", or data.columns.{key}=null if the log has none"
    return f"rename it with --set data.columns.{key}=NAME{optional}"


def read_ids(values: pd.Series, rows: Rows, column: str, text: bool = True) -> pd.Series:
    """Integer ids (whole numbers in a float column), or with `text` text ids where any id is not a number."""
    missing = values.isna()
    if missing.any():
        raise rows.at(column, values, missing, "missing id")
    expected = "expected an integer or text id" if text else "expected an integer id"
    if not numbers_or_text(values):
        raise rows.whole(column, f"{expected} in every row, got {value_kind(values)} values")
    if pd.api.types.is_numeric_dtype(values):
        fraction = ~np.isfinite(values) | (values != values.round())
        if fraction.any():
            raise rows.at(column, values, fraction, expected + ", got {value}")
        return values.astype("int64")
    if text:
        return values.astype(str)
    numbers = pd.to_numeric(values, errors="coerce")
    bad = numbers.isna() | (numbers != numbers.round())
    if bad.any():
        raise rows.at(column, values, bad, expected + ", got '{value}'")
    return numbers.astype("int64")


def read_ratings(values: pd.Series, rows: Rows, column: str, stars: tuple[float, float] | None = None) -> pd.Series:
    """Numbers, NaN where empty; with `stars` (MovieLens) every row has a rating in that range."""
    numbers = read_numbers(values, rows, column, expected="numeric ratings")
    if stars is not None:
        if numbers.isna().any():
            raise rows.at(column, values, numbers.isna(), "missing rating")
        outside = ~numbers.between(*stars)
        if outside.any():
            expected = f"expected a rating from {stars[0]:g} to {stars[1]:g} stars"
            raise rows.at(column, values, outside, expected + ", got {value}")
    return numbers


def read_seconds(values: pd.Series, rows: Rows, column: str) -> pd.Series:
    """Unix seconds (1970 or later) from integer seconds or anything pandas reads as a date (UTC by default)."""
    missing = values.isna()
    if missing.any():
        raise rows.at(column, values, missing, "missing timestamp")
    if pd.api.types.is_datetime64_any_dtype(values):
        dates = values.dt.tz_localize("UTC") if values.dt.tz is None else values.dt.tz_convert("UTC")
        seconds = (dates - EPOCH) // pd.Timedelta(seconds=1)
    elif numbers_or_text(values) or pd.api.types.infer_dtype(values) in DATE_KINDS:
        seconds = _from_text_or_numbers(values, rows, column)
    else:
        raise rows.whole(column, f"expected timestamps (Unix seconds or dates), got {value_kind(values)} values; "
                                 "set data.columns.timestamp to the time column, or to null if the log has none")
    before_1970 = seconds < 0
    if before_1970.any():
        raise rows.at(column, values, before_1970,
                      "'{value}' is before 1970 (expected Unix seconds, which are not negative, or a date)")
    return seconds.astype("int64")


def _from_text_or_numbers(values: pd.Series, rows: Rows, column: str) -> pd.Series:
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
        raise rows.at(column, values, bad, "cannot read '{value}' as a timestamp (expected Unix seconds or a date)")
    return numbers.round()
