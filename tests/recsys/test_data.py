"""Reading MovieLens and interaction logs, filtering, encoding and splitting; every bad input fails with one line
naming the file, column or config key. No test touches the network."""

from __future__ import annotations

import hashlib
import io
import os
import urllib.error
import zipfile
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp
from scipy.stats import spearmanr

from common.errors import DataUnavailable, UserError
from usecases.recsys import movielens
from usecases.recsys.config import Config, Data, Synthetic
from usecases.recsys.data import load_interactions
from usecases.recsys.ranking import UNKNOWN
from usecases.recsys.logs import read_log
from usecases.recsys.movielens import read_movielens
from usecases.recsys.pipeline import INTERACTION_BYTES, load_data
from usecases.recsys.preprocess import (drop_unrankable, encode, filter_interactions, k_core, split_leave_last_out,
                                        split_random, split_sizes, split_temporal)
from usecases.recsys.synthetic import draw_by_popularity, guide_table, synthetic_log

SHARED_MOVIELENS = Path(__file__).resolve().parents[3] / "shared" / "data" / "movielens" / "ml-latest-small"
RATIOS = [0.8, 0.1, 0.1]

# three users, four items; (user, item, rating, timestamp) as every MovieLens layout holds them
RATINGS = [(1, 10, 4, 100), (1, 20, 3, 200), (1, 30, 5, 300), (2, 10, 2, 150), (2, 40, 5, 250), (3, 20, 1, 120)]
TITLES = {10: "Amélie (2001)", 20: "Star Wars: Episode IV - A New Hope (1977)", 30: "American President, The (1995)",
          40: "Heat (1995)"}

LOG = """user_id,item_id,rating,timestamp
u1,i1,5,2021-01-01
u1,i2,3,2021-01-02
u2,i1,4,2021-01-03
u2,i3,1,2021-01-04
"""


def make_config(**overrides) -> Config:
    return Config.model_validate(overrides)


def write(tmp_path: Path, text: str, name: str = "log.csv") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def log_error(tmp_path: Path, text: str, **overrides) -> str:
    with pytest.raises(UserError) as caught:
        load_interactions(make_config(split="random", **overrides), write(tmp_path, text))
    message = str(caught.value)
    assert "\n" not in message and "log.csv" in message
    return message


def ml100k(folder: Path) -> None:
    folder.mkdir()
    (folder / "u.data").write_text("".join(f"{u}\t{i}\t{r}\t{t}\n" for u, i, r, t in RATINGS))
    (folder / "u.item").write_bytes("".join(f"{i}|{title}|01-Jan-1995||http://x|0|1\n"
                                            for i, title in TITLES.items()).encode("latin-1"))


def ml1m(folder: Path) -> None:
    folder.mkdir()
    (folder / "ratings.dat").write_text("".join(f"{u}::{i}::{r}::{t}\n" for u, i, r, t in RATINGS))
    (folder / "movies.dat").write_bytes("".join(f"{i}::{title}::Drama\n" for i, title in TITLES.items())
                                        .encode("latin-1"))


def ml_csv(folder: Path) -> None:
    folder.mkdir()
    ratings = "userId,movieId,rating,timestamp\r\n" + "".join(f"{u},{i},{r}.0,{t}\r\n" for u, i, r, t in RATINGS)
    movies = "movieId,title,genres\r\n" + "".join(f'{i},"{title}",Drama|Comedy\r\n' for i, title in TITLES.items())
    (folder / "ratings.csv").write_bytes(ratings.encode())
    (folder / "movies.csv").write_bytes(movies.encode())


