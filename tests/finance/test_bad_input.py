"""Bad files and options a new user gives `usecases run finance --preset smoke --data FILE`: each one is refused
before any run starts, in one `error:` line naming the file, row, column or config key.

Rows are counted as the README says: 1 is the first data row (the line after the header), in the file's own order.
The base file is date-major (every ticker on a day, then the next day), so row 2k-1 is SYN000 and row 2k is SYN001.
"""

import gzip
import zipfile

import pandas as pd
import pytest

from tests.cli_helpers import assert_rejected
from usecases.finance.config import Data, Synthetic
from usecases.finance.data import load_file, synthetic_panel

CASES = []


@pytest.fixture(scope="module")
def good() -> pd.DataFrame:
    """Two tickers × 400 business days from 2000-01-03, dates as text: a file the smoke preset accepts (its last 30%
    tested, 280 days of history before)."""
    frame = synthetic_panel(Synthetic(tickers=2, days=400, seed=1)).frame
    frame = frame.sort_values(["date", "ticker"], kind="stable").reset_index(drop=True)
    return frame.assign(date=frame["date"].dt.strftime("%Y-%m-%d"))


def case(*names: str, args: tuple[str, ...] = ()):
    """Register `make(folder, good) -> path` as a bad input whose error line must contain each of `names`."""
    def register(make):
        CASES.append(pytest.param(make, args, names, id=make.__name__))
        return make
    return register


def csv(folder, frame, name="prices.csv", **options):
    path = folder / name
    frame.to_csv(path, index=False, **options)
    return path


def parquet(folder, frame, name="prices.parquet"):
    path = folder / name
    frame.to_parquet(path, index=False)
    return path


def changed(frame, row, column, value):
    """The frame with the value of one file row (1 = the first data row) replaced."""
    copy = frame.astype({column: object})
    copy.loc[row - 1, column] = value
    return copy


def flat(frame, ticker, rows):
    """`ticker`'s prices all 100 on the rows selected by `rows`, a mask over the frame's index."""
    copy = frame.copy()
    copy.loc[(copy["ticker"] == ticker) & rows, ["open", "high", "low", "close"]] = 100.0
    return copy


@case("prices.csv", "ticker 'SYN000'", "close", "expected prices that move")
def constant_prices(folder, good):
    """Was an IndexError in training_window, with a traceback."""
    return csv(folder, good.assign(open=100.0, high=100.0, low=100.0, close=100.0))


@case("prices.csv", "expected a comma-separated file")
def empty_file(folder, good):
    path = folder / "prices.csv"
    path.write_bytes(b"")
    return path


@case("exports", "is a folder")
def folder_without_data(folder, good):
    (folder / "exports").mkdir()
    return folder / "exports"


@case("prices.csv", "not UTF-8", "byte 0x00 at position 0")
def binary_garbage(folder, good):
    path = folder / "prices.csv"
    path.write_bytes(bytes(range(256)) * 20)
    return path


@case("prices.csv", "line 6", "line 1 is the header")
def a_row_with_an_extra_field(folder, good):
    path = csv(folder, good)
    lines = path.read_text().splitlines()
    lines[5] += ",1"
    path.write_text("\n".join(lines) + "\n")
    return path


@case("prices.csv", "Excel workbook", "expected comma-separated text")
def excel_workbook_renamed_to_csv(folder, good):
    path = folder / "prices.csv"
    with zipfile.ZipFile(path, "w") as workbook:
        workbook.writestr("xl/workbook.xml", "<workbook/>")
    return path


@case("prices.csv", "gzip-compressed", ".csv.gz")
def gzip_file_without_gz_suffix(folder, good):
    path = folder / "prices.csv"
    path.write_bytes(gzip.compress(good.to_csv(index=False).encode()))
    return path


@case("prices.csv.gz", "Not a gzipped file", "expected a comma-separated file")
def plain_text_named_gz(folder, good):
    path = folder / "prices.csv.gz"
    path.write_text(good.to_csv(index=False))
    return path


@case("prices.csv.gz", "column 'low', row 31", "expected a number, got 'x'")
def gzip_csv_with_a_bad_value(folder, good):
    return csv(folder, changed(good, 31, "low", "x"), "prices.csv.gz")


@case("prices.csv", "separated by ';'", "expected comma-separated columns")
def semicolon_separated(folder, good):
    return csv(folder, good, sep=";")


@case("prices.csv", "not UTF-8", "byte 0xc9")
def latin1_encoded(folder, good):
    return csv(folder, good.assign(ticker=good["ticker"].str.replace("SYN000", "SOCIÉTÉ")), encoding="latin-1")


@case("prices.csv", "missing column 'date'", "--set data.columns.date=Date", "--set data.columns.close=Close")
def capitalised_header(folder, good):
    return csv(folder, good.rename(columns=str.capitalize))


