"""A user's interaction log (CSV or Parquet) read into a `RawLog`, the form every source is read into, and the
column checks that MovieLens's files share with it.

Every mistake in a log is one `UserError` line naming the file, the column (or config key) and the row, and saying
how rows are counted: from 1 at the line after the header, at the first line of a file without one.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa

from common.errors import UserError
from common.paths import file_sha256
from .config import Columns

EPOCH = pd.Timestamp(0, tz="UTC")
SEPARATORS = (";", "\t", "|")  # what a one-column "CSV" is usually separated by instead
TEXT_KINDS = ("string", "mixed-integer")  # pandas' inferred kinds of a text id column (CSV chunks may mix in ints)
COMPRESSED = (".gz", ".bz2", ".zip", ".xz", ".zst")  # a CSV's size says nothing of its rows, nor can it be cut
DATE_KINDS = ("date", "datetime", "datetime64")  # Python dates in an object column (Parquet's date32, for one)


@dataclass
class RawLog:
    """A log before filtering: columns user and item (raw ids: int64, or str where any id is not an integer),
    rating (float, NaN where missing) and timestamp (int64 Unix seconds, 0 when the log has none)."""

    frame: pd.DataFrame
    titles: pd.Series | None  # title by raw item id
    source: str
    sha256: str
    has_timestamps: bool


@dataclass(frozen=True)
class Rows:
    """Where a column was read from, so that an error names the file, the column and the row as its user counts
    them: `fields` lists a headerless file's fields in order (MovieLens's u.data, ratings.dat); `header` is False
    for a table without lines (Parquet); `first` is how many rows come before a part read on its own."""

    path: Path
    fields: tuple[str, ...] = ()
    header: bool = True
    first: int = 0  # rows before these: a part of a file read in partitions counts on from the parts before it

    def counting(self) -> str:
        if self.fields:
            return "row N is line N: the file has no header"
        return "rows counted from 1 at the line after the header" if self.header else "rows counted from 1"

    def column(self, name: str) -> str:
        return f"field {self.fields.index(name) + 1} ({name})" if self.fields else f"column '{name}'"

    def at(self, name: str, values: pd.Series, mask: pd.Series, problem: str) -> UserError:
        """`problem` at the first row where `mask` holds; `{value}` in it is that row's value."""
        row = int(np.flatnonzero(np.asarray(mask))[0])
        problem = problem.format(value=values.iloc[row])
        return UserError(f"{self.path}: {self.column(name)}, row {self.first + row + 1}: {problem} "
                         f"({self.counting()})")

    def whole(self, name: str, problem: str) -> UserError:
        return UserError(f"{self.path}: {self.column(name)}: {problem}")


def is_parquet(path: Path) -> bool:
    return path.name.lower().endswith((".parquet", ".pq"))


def not_parquet(path: Path, exc: Exception) -> UserError:
    reason = str(exc).replace(f"'{path}'", "it").split(". ")[0]  # pyarrow's reason, without the path again
    return UserError(f"{path}: cannot be read as Parquet ({reason})")


def csv_separator(path: Path) -> str | None:
    """The field separator of a text log by its name; None for a file that is not one."""
    suffixes = "".join(path.suffixes).lower()
    if ".csv" in suffixes or ".tsv" in suffixes or ".txt" in suffixes:
        return "\t" if ".tsv" in suffixes else ","
    return None


def _read_table(path: Path) -> pd.DataFrame:
    suffixes = "".join(path.suffixes).lower()
    if is_parquet(path):
        try:
            table = pd.read_parquet(path)
        except (ValueError, OSError, pa.ArrowException) as exc:
            raise not_parquet(path, exc) from None
        return plain(table)
    separator = csv_separator(path)
    if separator is not None:
        return read_csv_text(path, separator, path)
    if suffixes.endswith(".zip"):
        raise UserError(f"{path}: a zip archive; unzip it and pass the log, or a MovieLens zip's unzipped folder")
    raise UserError(f"{path}: expected a .csv, .tsv or .parquet interaction log (one row per user and item) or a "
                    "MovieLens folder")


