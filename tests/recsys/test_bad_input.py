"""Bad input as a new user gives it: `usecases run recsys --preset smoke --data PATH [--set ...]` must exit 2 with
one `error:` line naming the file, the row, the column or the config key, and leave no run behind. Each case is
one file (or folder) and the options that go with it; the reading details are unit-tested in test_data.py."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from common.config import load_config
from tests.cli_helpers import assert_rejected
from usecases.recsys import USECASE
from usecases.recsys.config import Config
from usecases.recsys.data import load_interactions

DAY = 86_400
START = 1_600_000_000  # Unix seconds, September 2020


def interactions(users: int = 8, per_user: int = 4) -> pd.DataFrame:
    """A valid log: each user rates `per_user` distinct items, one a day, every user on the same days."""
    rows = [(user, (user * per_user + step) % 25 + 1, 1 + (user + step) % 5, START + (step * users + user) * DAY)
            for user in range(1, users + 1) for step in range(per_user)]
    return pd.DataFrame(rows, columns=["user_id", "item_id", "rating", "timestamp"])


def csv(frame: pd.DataFrame, cells: dict[tuple[int, str], str] | None = None) -> str:
    """The log as CSV text, with `cells` ({(row, column): text}, rows from 1 after the header) written in."""
    frame = frame.astype(object)
    for (row, column), text in (cells or {}).items():
        frame.loc[row - 1, column] = text
    return frame.to_csv(index=False)


def text_file(name: str, content: str | bytes):
    """A writer of one file; a name inside a folder (ml-100k/u.data) passes the folder as --data."""
    def write(folder: Path) -> Path:
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        return path.parent if "/" in name else path
    return write


def parquet(frame: pd.DataFrame):
    def write(folder: Path) -> Path:
        frame.to_parquet(folder / "log.parquet")
        return folder / "log.parquet"
    return write


def inserted(text: str, row: int, line: str) -> str:
    """`text` with `line` as its line number `row` (from 1)."""
    lines = text.splitlines(keepends=True)
    return "".join(lines[:row - 1] + [line] + lines[row - 1:])


GOOD = interactions()
LOG = csv(GOOD)
ML_CSV = "userId,movieId,rating,timestamp\n" + "".join(f"{u},{i},{r}.0,{t}\n" for u, i, r, t in GOOD.values)
U_DATA = "".join(f"{u}\t{i}\t{r}\t{t}\n" for u, i, r, t in GOOD.values)
RATINGS_DAT = "".join(f"{u}::{i}::{r}::{t}\n" for u, i, r, t in GOOD.values)
ONE_EACH = csv(interactions(users=12, per_user=1))  # one interaction per user: nothing to test on
LATECOMERS = pd.DataFrame({"user_id": [20, 21, 22, 23], "item_id": [1, 2, 3, 4], "rating": 3,
                           "timestamp": START + 100 * DAY + DAY * pd.RangeIndex(4)})  # after everyone else

CASES = [
    # the two reported failures, and their variants
    ("u.data, a text rating", text_file("ml-100k/u.data", inserted(U_DATA, 2, "1\t20\tgood\t200\n")), (),
     ("u.data", "row 2", "rating", "'good'", "no header")),
    ("one interaction per user, temporal", text_file("log.csv", ONE_EACH), (),
     ("log.csv", "split=temporal", "validation and test splits empty", "earlier one to train on", "the most is 1")),
    ("only new users after the cut in time", text_file("log.csv", csv(pd.concat([GOOD, LATECOMERS]))), (),
     ("log.csv", "split=temporal", "split=leave_last_out", "8 of the 12 users")),
    ("one interaction per user, random", text_file("log.csv", ONE_EACH), ("--set", "split=random"),
     ("log.csv", "split=random", "0 of the 12 users have 3 interactions", "the most is 1")),
    ("two per user, leave_last_out", text_file("log.csv", csv(interactions(per_user=2))),
     ("--set", "split=leave_last_out"), ("log.csv", "split=leave_last_out", "the most is 2")),
    ("Parquet, boolean timestamps", parquet(GOOD.assign(timestamp=GOOD["user_id"] % 2 == 0)), (),
     ("log.parquet", "column 'timestamp'", "bool")),
    # MovieLens folders
    ("ratings.csv, a rating out of range", text_file("ml-latest-small/ratings.csv",
                                                     inserted(ML_CSV, 6, "1,99,7.0,1600000000\n")), (),
     ("ratings.csv", "row 5", "rating", "0.5 to 5 stars", "after the header")),
    ("ratings.csv, no timestamp column", text_file("ml-latest-small/ratings.csv", ML_CSV.replace(",timestamp", ",t")),
     (), ("ratings.csv", "missing column 'timestamp'")),
    ("ratings.dat, a row of five fields", text_file("ml-1m/ratings.dat", inserted(RATINGS_DAT, 3, "3::4::5::6::7\n")),
     (), ("ratings.dat", "row 3", "4 fields", "'::'")),
    ("u.data, a text item id", text_file("ml-100k/u.data", inserted(U_DATA, 4, "4\tabc\t3\t500\n")), (),
     ("u.data", "row 4", "item id", "'abc'")),
    ("u.data, a missing rating", text_file("ml-100k/u.data", inserted(U_DATA, 9, "4\t7\t\t1600000000\n")), (),
     ("u.data", "row 9", "rating", "missing rating")),
    ("u.data, a negative timestamp", text_file("ml-100k/u.data", inserted(U_DATA, 2, "1\t20\t3\t-5\n")), (),
     ("u.data", "row 2", "timestamp", "before 1970")),
    ("u.data, an empty line", text_file("ml-100k/u.data", inserted(U_DATA, 7, "\n")), (), ("u.data", "row 7", "empty")),
    ("u.data with a header line", text_file("ml-100k/u.data", inserted(U_DATA, 1, "user\titem\trating\ttime\n")),
     (), ("u.data", "row 1", "user id", "no header")),
    ("a folder without a ratings file", text_file("downloads/movies.csv", "movieId,title\n1,Heat\n"), (),
     ("downloads", "not a MovieLens folder", "ratings.csv")),
    ("a MovieLens zip", text_file("ml-latest-small.zip", b"PK\x03\x04 not unzipped"), (),
     ("ml-latest-small.zip", "unzip")),
    ("MovieLens's ratings.csv given as a log", text_file("ratings.csv", ML_CSV), (),
     ("ratings.csv", "missing column 'user_id'", "pass its folder")),
    # the file itself
    ("a JSON log", text_file("log.json", GOOD.to_json()), (), ("log.json", ".csv", ".parquet")),
    ("binary garbage named .csv", text_file("log.csv", b"\x89PNG\r\n\x1a\n\x00\x00\rIHDR\xff\xfe"), (),
     ("log.csv", "not UTF-8")),
    ("garbage named .parquet", text_file("log.parquet", b"not a parquet file at all"), (),
     ("log.parquet", "cannot be read as Parquet")),
    ("Parquet without rows", parquet(GOOD.iloc[:0]), (), ("log.parquet", "no data rows")),
    ("separated by semicolons", text_file("log.csv", LOG.replace(",", ";")), (),
     ("log.csv", "separated by ';'", "expected comma-separated columns")),
    ("a header that names too few columns", text_file("log.csv", LOG.replace("user_id,", "", 1)), (),
     ("log.csv", "more values than the header")),
    ("one row with an extra field", text_file("log.csv", inserted(LOG, 6, "1,2,3,4,5\n")), (),
     ("log.csv", "line 6", "line 1 is the header")),
    # columns
    ("data.columns.item naming no column", text_file("log.csv", LOG), ("--set", "data.columns.item=product"),
     ("log.csv", "missing column 'product'", "data.columns.item")),
    ("data.columns.rating misspelt", text_file("log.csv", LOG), ("--set", "data.columns.rating=score"),
     ("log.csv", "missing column 'score'", "data.columns.rating", "=null")),
    ("user and item the same column", text_file("log.csv", LOG), ("--set", "data.columns.item=user_id"),
     ("log.csv", "data.columns.user", "data.columns.item", "'user_id'")),
    ("an empty user id", text_file("log.csv", csv(GOOD, {(3, "user_id"): ""})), (),
     ("log.csv", "column 'user_id'", "row 3", "missing id")),
    ("Parquet, a null item id", parquet(GOOD.assign(item_id=GOOD["item_id"].where(GOOD.index != 1))), (),
     ("log.parquet", "column 'item_id'", "row 2", "missing id", "rows counted from 1")),
    ("Parquet, fractional user ids", parquet(GOOD.assign(user_id=GOOD["user_id"] + 0.5)), (),
     ("log.parquet", "column 'user_id'", "row 1", "1.5")),
    ("Parquet, boolean item ids", parquet(GOOD.assign(item_id=GOOD["item_id"] > 5)), (),
     ("log.parquet", "column 'item_id'", "bool")),
    ("Parquet, dates as ratings", parquet(GOOD.assign(rating=pd.to_datetime(GOOD["timestamp"], unit="s"))), (),
     ("log.parquet", "column 'rating'", "numeric ratings")),
    ("Parquet, durations as timestamps", parquet(GOOD.assign(timestamp=pd.to_timedelta(GOOD["timestamp"], "s"))),
     (), ("log.parquet", "column 'timestamp'", "timedelta")),
    ("Parquet, a text timestamp", parquet(GOOD.assign(timestamp=["2021-03-04"] * 2 + ["soon"] + ["2021-03-05"] * 29)),
     (), ("log.parquet", "column 'timestamp'", "row 3", "'soon'")),
    ("a negative timestamp", text_file("log.csv", csv(GOOD, {(2, "timestamp"): "-86400"})), (),
     ("log.csv", "column 'timestamp'", "row 2", "before 1970")),
    ("an infinite rating", text_file("log.csv", csv(GOOD, {(4, "rating"): "inf"})), (),
     ("log.csv", "column 'rating'", "row 4")),
    # what is left to learn from
    ("every interaction by one user", text_file("log.csv", csv(GOOD.assign(user_id=7))), (),
     ("log.csv", "one user", "data.columns.user")),
    ("a catalogue of one item", text_file("log.csv", csv(GOOD.assign(item_id=3))), (),
     ("log.csv", "one item", "data.columns.item")),
    ("one interaction repeated", text_file("log.csv", csv(pd.concat([GOOD.iloc[:1]] * 30))), (),
     ("log.csv", "one user", "de-duplication")),
    ("every timestamp the same", text_file("log.csv", csv(GOOD.assign(timestamp=START))), (),
     ("log.csv", "split=temporal", "no training interactions", "earliest timestamp")),
    ("a k-core that drops everyone", text_file("log.csv", LOG), ("--set", "data.min_user_interactions=50"),
     ("log.csv", "data.min_user_interactions=50", "8 users with at most 4 interactions")),
    ("a threshold above every rating", text_file("log.csv", LOG), ("--set", "data.rating_threshold=6"),
     ("log.csv", "data.rating_threshold=6", "highest rating is 5")),
    # config values
    ("no test share", text_file("log.csv", LOG), ("--set", "split_ratios=[0.9,0.1,0]"),
     ("split_ratios", "between 0 and 1")),
    ("K of 0", text_file("log.csv", LOG), ("--set", "evaluation.ks=[10,0]"), ("evaluation.ks",)),
    ("K without 10", text_file("log.csv", LOG), ("--set", "evaluation.ks=[5]"), ("evaluation.ks", "10")),
    ("negative epochs", text_file("log.csv", LOG), ("--set", "bpr.epochs=-1"), ("bpr.epochs",)),
    ("a learning rate of 0", text_file("log.csv", LOG), ("--set", "lightgcn.lr=0"), ("lightgcn.lr",)),
    ("an embedding of size 0", text_file("log.csv", LOG), ("--set", "bpr.dim=0"), ("bpr.dim",)),
    ("an unknown split", text_file("log.csv", LOG), ("--set", "split=kfold"), ("split", "kfold")),
    ("no models", text_file("log.csv", LOG), ("--set", "models=[]"), ("models",)),
    ("a K beyond the catalogue", text_file("log.csv", LOG), ("--set", "evaluation.ks=[10,50]"),
     ("log.csv", "evaluation.ks", "top 50", "items")),
]


@pytest.mark.parametrize("write", [text_file("log.csv", LOG), parquet(GOOD), text_file("ml/u.data", U_DATA),
                                   text_file("ml/ratings.dat", RATINGS_DAT), text_file("ml/ratings.csv", ML_CSV)],
                         ids=["log.csv", "log.parquet", "u.data", "ratings.dat", "ratings.csv"])
def test_the_logs_the_cases_spoil_are_accepted(tmp_path, write):
    """So that each case below is refused for the one mistake it makes."""
    config = load_config(Config, USECASE.presets_dir, "smoke")
    data = load_interactions(config, write(tmp_path))
    assert data.n_users - 1 == 8 and data.n_items - 1 >= max(config.evaluation.ks) and len(data.test)


@pytest.mark.parametrize("write, options, names", [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_bad_input_is_one_line_naming_it(tmp_path, capsys, write, options, names):
    path = write(tmp_path)
    assert_rejected(capsys, "recsys", "run", "recsys", "--preset", "smoke", "--data", str(path), *options,
                    names=names)
