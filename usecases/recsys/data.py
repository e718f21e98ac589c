"""Interaction logs as encoded, split positives: where a reader starts. `load_interactions` reads one source into a
`RawLog` (MovieLens in its published formats, any CSV or Parquet log, or a synthetic log), filters and encodes it
and splits it into train, val and test.

The steps live beside this module: `movielens` (the cache, a mirror folder in $USECASES_DATA_PATH, else GroupLens,
MD5-checked; a `DataUnavailable` offline, on which the demo falls back to the synthetic log), `logs` (a user's log;
every mistake is one `UserError` line naming the file, the column and the row), `synthetic`, `preprocess`
(threshold, k-core, encoding; pandas API, so that cuDF can run it on a GPU) and `splits`.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import psutil
import scipy.sparse as sp

from common.errors import UserError
from common.paths import cache_dir
from common.runtime.devices import distributed_env
from common.tables import COMPRESSED_SUFFIXES, is_parquet
from .config import Columns, Config, Data
from .logs import RawLog, read_log
from .movielens import movielens_folder, movielens_format, read_movielens
from .preprocess import encode, filter_interactions
from .splits import check_evaluable, check_ratios, drop_unrankable, split
from .synthetic import synthetic_log

__all__ = ["Interactions", "RawLog", "load_interactions", "read_path", "read_source"]

log = logging.getLogger(__name__)

PANDAS_BASE_BYTES = 1.4 * 2**30  # a pandas-engine run's peak resident memory: this, plus per interaction of the log
PANDAS_BYTES_PER_INTERACTION = 120  # (the scale preset: 1.8 GB at 4 M, 3.0 GB at 16 M, 13.4 GB at 100 M)
PANDAS_MEMORY_SHARE = 0.8  # of the free memory a run may plan to use


@dataclass
class Interactions:
    """Positives split into train, val and test; each frame has int64 columns `user` and `item` (codes from 1)
    and `timestamp` (int64 seconds, 0 when the log has none), and `rating` (float, NaN when the log has none).
    The Dask engine gives the splits as `matrices` only (memory-mapped from its cache), and no frames.

    `matrix("known")` holds every positive the run read, val and test as split, before the rows no model can rank
    were dropped (those of users first seen after a temporal cut): what the served model knows of each user.

    `user_ids[code]` and `item_ids[code]` give the raw ids back (index 0 is the unknown id: -1 for integer ids,
    None for text ids); `titles[code]` the item titles when the data has them ("" at index 0 and where missing).
    """

    train: pd.DataFrame | None
    val: pd.DataFrame | None
    test: pd.DataFrame | None
    user_ids: np.ndarray
    item_ids: np.ndarray
    titles: np.ndarray | None
    source: str
    sha256: str
    matrices: dict[str, sp.csr_matrix] = field(default_factory=dict)
    prepare_seconds: float | None = None  # reading, filtering, encoding and splitting, for the run's stage times
    val_events: pd.DataFrame | None = None  # the validation and test periods as split, every user's (replay);
    test_events: pd.DataFrame | None = None  # None on Dask

    @property
    def n_users(self) -> int:
        """Rows of a user matrix, the unknown id included."""
        return len(self.user_ids)

    @property
    def n_items(self) -> int:
        return len(self.item_ids)

    def matrix(self, split: str) -> sp.csr_matrix:
        """Binary user x item CSR matrix of one split (repeated pairs count once)."""
        if split in self.matrices:
            return self.matrices[split]
        frame = getattr(self, split)
        users, items = np.asarray(frame["user"]), np.asarray(frame["item"])
        values = np.ones(len(users), dtype=np.float32)
        matrix = sp.csr_matrix((values, (users, items)), shape=(self.n_users, self.n_items))
        matrix.data[:] = 1.0
        return matrix

    def size(self, split: str) -> int:
        frame = getattr(self, split)
        return len(frame) if frame is not None else self.matrices[split].nnz


def load_interactions(config: Config, path: Path | None = None, client=None) -> Interactions:
    """`--data PATH` decides the source when given: a MovieLens folder, or a CSV or Parquet log. What no run could
    learn from or be scored on (one user or item, an empty train, validation or test split) is refused here, before
    a run is started. With a Dask `client` the log is prepared on its cluster, out of core (`outofcore`); under
    torchrun, where Dask does not run, the ranks train from the matrices an earlier Dask run prepared, if any."""
    started = time.perf_counter()
    ratios = check_ratios(config.split_ratios)
    if client is not None:
        return _load_on_dask(config, path, client, started)
    if path is None and config.data.source == "synthetic" and distributed_env()[2] > 1:
        from .outofcore import cached
        from .synthetic import synthetic_digest

        earlier = cached(config, synthetic_digest(config.data.synthetic))
        if earlier is not None:
            return _from_prepared(earlier, started)
    check_fits_in_memory(config, path)
    raw = read_source(config.data, path)
    _check_timestamps(config, raw.has_timestamps, raw.source)
    frame = filter_interactions(raw.frame, config.data, raw.source)
    _check_variety(frame, raw.source)
    frame, user_ids, item_ids, titles = encode(frame, raw.titles)
    train, held_out_val, held_out_test = split(frame, config.split, ratios, config.runtime.seed)
    val, test = drop_unrankable(train, held_out_val, held_out_test)
    check_evaluable(frame, config.split, (train, held_out_val, held_out_test), (val, test), raw.source)
    known = sp.csr_matrix((np.ones(len(frame), dtype=np.float32), (frame["user"].to_numpy(), frame["item"].to_numpy())),
                          shape=(len(user_ids), len(item_ids)))
    data = Interactions(train, val, test, user_ids, item_ids, titles, raw.source, raw.sha256, {"known": known},
                        prepare_seconds=time.perf_counter() - started, val_events=held_out_val,
                        test_events=held_out_test)
    density = len(frame) / max((data.n_users - 1) * (data.n_items - 1), 1)
    log.info("data %s: %d users, %d items, %d/%d/%d train/val/test interactions (%s split), density %.4f%%",
             raw.source, data.n_users - 1, data.n_items - 1, len(train), len(val), len(test), config.split,
             100 * density)
    return data


def expected_interactions(config: Config, path: Path | None) -> int | None:
    """How many rows the log has, from what is known before reading it: the generator's size, a Parquet file's
    metadata, a CSV file's size over the length of its first lines; None when unknown (a MovieLens folder)."""
    if path is None:
        synthetic = config.data.synthetic
        return synthetic.users * synthetic.interactions_per_user if config.data.source == "synthetic" else None
    if not path.is_file() or not os.access(path, os.R_OK) or path.name.lower().endswith(COMPRESSED_SUFFIXES):
        return None  # unknown: the reader says what is wrong, in its own words
    if is_parquet(path):
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            return pq.ParquetFile(path).metadata.num_rows
        except (OSError, pa.ArrowException):  # not Parquet after all: the reader says so in its own words
            return None
    with path.open("rb") as file:
        head = file.read(1 << 20)
    lines = head.count(b"\n")
    return int(path.stat().st_size / (len(head) / lines)) if lines else None


