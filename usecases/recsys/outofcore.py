"""The Dask engine's preprocessing: the steps of `preprocess` over a log that never meets in one process, written
as CSR matrices in a cache that the next run starts from; only counts, ids and the cut days come back here."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import scipy.sparse as sp

from common.runtime.engine import worker_frames
from common.errors import UserError
from common.paths import building, cache_dir, write_json_atomic
from .config import Config
from .preprocess import (TEST, TRAIN, VAL, _with_placeholder, check_ratios, check_threshold, check_variety,
                         cut_positions, drop_unrankable, split)

log = logging.getLogger(__name__)

PREPARED_FORMAT = 2  # bump when what the cache holds changes
ROWS_PER_PARTITION = 1_000_000
DAY_S = 86_400
SPLITS = ("train", "val", "test")
MATRICES = (*SPLITS, "known")


@dataclass
class Source:
    """A log as the Dask engine reads it: `write_shards(client, folder)` writes its shards, returns them and titles."""

    write_shards: Callable[[Any, Path], tuple[list[Path], pd.Series | None]]
    by_user: bool
    source: str
    sha256: str
    has_timestamps: bool


def frame_source(raw) -> Source:
    """A `RawLog` read whole in this process, as shards for the workers."""
    return Source(lambda client, folder: (_raw_shards(raw.frame, folder), raw.titles), False, raw.source,
                  raw.sha256, raw.has_timestamps)


@dataclass
class Prepared:
    matrices: dict[str, sp.csr_matrix]
    user_ids: np.ndarray
    item_ids: np.ndarray
    titles: np.ndarray | None
    source: str
    sha256: str


def prepared_key(config: Config, sha256: str) -> str:
    """What the cached matrices depend on: the data and the settings that read, filter and split it."""
    data = config.data
    settings = {"format": PREPARED_FORMAT, "data": sha256, "columns": data.columns.model_dump(),
                "threshold": data.rating_threshold, "min_user": data.min_user_interactions,
                "min_item": data.min_item_interactions, "split": config.split,
                "ratios": check_ratios(config.split_ratios), "seed": config.runtime.seed}
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:20]


def cached(config: Config, sha256: str) -> Prepared | None:
    """The matrices an earlier run prepared from this data with these settings, if any (for torchrun)."""
    folder = _folder(config, sha256)
    if not (folder / "meta.json").exists():
        return None
    log.info("data: the matrices prepared earlier, from %s", folder)
    return _load(folder)


def _folder(config: Config, sha256: str) -> Path:
    return cache_dir("recsys-prepared") / prepared_key(config, sha256)


def prepare(source: Source, config: Config, client) -> Prepared:
    folder = _folder(config, source.sha256)
    with building(folder, "meta.json") as work:
        if work is None:
            log.info("data: the matrices prepared earlier, from %s", folder)
        else:
            _compute(source, config, client, work)
            for stage in ("raw", "positives", "splits"):
                shutil.rmtree(work / stage, ignore_errors=True)
    return _load(folder)


def _compute(source: Source, config: Config, client, work: Path) -> None:
    shards, titles = source.write_shards(client, work / "raw")
    positives = _positives(source, shards, config, client, work / "positives")
    kept = _kept_ids(source, positives, config, client)
    counts, sizes = _split_counts(source, positives, kept, config, client, work / "splits")
    _write_prepared(source, kept, (counts, sizes), titles, config, work)


def _positives(source: Source, shards: list[Path], config: Config, client, folder: Path) -> list[Path]:
    import dask.dataframe as dd
    import pyarrow.parquet as pq

    lengths = [pq.ParquetFile(path).metadata.num_rows for path in shards]
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).tolist()
    frame = dd.from_map(_numbered_shard, shards, offsets, meta=_numbered_shard(shards[0], 0)[:0])
    threshold = config.data.rating_threshold
    if threshold is not None:
        check_threshold(source.source, threshold, *client.compute([frame["rating"].count(), frame["rating"].max()],
                                                                  sync=True))
        frame = frame[frame["rating"] >= threshold]
    if worker_frames(client) == "cudf":
        frame = frame.to_backend("cudf")  # the shuffle, sort and de-duplication on the workers' GPUs
    if not source.by_user:
        frame = frame.shuffle(on="user", npartitions=frame.npartitions)
    frame.map_partitions(_deduplicated, meta=frame._meta).to_parquet(str(folder), write_index=False,
                                                                     compute_kwargs={"scheduler": client})
    return sorted(folder.glob("*.parquet"))


@dataclass(frozen=True)
class Kept:
    """Every user and item id of the positives, and which the k-core filter keeps."""

    users: np.ndarray
    items: np.ndarray
    keep_users: np.ndarray
    keep_items: np.ndarray


def _kept_ids(source: Source, shards: list[Path], config: Config, client) -> Kept:
    data = config.data
    uniques = client.gather(client.map(_shard_ids, shards, pure=False))
    users = np.unique(np.concatenate([shard_users for shard_users, _ in uniques]))
    items = np.unique(np.concatenate([shard_items for _, shard_items in uniques]))
    keep_users, keep_items = _k_core(client, shards, users, items, data.min_user_interactions,
                                     data.min_item_interactions)
    if not keep_users.any():
        raise UserError(f"{source.source}: nothing left after the k-core filter (data.min_user_interactions="
                        f"{data.min_user_interactions}, data.min_item_interactions={data.min_item_interactions}); "
                        "relax the filters")
    for key, kept, ids, others in (("user", keep_users, users, keep_items), ("item", keep_items, items, keep_users)):
        check_variety(source.source, key, ids[kept], int(others.sum()))
    return Kept(users, items, keep_users, keep_items)


def _split_counts(source: Source, shards: list[Path], kept: Kept, config: Config, client,
                  out: Path) -> tuple[list, dict[str, int]]:
    """Each shard's rows coded and split (written to `out`), each shard's counts, and each split's size."""
    user_codes = np.where(kept.keep_users, np.cumsum(kept.keep_users), 0)
    item_codes = np.where(kept.keep_items, np.cumsum(kept.keep_items), 0)
    coded = client.scatter({"users": kept.users, "items": kept.items, "user_codes": user_codes,
                            "item_codes": item_codes}, broadcast=True, hash=False)
    cuts = _temporal_cuts(client, shards, coded, config) if config.split == "temporal" else None
    counts = client.gather(client.map(_split_shard, shards, range(len(shards)), coded=coded, config=config, cuts=cuts,
                                      out=out, pure=False))
    sizes = {name: sum(shard[name][1].sum() for shard in counts) for name in SPLITS}
    for name in ("val", "test"):
        dropped = sum(shard[f"{name}_held_out"] for shard in counts) - sizes[name]
        if dropped:
            log.info("data: dropped %d %s interactions of users without training interactions", dropped, name)
    empty = [name for name in SPLITS if not sizes[name]]
    if empty:
        raise UserError(f"{source.source}: split={config.split} leaves the {' and '.join(empty)} split empty; "
                        "--engine pandas says why in detail")
    return counts, sizes


