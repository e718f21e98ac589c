"""A user's table file, CSV or Parquet, read into a DataFrame, and the one-line errors that name its file, column and
row: one reader, so that every use case accepts the same files and words a bad one alike. pandas and pyarrow parse;
only the reporting is written here. A bad row is named by its number (1 is the first data row) and, in a text file,
by the line an editor shows it on."""

from __future__ import annotations

import codecs
import csv
import lzma
import re
import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
from pandas.io.common import get_handle

from common.errors import UserError, one_line

PARQUET_SUFFIXES = (".parquet", ".pq")
COMPRESSED_SUFFIXES = (".gz", ".bz2", ".xz", ".zst", ".zip")  # pandas decompresses these, by the suffix
TEXT_SUFFIXES = {".tsv": "\t", ".csv": ",", ".txt": ","}  # and the field separator of each
SEPARATOR_NAMES = {",": "comma", "\t": "tab", ";": "semicolon", "|": "pipe"}
OTHER_SEPARATORS = (",", ";", "\t", "|")  # what a one-column "CSV" is usually separated by instead
# UTF-32 LE's mark begins with UTF-16 LE's, so it is looked for first.
BYTE_ORDER_MARKS = ((codecs.BOM_UTF32_LE, "utf-32"), (codecs.BOM_UTF32_BE, "utf-32"), (codecs.BOM_UTF8, "utf-8-sig"),
                    (codecs.BOM_UTF16_LE, "utf-16"), (codecs.BOM_UTF16_BE, "utf-16"))
# What a file that is no text usually is, by its first bytes, and what to do about it.
SIGNATURES = {b"PK\x03\x04": "a zip archive or an Excel workbook (export it as CSV)",
              b"\x1f\x8b": "gzip-compressed (name it .csv.gz)", b"PAR1": "a Parquet file (name it .parquet)"}
SNIFF_BYTES = 1 << 16  # of a text file's start, checked before pandas reads it
TEXT_KINDS = ("string", "mixed-integer", "empty")  # pandas' inferred kinds of an object column of numbers as text
UNREADABLE = (ValueError, OSError, ImportError, EOFError, zipfile.BadZipFile, lzma.LZMAError)  # ImportError: a
# compression whose library is missing; the others: a compressed file that is not what its suffix says


@dataclass(frozen=True)
class Rows:
    """Where a table was read from, for its errors: `fields` lists a headerless file's fields in order; `header` is
    False for a table without lines (Parquet); `first` is how many rows come before a part of a file read alone."""

    path: Path
    fields: tuple[str, ...] = ()
    header: bool = True
    first: int = 0
    separator: str | None = None
    encoding: str = "utf-8-sig"

    def column(self, name: str) -> str:
        return f"field {self.fields.index(name) + 1} ({name})" if self.fields else f"column '{name}'"

    def counting(self, row: int) -> str:
        if self.fields:
            return "row N is line N: the file has no header"
        if not self.header:
            return "rows counted from 1"
        return f"line {self.line(row)} of the file; rows counted from 1 at the line after the header"

    @staticmethod
    def first_bad(mask: pd.Series) -> int:
        """The first row where `mask` holds: a frame's index is its rows' positions in the file, kept through sorts."""
        return int(mask.index[np.asarray(mask, dtype=bool)].min())

    def error(self, position: int, problem: str, name: str | None = None) -> UserError:
        """`problem` at the row at `position` (from 0, in the part read), in the column `name` if given."""
        row = self.first + position + 1
        where = f"{self.column(name)}, " if name is not None else ""
        return UserError(f"{self.path}: {where}row {row}: {problem} ({self.counting(row)})")

    def at(self, name: str, values: pd.Series, mask: pd.Series, problem: str) -> UserError:
        """`problem` at the first row where `mask` holds; `{value}` in it is that row's value."""
        position = self.first_bad(mask)
        return self.error(position, problem.format(value=values.loc[position]), name)

    def whole(self, name: str, problem: str) -> UserError:
        return UserError(f"{self.path}: {self.column(name)}: {problem}")

    def line(self, row: int) -> int:
        """The line data row `row` (from 1) starts on (pandas skips blank lines; quotes may hold line breaks)."""
        try:
            with get_handle(self.path, "r", encoding=self.encoding, compression="infer", errors="replace") as text:
                records = csv.reader(text.handle, delimiter=self.separator or csv_separator(self.path) or ",")
                next(records, None)  # the header
                start, seen = records.line_num + 1, 0
                for record in records:
                    if len(record) > 1 or (record and record[0].strip()):
                        seen += 1
                        if seen == row:
                            return start
                    start = records.line_num + 1
        except (csv.Error, OSError):  # a field beyond the csv module's limit, a file gone: as if no line were blank
            pass
        return row + 1


