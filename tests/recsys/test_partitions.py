"""A log file read in parts on the Dask workers gives what the whole-file readers give: the same matrices, ids and
titles, and for a bad value or a bad line the same one-line error, naming the row of the whole file."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from common.errors import UserError
from tests.recsys.test_data import SHARED_MOVIELENS
from tests.recsys.test_engines import assert_same, config
from usecases.recsys import data as recsys_data
from usecases.recsys import partitions
from usecases.recsys.config import Synthetic
from usecases.recsys.data import load_interactions
from usecases.recsys.synthetic import synthetic_log

pytest.importorskip("distributed")


@pytest.fixture(autouse=True)
def small_parts(tmp_path, monkeypatch):
    """Parts of 4 KB (about 150 rows), read only on the workers: the whole-file readers are not called on Dask."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(partitions, "BLOCK_BYTES", 4096)
    whole = recsys_data.read_source

    def only_for_pandas(*args):
        if only_for_pandas.dask:
            raise AssertionError("read whole on the Dask engine")
        return whole(*args)

    only_for_pandas.dask = False
    monkeypatch.setattr(recsys_data, "read_source", only_for_pandas)
    return only_for_pandas


def both_engines(small_parts, client, path, *overrides):
    settings = config("data.source=file", "split=leave_last_out", "data.min_item_interactions=3", *overrides)
    pandas = load_interactions(settings, path)
    small_parts.dask = True
    return pandas, load_interactions(settings, path, client)


def both_errors(small_parts, client, path) -> tuple[str, str]:
    settings = config("data.source=file", "split=random")
    messages = []
    for engine_client in (None, client):
        small_parts.dask = engine_client is not None
        with pytest.raises(UserError) as raised:
            load_interactions(settings, path, engine_client)
        messages.append(str(raised.value))
    return messages[0], messages[1]


def user_log(seed: int = 4) -> pd.DataFrame:
    frame = synthetic_log(Synthetic(users=200, items=150, interactions_per_user=20, seed=seed)).frame
    repeats = frame.sample(400, random_state=0).assign(timestamp=lambda rows: rows["timestamp"] + 5)
    log = pd.concat([frame, repeats], ignore_index=True)
    return log.rename(columns={"user": "user_id", "item": "item_id"})


def test_a_csv_in_many_parts_with_text_ids_and_titles_is_read_alike(dask_client, small_parts, tmp_path):
    log = user_log()
    log = log.assign(user_id="u" + log["user_id"].astype(str), item_id="i" + log["item_id"].astype(str),
                     title=np.where(np.arange(len(log)) % 7 == 0, "", "Title, " + log["item_id"].astype(str)))
    path = tmp_path / "log.csv"
    log.to_csv(path, index=False)
    parts = partitions._plan(partitions.LogFile(path, ",", path.open("rb").readline(), None, {}))
    assert len(parts) > 20 and all(path.read_bytes()[part.end - 1:part.end] == b"\n" for part in parts)
    pandas, dask = both_engines(small_parts, dask_client, path, "data.columns.title=title")
    assert pandas.titles is not None
    assert_same(pandas, dask)


def test_a_parquet_log_is_read_by_row_group_alike(dask_client, small_parts, tmp_path):
    path = tmp_path / "log.parquet"
    user_log().to_parquet(path, row_group_size=500)
    pandas, dask = both_engines(small_parts, dask_client, path)
    assert_same(pandas, dask)


def test_integer_ids_in_some_parts_and_text_in_others_are_text_everywhere(dask_client, small_parts, tmp_path):
    log = user_log()
    late = np.arange(len(log)) > len(log) - 300
    log["item_id"] = log["item_id"].astype(object)
    log.loc[late, "item_id"] = "x" + log.loc[late, "item_id"].astype(str)
    path = tmp_path / "log.csv"
    log.to_csv(path, index=False)
    pandas, dask = both_engines(small_parts, dask_client, path)
    assert not pd.api.types.is_integer_dtype(dask.item_ids) and "3" in set(dask.item_ids)
    assert_same(pandas, dask)


def test_a_bad_value_late_in_the_file_names_the_row_of_the_whole_file(dask_client, small_parts, tmp_path):
    path = tmp_path / "log.csv"
    log = user_log()
    log["rating"] = log["rating"].astype(object)
    log.loc[3000, "rating"] = "five"
    log.to_csv(path, index=False)
    pandas, dask = both_errors(small_parts, dask_client, path)
    assert dask == pandas and "column 'rating', row 3001: expected a number, got 'five'" in dask


def test_a_line_with_an_extra_field_late_in_the_file_names_its_line(dask_client, small_parts, tmp_path):
    path = tmp_path / "log.csv"
    user_log().to_csv(path, index=False)
    lines = path.read_text().splitlines(keepends=True)
    lines[2500] = lines[2500].rstrip("\n") + ",7\n"
    path.write_text("".join(lines))
    pandas, dask = both_errors(small_parts, dask_client, path)
    assert dask == pandas and "line 2501" in dask


def test_a_header_only_csv_is_one_line(dask_client, small_parts, tmp_path):
    path = tmp_path / "log.csv"
    path.write_text("user_id,item_id,rating,timestamp\n")
    small_parts.dask = True
    with pytest.raises(UserError, match="no data rows"):
        load_interactions(config("data.source=file", "split=random"), path, dask_client)


def write_movielens(folder, frame: pd.DataFrame) -> None:
    folder.mkdir()
    frame.rename(columns={"user": "userId", "item": "movieId"})[["userId", "movieId", "rating", "timestamp"]].to_csv(
        folder / "ratings.csv", index=False)
    items = np.unique(frame["item"])
    pd.DataFrame({"movieId": items, "title": [f"Film {item} (1999)" for item in items], "genres": "Drama"}).to_csv(
        folder / "movies.csv", index=False)


def test_a_movielens_ratings_csv_is_read_in_parts_alike(dask_client, small_parts, tmp_path):
    frame = synthetic_log(Synthetic(users=150, items=120, interactions_per_user=15, seed=1)).frame
    write_movielens(tmp_path / "ml-25m", frame.assign(rating=(frame["rating"] * 2).round() / 2))
    pandas, dask = both_engines(small_parts, dask_client, tmp_path / "ml-25m")
    assert dask.source == pandas.source == "movielens:ml-25m" and dask.sha256 == pandas.sha256
    assert_same(pandas, dask)


@pytest.mark.skipif(not SHARED_MOVIELENS.is_dir(), reason="no development copy of ml-latest-small in ../shared")
def test_the_shared_ml_latest_small_in_parts(dask_client, small_parts, monkeypatch):
    monkeypatch.setattr(partitions, "BLOCK_BYTES", 256 * 1024)  # ten parts
    pandas, dask = both_engines(small_parts, dask_client, SHARED_MOVIELENS, "split=temporal")
    assert dask.n_users - 1 == 610 and dask.titles[dask.item_ids == 1][0] == "Toy Story (1995)"
    assert_same(pandas, dask)


def test_a_utf16_log_is_left_to_the_whole_file_reader(tmp_path):
    """Byte offsets cut UTF-16 in the middle of a character: such a file is not planned in parts, its UTF-8 copy is."""
    log = user_log().head(50)
    utf8, utf16 = tmp_path / "log8.csv", tmp_path / "log16.csv"
    log.to_csv(utf8, index=False)
    log.to_csv(utf16, index=False, encoding="utf-16")
    columns = config("data.source=file").data.columns
    assert isinstance(partitions.log_source(utf8, columns), partitions.Source)
    assert partitions.log_source(utf16, columns) is None