def _write_prepared(source: Source, kept: Kept, split: tuple[list, dict], titles, config: Config, work: Path) -> None:
    counts, sizes = split
    n_users, n_items = int(kept.keep_users.sum()) + 1, int(kept.keep_items.sum()) + 1
    for name in MATRICES:
        _write_csr(work, name, counts, n_users)
    pd.DataFrame({"id": kept.users[kept.keep_users]}).to_parquet(work / "user_ids.parquet")
    pd.DataFrame({"id": kept.items[kept.keep_items]}).to_parquet(work / "item_ids.parquet")
    if titles is not None:
        titles = titles[~titles.index.duplicated()]
        pd.DataFrame({"title": titles.reindex(kept.items[kept.keep_items]).fillna("").astype(str).to_numpy()}
                     ).to_parquet(work / "titles.parquet")
    write_json_atomic({"source": source.source, "sha256": source.sha256, "users": n_users - 1, "items": n_items - 1,
                       **{f"{name}_interactions": int(sizes[name]) for name in SPLITS}}, work / "meta.json")
    log.info("data %s: %d users, %d items, %d/%d/%d train/val/test interactions (%s split), prepared on Dask in %s",
             source.source, n_users - 1, n_items - 1, sizes["train"], sizes["val"], sizes["test"], config.split, work)


def _raw_shards(frame: pd.DataFrame, folder: Path) -> list[Path]:
    """A log read in this process, as Parquet shards (not sent inside the task graph)."""
    folder.mkdir(parents=True)
    paths = []
    for start in range(0, len(frame), ROWS_PER_PARTITION):
        paths.append(folder / f"part-{len(paths):05d}.parquet")
        frame.iloc[start:start + ROWS_PER_PARTITION][["user", "item", "rating", "timestamp"]].to_parquet(
            paths[-1], index=False)
    return paths


