"""The Dask engine prepares the pandas engine's train, val and test to the last id and interaction, from the
generator's shards (a log file read in parts: test_partitions.py), and caches them; the pandas engine refuses a log too large for this machine's
memory in one line."""

from __future__ import annotations

import os

import numpy as np
import pandas as pd
import pytest

from common.config import load_config
from tests.cli_helpers import assert_rejected, runs, usecases
from usecases.recsys import USECASE, Config, outofcore
from usecases.recsys.config import Synthetic
from usecases.recsys.data import load_interactions
from usecases.recsys.synthetic import synthetic_log, write_synthetic_shards

pytest.importorskip("distributed")


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def config(*overrides: str) -> Config:
    return load_config(Config, USECASE.presets_dir, "smoke", list(overrides))


def assert_same(pandas, dask) -> None:
    assert np.array_equal(pandas.user_ids, dask.user_ids) and np.array_equal(pandas.item_ids, dask.item_ids)
    assert (pandas.titles is None) == (dask.titles is None)
    if pandas.titles is not None:
        assert np.array_equal(pandas.titles, dask.titles)
    for split in ("train", "val", "test", "known"):  # known: every positive, what the served model knows
        expected, got = pandas.matrix(split), dask.matrix(split)
        canonical = got.copy()
        canonical.sum_duplicates()
        assert got.nnz > 0 and canonical.nnz == got.nnz, f"{split}: a pair twice"
        assert got.shape == expected.shape and got.nnz == expected.nnz and (got != expected).nnz == 0, split


@pytest.mark.parametrize("split", ["temporal", "random", "leave_last_out"])
def test_the_dask_splits_are_the_pandas_ones_to_the_last_interaction(dask_client, split):
    settings = config(f"split={split}", "data.rating_threshold=2", "data.min_user_interactions=28",
                      "data.min_item_interactions=12")
    pandas, dask = load_interactions(settings), load_interactions(settings, None, dask_client)
    assert 1 < pandas.n_users - 1 < 600 and 1 < pandas.n_items - 1 < 1000, "the k-core removed users and items"
    assert_same(pandas, dask)


def test_the_generator_draws_the_same_log_on_the_workers(dask_client, tmp_path, monkeypatch):
    from usecases.recsys import synthetic as generator

    monkeypatch.setattr(generator, "SYNTHETIC_CHUNK_SCORES", 6_000)  # blocks of 100 users (the workers are threads)
    synthetic = Synthetic(users=700, items=300, interactions_per_user=12, candidates=60, seed=2)
    shards = write_synthetic_shards(synthetic, tmp_path / "shards", dask_client)
    assert len(shards) == 7
    drawn = pd.concat([pd.read_parquet(path) for path in shards], ignore_index=True)
    pd.testing.assert_frame_equal(drawn, synthetic_log(synthetic).frame)


def test_a_second_run_starts_from_the_cache_of_its_data_and_settings(dask_client, monkeypatch):
    first = load_interactions(config(), None, dask_client)

    def recompute(*args):
        raise AssertionError("prepared again")

    monkeypatch.setattr(outofcore, "_compute", recompute)
    assert_same(first, load_interactions(config(), None, dask_client))
    with pytest.raises(AssertionError, match="prepared again"):
        load_interactions(config("split=random"), None, dask_client)