@dataclass
class Table:
    frame: pd.DataFrame
    rows: Rows


def is_parquet(path: Path) -> bool:
    return path.name.lower().endswith(PARQUET_SUFFIXES)


def csv_separator(path: Path) -> str | None:
    """The field separator of a text table by its name (prices.csv.gz: ','); None for a file that is not one."""
    suffixes = [suffix.lower() for suffix in reversed(path.suffixes)]  # the last: log.tsv.csv is a CSV
    return next((TEXT_SUFFIXES[suffix] for suffix in suffixes if suffix in TEXT_SUFFIXES), None)


def read_table(path: Path, expected: str, dtype=None, text: bool = False) -> Table:
    """A CSV (.csv, .tsv or .txt, compressed or not) or Parquet file (or folder of parts); `expected` says what the
    file should be, for the error about one of another kind. With `text`, every value is a string as written (an
    empty cell "", never NaN: "NA" is a name)."""
    if is_parquet(path):
        frame = read_parquet(path)
        return Table(frame.astype(str).where(frame.notna(), "") if text else frame, Rows(path, header=False))
    if path.is_dir():
        raise UserError(f"{path}: is a folder; expected {expected}")
    separator = csv_separator(path)
    if separator is None:
        raise UserError(f"{path}: expected {expected}")
    encoding = text_encoding(path, separator)
    frame = read_csv_text(path, separator, path, dtype=str if text else dtype, encoding=encoding,
                          keep_default_na=not text)
    if frame.columns.empty:
        raise UserError(f"{path}: empty file (no header line, no data rows); expected a "
                        f"{SEPARATOR_NAMES[separator]}-separated file with a header line")
    return Table(frame, Rows(path, separator=separator, encoding=encoding))


def text_encoding(path: Path, separator: str) -> str:
    """A byte-order mark's encoding, else UTF-8; a file that is no text (a workbook, a Parquet file named .csv, a
    NUL byte, a byte that is not UTF-8) is an error."""
    try:
        with get_handle(path, "rb", compression="infer", is_text=False) as binary:
            head = binary.handle.read(SNIFF_BYTES)
    except UNREADABLE as exc:
        raise cannot_read(path, exc, separator) from None
    for signature, what in SIGNATURES.items():
        if head.startswith(signature):
            raise UserError(f"{path}: this is {what}; expected {SEPARATOR_NAMES[separator]}-separated text")
    for mark, encoding in BYTE_ORDER_MARKS:
        if head.startswith(mark):
            return encoding
    bad = [head.find(b"\x00")]
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=len(head) < SNIFF_BYTES)
    except UnicodeDecodeError as exc:
        bad.append(exc.start)
    position = min((where for where in bad if where >= 0), default=None)
    if position is not None:
        raise not_text(path, separator, head[position], position)
    return "utf-8-sig"


def not_text(path: Path, separator: str, byte: int, position: int | None = None) -> UserError:
    at = f" at position {position}" if position is not None else ""
    return UserError(f"{path}: not UTF-8 text, nor UTF-16 with a byte-order mark (byte {byte:#04x}{at}); expected "
                     f"{SEPARATOR_NAMES.get(separator, repr(separator))}-separated text saved as UTF-8")


def cannot_read(path: Path, exc: Exception, separator: str) -> UserError:
    return UserError(f"{path}: cannot be read as a table ({one_line(exc)}); expected a "
                     f"{SEPARATOR_NAMES.get(separator, repr(separator))}-separated file")