@case("prices.csv", "missing column 'ticker'", "--set data.columns.ticker=Ticker")
def ticker_column_in_another_case(folder, good):
    """Was read as one series named after the file, then refused for dates repeated in it."""
    return csv(folder, good.rename(columns={"ticker": "Ticker"}))


@case("prices.csv", "missing column 'date'", "' date'", "--set 'data.columns.date= date'")
def header_with_spaces(folder, good):
    return csv(folder, good.rename(columns=lambda name: f" {name}"))


@case("prices.csv", "missing column 'Adj Close'", "data.columns.close", args=("--set", "data.columns.close=Adj Close"))
def close_option_names_no_column(folder, good):
    return csv(folder, good)


@case("prices.csv", "missing column 'Symbol'", "data.columns.ticker", args=("--set", "data.columns.ticker=Symbol"))
def ticker_option_names_no_column(folder, good):
    """Was silently ignored: one series named after the file."""
    return csv(folder, good)


@case("prices.csv", "data.columns.high and data.columns.low", "same column 'low'",
      args=("--set", "data.columns.high=low"))
def two_options_name_one_column(folder, good):
    return csv(folder, good)


@case("prices.csv", "column 'ticker', row 9", "missing ticker")
def a_row_without_its_ticker(folder, good):
    """Was dropped by the grouping, and the run finished."""
    return csv(folder, changed(good, 9, "ticker", None))


@case("prices.parquet", "column 'high', row 11", "expected a number, got 'n/a?'")
def parquet_prices_stored_as_text(folder, good):
    return parquet(folder, changed(good.astype({"high": str}), 11, "high", "n/a?"))


@case("prices.parquet", "column 'low', row 14", "prices must be positive", "-3.5")
def parquet_negative_low(folder, good):
    return parquet(folder, changed(good, 14, "low", -3.5).astype({"low": float}))


@case("prices.csv", "column 'volume', row 6", "expected a volume of at least 0")
def negative_volume(folder, good):
    """Was accepted."""
    return csv(folder, changed(good, 6, "volume", -100))


@case("prices.parquet", "column 'volume'", "true/false")
def parquet_boolean_volume(folder, good):
    """Was accepted, True read as 1."""
    return parquet(folder, good.assign(volume=True))


@case("prices.parquet", "column 'date', row 1", "946857600000000000", "20160128")
def parquet_dates_as_epoch_nanoseconds(folder, good):
    """Integers are YYYYMMDD, as in a CSV file; nanoseconds since 1970 were accepted (and YYYYMMDD read as them)."""
    return parquet(folder, good.assign(date=pd.to_datetime(good["date"]).astype("datetime64[ns]").astype("int64")))


@case("prices.parquet", "column 'date', row 1", "date 1800-", "outside 1900-01-01")
def parquet_yyyymmdd_before_1900(folder, good):
    dates = pd.to_datetime(good["date"]) - pd.Timedelta(weeks=52 * 200)
    return parquet(folder, good.assign(date=dates.dt.strftime("%Y%m%d").astype(int)))


@case("prices.csv", "column 'date', row 800", "2999-01-04", "expected the day of each row's prices")
def a_date_in_the_future(folder, good):
    return csv(folder, changed(good, 800, "date", "2999-01-04"))


@case("prices.csv", "column 'date', row 21", "another time zone than row 1's", "expected dates in one time zone")
def mixed_time_zones(folder, good):
    """Was a traceback from pandas ("Mixed timezones detected")."""
    offsets = ["+00:00"] * 20 + ["-05:00"] * (len(good) - 20)
    return csv(folder, good.assign(date=good["date"] + "T00:00:00" + pd.Series(offsets)))


@case("prices.csv", "column 'date', row 5", "appears twice for ticker 'SYN000'", "one row per day")
def two_bars_on_one_day(folder, good):
    """Was accepted: times of day made the rows distinct."""
    times = good["date"] + " 16:00"
    return csv(folder, good.assign(date=times.where(good.index != 4, good.loc[0, "date"] + " 10:30")))


@case("prices.csv", "column 'date', row 50", "cannot read 'date' as a date")
def header_repeated_inside(folder, good):
    """Two exports pasted into one file."""
    path = csv(folder, good)
    lines = path.read_text().splitlines()
    lines.insert(50, lines[0])
    path.write_text("\n".join(lines) + "\n")
    return path


@case("prices.parquet", "cannot be read as Parquet", "expected a Parquet file")
def truncated_parquet(folder, good):
    path = parquet(folder, good)
    path.write_bytes(path.read_bytes()[:2000])
    return path


@case("prices.csv", "ticker 'SYN001'", "only 18 days before the test window", "evaluation.test_fraction")
def one_ticker_with_too_few_days(folder, good):
    """Named no file before."""
    return csv(folder, good[(good["ticker"] == "SYN000") | (good.index >= 520)])


@case("prices.csv", "evaluation.test_start", "no trading days between 2030-01-01",
      args=("--set", "evaluation.test_start=2030-01-01"))