def test_a_run_on_the_dask_engine_logs_its_stages(tmp_path):
    result = usecases("run", "recsys", "--preset", "smoke", "--engine", "dask", "--workers", "2", "--set",
                      "models=[pop,bpr]", "--set", "bpr.epochs=2", "--set", "evaluation.sample_users=200",
                      env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert result.returncode == 0, result.stderr[-2000:]
    (run,) = runs("recsys")
    assert run.info.status == "FINISHED" and run.data.tags["engine"] == "dask"
    metrics = run.data.metrics
    assert metrics["time/preprocess_s"] > 0 and metrics["memory/peak_rss_gb"] > 0
    assert metrics["test/bpr/users_evaluated"] == metrics["test/pop/users_evaluated"] == 200
    assert list((tmp_path / "cache" / "gpu-usecases" / "recsys-prepared").glob("*/train-indices.npy"))


def test_the_pandas_engine_refuses_a_log_larger_than_the_free_memory(capsys, monkeypatch):
    import psutil

    class Small:
        available = 4 * 2**30

    monkeypatch.setattr(psutil, "virtual_memory", lambda: Small())
    assert_rejected(capsys, "recsys", "run", "recsys", "--preset", "smoke", "--set", "data.synthetic.users=1000000",
                    "--set", "data.synthetic.interactions_per_user=40",
                    names=("data.synthetic", "40 M interactions", "GB with the pandas engine", "4.0 GB free",
                           "--engine dask"))


def test_ranks_under_torchrun_train_from_the_matrices_a_dask_run_prepared(dask_client, monkeypatch):
    prepared = load_interactions(config(), None, dask_client)
    monkeypatch.setenv("WORLD_SIZE", "2")
    loaded = load_interactions(config())
    assert loaded.train is None and loaded.matrices
    assert_same(prepared, loaded)


def test_engine_auto_takes_dask_for_a_large_log_only_where_dask_is_installed(monkeypatch, caplog):
    import importlib.util
    from types import SimpleNamespace

    from common.runner import resolve_engine

    alone = SimpleNamespace(distributed=False)
    large = config("runtime.engine=auto", "data.synthetic.users=1000000")
    assert resolve_engine(USECASE, config("runtime.engine=auto"), None, alone) == "pandas"
    assert resolve_engine(USECASE, large, None, alone) == "dask"
    assert resolve_engine(USECASE, large, None, SimpleNamespace(distributed=True)) == "pandas"
    assert resolve_engine(USECASE, config("data.synthetic.users=1000000"), None, alone) == "pandas"  # as configured
    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *rest: None if name == "distributed" else
                        found(name, *rest))
    assert resolve_engine(USECASE, large, None, alone) == "pandas"
    assert "about 40 M interactions (more than 20 M), but Dask is not installed" in caplog.text


@pytest.mark.slow
def test_a_log_larger_than_the_workers_memory_limit_is_prepared_out_of_core(tmp_path):
    """About 30 M interactions (1.2 GB as a DataFrame) through one worker process limited to 1 GiB."""
    import distributed
    import pyarrow.parquet as pq

    settings = config("data.synthetic.users=300000", "data.synthetic.items=5000", "data.synthetic.candidates=200",
                      "data.synthetic.interactions_per_user=100", "split=random")
    with distributed.LocalCluster(n_workers=1, threads_per_worker=1, memory_limit="1GiB",
                                  dashboard_address=":0") as cluster, distributed.Client(cluster) as client:
        (limit,) = client.run(lambda dask_worker: dask_worker.memory_manager.memory_limit).values()
        data = load_interactions(settings, None, client)
    drawn = sum(pq.ParquetFile(path).metadata.num_rows for path in (tmp_path / "cache").rglob("part-*.parquet"))
    assert limit < drawn * 40 and drawn > 25_000_000  # user, item, rating, timestamp, row number: 8 bytes each
    assert sum(data.size(split) for split in ("train", "val", "test")) == drawn  # every user has its val and test


def test_the_cache_key_holds_the_columns_read_and_the_normalised_ratios():
    assert outofcore.prepared_key(config(), "a" * 64) != outofcore.prepared_key(
        config("data.columns.rating=null"), "a" * 64)
    assert outofcore.prepared_key(config("split=random"), "a" * 64) != outofcore.prepared_key(config(), "a" * 64)


def test_a_size_unknown_before_reading_is_no_estimate(tmp_path):
    import gzip

    from usecases.recsys.data import expected_interactions

    packed = tmp_path / "log.csv.gz"
    with gzip.open(packed, "wt") as file:
        file.write("user_id,item_id\n" + "1,2\n" * 1000)
    plain = tmp_path / "log.csv"
    plain.write_text("user_id,item_id\n" + "1,2\n" * 1000)
    settings = config("data.source=file")
    assert expected_interactions(settings, packed) is None
    assert 990 <= expected_interactions(settings, plain) <= 1010
    plain.chmod(0)
    if not os.access(plain, os.R_OK):  # root reads anything
        assert expected_interactions(settings, plain) is None