def read_csv_text(source, separator: str, path: Path, dtype=None, first_line: int = 0,
                  encoding: str = "utf-8-sig", keep_default_na: bool = True) -> pd.DataFrame:
    """A CSV file, or the bytes of a part of one behind its header line (`source`); a line number in an error
    counts on from `first_line`. A byte-order mark never sticks to the first column's name."""
    name = SEPARATOR_NAMES.get(separator, repr(separator))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", pd.errors.ParserWarning)  # rows longer than the header: values dropped
            frame = pd.read_csv(source, sep=separator, encoding=encoding, index_col=False, dtype=dtype,
                                keep_default_na=keep_default_na)
    except pd.errors.ParserWarning:
        raise UserError(f"{path}: the rows hold more values than the header names columns (name every column in "
                        "the first line, or remove the separator at the end of each line)") from None
    except pd.errors.EmptyDataError:
        return pd.DataFrame()
    except UnicodeDecodeError as exc:
        raise not_text(path, separator, exc.object[exc.start]) from None
    except pd.errors.ParserError as exc:  # its line numbers count the header as line 1
        reason = re.sub(r"(?<=line )(\d+)", lambda found: str(first_line + int(found.group())), one_line(exc))
        raise UserError(f"{path}: cannot be read as a table ({reason}; line 1 is the header); expected the same "
                        f"number of {name}-separated fields on every line") from None
    except UNREADABLE as exc:
        raise cannot_read(path, exc, separator) from None
    if frame.columns.empty:
        return frame
    frame = frame.rename(columns={frame.columns[0]: str(frame.columns[0]).removeprefix("\ufeff")})
    if len(frame.columns) == 1:
        other = next((mark for mark in OTHER_SEPARATORS if mark != separator and mark in str(frame.columns[0])), None)
        if other is not None:
            raise UserError(f"{path}: one column {str(frame.columns[0])!r}, its fields separated by {other!r}; "
                            f"expected {name}-separated columns")
    return frame


def read_parquet(path: Path) -> pd.DataFrame:
    try:
        return plain(pd.read_parquet(path))
    except (ValueError, OSError, ImportError, pa.ArrowException) as exc:
        raise not_parquet(path, exc) from None


def not_parquet(path: Path, exc: Exception) -> UserError:
    reason = str(exc).replace(f" '{path}'", "").split(". ")[0]  # pyarrow's reason, without the path again
    return UserError(f"{path}: cannot be read as Parquet ({reason}); expected a Parquet file")


def plain(table: pd.DataFrame) -> pd.DataFrame:
    """A Parquet file's columns as a CSV's, rows from 0: a named index as a column, a category as its values' type."""
    if any(name is not None for name in table.index.names):
        table = table.reset_index()
    categorical = [name for name, dtype in table.dtypes.items() if isinstance(dtype, pd.CategoricalDtype)]
    return table.astype({name: table[name].cat.categories.dtype for name in categorical}).reset_index(drop=True)


def found_columns(frame: pd.DataFrame) -> str:
    return ", ".join(repr(str(name)) for name in frame.columns)


def require_columns(frame: pd.DataFrame, path: Path, required, what: str) -> None:
    missing = [name for name in required if name not in frame.columns]
    if missing:
        plural = "s" if len(missing) > 1 else ""
        raise UserError(f"{path}: missing column{plural} {', '.join(map(repr, missing))} ({what}; found: "
                        f"{found_columns(frame)})")


def numbers_or_text(values: pd.Series) -> bool:
    """Not true/false, dates or bytes: what a column of numbers or of their text holds."""
    if pd.api.types.is_bool_dtype(values):
        return False
    return pd.api.types.is_numeric_dtype(values) or pd.api.types.infer_dtype(values) in TEXT_KINDS


def value_kind(values: pd.Series) -> str:
    """The type a user would name: an object column's is in its values (bytes, mixed, ...)."""
    if pd.api.types.is_bool_dtype(values):
        return "true/false (bool)"
    return pd.api.types.infer_dtype(values) if values.dtype == object else str(values.dtype)


def read_numbers(values: pd.Series, rows: Rows, name: str, expected: str = "numbers") -> pd.Series:
    """Floats, NaN where a cell is empty; a value that is no finite number is an error at its first row."""
    if not numbers_or_text(values):
        raise rows.whole(name, f"expected {expected}, got {value_kind(values)} values")
    numbers = pd.to_numeric(values, errors="coerce").astype("float64")
    bad = (numbers.isna() & values.notna()) | np.isinf(numbers)
    if bad.any():
        raise rows.at(name, values, bad, "expected a number, got '{value}'")
    return numbers