def check_fits_in_memory(config: Config, path: Path | None) -> None:
    """The pandas engine holds the whole log, and its copies, in this process: refuse up front a log whose estimated
    need exceeds the free memory, rather than meet the kernel's out-of-memory killer an hour in."""
    rows = expected_interactions(config, path)
    if rows is None:
        return
    needed = PANDAS_BASE_BYTES + rows * PANDAS_BYTES_PER_INTERACTION
    free = psutil.virtual_memory().available
    if needed > free * PANDAS_MEMORY_SHARE:
        raise UserError(f"{path or 'data.synthetic'}: about {rows / 1e6:,.0f} M interactions need about "
                        f"{needed / 2**30:.1f} GB with the pandas engine (an estimate), and this machine has "
                        f"{free / 2**30:.1f} GB free; use --engine dask, which works out of core")


def _check_timestamps(config: Config, has_timestamps: bool, source: str) -> None:
    if config.split == "temporal" and not has_timestamps:
        raise UserError(f"split=temporal needs a timestamp column (data.columns.timestamp) but {source} has "
                        "none; use split=random")


def _load_on_dask(config: Config, path: Path | None, client, started: float) -> Interactions:
    from .outofcore import Source, frame_source, prepare
    from .synthetic import synthetic_digest, write_synthetic_shards

    if path is None and config.data.source == "synthetic":
        digest = synthetic_digest(config.data.synthetic)
        folder = cache_dir("recsys-synthetic") / digest[:20]
        source = Source(lambda client, _: (write_synthetic_shards(config.data.synthetic, folder, client), None),
                        True, "synthetic", digest, True)
    else:
        source = _in_partitions(config.data, path) or frame_source(read_source(config.data, path))
    _check_timestamps(config, source.has_timestamps, source.source)
    return _from_prepared(prepare(source, config, client), started)


def _in_partitions(data: Data, path: Path | None):
    """The log as the workers read it in parts, where it can be cut: a CSV or Parquet file, a MovieLens
    ratings.csv; None otherwise (the readers then read it whole, or say what is wrong)."""
    from .partitions import log_source, movielens_source

    if path is None and data.source == "movielens":
        path = movielens_folder(data.movielens)
    if path is None:
        return None
    if path.is_dir():
        kind = movielens_format(path)
        return movielens_source(path, kind) if kind is not None else None
    return log_source(path, data.columns) if path.is_file() else None


def _from_prepared(prepared, started: float) -> Interactions:
    return Interactions(None, None, None, prepared.user_ids, prepared.item_ids, prepared.titles, prepared.source,
                        prepared.sha256, prepared.matrices, prepare_seconds=time.perf_counter() - started)


def _check_variety(frame: pd.DataFrame, source: str) -> None:
    """One user or one item left is a log with nothing to learn, most often the wrong column named as the id."""
    for key, other in (("user", "item"), ("item", "user")):
        ids = frame[key].unique()
        if len(ids) == 1:
            raise UserError(f"{source}: every interaction is of one {key} ('{ids[0]}'; {other} ids: "
                            f"{frame[other].nunique()}) after de-duplication and the data.* filters; a recommender "
                            f"needs several: is the {key} column the right one (data.columns.{key})?")


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