@pytest.mark.parametrize("layout", [ml100k, ml1m, ml_csv], ids=["ml-100k", "ml-1m", "ratings.csv"])
def test_each_movielens_layout_reads_ratings_and_titles_aligned_with_codes(tmp_path, layout):
    folder = tmp_path / "ml-test"
    layout(folder)
    raw = read_movielens(folder)
    assert list(raw.frame.itertuples(index=False, name=None)) == [(u, i, float(r), t) for u, i, r, t in RATINGS]
    assert raw.source == "movielens:ml-test" and len(raw.sha256) == 64 and raw.has_timestamps
    data = load_interactions(make_config(split="leave_last_out"), folder)
    assert list(data.item_ids) == [-1, 10, 20, 30, 40] and list(data.user_ids) == [-1, 1, 2, 3]
    assert list(data.titles) == [""] + [TITLES[item] for item in data.item_ids[1:]]
    assert UNKNOWN == 0 and data.n_items == 5


def test_movielens_without_titles_has_none(tmp_path):
    folder = tmp_path / "ml-100k"
    ml100k(folder)
    (folder / "u.item").unlink()
    assert load_interactions(make_config(split="random"), folder).titles is None


def test_a_folder_that_is_not_movielens(tmp_path):
    with pytest.raises(UserError, match="not a MovieLens folder"):
        load_interactions(make_config(), tmp_path)


@pytest.mark.skipif(not SHARED_MOVIELENS.is_dir(), reason="no development copy of ml-latest-small in ../shared")
def test_the_shared_ml_latest_small():
    data = load_interactions(make_config(split="random"), SHARED_MOVIELENS)
    assert (data.n_users - 1, data.n_items - 1) == (610, 9724)
    assert len(data.train) + len(data.val) + len(data.test) == 100836, "every user has >= 20 ratings: none dropped"
    assert data.titles[data.item_ids == 1][0] == "Toy Story (1995)"


def cached_movielens(tmp_path, monkeypatch, **settings) -> Config:
    """A config whose cache is empty, with only an empty mirror folder to fall back on."""
    monkeypatch.setenv("USECASES_DATA_PATH", str(tmp_path / "mirror"))
    return make_config(split="random", data={"movielens": {"cache_dir": str(tmp_path / "cache"), **settings}})


def test_movielens_is_read_from_a_mirror_folder_after_the_cache(tmp_path, monkeypatch):
    mirror = tmp_path / "mirror" / "movielens"
    mirror.mkdir(parents=True)
    ml_csv(mirror / "ml-latest-small")
    monkeypatch.setenv("USECASES_DATA_PATH", os.pathsep.join([str(tmp_path / "absent"), str(tmp_path / "mirror")]))
    config = make_config(split="random", data={"movielens": {"cache_dir": str(tmp_path / "cache"), "download": False}})
    data = load_interactions(config, None)
    assert data.source == "movielens:ml-latest-small" and data.n_users == 4
    assert not (tmp_path / "cache").exists(), "a mirror is read in place"
    (tmp_path / "cache").mkdir()
    ml100k(tmp_path / "cache" / "ml-latest-small")
    assert load_interactions(config, None).sha256 != data.sha256, "the cache comes first"


def test_movielens_offline_is_data_unavailable_naming_folder_and_url(tmp_path, monkeypatch):
    def offline(url, timeout):
        raise urllib.error.URLError("no network")

    monkeypatch.setattr(movielens.urllib.request, "urlopen", offline)
    with pytest.raises(DataUnavailable) as caught:
        load_interactions(cached_movielens(tmp_path, monkeypatch), None)
    message = str(caught.value)
    assert "\n" not in message and str(tmp_path / "cache") in message
    assert "https://files.grouplens.org/datasets/movielens/ml-latest-small.zip" in message
    assert "mirror folder in $USECASES_DATA_PATH" in message
    with pytest.raises(DataUnavailable, match="download is off"):
        load_interactions(cached_movielens(tmp_path, monkeypatch, download=False), None)


def serve(monkeypatch, files: dict[str, bytes]) -> None:
    monkeypatch.setattr(movielens.urllib.request, "urlopen", lambda url, timeout: io.BytesIO(files[url]))


def zipped_ml_csv(tmp_path) -> bytes:
    ml_csv(tmp_path / "source")
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for path in (tmp_path / "source").iterdir():
            archive.write(path, f"ml-latest-small/{path.name}")
    return buffer.getvalue()


