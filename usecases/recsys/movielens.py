"""Where MovieLens comes from (the cache, a mirror folder in $USECASES_DATA_PATH, else GroupLens, MD5-checked; a
`DataUnavailable` offline, on which the demo falls back to the synthetic log), and its three formats read."""

from __future__ import annotations

import hashlib
import http.client
import logging
import os
import re
import shutil
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.csv as pacsv

from common.errors import DataUnavailable, UserError, one_line
from common.paths import cache_dir, data_search_path, file_sha256
from common.tables import Rows, read_table, require_columns
from .config import MovieLens
from .logs import RawLog, read_ids, read_ratings, read_seconds

log = logging.getLogger(__name__)

DOWNLOAD_TIMEOUT_S = 30
GROUPLENS_URL = "https://files.grouplens.org/datasets/movielens"
# GroupLens's published checksums of the frozen archives. ml-latest-small is republished under the same name, so
# its checksum is read from the `.md5` file GroupLens puts beside every zip instead.
PUBLISHED_MD5 = {"ml-100k": "0e33842e24a9c977be4e0107933c0723", "ml-1m": "c4d9eecfca2ab87c1945afe126590906",
                 "ml-25m": "6b51fb2759a8657d3bfcbfc42b592ada"}
STARS = (0.5, 5.0)  # the rating scale of every release (half stars since ml-latest; whole ones before)


@dataclass(frozen=True)
class Layout:
    """A release's ratings file: its separator, its fields (as GroupLens names them) and its titles file."""

    separator: str
    fields: tuple[str, str, str, str]
    titles: str


LAYOUTS = {"u.data": Layout("\t", ("user id", "item id", "rating", "timestamp"), "u.item"),  # ml-100k
           "ratings.dat": Layout("::", ("UserID", "MovieID", "Rating", "Timestamp"), "movies.dat"),  # ml-1m
           "ratings.csv": Layout(",", ("userId", "movieId", "rating", "timestamp"), "movies.csv")}  # ml-latest, 25m
RATINGS_FILES = tuple(LAYOUTS)


def movielens_format(folder: Path) -> str | None:
    """The ratings file that marks a folder as MovieLens, or None."""
    return next((name for name in RATINGS_FILES if (folder / name).is_file()), None)


def movielens_folder(config: MovieLens) -> Path:
    """The extracted data set: the cache, each mirror folder, else a download into the cache."""
    cache = cache_dir("movielens", config.cache_dir, "MOVIELENS_CACHE")
    mirrors = [folder / "movielens" / config.version for folder in data_search_path()]
    for candidate in (cache / config.version, *mirrors):
        if movielens_format(candidate) is not None:
            return candidate
    url = f"{GROUPLENS_URL}/{config.version}.zip"
    where = (f"unzip {url} into {cache} (or into movielens/ in a mirror folder in $USECASES_DATA_PATH), or pass "
             "--data FOLDER")
    if not config.download:
        raise DataUnavailable(f"MovieLens {config.version} is not in {cache} and data.movielens.download is off: "
                              f"{where}")
    return _download(config.version, cache, where)


def _download(version: str, cache: Path, where: str) -> Path:
    url = f"{GROUPLENS_URL}/{version}.zip"
    part = cache / f"{version}.zip.part"
    log.info("downloading MovieLens %s from %s", version, url)
    try:
        cache.mkdir(parents=True, exist_ok=True)
        expected = PUBLISHED_MD5.get(version) or _published_md5(f"{url}.md5")
        digest = _fetch(url, part)
    except (OSError, http.client.HTTPException, ValueError) as exc:
        part.unlink(missing_ok=True)
        raise DataUnavailable(f"MovieLens {version} is not in {cache} and cannot be downloaded "
                              f"({one_line(exc, 80)}): {where}") from None
    staging = cache / f".{version}.extract"
    try:
        if digest != expected:
            raise UserError(f"the downloaded {version}.zip does not match GroupLens's MD5 {expected}: {where}")
        shutil.rmtree(staging, ignore_errors=True)
        try:
            with zipfile.ZipFile(part) as archive:
                archive.extractall(staging)
        except zipfile.BadZipFile:
            raise UserError(f"the downloaded {version}.zip is not a zip archive: {where}") from None
        if movielens_format(staging / version) is None:
            raise UserError(f"the downloaded {version}.zip has no {version}/ folder of MovieLens files: {where}")
        shutil.rmtree(cache / version, ignore_errors=True)
        os.replace(staging / version, cache / version)
    finally:
        part.unlink(missing_ok=True)
        shutil.rmtree(staging, ignore_errors=True)
    return cache / version


def _fetch(url: str, target: Path) -> str:
    digest = hashlib.md5()
    with urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_S) as response, open(target, "wb") as out:
        for block in iter(lambda: response.read(1 << 20), b""):
            digest.update(block)
            out.write(block)
    return digest.hexdigest()


def _published_md5(url: str) -> str:
    """GroupLens writes `MD5 (name.zip) = <hex>`; any layout with one 32-digit hex word is accepted."""
    with urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_S) as response:
        text = response.read(4096).decode("ascii", "replace").lower()
    found = re.search(r"\b[0-9a-f]{32}\b", text)
    if found is None:
        raise ValueError(f"no MD5 in {url}")
    return found.group()


