"""A CSV or Parquet log, or a MovieLens ratings.csv, read in partitions on the Dask workers (a CSV's byte ranges cut
at line ends, a Parquet file's row groups), each part checked by the whole-file readers and written as a shard."""

from __future__ import annotations

import io
import os
from dataclasses import dataclass, replace
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from common.errors import UserError
from common.paths import file_sha256
from common.tables import (COMPRESSED_SUFFIXES as COMPRESSED, Rows, csv_separator, is_parquet, not_parquet, plain,
                           read_csv_text, text_encoding)
from .config import Columns
from .logs import check_columns, log_frame, no_rows
from .movielens import LAYOUTS, check_ratings_columns, movielens_files, movielens_frame, read_titles
from .outofcore import Source

BLOCK_BYTES = 64 * 2**20  # of a CSV per part: about 3 M MovieLens ratings
ID_KEYS = ("user", "item")


@dataclass(frozen=True)
class LogFile:
    """What every part of one file is read with (`names`: the log's column of each key it has)."""

    path: Path
    separator: str | None  # None for Parquet
    header: bytes
    columns: Columns
    names: dict[str, str]
    movielens: bool = False
    text_ids: tuple[str, ...] = ()  # the id keys read as text in every part


@dataclass(frozen=True)
class Part:
    index: int
    start: int  # a CSV's byte offset, or a Parquet file's row group
    end: int


@dataclass
class PartRead:
    rows: int
    text_ids: tuple[str, ...]
    titles: pd.Series | None
    error: str | None  # the first problem, its row counted from the part's start
    parse_error: bool = False  # the CSV parser's, whose line needs the lines before the part


def log_source(path: Path, columns: Columns) -> Source | None:
    """A user's log as a Source read in partitions; None for a file that cannot be cut (read whole)."""
    suffixes = "".join(path.suffixes).lower()
    separator = csv_separator(path)
    if suffixes.endswith(COMPRESSED) or (separator is None and not is_parquet(path)) or not os.access(path, os.R_OK):
        return None
    if separator is not None and text_encoding(path, separator) != "utf-8-sig":
        return None  # a UTF-16 or UTF-32 file cannot be cut at byte offsets: the whole-file reader reads it
    header, table = _header(path, separator)
    if table is None:
        raise no_rows(path, columns)
    names = check_columns(table, columns, path)
    log = LogFile(path, separator, header, columns, names)
    return Source(lambda client, folder: read_parts(log, client, folder), False, f"file:{path.name}",
                  file_sha256(path), "timestamp" in names)


def movielens_source(folder: Path, kind: str | None) -> Source | None:
    """A MovieLens ratings.csv as a Source read in partitions; None for the headerless releases (or no `kind`)."""
    if kind != "ratings.csv":
        return None
    path = folder / kind
    header, table = _header(path, ",")
    if table is None:
        raise UserError(f"{path}: no data rows (expected one rating per line)")
    check_ratings_columns(table, path)
    names = dict(zip(("user", "item", "rating", "timestamp"), LAYOUTS[kind].fields))
    log = LogFile(path, ",", header, Columns(**names), names, movielens=True)

    def read(client, shards: Path):
        return read_parts(log, client, shards)[0], read_titles(folder, kind)

    return Source(read, False, f"movielens:{folder.name}", file_sha256(*movielens_files(folder, kind)), True)


def _header(path: Path, separator: str | None) -> tuple[bytes, pd.DataFrame | None]:
    """A CSV's header line and its columns, or a Parquet file's columns; None for a file without data rows."""
    if separator is None:
        try:
            metadata = pq.ParquetFile(path).metadata
            table = plain(pq.read_schema(path).empty_table().to_pandas())
        except (OSError, ValueError, pa.ArrowException) as exc:
            raise not_parquet(path, exc) from None
        return b"", table if metadata.num_rows else None
    with path.open("rb") as file:
        header = file.readline()
        empty = not file.read(1 << 16).strip()
    table = read_csv_text(io.BytesIO(header), separator, path)
    return header, None if empty or table.columns.empty else table


