"""Where MovieLens comes from, and its three published formats read into a `RawLog`.

The data set is looked for in the cache, then in each mirror folder in $USECASES_DATA_PATH (as
movielens/<version>/), then downloaded from GroupLens with its MD5 checked; when it cannot be had offline the error
is a `DataUnavailable`, on which the demo falls back to the synthetic log.
"""

from __future__ import annotations

import hashlib
import http.client
import logging
import os
import re
import shutil
import urllib.request
import zipfile
from pathlib import Path

import pandas as pd

from common.errors import DataUnavailable, UserError
from common.paths import cache_dir, data_search_path, file_sha256
from .config import MovieLens
from .logs import RawLog

log = logging.getLogger(__name__)

DOWNLOAD_TIMEOUT_S = 30
GROUPLENS_URL = "https://files.grouplens.org/datasets/movielens"
# GroupLens's published checksums of the frozen archives. ml-latest-small is republished under the same name, so
# its checksum is read from the `.md5` file GroupLens puts beside every zip instead.
PUBLISHED_MD5 = {
    "ml-100k": "0e33842e24a9c977be4e0107933c0723",
    "ml-1m": "c4d9eecfca2ab87c1945afe126590906",
    "ml-25m": "6b51fb2759a8657d3bfcbfc42b592ada",
}
RATINGS_FILES = ("u.data", "ratings.dat", "ratings.csv")  # ml-100k, ml-1m, ml-latest-small and ml-25m


def movielens_format(folder: Path) -> str | None:
    """The ratings file that marks a folder as MovieLens, or None."""
    return next((name for name in RATINGS_FILES if (folder / name).is_file()), None)


def movielens_folder(config: MovieLens) -> Path:
    """The extracted data set: the cache, then each mirror folder in $USECASES_DATA_PATH, then a download from
    GroupLens into the cache."""
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
        reason = (str(exc).splitlines() or [type(exc).__name__])[0][:80]
        raise DataUnavailable(f"MovieLens {version} is not in {cache} and cannot be downloaded ({reason}): "
                              f"{where}") from None
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
    """Stream `url` into `target`; its MD5."""
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
    """Any of the MovieLens layouts: ml-100k (u.data, u.item), ml-1m (ratings.dat, movies.dat) or the CSV
    releases such as ml-latest-small and ml-25m (ratings.csv, movies.csv)."""
    kind = movielens_format(folder)
    if kind is None:
        raise UserError(f"{folder}: not a MovieLens folder (expected {', '.join(RATINGS_FILES)} in it); pass a "
                        "CSV or Parquet log as a file")
    reader, titles_name = {"u.data": (_ml100k, "u.item"), "ratings.dat": (_ml1m, "movies.dat"),
                           "ratings.csv": (_ml_csv, "movies.csv")}[kind]
    ratings_file, titles_file = folder / kind, folder / titles_name
    try:
        frame, titles = reader(ratings_file, titles_file if titles_file.is_file() else None)
    except (ValueError, OSError, pd.errors.ParserError) as exc:
        raise UserError(f"{folder}: cannot be read as MovieLens {kind} ({str(exc).splitlines()[0][:120]})") from None
    if frame.empty:
        raise UserError(f"{ratings_file}: no data rows (expected one rating per line)")
    files = [ratings_file] + ([titles_file] if titles is not None else [])
    frame = frame.astype({"user": "int64", "item": "int64", "rating": "float64", "timestamp": "int64"})
    return RawLog(frame, titles, f"movielens:{folder.name}", file_sha256(*files), has_timestamps=True)


def _ml100k(ratings: Path, titles: Path | None) -> tuple[pd.DataFrame, pd.Series | None]:
    frame = pd.read_csv(ratings, sep="\t", header=None, names=["user", "item", "rating", "timestamp"], quoting=3)
    if titles is None:
        return frame, None
    table = pd.read_csv(titles, sep="|", header=None, usecols=[0, 1], encoding="latin-1", quoting=3)
    return frame, pd.Series(table[1].to_numpy(), index=table[0].to_numpy())


def _ml1m(ratings: Path, titles: Path | None) -> tuple[pd.DataFrame, pd.Series | None]:
    # `::` read as ':' with empty fields between keeps pandas' fast C parser; ratings hold no other colons
    frame = pd.read_csv(ratings, sep=":", header=None, usecols=[0, 2, 4, 6], quoting=3)
    frame.columns = ["user", "item", "rating", "timestamp"]
    if titles is None:
        return frame, None
    table = pd.read_csv(titles, sep="::", engine="python", header=None, usecols=[0, 1], encoding="latin-1",
                        quoting=3)
    return frame, pd.Series(table[1].to_numpy(), index=table[0].to_numpy())


def _ml_csv(ratings: Path, titles: Path | None) -> tuple[pd.DataFrame, pd.Series | None]:
    frame = pd.read_csv(ratings)
    expected = ["userId", "movieId", "rating", "timestamp"]
    missing = [name for name in expected if name not in frame.columns]
    if missing:
        raise ValueError(f"missing column '{missing[0]}'; found: {', '.join(map(str, frame.columns))}")
    frame = frame[expected].set_axis(["user", "item", "rating", "timestamp"], axis=1)
    if titles is None:
        return frame, None
    table = pd.read_csv(titles, usecols=["movieId", "title"])
    return frame, pd.Series(table["title"].to_numpy(), index=table["movieId"].to_numpy())
