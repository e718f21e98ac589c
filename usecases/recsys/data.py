"""Interaction logs as encoded, split positives: MovieLens in its published formats, any CSV or Parquet log, or a
synthetic log; preprocessing written against the pandas API so that cuDF can run it on a GPU.

Every mistake in a log is one `UserError` line naming the file, the column and the row (1 is the first data row).
MovieLens comes from the cache, else the development copy in ../shared, else GroupLens (MD5-checked); when it
cannot be had offline the error is a `DataUnavailable`, on which the demo falls back to the synthetic log.
"""

from __future__ import annotations

import hashlib
import http.client
import logging
import os
import re
import shutil
import urllib.request
import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import scipy.sparse as sp

from common.errors import DataUnavailable, UserError
from common.tracking import file_sha256, project_root
from usecases.recsys.config import Columns, Config, Data, MovieLens, Synthetic

log = logging.getLogger(__name__)

UNKNOWN = 0  # the code of an unseen user or item; real ids are encoded from 1

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

TRAIN, VAL, TEST = 0, 1, 2
EPOCH = pd.Timestamp(0, tz="UTC")

SYNTHETIC_TEMPERATURE = 0.5  # affinity (unit variance) over this, next to log-popularity: taste dominates
SYNTHETIC_START = 1_577_836_800  # 2020-01-01 UTC
SYNTHETIC_SPAN_S = 365 * 86_400
SYNTHETIC_CHUNK_SCORES = 4_000_000  # user x item scores held at once (float32): bounded memory at any size


@dataclass
class Interactions:
    """Positives split into train, val and test; each frame has int64 columns `user` and `item` (codes from 1)
    and `timestamp` (int64 seconds, 0 when the log has none), and `rating` (float, NaN when the log has none).

    `user_ids[code]` and `item_ids[code]` give the raw ids back (index 0 is the unknown id: -1 for integer ids,
    None for text ids); `titles[code]` the item titles when the data has them ("" at index 0 and where missing).
    """

    train: pd.DataFrame
    val: pd.DataFrame
    test: pd.DataFrame
    user_ids: np.ndarray
    item_ids: np.ndarray
    titles: np.ndarray | None
    source: str
    sha256: str

    @property
    def n_users(self) -> int:
        """Rows of a user matrix, the unknown id included."""
        return len(self.user_ids)

    @property
    def n_items(self) -> int:
        return len(self.item_ids)

    def matrix(self, split: str) -> sp.csr_matrix:
        """Binary user x item CSR matrix of one split (repeated pairs count once)."""
        frame = getattr(self, split)
        users, items = np.asarray(frame["user"]), np.asarray(frame["item"])
        values = np.ones(len(users), dtype=np.float32)
        matrix = sp.csr_matrix((values, (users, items)), shape=(self.n_users, self.n_items))
        matrix.data[:] = 1.0
        return matrix


@dataclass
class RawLog:
    """A log before filtering: columns user and item (raw ids: int64, or str where any id is not an integer),
    rating (float, NaN where missing) and timestamp (int64 Unix seconds, 0 when the log has none)."""

    frame: pd.DataFrame
    titles: pd.Series | None  # title by raw item id
    source: str
    sha256: str
    has_timestamps: bool


def load_interactions(config: Config, path: Path | None = None) -> Interactions:
    """`--data PATH` decides the source when given: a MovieLens folder, or a CSV or Parquet log."""
    ratios = check_ratios(config.split_ratios)
    raw = read_source(config.data, path)
    if config.split == "temporal" and not raw.has_timestamps:
        raise UserError(f"split=temporal needs a timestamp column (data.columns.timestamp) but {raw.source} has "
                        "none; use split=random")
    frame = filter_interactions(raw.frame, config.data, raw.source)
    frame, user_ids, item_ids, titles = encode(frame, raw.titles)
    train, val, test = split(frame, config.split, ratios, config.runtime.seed)
    val, test = drop_unrankable(train, val, test)
    data = Interactions(train, val, test, user_ids, item_ids, titles, raw.source, raw.sha256)
    density = len(frame) / max((data.n_users - 1) * (data.n_items - 1), 1)
    log.info("data %s: %d users, %d items, %d/%d/%d train/val/test interactions (%s split), density %.4f%%",
             raw.source, data.n_users - 1, data.n_items - 1, len(train), len(val), len(test), config.split,
             100 * density)
    return data