def test_movielens_download_is_checked_against_the_published_md5_and_cached(tmp_path, monkeypatch):
    archive = zipped_ml_csv(tmp_path)
    url = "https://files.grouplens.org/datasets/movielens/ml-latest-small.zip"
    serve(monkeypatch, {url: archive, f"{url}.md5": f"MD5 (ml-latest-small.zip) = {'0' * 32}\n".encode()})
    with pytest.raises(UserError, match="does not match GroupLens's MD5"):
        load_interactions(cached_movielens(tmp_path, monkeypatch), None)
    digest = hashlib.md5(archive).hexdigest()
    serve(monkeypatch, {url: archive, f"{url}.md5": f"MD5 (ml-latest-small.zip) = {digest}\n".encode()})
    data = load_interactions(cached_movielens(tmp_path, monkeypatch), None)
    assert data.source == "movielens:ml-latest-small" and data.n_users == 4
    assert sorted(path.name for path in (tmp_path / "cache").iterdir()) == ["ml-latest-small"]
    serve(monkeypatch, {})
    assert load_interactions(cached_movielens(tmp_path, monkeypatch), None).sha256 == data.sha256, "from the cache"


def test_a_log_with_text_ids_dates_and_titles(tmp_path):
    path = tmp_path / "log.parquet"
    text = LOG + "u1,i3,2,2021-01-05\n"  # a third interaction of u1: one each for train, val and test
    pd.read_csv(io.StringIO(text)).assign(name=lambda frame: frame["item_id"].str.upper()).to_parquet(path)
    data = load_interactions(make_config(data={"columns": {"title": "name"}}, split="random"), path)
    assert list(data.user_ids) == [None, "u1", "u2"] and list(data.titles) == ["", "I1", "I2", "I3"]
    assert data.source == "file:log.parquet"
    days = [1609459200 + day * 86400 for day in range(5)]
    assert list(read_log(path, Data().columns).frame["timestamp"]) == days
    pd.read_csv(io.StringIO(text), parse_dates=["timestamp"]).to_parquet(path)
    assert list(read_log(path, Data().columns).frame["timestamp"]) == days


def test_a_utf16_log_reads_as_its_utf8_twin(tmp_path):
    expected = read_log(write(tmp_path, LOG), Data().columns).frame
    path = tmp_path / "unicode.csv"
    path.write_bytes(LOG.encode("utf-16"))
    pd.testing.assert_frame_equal(read_log(path, Data().columns).frame, expected)


def test_a_bad_value_names_its_row_and_line(tmp_path):
    message = log_error(tmp_path, LOG.replace("u2,i1,4,", "u2,i1,four,"))
    assert "column 'rating', row 3: expected a number, got 'four' (line 4 of the file;" in message


def test_a_log_without_optional_columns(tmp_path):
    raw = read_log(write(tmp_path, "user_id,item_id\n1,7\n2,7\n"), Data().columns)
    assert raw.frame["rating"].isna().all() and (raw.frame["timestamp"] == 0).all() and not raw.has_timestamps
    assert raw.frame["user"].dtype == np.int64


def test_missing_user_column_names_column_and_file(tmp_path):
    message = log_error(tmp_path, LOG.replace("user_id", "customer"))
    assert "missing column 'user_id'" in message and "customer" in message and "data.columns.user" in message


def test_unparsable_timestamp_names_column_row_and_value(tmp_path):
    assert "column 'timestamp', row 3: cannot read 'someday'" in log_error(tmp_path, LOG.replace("2021-01-03",
                                                                                                 "someday"))
    numeric = "user_id,item_id,timestamp\n1,1,100\n1,2,200\n2,1,later\n"
    assert "column 'timestamp', row 3: cannot read 'later'" in log_error(tmp_path, numeric)


def test_duplicated_header_row(tmp_path):
    text = LOG + LOG.splitlines()[0] + "\nu3,i1,5,2021-01-05\n"
    assert "duplicated header at row 5" in log_error(tmp_path, text)
    assert "duplicated header at row 2" in log_error(tmp_path, "user_id,item_id\n1,2\nuser_id,item_id\n3,4\n")