def read_parts(log: LogFile, client, folder: Path) -> tuple[list[Path], pd.Series | None]:
    """Every part of the log read on the cluster, as shards in `folder`, and the titles."""
    folder.mkdir(parents=True, exist_ok=True)
    parts = _plan(log)
    reads = client.gather(client.map(_read_part, [log] * len(parts), parts, [folder] * len(parts), pure=False))
    _raise_first_error(log, parts, reads, client)
    text = tuple(key for key in ID_KEYS if any(key in read.text_ids for read in reads))
    again = [index for index, read in enumerate(reads) if set(text) - set(read.text_ids)]
    if again:  # ids that look like integers in some parts only: text everywhere, as the whole file reads them
        retyped = replace(log, text_ids=text)
        for index, read in zip(again, client.gather(client.map(_read_part, [retyped] * len(again),
                                                                [parts[index] for index in again],
                                                                [folder] * len(again), pure=False))):
            reads[index] = read
    if not sum(read.rows for read in reads):
        raise no_rows(log.path, log.columns)
    titles = pd.concat([read.titles for read in reads]).groupby(level=0).first().fillna("").astype(str) \
        if "title" in log.names else None
    return [_shard(folder, part) for part in parts], titles


def _plan(log: LogFile) -> list[Part]:
    if log.separator is None:
        return [Part(group, group, group + 1) for group in range(pq.ParquetFile(log.path).num_row_groups)]
    size = log.path.stat().st_size
    parts, start = [], len(log.header)
    with log.path.open("rb") as file:
        while start < size:
            end = start + BLOCK_BYTES
            if end < size:
                file.seek(end - 1)
                file.readline()  # on to the end of the line the cut falls in
                end = file.tell()
            parts.append(Part(len(parts), start, min(end, size)))
            start = parts[-1].end
    return parts


def _shard(folder: Path, part: Part) -> Path:
    return folder / f"part-{part.index:05d}.parquet"


def _table(log: LogFile, part: Part, first_line: int = 0) -> pd.DataFrame:
    if log.separator is None:
        return plain(pq.ParquetFile(log.path).read_row_group(part.start).to_pandas())
    with log.path.open("rb") as file:
        file.seek(part.start)
        data = file.read(part.end - part.start)
    text = {log.names[key]: str for key in log.text_ids}
    return read_csv_text(io.BytesIO(log.header + data), log.separator, log.path, dtype=text or None,
                         first_line=first_line)


def _read_part(log: LogFile, part: Part, folder: Path | None, first: int = 0, first_line: int = 0) -> PartRead:
    """One part checked and written; a problem is returned, so that the client can report the first in the file."""
    try:
        table = _table(log, part, first_line)
    except UserError as problem:
        return PartRead(0, (), None, str(problem), parse_error=True)
    rows = Rows(log.path, header=log.separator is not None, first=first)
    try:
        if log.movielens:
            frame, titles = movielens_frame(table, LAYOUTS["ratings.csv"], rows), None
        else:
            frame, titles = log_frame(table, log.columns, log.names, rows) if len(table) else (table, None)
    except UserError as problem:
        return PartRead(len(table), (), None, str(problem))
    if folder is not None:
        shard = frame[["user", "item", "rating", "timestamp"]] if len(table) else _empty_shard(log)
        shard.to_parquet(_shard(folder, part), index=False)
    text = tuple(key for key in ID_KEYS if len(table) and not pd.api.types.is_integer_dtype(frame[key]))
    return PartRead(len(table), text, titles, None)


def _empty_shard(log: LogFile) -> pd.DataFrame:
    ids = {key: pd.Series(dtype=str if key in log.text_ids else "int64") for key in ID_KEYS}
    return pd.DataFrame({**ids, "rating": pd.Series(dtype="float64"), "timestamp": pd.Series(dtype="int64")})


def _raise_first_error(log: LogFile, parts: list[Part], reads: list[PartRead], client) -> None:
    """The first part's problem, read again counting the rows (or lines) before it: the row of the whole file."""
    failed = next((index for index, read in enumerate(reads) if read.error is not None), None)
    if failed is None:
        return
    part = parts[failed]
    if reads[failed].parse_error:
        lines = client.submit(_lines_between, log.path, len(log.header), part.start, pure=False).result()
        read = client.submit(_read_part, log, part, None, first_line=lines, pure=False).result()
    else:
        first = sum(read.rows for read in reads[:failed])
        read = client.submit(_read_part, log, part, None, first=first, pure=False).result()
    raise UserError(read.error)


def _lines_between(path: Path, start: int, end: int) -> int:
    lines = 0
    with path.open("rb") as file:
        file.seek(start)
        while file.tell() < end:
            lines += file.read(min(1 << 24, end - file.tell())).count(b"\n")
    return lines