def read_source(data: Data, path: Path | None) -> RawLog:
    if path is not None:
        return read_path(path, data.columns)
    if data.source == "file":
        raise UserError("data.source=file needs --data PATH (a CSV or Parquet interaction log)")
    if data.source == "synthetic":
        return synthetic_log(data.synthetic)
    return read_movielens(movielens_folder(data.movielens))


def read_path(path: Path, columns: Columns) -> RawLog:
    """A folder is read as MovieLens, a file as an interaction log with the configured column names."""
    if path.is_dir():
        return read_movielens(path)
    if not path.is_file():
        raise UserError(f"{path}: no such file or folder (expected a MovieLens folder or a CSV or Parquet log)")
    return read_log(path, columns)


# MovieLens


def movielens_format(folder: Path) -> str | None:
    """The ratings file that marks a folder as MovieLens, or None."""
    return next((name for name in RATINGS_FILES if (folder / name).is_file()), None)


def movielens_cache(config: MovieLens) -> Path:
    if config.cache_dir is not None:
        return config.cache_dir.expanduser()
    return Path(os.environ.get("MOVIELENS_CACHE", Path.home() / ".cache" / "gpu-usecases" / "movielens"))


def movielens_folder(config: MovieLens) -> Path:
    """The extracted data set: the cache, then the development copy in ../shared, then a download from GroupLens."""
    cache = movielens_cache(config)
    for candidate in (cache / config.version, project_root().parent / "shared" / "data" / "movielens" / config.version):
        if movielens_format(candidate) is not None:
            return candidate
    url = f"{GROUPLENS_URL}/{config.version}.zip"
    where = f"unzip {url} into {cache} or pass --data FOLDER"
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


# a user's interaction log


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


# synthetic