def window_starting_after_the_data_ends(folder, good):
    return csv(folder, good)


@case("prices.csv", "ticker 'SYN001'", "close never changes before the test window")
def flat_before_the_test_window(folder, good):
    """Was a finished run with GARCH fitted on zeros (QLIKE over 1000) and a registered champion."""
    return csv(folder, flat(good, "SYN001", good.index < 600))


@case("prices.csv", "ticker 'SYN001'", "close never changes in the test window")
def flat_in_the_test_window(folder, good):
    """Was a finished run scored on nothing (NaN metrics)."""
    return csv(folder, flat(good, "SYN001", good.index >= 540))


@case("prices.csv", "ticker 'SYN000'", "high equals its low on every day", "expected a daily range")
def closing_prices_only(folder, good):
    """High and Low filled with the close: no range to measure variance by."""
    return csv(folder, good.assign(high=good["close"], low=good["close"], open=good["close"]))


@case("prices.csv", "evaluation.horizon=300", "0 training and 0 validation pairs",
      args=("--set", "evaluation.horizon=300"))
def horizon_longer_than_the_history(folder, good):
    """Was an IndexError in training_window, with a traceback."""
    return csv(folder, good)


@case("prices.csv", "data.exogenous=wti", "no value", "2021", args=("--set", "data.exogenous=[wti]"))
def exogenous_input_without_a_value_on_these_dates(folder, good):
    """arch's WTI ends in 2019: it was a constant input the model learned nothing from."""
    return csv(folder, good.assign(date=(pd.to_datetime(good["date"]) + pd.Timedelta(weeks=52 * 22)).astype(str)))


@case("config key 'evaluation.test_fraction'", "less than 1", args=("--set", "evaluation.test_fraction=1.5"))
def fraction_tested_above_one(folder, good):
    return csv(folder, good)


@case("config key 'train.epochs'", "greater than or equal to 1", args=("--set", "train.epochs=-5"))
def negative_epochs(folder, good):
    return csv(folder, good)


@case("config key 'baselines.models.1'", "'lstm'", args=("--set", "baselines.models=[har,lstm]"))
def unknown_baseline_model(folder, good):
    return csv(folder, good)


@case("config key 'data.max_fill_gap'", "-1", args=("--set", "data.max_fill_gap=-1"))
def negative_fill_gap(folder, good):
    return csv(folder, good)


@pytest.mark.parametrize(("make", "args", "names"), CASES)
def test_a_bad_input_is_refused_in_one_line_before_the_run(capsys, tmp_path, good, make, args, names):
    path = make(tmp_path, good)
    assert_rejected(capsys, "finance", "run", "finance", "--preset", "smoke", "--data", str(path), *args,
                    names=names)


def test_the_base_file_passes_every_check(tmp_path, good):
    """So that each case above is refused for its own change."""
    from common.config import load_config
    from usecases import finance
    from usecases.finance.pipeline import load_data

    config = load_config(finance.Config, finance.USECASE.presets_dir, "smoke")
    prepared, tags = load_data(config, csv(tmp_path, good))
    assert prepared.panel.tickers == ["SYN000", "SYN001"] and prepared.test.sum() > 200


@pytest.mark.parametrize("spelling", [
    pytest.param(lambda good: good.assign(date=good["date"].str.replace("-", "").astype(int)), id="parquet-yyyymmdd"),
    pytest.param(lambda good: good.assign(date=good["date"].str.replace("-", "").astype(float)), id="parquet-float"),
    pytest.param(lambda good: good.assign(date=pd.to_datetime(good["date"]).dt.date), id="parquet-date32"),
    pytest.param(lambda good: good.assign(date=pd.to_datetime(good["date"]).dt.tz_localize("Asia/Tokyo")),
                 id="parquet-tz-aware"),
])
def test_parquet_dates_read_as_the_same_days_as_in_csv(tmp_path, good, spelling):
    """YYYYMMDD integers were read as nanoseconds since 1970: the run finished with forecasts dated 1970."""
    expected = load_file(csv(tmp_path, good), Data()).frame
    frame = load_file(parquet(tmp_path, spelling(good)), Data()).frame
    pd.testing.assert_series_equal(frame["date"].astype("datetime64[ns]"), expected["date"].astype("datetime64[ns]"))
    pd.testing.assert_frame_equal(frame.drop(columns="date"), expected.drop(columns="date"))


def test_iso_dates_with_one_time_zone_keep_the_day_as_written(tmp_path, good):
    """Was a traceback: tz-aware dates cannot be compared with the test window's dates."""
    expected = load_file(csv(tmp_path, good), Data()).frame["date"]
    frame = load_file(csv(tmp_path, good.assign(date=good["date"] + "T00:00:00-05:00"), "offsets.csv"), Data()).frame
    assert (frame["date"].astype("datetime64[ns]") == expected.astype("datetime64[ns]")).all()