def _numbered_shard(path: Path, first: int) -> pd.DataFrame:
    """A shard as one partition, its rows numbered in log order from `first`."""
    shard = pd.read_parquet(path, columns=["user", "item", "rating", "timestamp"])
    return shard.assign(order=np.arange(first, first + len(shard), dtype=np.int64))


def _deduplicated(partition):
    """Each (user, item) once, at its earliest time, in time order (cuDF's de-duplication loses it: sorted again)."""
    by_time = ["timestamp", "order"]  # a total order: `order` numbers every row
    kept = partition.sort_values(by_time).drop_duplicates(["user", "item"], keep="first")
    return kept if isinstance(kept, pd.DataFrame) else kept.sort_values(by_time)


def _shard_ids(path: Path) -> tuple[np.ndarray, np.ndarray]:
    shard = pd.read_parquet(path, columns=["user", "item"])
    return shard["user"].unique(), shard["item"].unique()


def _codes(shard: pd.DataFrame, users: np.ndarray, items: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return np.searchsorted(users, shard["user"].to_numpy()), np.searchsorted(items, shard["item"].to_numpy())


def _shard_counts(path: Path, users, items, keep_users, keep_items) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    shard = pd.read_parquet(path, columns=["user", "item"])
    user, item = _codes(shard, users, items)
    kept = keep_users[user] & keep_items[item]
    present, per_user = np.unique(user[kept], return_counts=True)
    return present, per_user, np.bincount(item[kept], minlength=len(items))


def _k_core(client, shards: list[Path], users: np.ndarray, items: np.ndarray, min_user: int, min_item: int
            ) -> tuple[np.ndarray, np.ndarray]:
    from distributed import as_completed

    keep_users, keep_items = np.ones(len(users), dtype=bool), np.ones(len(items), dtype=bool)
    if not min_user and not min_item:
        return keep_users, keep_items  # every id left has an interaction
    users_there, items_there = client.scatter([users, items], broadcast=True, hash=False)
    while True:
        users_kept, items_kept = client.scatter([keep_users, keep_items], broadcast=True, hash=False)
        user_counts, item_counts = np.zeros(len(users), dtype=np.int64), np.zeros(len(items), dtype=np.int64)
        for future in as_completed(client.map(_shard_counts, shards, users=users_there, items=items_there,
                                              keep_users=users_kept, keep_items=items_kept, pure=False)):
            present, per_user, per_item = future.result()
            user_counts[present] += per_user
            item_counts += per_item
        drop_users = keep_users & (user_counts < max(min_user, 1))
        drop_items = keep_items & (item_counts < max(min_item, 1))
        if not drop_users.any() and not drop_items.any():
            return keep_users, keep_items
        keep_users &= ~drop_users
        keep_items &= ~drop_items


def _kept_rows(path: Path, coded: dict, columns: list[str]) -> pd.DataFrame:
    """A shard's rows that survived the filters, with codes 1..n for users and items."""
    shard = pd.read_parquet(path, columns=columns)
    user, item = _codes(shard, coded["users"], coded["items"])
    user, item = coded["user_codes"][user], coded["item_codes"][item]
    kept = (user > 0) & (item > 0)
    return shard[kept].assign(user=user[kept].astype(np.int64), item=item[kept].astype(np.int64))


def _shard_days(path: Path, coded: dict) -> pd.Series:
    return (_kept_rows(path, coded, ["user", "item", "timestamp"])["timestamp"] // DAY_S).value_counts()


def _shard_times_on(path: Path, coded: dict, days: list[int]) -> np.ndarray:
    times = _kept_rows(path, coded, ["user", "item", "timestamp"])["timestamp"].to_numpy()
    return times[np.isin(times // DAY_S, days)]


def _temporal_cuts(client, shards: list[Path], coded: dict, config: Config) -> list[int]:
    """`split_temporal`'s cuts: only the timestamps of the days the cuts fall in come back to be sorted."""
    histogram = pd.concat(client.gather(client.map(_shard_days, shards, coded=coded, pure=False)))
    histogram = histogram.groupby(level=0).sum().sort_index()
    total, ends = int(histogram.sum()), np.cumsum(histogram.to_numpy())
    positions = cut_positions(total, check_ratios(config.split_ratios))
    wanted = {}
    for position in positions:
        if position < total:
            day_index = int(np.searchsorted(ends, position, side="right"))
            wanted[position] = (int(histogram.index[day_index]), position - (ends[day_index - 1] if day_index else 0))
    days = sorted({day for day, _ in wanted.values()} | {int(histogram.index[-1])})
    times = np.sort(np.concatenate(client.gather(client.map(_shard_times_on, shards, coded=coded, days=days,
                                                            pure=False))))
    cuts = []
    for position in positions:
        if position >= total:
            cuts.append(int(times.max()) + 1)
        else:
            day, rank = wanted[position]
            cuts.append(int(times[times // DAY_S == day][rank]))
    return cuts


def _split_shard(path: Path, index: int, coded: dict, config: Config, cuts: list[int] | None, out: Path) -> dict:
    """One shard's matrices as code arrays on disk; per matrix its users and their counts."""
    rows = _kept_rows(path, coded, ["user", "item", "timestamp", "order"]).reset_index(drop=True)
    parts = split(rows, config.split, check_ratios(config.split_ratios), config.runtime.seed, cuts)
    val, test = drop_unrankable(parts[TRAIN], parts[VAL], parts[TEST])
    result = {"val_held_out": len(parts[VAL]), "test_held_out": len(parts[TEST])}
    for name, part in zip(MATRICES, (parts[TRAIN], val, test, rows)):
        ordered = part.sort_values(["user", "item"])
        folder = out / name
        folder.mkdir(parents=True, exist_ok=True)
        np.save(folder / f"{index:05d}-users.npy", ordered["user"].to_numpy(np.int64))
        np.save(folder / f"{index:05d}-items.npy", ordered["item"].to_numpy(np.int32))
        result[name] = np.unique(ordered["user"].to_numpy(np.int64), return_counts=True)
    return result


def _write_csr(work: Path, name: str, counts: list[dict], n_users: int) -> None:
    """One split's CSR arrays, filled shard by shard (a user's rows all come from one shard, sorted by item)."""
    per_user = np.zeros(n_users, dtype=np.int64)
    for shard in counts:
        present, how_many = shard[name]
        per_user[present] += how_many
    nnz = int(per_user.sum())
    index_type = np.int32 if nnz < 2**31 else np.int64
    indptr = np.concatenate([[0], np.cumsum(per_user)]).astype(index_type)
    np.save(work / f"{name}-indptr.npy", indptr)
    indices = np.lib.format.open_memmap(work / f"{name}-indices.npy", mode="w+", dtype=index_type, shape=(nnz,))
    folder = work / "splits" / name
    for users_file in sorted(folder.glob("*-users.npy")):
        users = np.load(users_file)
        items = np.load(users_file.with_name(users_file.name.replace("-users", "-items")))
        if not len(users):
            continue
        starts = np.flatnonzero(np.r_[True, users[1:] != users[:-1]])
        within = np.arange(len(users)) - np.repeat(starts, np.diff(np.r_[starts, len(users)]))
        indices[indptr[users] + within] = items
    indices.flush()
    del indices


def _load(folder: Path) -> Prepared:
    meta = json.loads((folder / "meta.json").read_text())
    n_users, n_items = meta["users"] + 1, meta["items"] + 1
    matrices = {}
    for name in MATRICES:
        indptr = np.load(folder / f"{name}-indptr.npy")
        indices = np.load(folder / f"{name}-indices.npy", mmap_mode="c")  # copy-on-write: nothing changes the cache
        matrix = sp.csr_matrix((np.ones(len(indices), dtype=np.float32), indices, indptr), shape=(n_users, n_items),
                               copy=False)
        matrix.has_sorted_indices = True
        matrices[name] = matrix
    user_ids = _with_placeholder(pd.Index(pd.read_parquet(folder / "user_ids.parquet")["id"]))
    item_ids = _with_placeholder(pd.Index(pd.read_parquet(folder / "item_ids.parquet")["id"]))
    titles = None
    if (folder / "titles.parquet").exists():
        titles = np.concatenate([[""], pd.read_parquet(folder / "titles.parquet")["title"].to_numpy(object)]
                                ).astype(object)
    return Prepared(matrices, user_ids, item_ids, titles, meta["source"], meta["sha256"])