def synthetic_log(config: Synthetic) -> RawLog:
    """Users and items with normal latent factors; each user picks `interactions_per_user` distinct items with
    probability proportional to exp(affinity / temperature) x Zipf popularity, without replacement (Gumbel top-k).

    Times are uniform over a year and independent of taste, so every split sees the same preferences; ratings
    1..5 rise with the affinity (centred near 3.5, as MovieLens's are). Users are drawn in chunks, so memory stays
    bounded for any number of them.
    """
    users, items, per_user = config.users, config.items, config.interactions_per_user
    if per_user > items:
        raise UserError(f"data.synthetic.interactions_per_user={per_user} exceeds data.synthetic.items={items} "
                        "(each user picks distinct items)")
    rng = np.random.default_rng(config.seed)
    scale = np.float32(1 / np.sqrt(config.factors))  # unit-variance affinities whatever the number of factors
    user_factors = rng.standard_normal((users, config.factors), dtype=np.float32) * scale
    item_factors = rng.standard_normal((items, config.factors), dtype=np.float32)
    popularity_rank = rng.permutation(items) + 1
    log_popularity = (-config.popularity_exponent * np.log(popularity_rank)).astype(np.float32)
    picked = np.empty((users, per_user), dtype=np.int64)
    affinity_picked = np.empty((users, per_user), dtype=np.float32)
    chunk = max(1, SYNTHETIC_CHUNK_SCORES // items)
    for start in range(0, users, chunk):
        affinity = user_factors[start:start + chunk] @ item_factors.T
        with np.errstate(divide="ignore"):  # a uniform draw of exactly 0 only rules that one item out
            scores = -np.log(-np.log(rng.random(affinity.shape, dtype=np.float32)))
        scores += affinity / np.float32(SYNTHETIC_TEMPERATURE)
        scores += log_popularity
        top = np.argpartition(scores, items - per_user, axis=1)[:, items - per_user:]
        picked[start:start + chunk] = top
        affinity_picked[start:start + chunk] = np.take_along_axis(affinity, top, axis=1)
    standardised = (affinity_picked - affinity_picked.mean()) / max(float(affinity_picked.std()), 1e-6)
    noise = rng.standard_normal(affinity_picked.shape, dtype=np.float32)
    ratings = np.clip(np.rint(3.5 + standardised + 0.5 * noise), 1, 5)
    timestamps = SYNTHETIC_START + rng.integers(0, SYNTHETIC_SPAN_S, size=users * per_user)
    frame = pd.DataFrame({"user": np.repeat(np.arange(1, users + 1, dtype=np.int64), per_user),
                          "item": picked.ravel() + 1, "rating": ratings.ravel().astype(np.float64),
                          "timestamp": timestamps.astype(np.int64)})
    digest = hashlib.sha256(config.model_dump_json().encode()).hexdigest()
    return RawLog(frame, None, "synthetic", digest, has_timestamps=True)


# preprocessing


def filter_interactions(frame: pd.DataFrame, data: Data, source: str = "the log") -> pd.DataFrame:
    """Positives for implicit feedback: ratings at or above the threshold, each (user, item) pair once at its
    earliest time, then the k-core. The result is in time order (ties in log order) with a fresh index."""
    threshold = data.rating_threshold
    if threshold is not None:
        if frame["rating"].isna().all():
            raise UserError(f"{source}: data.rating_threshold={threshold} needs ratings but there are none "
                            "(data.columns.rating names the column); set data.rating_threshold=null")
        frame = frame[frame["rating"] >= threshold]
    frame = frame.sort_values("timestamp", kind="stable").drop_duplicates(["user", "item"], keep="first")
    frame = k_core(frame, data.min_user_interactions, data.min_item_interactions)
    if frame.empty:
        filters = [f"data.rating_threshold={threshold}"] if threshold is not None else []
        if data.min_user_interactions or data.min_item_interactions:
            filters.append(f"the k-core filter (data.min_user_interactions={data.min_user_interactions}, "
                           f"data.min_item_interactions={data.min_item_interactions})")
        raise UserError(f"{source}: nothing left after {' and '.join(filters) or 'reading'}; relax the filters")
    return frame.reset_index(drop=True)


def k_core(frame: pd.DataFrame, min_user: int, min_item: int) -> pd.DataFrame:
    """Drop users and items with fewer interactions than asked until none is left: dropping an item can take a
    user below its minimum, and the other way round (0 turns a side off)."""
    while not frame.empty:
        keep = pd.Series(True, index=frame.index)
        if min_user:
            keep &= frame.groupby("user")["item"].transform("size") >= min_user
        if min_item:
            keep &= frame.groupby("item")["user"].transform("size") >= min_item
        if keep.all():
            break
        frame = frame[keep]
    return frame


def encode(frame: pd.DataFrame, titles: pd.Series | None = None
           ) -> tuple[pd.DataFrame, np.ndarray, np.ndarray, np.ndarray | None]:
    """Codes 1..n in the order of the sorted raw ids (0 stays UNKNOWN); the raw ids and titles by code."""
    user_codes, users = pd.factorize(frame["user"], sort=True)
    item_codes, items = pd.factorize(frame["item"], sort=True)
    encoded = pd.DataFrame({"user": user_codes.astype(np.int64) + 1, "item": item_codes.astype(np.int64) + 1,
                            "timestamp": frame["timestamp"].to_numpy(np.int64),
                            "rating": frame["rating"].to_numpy(np.float64)})
    aligned = None
    if titles is not None:
        titles = titles[~titles.index.duplicated()]
        aligned = np.concatenate([[""], titles.reindex(items).fillna("").astype(str).to_numpy(object)]).astype(object)
    return encoded, _with_placeholder(users), _with_placeholder(items), aligned


def _with_placeholder(ids: pd.Index) -> np.ndarray:
    if pd.api.types.is_integer_dtype(ids):
        return np.concatenate([[-1], ids.to_numpy(np.int64)])
    return np.concatenate([[None], ids.to_numpy(object)]).astype(object)


# splits


def check_ratios(ratios: list[float]) -> list[float]:
    """Train, val and test fractions, normalised as RecBole does so that its rounding is reproduced exactly."""
    total = sum(ratios)
    if len(ratios) != 3 or min(ratios) < 0 or ratios[0] <= 0 or abs(total - 1) > 1e-6:
        raise UserError(f"split_ratios: expected three fractions (train, val, test) summing to 1 with a positive "
                        f"train share, got {list(ratios)}")
    return [ratio / total for ratio in ratios]


def split(frame: pd.DataFrame, method: str, ratios: list[float], seed: int
          ) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    if method == "temporal":
        return split_temporal(frame, ratios)
    if method == "random":
        return split_random(frame, ratios, seed)
    if method == "leave_last_out":
        return split_leave_last_out(frame)
    raise UserError(f"split: unknown method '{method}' (expected temporal, random or leave_last_out)")


def _by_label(frame: pd.DataFrame, labels: np.ndarray) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    return tuple(frame[labels == label].reset_index(drop=True) for label in (TRAIN, VAL, TEST))


def split_temporal(frame: pd.DataFrame, ratios: list[float]) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """One global cut in time, so that no model trains on the future of what it is tested on.

    The cuts are the timestamps at positions floor(0.8 n) and floor(0.9 n) of the time-sorted log (for 8:1:1);
    interactions at exactly a cut's timestamp go to the later split, so max(train) < min(val) <= max(val) <
    min(test), and a split can come out a little smaller than its ratio when many interactions share a time.
    """
    ordered = frame["timestamp"].sort_values(ignore_index=True)
    count = len(ordered)
    cuts = []
    for fraction in (ratios[0], ratios[0] + ratios[1]):
        position = int(np.floor(fraction * count + 1e-9))
        cuts.append(ordered.iloc[position] if position < count else ordered.iloc[-1] + 1)
    timestamps = frame["timestamp"].to_numpy()
    labels = (timestamps >= cuts[0]).astype(np.int8) + (timestamps >= cuts[1]).astype(np.int8)
    if not (labels == TRAIN).any():
        raise UserError(f"split=temporal leaves no training interactions: the first {ratios[0]:.0%} of the log "
                        f"shares one timestamp ({cuts[0]}); use split=random")
    return _by_label(frame, labels)


def split_sizes(counts: np.ndarray, ratios: list[float]) -> np.ndarray:
    """Train, val and test sizes per user with RecBole's rounding (`Dataset._calcu_split_ids`): val and test get
    floor(ratio x n), train the rest; then a split whose exact share is between 0 and 1 gets one interaction
    taken from train, test first, as long as train keeps at least two."""
    counts = np.asarray(counts, dtype=np.int64)
    exact = counts[:, None] * np.asarray(ratios, dtype=np.float64)[None, :]
    sizes = np.floor(exact).astype(np.int64)
    sizes[:, 0] = counts - sizes[:, 1:].sum(axis=1)
    for column in range(len(ratios) - 1, 0, -1):
        bump = (sizes[:, 0] > 1) & (exact[:, column] > 0) & (exact[:, column] < 1)
        sizes[bump, column] += 1
        sizes[bump, 0] -= 1
    return sizes


def split_random(frame: pd.DataFrame, ratios: list[float], seed: int
                 ) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """Per user, a seeded shuffle cut by `split_sizes`: RecBole's `RS` with `group_by: user`, vectorised."""
    frame = frame.reset_index(drop=True)
    shuffled = frame[["user"]].assign(key=np.random.default_rng(seed).permutation(len(frame)))
    rank = shuffled.sort_values(["user", "key"]).groupby("user").cumcount().sort_index().to_numpy()
    sizes = split_sizes(frame.groupby("user")["user"].transform("size").to_numpy(), ratios)
    labels = (rank >= sizes[:, 0]).astype(np.int8) + (rank >= sizes[:, 0] + sizes[:, 1]).astype(np.int8)
    return _by_label(frame, labels)


def split_leave_last_out(frame: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """Per user the latest interaction is test and the one before val (ties in log order); users with fewer than
    three interactions keep them all in train."""
    frame = frame.reset_index(drop=True)
    ordered = frame.assign(order=np.arange(len(frame))).sort_values(["user", "timestamp", "order"])
    from_end = ordered.groupby("user").cumcount(ascending=False).sort_index().to_numpy()
    counts = frame.groupby("user")["user"].transform("size").to_numpy()
    labels = np.where(counts >= 3, np.where(from_end == 0, TEST, np.where(from_end == 1, VAL, TRAIN)), TRAIN)
    return _by_label(frame, labels)


def drop_unrankable(train: pd.DataFrame, val: pd.DataFrame, test: pd.DataFrame
                    ) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Val and test keep users with training interactions only (a model cannot rank for a user it never saw) and
    pairs not in the user's training set (only repeated interactions could be; duplicates are dropped earlier)."""
    width = int(max(frame["item"].max() if len(frame) else 0 for frame in (train, val, test))) + 1
    known_users = train["user"].unique()
    seen_pairs = (train["user"] * width + train["item"]).unique()
    kept = []
    for name, frame in (("val", val), ("test", test)):
        known = frame["user"].isin(known_users)
        fresh = ~(frame["user"] * width + frame["item"]).isin(seen_pairs)
        if not known.all():
            log.info("data: dropped %d %s interactions of %d users without training interactions", int((~known).sum()),
                     name, frame.loc[~known, "user"].nunique())
        if not (fresh | ~known).all():
            log.info("data: dropped %d %s interactions already in their user's training set",
                     int((known & ~fresh).sum()), name)
        kept.append(frame[known & fresh].reset_index(drop=True))
    return kept[0], kept[1]