def test_non_numeric_rating_and_empty_files(tmp_path):
    assert "column 'rating', row 2: expected a number, got 'good'" in log_error(tmp_path, LOG.replace(",3,", ",good,"))
    assert "no data rows" in log_error(tmp_path, "")
    assert "no data rows" in log_error(tmp_path, LOG.splitlines()[0] + "\n")


def test_nothing_left_after_filtering_names_the_filters(tmp_path):
    message = log_error(tmp_path, LOG, data={"rating_threshold": 4.5, "min_user_interactions": 10})
    assert ("nothing left after data.rating_threshold=4.5 and the k-core filter (data.min_user_interactions=10"
            in message)


def test_bad_config_combinations(tmp_path):
    path = write(tmp_path, "user_id,item_id\n1,7\n2,7\n")
    with pytest.raises(UserError, match=r"split=temporal needs a timestamp column \(data.columns.timestamp\)"):
        load_interactions(make_config(split="temporal"), path)
    with pytest.raises(UserError, match="split_ratios"):
        load_interactions(make_config(split="random", split_ratios=[0.8, 0.1, 0.2]), path)
    with pytest.raises(UserError, match="data.rating_threshold=4.0 needs ratings"):
        load_interactions(make_config(split="random", data={"rating_threshold": 4}), path)
    with pytest.raises(UserError, match="data.source=file needs --data PATH"):
        load_interactions(make_config(data={"source": "file"}), None)


