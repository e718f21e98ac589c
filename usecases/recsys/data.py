"""Interaction logs as encoded, split positives: `load_interactions` reads one source into a `RawLog` (`movielens`,
`logs` or `synthetic`), then filters, encodes and splits it (`preprocess`); on Dask, out of core (`outofcore`)."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import scipy.sparse as sp

from common.errors import UserError
from common.paths import cache_dir
from common.runtime.devices import distributed_env
from common.tables import COMPRESSED_SUFFIXES, is_parquet
from .config import Config, Data
from .logs import RawLog, read_log
from .movielens import movielens_folder, movielens_format, read_movielens
from .preprocess import (check_evaluable, check_ratios, check_variety, drop_unrankable, encode, filter_interactions,
                         split)
from .outofcore import Source, cached, frame_source, prepare
from .partitions import log_source, movielens_source
from .synthetic import synthetic_digest, synthetic_log, write_synthetic_shards

log = logging.getLogger(__name__)

PANDAS_BASE_BYTES = 1.4 * 2**30  # a pandas-engine run's peak resident memory: this, plus per interaction of the log
PANDAS_BYTES_PER_INTERACTION = 120  # (the scale preset: 1.8 GB at 4 M, 3.0 GB at 16 M, 13.4 GB at 100 M)
PANDAS_MEMORY_SHARE = 0.8  # of the free memory a run may plan to use


@dataclass
class Interactions:
    """Positives split into train, val and test (on Dask as `matrices` only); `matrix("known")` holds every positive
    the run read, what the served model knows. `user_ids`, `item_ids` and `titles` by code (0: the unknown id)."""

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
        return len(self.user_ids)

    @property
    def n_items(self) -> int:
        return len(self.item_ids)

    def matrix(self, split: str) -> sp.csr_matrix:
        if split in self.matrices:
            return self.matrices[split]
        frame = getattr(self, split)
        matrix = sp.csr_matrix((np.ones(len(frame), np.float32), (frame["user"].to_numpy(), frame["item"].to_numpy())),
                               shape=(self.n_users, self.n_items))
        matrix.data[:] = 1.0  # a repeated pair counts once
        return matrix

    def size(self, split: str) -> int:
        frame = getattr(self, split)
        return len(frame) if frame is not None else self.matrices[split].nnz


def load_interactions(config: Config, path: Path | None = None, client=None) -> Interactions:
    """What no run could learn from or be scored on is refused here; under torchrun, from an earlier Dask run's."""
    started = time.perf_counter()
    ratios = check_ratios(config.split_ratios)
    if client is not None:
        return _load_on_dask(config, path, client, started)
    if path is None and config.data.source == "synthetic" and distributed_env()[2] > 1:
        earlier = cached(config, synthetic_digest(config.data.synthetic))
        if earlier is not None:
            return _from_prepared(earlier, started)
    check_fits_in_memory(config, path)
    raw = read_source(config.data, path)
    _check_timestamps(config, raw.has_timestamps, raw.source)
    frame = filter_interactions(raw.frame, config.data, raw.source)
    for key, other in (("user", "item"), ("item", "user")):
        check_variety(raw.source, key, frame[key].unique(), frame[other].nunique())
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
    log.info("data %s: %d users, %d items, %d/%d/%d train/val/test interactions (%s split), density %.4f%%", raw.source,
             data.n_users - 1, data.n_items - 1, len(train), len(val), len(test), config.split, 100 * density)
    return data


def expected_interactions(config: Config, path: Path | None) -> int | None:
    """How many rows the log has, from what is known before reading it; None when unknown."""
    if path is None:
        synthetic = config.data.synthetic
        return synthetic.users * synthetic.interactions_per_user if config.data.source == "synthetic" else None
    if not path.is_file() or not os.access(path, os.R_OK) or path.name.lower().endswith(COMPRESSED_SUFFIXES):
        return None  # unknown: the reader says what is wrong, in its own words
    if is_parquet(path):
        try:
            return pq.ParquetFile(path).metadata.num_rows
        except (OSError, pa.ArrowException):  # not Parquet after all: the reader says so in its own words
            return None
    with path.open("rb") as file:
        head = file.read(1 << 20)
    lines = head.count(b"\n")
    return int(path.stat().st_size / (len(head) / lines)) if lines else None


def check_fits_in_memory(config: Config, path: Path | None) -> None:
    """Refuse up front a log too large for the pandas engine, rather than meet the out-of-memory killer later."""
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
    """The log as the workers read it in parts, where it can be cut; None otherwise (read whole)."""
    if path is None and data.source == "movielens":
        path = movielens_folder(data.movielens)
    if path is None:
        return None
    if path.is_dir():
        return movielens_source(path, movielens_format(path))
    return log_source(path, data.columns) if path.is_file() else None


def _from_prepared(prepared, started: float) -> Interactions:
    return Interactions(None, None, None, prepared.user_ids, prepared.item_ids, prepared.titles, prepared.source,
                        prepared.sha256, prepared.matrices, prepare_seconds=time.perf_counter() - started)


def read_source(data: Data, path: Path | None) -> RawLog:
    if path is None and data.source == "file":
        raise UserError("data.source=file needs --data PATH (a CSV or Parquet interaction log)")
    if path is None and data.source == "synthetic":
        return synthetic_log(data.synthetic)
    if path is None or path.is_dir():
        return read_movielens(movielens_folder(data.movielens) if path is None else path)
    if not path.is_file():
        raise UserError(f"{path}: no such file or folder (expected a MovieLens folder or a CSV or Parquet log)")
    return read_log(path, data.columns)