def plain(table: pd.DataFrame) -> pd.DataFrame:
    """A Parquet file's columns as a CSV's would be: a frame written with its index (user_id, say) gets it back as
    a column, and a category column (pandas writes one as a dictionary) its values' type."""
    if any(name is not None for name in table.index.names):
        table = table.reset_index()
    categorical = [name for name, dtype in table.dtypes.items() if isinstance(dtype, pd.CategoricalDtype)]
    return table.astype({name: table[name].cat.categories.dtype for name in categorical}).reset_index(drop=True)


def read_csv_text(source, separator: str, path: Path, dtype: dict | None = None, first_line: int = 0
                  ) -> pd.DataFrame:
    """A CSV file, or the bytes of a part of one behind its header line (`source`), read as `path` names it; a
    line number in an error counts on from `first_line` (the lines before the part). utf-8-sig, since spreadsheets
    save a byte-order mark that would otherwise stick to the first column's name."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", pd.errors.ParserWarning)  # rows longer than the header: values dropped
            return pd.read_csv(source, sep=separator, encoding="utf-8-sig", index_col=False, dtype=dtype)
    except pd.errors.ParserWarning:
        raise UserError(f"{path}: the rows hold more values than the header names columns (name every column in "
                        "the first line, or remove the separator at the end of each line)") from None
    except pd.errors.EmptyDataError:
        return pd.DataFrame()
    except UnicodeDecodeError as exc:
        raise UserError(f"{path}: not UTF-8 text (byte {exc.object[exc.start]:#04x}); expected a CSV file saved as "
                        "UTF-8") from None
    except (ValueError, OSError, pd.errors.ParserError) as exc:
        reason = re.sub(r"(?<=line )(\d+)", lambda found: str(first_line + int(found.group())),
                        str(exc).splitlines()[0][:120])
        raise UserError(f"{path}: cannot be read as a table ({reason}; lines counted from 1 at the header)"
                        ) from None


def read_log(path: Path, columns: Columns) -> RawLog:
    """A CSV or Parquet log with `columns`' names; absent optional columns (rating, timestamp, title) are none,
    unless they were named explicitly (a misspelt name would otherwise drop the column silently).

    Ids are read as integers when every one is an integer, else as text.
    """
    table = _read_table(path)
    if table.empty:
        raise no_rows(path, columns)
    names = check_columns(table, columns, path)
    frame, titles = log_frame(table, columns, names, Rows(path, header=not is_parquet(path)))
    if titles is not None:
        titles = titles.fillna("").astype(str)
    return RawLog(frame, titles, f"file:{path.name}", file_sha256(path), has_timestamps="timestamp" in names)


def no_rows(path: Path, columns: Columns) -> UserError:
    return UserError(f"{path}: no data rows (expected one row per interaction with columns '{columns.user}' and "
                     f"'{columns.item}')")


def log_frame(table: pd.DataFrame, columns: Columns, names: dict[str, str], rows: Rows
              ) -> tuple[pd.DataFrame, pd.Series | None]:
    """The checked columns of a log, or of a part of one, as a `RawLog` holds them, and with a title column the
    first title of each item (NaN where it has none)."""
    users, items = table[columns.user], table[columns.item]
    if not pd.api.types.is_numeric_dtype(users) and not pd.api.types.is_numeric_dtype(items):
        header = (users.astype(str) == columns.user) & (items.astype(str) == columns.item)
        if header.any():
            row = rows.first + int(np.flatnonzero(header.to_numpy())[0]) + 1
            raise UserError(f"{rows.path}: duplicated header at row {row} (a second '{columns.user}', "
                            f"'{columns.item}' header line inside the data; remove it; {rows.counting()})")
    frame = pd.DataFrame({"user": read_ids(users, rows, columns.user), "item": read_ids(items, rows, columns.item)})
    frame["rating"] = read_ratings(table[names["rating"]], rows, names["rating"]) if "rating" in names else np.nan
    frame["timestamp"] = (read_seconds(table[names["timestamp"]], rows, names["timestamp"])
                          if "timestamp" in names else 0)
    frame["timestamp"] = frame["timestamp"].astype("int64")
    titles = table[names["title"]].groupby(frame["item"]).first() if "title" in names else None
    return frame, titles


def check_columns(table: pd.DataFrame, columns: Columns, path: Path) -> dict[str, str]:
    """The log's column for each key of data.columns it has: user and item always, an optional one when present
    (or an error when it was named explicitly and is absent)."""
    found = ", ".join(repr(str(name)) for name in table.columns)
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
    """What to do about a missing column, when the header says why it is missing."""
    if len(table.columns) == 1:
        separator = next((mark for mark in SEPARATORS if mark in str(table.columns[0])), None)
        if separator is not None:
            return f"the header is one column separated by {separator!r}; expected comma-separated columns"
    if {"userId", "movieId"} <= set(table.columns):
        return "this is a MovieLens ratings.csv: pass its folder as --data"
    optional = "" if key in ("user", "item") else f", or data.columns.{key}=null if the log has none"
    return f"rename it with --set data.columns.{key}=NAME{optional}"


def read_ids(values: pd.Series, rows: Rows, column: str, text: bool = True) -> pd.Series:
    """Integer ids (a float column's values must be whole numbers), or with `text` text ids where any id is not a
    number; anything else (true/false, dates, bytes) is a column named wrongly or a wrong type."""
    missing = values.isna()
    if missing.any():
        raise rows.at(column, values, missing, "missing id")
    expected = "expected an integer or text id" if text else "expected an integer id"
    if not _numbers_or_text(values):
        raise rows.whole(column, f"{expected} in every row, got {_kind(values)} values")
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


def read_ratings(values: pd.Series, rows: Rows, column: str, stars: tuple[float, float] | None = None
                 ) -> pd.Series:
    """Numbers; an empty cell is no rating (NaN), text is an error. With `stars` (MovieLens) every row has a
    rating in that range."""
    if not _numbers_or_text(values):
        raise rows.whole(column, f"expected numeric ratings, got {_kind(values)} values")
    numbers = pd.to_numeric(values, errors="coerce").astype("float64")
    bad = (numbers.isna() & values.notna()) | np.isinf(numbers)
    if bad.any():
        raise rows.at(column, values, bad, "expected a number, got '{value}'")
    if stars is not None:
        if numbers.isna().any():
            raise rows.at(column, values, numbers.isna(), "missing rating")
        outside = ~numbers.between(*stars)
        if outside.any():
            expected = f"expected a rating from {stars[0]:g} to {stars[1]:g} stars"
            raise rows.at(column, values, outside, expected + ", got {value}")
    return numbers


def read_seconds(values: pd.Series, rows: Rows, column: str) -> pd.Series:
    """Unix seconds (not negative: 1970 or later) from integer seconds or from anything pandas reads as a date
    (UTC when it names no zone)."""
    missing = values.isna()
    if missing.any():
        raise rows.at(column, values, missing, "missing timestamp")
    if pd.api.types.is_datetime64_any_dtype(values):
        dates = values.dt.tz_localize("UTC") if values.dt.tz is None else values.dt.tz_convert("UTC")
        seconds = (dates - EPOCH) // pd.Timedelta(seconds=1)
    elif _numbers_or_text(values) or pd.api.types.infer_dtype(values) in DATE_KINDS:
        seconds = _from_text_or_numbers(values, rows, column)
    else:
        raise rows.whole(column, f"expected timestamps (Unix seconds or dates), got {_kind(values)} values; "
                                 "set data.columns.timestamp to the time column, or to null if the log has none")
    before_1970 = seconds < 0
    if before_1970.any():
        raise rows.at(column, values, before_1970,
                      "'{value}' is before 1970 (expected Unix seconds, which are not negative, or a date)")
    return seconds.astype("int64")


def _numbers_or_text(values: pd.Series) -> bool:
    """Not true/false, dates or bytes: what a column of numbers or of their text holds."""
    if pd.api.types.is_bool_dtype(values):
        return False
    return pd.api.types.is_numeric_dtype(values) or pd.api.types.infer_dtype(values) in TEXT_KINDS


def _kind(values: pd.Series) -> str:
    """The type a user would name: an object column's is in its values (bytes, mixed, ...)."""
    return pd.api.types.infer_dtype(values) if values.dtype == object else str(values.dtype)


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