@pytest.fixture(scope="module")
def log_frame() -> pd.DataFrame:
    """A filtered, encoded synthetic log with many timestamp ties and uneven users."""
    frame = synthetic_log(Synthetic(users=300, items=400, interactions_per_user=30, seed=3)).frame
    frame = frame[frame["item"] % 7 != frame["user"] % 5]  # users of different sizes
    frame = frame.assign(timestamp=frame["timestamp"] // 86_400)  # whole days: ties at the cuts
    return encode(filter_interactions(frame, Data()))[0]


def train_pairs(train: pd.DataFrame) -> set[tuple[int, int]]:
    return set(zip(train["user"], train["item"]))


@pytest.mark.parametrize("split", ["temporal", "random", "leave_last_out"])
def test_no_val_or_test_pair_is_in_its_users_training_set(split):
    config = make_config(split=split, data={"source": "synthetic", "synthetic": {"users": 100, "items": 200}})
    data = load_interactions(config, None)
    seen = train_pairs(data.train)
    for frame in (data.val, data.test):
        assert len(frame) and not seen & set(zip(frame["user"], frame["item"]))
        assert frame["user"].isin(data.train["user"]).all()


def test_temporal_split_is_one_cut_in_time_with_ties_in_the_later_split(log_frame):
    train, val, test = split_temporal(log_frame, RATIOS)
    assert train["timestamp"].max() < val["timestamp"].min() <= val["timestamp"].max() < test["timestamp"].min()
    assert len(train) + len(val) + len(test) == len(log_frame)
    assert abs(len(train) / len(log_frame) - 0.8) < 0.02
    tied = pd.DataFrame({"user": [1, 1, 1, 1, 1], "item": [1, 2, 3, 4, 5], "timestamp": [1, 2, 3, 3, 3]})
    assert [len(part) for part in split_temporal(tied, [0.6, 0.2, 0.2])] == [2, 0, 3]


def recbole_split_ids(total: int, ratios: list[float]) -> list[int]:
    """RecBole's `Dataset._calcu_split_ids`, transcribed as the oracle for the vectorised version."""
    cnt = [int(ratios[i] * total) for i in range(len(ratios))]
    cnt[0] = total - sum(cnt[1:])
    for i in range(1, len(ratios)):
        if cnt[0] <= 1:
            break
        if 0 < ratios[-i] * total < 1:
            cnt[-i] += 1
            cnt[0] -= 1
    return list(np.cumsum(cnt)[:-1])


def test_split_sizes_round_as_recbole_does():
    counts = np.arange(1, 200)
    for ratios in (RATIOS, [0.7, 0.2, 0.1], [0.6, 0.3, 0.1]):
        sizes = split_sizes(counts, ratios)
        assert [list(np.cumsum(row)[:-1]) for row in sizes] == [recbole_split_ids(n, ratios) for n in counts]


def test_random_split_is_8_1_1_per_user_and_seeded(log_frame):
    train, val, test = split_random(log_frame, RATIOS, seed=0)
    counts = log_frame.groupby("user").size()
    expected = split_sizes(counts.to_numpy(), RATIOS)
    for column, part in enumerate((train, val, test)):
        assert (part.groupby("user").size().reindex(counts.index, fill_value=0).to_numpy() == expected[:, column]).all()
    assert not train_pairs(train) & train_pairs(test)
    again = split_random(log_frame, RATIOS, seed=0)
    assert all(first.equals(second) for first, second in zip((train, val, test), again))
    assert not split_random(log_frame, RATIOS, seed=1)[2].equals(test)


def test_leave_last_out_holds_out_each_users_latest_two(log_frame):
    short = pd.DataFrame({"user": [10_000, 10_000], "item": [1, 2], "timestamp": [0, 1], "rating": np.nan})
    frame = pd.concat([log_frame, short], ignore_index=True)
    train, val, test = split_leave_last_out(frame)
    assert (val.groupby("user").size() == 1).all() and (test.groupby("user").size() == 1).all()
    assert set(val["user"]) == set(test["user"]) == set(log_frame["user"])
    assert (train["user"] == 10_000).sum() == 2
    ranked = frame.assign(order=np.arange(len(frame))).sort_values(["user", "timestamp", "order"])
    latest = ranked.groupby("user").tail(2).groupby("user")["item"].agg(list)
    assert all(latest[user] == [val_item, test_item] for user, val_item, test_item
               in zip(test["user"], val.set_index("user").loc[test["user"], "item"], test["item"]))


def test_users_without_training_interactions_leave_val_and_test():
    train = pd.DataFrame({"user": [1, 1], "item": [1, 2]})
    val = pd.DataFrame({"user": [1, 2, 1], "item": [3, 3, 2]})
    kept, _ = drop_unrankable(train, val, val.iloc[:0])
    assert list(zip(kept["user"], kept["item"])) == [(1, 3)]


def test_k_core_and_rating_threshold(log_frame):
    filtered = filter_interactions(log_frame, Data(min_user_interactions=15, min_item_interactions=15))
    assert len(filtered) and filtered.groupby("user").size().min() >= 15 and filtered.groupby("item").size().min() >= 15
    assert len(k_core(log_frame, 0, 0)) == len(log_frame)
    positives = filter_interactions(log_frame, Data(rating_threshold=4))
    assert positives["rating"].min() >= 4 and len(positives) == (log_frame["rating"] >= 4).sum()


def test_duplicate_pairs_keep_their_earliest_interaction():
    frame = pd.DataFrame({"user": [1, 1, 1], "item": [5, 5, 6], "rating": [5.0, 1.0, 3.0], "timestamp": [9, 2, 4]})
    kept = filter_interactions(frame, Data())
    assert list(zip(kept["item"], kept["timestamp"])) == [(5, 2), (6, 4)]


def test_synthetic_log_is_seeded_and_popularity_skewed():
    config = Synthetic(seed=4)
    first, second = synthetic_log(config), synthetic_log(config)
    assert first.frame.equals(second.frame) and first.sha256 == second.sha256
    assert not synthetic_log(Synthetic(seed=5)).frame.equals(first.frame)
    assert (first.frame.groupby("user")["item"].nunique() == config.interactions_per_user).all()
    counts = first.frame["item"].value_counts()
    assert counts.iloc[:config.items // 10].sum() > 0.3 * len(first.frame), "the top 10% items hold a large share"
    assert first.frame["rating"].between(1, 5).all()


@pytest.mark.parametrize("items", [1, 7, 5_000])
def test_the_popularity_draw_finds_the_items_a_binary_search_finds(items):
    """The guide table's search against numpy's, on a Zipf law with items of no mass (repeated sums) and the edges."""
    rng = np.random.default_rng(items)
    mass = rng.pareto(1.0, items) * (rng.random(items) < 0.8)
    mass[0] += 1.0  # some mass
    cdf = mass.cumsum() / mass.sum()
    cdf[-1] = 1.0
    guide = guide_table(cdf)
    edges = np.arange(len(guide)) / len(guide)
    uniform = np.concatenate([rng.random(20_000), [0.0, np.nextafter(1.0, 0.0)], cdf[:-1], edges])
    drawn = draw_by_popularity(cdf, guide, uniform.reshape(1, -1))
    assert drawn.shape == (1, len(uniform)) and (drawn[0] == cdf.searchsorted(uniform, side="right")).all()


def test_synthetic_split_is_learnable():
    data = load_interactions(make_config(data={"source": "synthetic"}), None)
    train, test = data.matrix("train"), data.matrix("test")
    correlation = spearmanr(np.asarray(train.sum(axis=0)).ravel(), np.asarray(test.sum(axis=0)).ravel())[0]
    assert correlation > 0.5, "popular items stay popular"
    norms = np.sqrt(np.asarray(train.sum(axis=0)).ravel())
    scaled = train @ sp.diags(1 / np.maximum(norms, 1))
    similarity = (scaled.T @ scaled).toarray()
    np.fill_diagonal(similarity, 0)
    profile = train.toarray() / np.maximum(np.asarray(train.sum(axis=1)), 1)
    users, items = test.nonzero()
    held_out = (profile[users] * similarity[items]).sum(axis=1)
    random_items = np.random.default_rng(0).integers(1, data.n_items, len(items))
    at_random = (profile[users] * similarity[random_items]).sum(axis=1)
    assert held_out.mean() > 1.5 * at_random.mean(), "a user's test items resemble its training items"


def test_data_bytes_of_a_movielens_folder_count_the_files_read_and_samples_every_split(tmp_path):
    folder = tmp_path / "ml-test"
    folder.mkdir()
    ratings = "".join(f"{user},{(user + k) % 24 + 1},4.0,{user * 100 + k}\n" for user in range(15) for k in range(12))
    (folder / "ratings.csv").write_text("userId,movieId,rating,timestamp\n" + ratings)
    titles = "".join(f"{item},Film {item},Drama\n" for item in range(1, 25))
    (folder / "movies.csv").write_text("movieId,title,genres\n" + titles)
    (folder / "README.txt").write_bytes(b"x" * 5000)  # not read
    _, tags = load_data(make_config(split="random"), folder)
    assert tags["data_bytes"] == (folder / "ratings.csv").stat().st_size + (folder / "movies.csv").stat().st_size
    splits = sum(tags[f"data_{split}_interactions"] for split in ("train", "val", "test"))
    assert tags["data_samples"] == splits and 15 * 12 * 0.8 < splits <= 15 * 12


def test_data_bytes_of_a_log_file_is_its_size_and_of_a_synthetic_log_its_frames(tmp_path):
    config = make_config(split="random", data={"source": "synthetic",
                                               "synthetic": {"users": 50, "items": 40, "interactions_per_user": 10}})
    data, tags = load_data(config, None)
    frames = [data.train, data.val, data.test]
    assert tags["data_samples"] == sum(map(len, frames)) > 400
    assert tags["data_bytes"] == tags["data_samples"] * INTERACTION_BYTES == sum(
        frame.memory_usage(deep=True, index=False).sum() for frame in frames)
    path = tmp_path / "log.csv"
    pd.concat(frames).to_csv(path, index=False, header=["user_id", "item_id", "rating", "timestamp"])
    _, tags = load_data(make_config(split="random"), path)
    assert tags["data_bytes"] == path.stat().st_size