def read_movielens(folder: Path) -> RawLog:
    """Any of the MovieLens layouts, every value checked (a bad one reported with its file, field and row)."""
    kind = movielens_format(folder)
    if kind is None:
        raise UserError(f"{folder}: not a MovieLens folder (expected {', '.join(RATINGS_FILES)} in it); pass a "
                        "CSV or Parquet log as a file")
    layout = LAYOUTS[kind]
    ratings_file = folder / kind
    if kind == "ratings.csv":
        read = read_table(ratings_file, "a MovieLens ratings.csv")
        check_ratings_columns(read.frame, ratings_file)
        table, rows = read.frame, read.rows
    else:
        table, rows = _read_headerless(ratings_file, layout)
    if table.empty:
        raise UserError(f"{ratings_file}: no data rows (expected one rating per line)")
    return RawLog(movielens_frame(table, layout, rows), read_titles(folder, kind), f"movielens:{folder.name}",
                  file_sha256(*movielens_files(folder, kind)), has_timestamps=True)


def movielens_frame(table: pd.DataFrame, layout: Layout, rows: Rows) -> pd.DataFrame:
    user, item, rating, timestamp = layout.fields
    return pd.DataFrame({"user": read_ids(table[user], rows, user, text=False),
                         "item": read_ids(table[item], rows, item, text=False),
                         "rating": read_ratings(table[rating], rows, rating, stars=STARS),
                         "timestamp": read_seconds(table[timestamp], rows, timestamp)})


def read_titles(folder: Path, kind: str) -> pd.Series | None:
    """Titles by item id; latin-1, as GroupLens wrote the older releases."""
    path = folder / LAYOUTS[kind].titles
    if not path.is_file():
        return None
    try:
        if kind == "u.data":
            table = pd.read_csv(path, sep="|", header=None, usecols=[0, 1], encoding="latin-1", quoting=3)
        elif kind == "ratings.dat":
            table = pd.read_csv(path, sep="::", engine="python", header=None, usecols=[0, 1], encoding="latin-1",
                                quoting=3)
        else:
            table = pd.read_csv(path, usecols=["movieId", "title"]).set_axis([0, 1], axis=1)
    except (ValueError, OSError, pd.errors.ParserError) as exc:
        raise UserError(f"{path}: cannot be read as MovieLens titles ({one_line(exc)})") from None
    return pd.Series(table[1].to_numpy(), index=table[0].to_numpy())


def movielens_files(folder: Path, kind: str) -> list[Path]:
    """The ratings file and the titles file where there is one: what is read, hashed and counted in data_bytes."""
    return [path for path in (folder / kind, folder / LAYOUTS[kind].titles) if path.is_file()]


def check_ratings_columns(table: pd.DataFrame, path: Path) -> None:
    fields = LAYOUTS["ratings.csv"].fields
    require_columns(table, path, fields, f"a MovieLens ratings.csv has {', '.join(fields)}")


def _read_headerless(path: Path, layout: Layout) -> tuple[pd.DataFrame, Rows]:
    """u.data or ratings.dat, single-threaded (a ragged row is reported with its line); `::` as ':' and empty fields."""
    double = layout.separator == "::"
    names = [f"field{index}" for index in range(2 * len(layout.fields) - 1 if double else len(layout.fields))]
    if path.stat().st_size == 0:
        return pd.DataFrame(), Rows(path, fields=layout.fields)
    ragged = []
    options = pacsv.ParseOptions(delimiter=layout.separator[0], quote_char=False, ignore_empty_lines=False,
                                 invalid_row_handler=lambda row: ragged.append(row) or "skip")
    try:
        table = pacsv.read_csv(path, read_options=pacsv.ReadOptions(column_names=names, use_threads=False),
                               parse_options=options,
                               convert_options=pacsv.ConvertOptions(column_types=dict.fromkeys(names, pa.string()),
                                                                    strings_can_be_null=True))
    except (pa.ArrowException, OSError) as exc:
        raise UserError(f"{path}: cannot be read as MovieLens ratings ({one_line(exc)})") from None
    frame = table.to_pandas()  # an empty field is null, an empty line a row of nulls
    line = ragged[0].number if ragged else None
    if line is None and double:  # no row was skipped, so rows are lines: a field between two colons?
        misplaced = np.flatnonzero(frame[names[1::2]].notna().any(axis=1).to_numpy())
        line = int(misplaced[0]) + 1 if len(misplaced) else None
    if line is not None:
        raise UserError(f"{path}: row {line}: expected {len(layout.fields)} fields ({', '.join(layout.fields)}) "
                        f"separated by {layout.separator!r} (row N is line N: the file has no header)")
    frame = frame[names[::2] if double else names].set_axis(list(layout.fields), axis=1)
    empty = frame.isna().all(axis=1).to_numpy()
    if empty.any():
        raise UserError(f"{path}: row {int(np.flatnonzero(empty)[0]) + 1} is empty (expected "
                        f"{', '.join(layout.fields)}; row N is line N: the file has no header)")
    return frame, Rows(path, fields=layout.fields)
