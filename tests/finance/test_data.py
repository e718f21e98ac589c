"""Loading the three data sources, and their data_bytes and data_samples tags; every bad file fails with one line
naming the file, column and row."""

import gzip
import io
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from common.config import load_config
from common.errors import UserError
from usecases import finance
from usecases.finance.config import Data, Synthetic
from usecases.finance.data import attach_exogenous, load_arch, load_file, load_panel, synthetic_panel
from usecases.finance.features import add_features
from usecases.finance.pipeline import load_data

GOOD = """date,ticker,open,high,low,close,volume
2020-01-02,AAA,10,11,9,10.5,100
2020-01-03,AAA,10.5,11.5,10,11,100
2020-01-06,AAA,11,12,10.5,11.5,100
2020-01-02,BBB,20,21,19,20.5,100
2020-01-03,BBB,20.5,21.5,20,21,100
"""


def write(tmp_path, text, name="prices.csv"):
    path = tmp_path / name
    path.write_text(text)
    return path


def error_for(tmp_path, text, config=None):
    with pytest.raises(UserError) as caught:
        load_file(write(tmp_path, text), config or Data())
    message = str(caught.value)
    assert "\n" not in message and "prices.csv" in message
    return message


def test_a_good_file_loads_sorted_with_its_checksum(tmp_path):
    panel = load_file(write(tmp_path, GOOD), Data())
    assert panel.tickers == ["AAA", "BBB"]
    assert len(panel.frame) == 5 and panel.source == "file:prices.csv" and len(panel.sha256) == 64


def test_a_csv_saved_by_excel_with_a_byte_order_mark_loads_as_without_it(tmp_path):
    """Excel's "CSV UTF-8" starts with the bytes EF BB BF, which must not stick to the first column's name as
    '\\ufeffdate' ("missing column 'date'", issue 19), compressed or not."""
    expected = load_file(write(tmp_path, GOOD), Data()).frame
    for name, compress in (("excel.csv", bytes), ("excel.csv.gz", gzip.compress)):
        path = tmp_path / name
        path.write_bytes(compress(b"\xef\xbb\xbf" + GOOD.replace("\n", "\r\n").encode()))
        pd.testing.assert_frame_equal(load_file(path, Data()).frame, expected)


def test_a_utf16_csv_loads_as_its_utf8_twin(tmp_path):
    """Excel and Windows tools save "Unicode" text as UTF-16 with a byte-order mark."""
    expected = load_file(write(tmp_path, GOOD), Data()).frame
    path = tmp_path / "unicode.csv"
    path.write_bytes(GOOD.encode("utf-16"))
    pd.testing.assert_frame_equal(load_file(path, Data()).frame, expected)


def test_a_bad_value_names_its_row_and_the_line_it_is_on(tmp_path):
    """A blank line (which pandas skips) puts row 2 on line 4: both are named."""
    text = GOOD.replace("\n2020-01-03,AAA,10.5,11.5,10,11", "\n\n2020-01-03,AAA,10.5,11.5,ten,11")
    assert ("column 'low', row 2: expected a number, got 'ten' (line 4 of the file; rows counted from 1 at the line "
            "after the header)") in error_for(tmp_path, text)


def test_a_byte_order_mark_left_on_the_first_name_by_another_reader_is_dropped(tmp_path, monkeypatch):
    """pandas' C parser drops the mark itself (the test above passed before the fix too); a reader that keeps it on
    the first column's name gave the issue's "missing column 'date'"."""
    read_csv = pd.read_csv

    def keeping_the_mark(path, **options):
        frame = read_csv(path, **options)
        return frame.rename(columns={frame.columns[0]: "\ufeff" + frame.columns[0]})

    monkeypatch.setattr(pd, "read_csv", keeping_the_mark)
    assert load_file(write(tmp_path, GOOD), Data()).tickers == ["AAA", "BBB"]


def test_parquet_and_renamed_columns(tmp_path):
    frame = pd.read_csv(pd.io.common.StringIO(GOOD)).rename(columns={"high": "High", "date": "Day"})
    path = tmp_path / "prices.parquet"
    frame.to_parquet(path)
    config = Data.model_validate({"columns": {"high": "High", "date": "Day"}})
    assert len(load_file(path, config).frame) == 5


def test_missing_ticker_column_uses_the_file_name(tmp_path):
    text = "\n".join(line.split(",", 2)[0] + "," + line.split(",", 2)[2] for line in GOOD.splitlines()[:4])
    panel = load_file(write(tmp_path, text), Data())
    assert panel.tickers == ["prices"]


def test_missing_high_column(tmp_path):
    text = GOOD.replace("high", "hi")
    assert "missing column 'high'" in error_for(tmp_path, text)


def test_non_numeric_value_names_column_and_row(tmp_path):
    message = error_for(tmp_path, GOOD.replace("10.5,11.5,10,11", "10.5,11.5,ten,11"))
    assert "column 'low', row 2" in message and "'ten'" in message


def test_unparsable_date(tmp_path):
    assert "column 'date', row 3" in error_for(tmp_path, GOOD.replace("2020-01-06", "someday"))


def test_duplicated_date(tmp_path):
    message = error_for(tmp_path, GOOD.replace("2020-01-06", "2020-01-03"))
    assert "row 3" in message and "appears twice" in message and "AAA" in message


def test_unsorted_dates(tmp_path):
    message = error_for(tmp_path, GOOD.replace("2020-01-03,AAA", "2020-01-07,AAA"))
    assert "row 3" in message and "not sorted" in message


def test_non_positive_price(tmp_path):
    assert "column 'close', row 1: prices must be positive" in error_for(tmp_path, GOOD.replace("10.5,100", "0,100", 1))


def test_high_below_low(tmp_path):
    assert "row 1: high 8.0 is below low 9.0" in error_for(tmp_path, GOOD.replace(",11,9,", ",8,9,", 1))


def test_short_gaps_are_filled_and_counted(tmp_path, caplog):
    caplog.set_level("INFO")
    panel = load_file(write(tmp_path, GOOD.replace("10.5,11.5,10,11,", "10.5,,,,")), Data())
    row = panel.frame.iloc[1]
    assert (row["high"], row["low"], row["close"]) == (11, 9, 10.5)
    assert "forward-filled 1 rows" in caplog.text and panel.filled_rows == 1


def test_long_gaps_and_leading_gaps_are_errors(tmp_path):
    message = error_for(tmp_path, GOOD.replace("10.5,11.5,10,11,", "10.5,,,,"), Data(max_fill_gap=0))
    assert "row 2" in message and "max_fill_gap" in message
    assert "row 1" in error_for(tmp_path, GOOD.replace("10,11,9,10.5,", "10,,,,"))


def test_unknown_format(tmp_path):
    with pytest.raises(UserError, match="expected a .csv or .parquet"):
        load_file(write(tmp_path, GOOD, "prices.xlsx"), Data())


def test_file_source_without_a_path():
    with pytest.raises(UserError, match="needs --data"):
        load_panel(Data(source="file"))


def test_arch_data_is_the_real_sp500_and_nasdaq():
    panel = load_arch(["sp500", "nasdaq"])
    frame = panel.frame
    assert panel.tickers == ["sp500", "nasdaq"]
    assert frame["date"].min() == pd.Timestamp("1999-01-04") and frame["date"].max() == pd.Timestamp("2018-12-31")
    assert (frame["high"] >= frame["low"]).all()


def test_synthetic_panel_is_seeded_consistent_and_carries_its_variance():
    config = Synthetic(tickers=3, days=2000, seed=5)
    first, second = synthetic_panel(config), synthetic_panel(config)
    assert first.sha256 == second.sha256
    frame = first.frame
    assert len(frame) == 6000
    assert ((frame["high"] >= frame[["open", "close"]].max(axis=1))
            & (frame["low"] <= frame[["open", "close"]].min(axis=1))).all()
    features = add_features(frame).dropna(subset=["rv_m", "target"])
    correlation = np.corrcoef(np.log(features["rv_m"]), np.log(features["target"]))[0, 1]
    assert correlation > 0.3, "the Parkinson variance must be predictable from its own past"
    assert synthetic_panel(Synthetic(tickers=3, days=2000, seed=6)).sha256 != first.sha256


def test_the_synthetic_overnight_gap_hides_its_share_of_the_variance_from_the_range():
    def ratios(overnight: float) -> tuple[float, float, pd.DataFrame]:
        frame = synthetic_panel(Synthetic(tickers=4, days=3000, seed=2, overnight=overnight)).frame
        features = add_features(frame)
        truth = features["true_variance"].mean()
        return features["sq_ret"].mean() / truth, features["parkinson"].mean() / truth, frame

    returns_gapped, range_gapped, frame = ratios(0.4)
    returns_closed, range_closed, closed = ratios(0.0)
    assert returns_gapped == pytest.approx(1.0, abs=0.1) and returns_closed == pytest.approx(1.0, abs=0.1), \
        "returns keep the GJR-t variance"
    assert range_gapped / range_closed == pytest.approx(0.6, abs=0.05), "the range sees 1 - 0.4 of it"
    assert 0.7 < range_closed < 0.85, "less the 32-step path's discretisation"
    gap = 100 * np.log(frame["open"] / frame.groupby("ticker")["close"].shift(1))
    assert (gap**2).mean() / frame["true_variance"].mean() == pytest.approx(0.4, abs=0.06)
    assert np.allclose(closed["open"].iloc[1:3000], closed["close"].iloc[:2999]), "no gap: each day opens at the close"


def test_exogenous_series_join_by_date_without_look_ahead():
    from arch.data import wti

    frame = pd.DataFrame({"date": pd.to_datetime(["2011-01-03", "2011-01-01", "2030-01-02"]), "ticker": "A"})
    joined = attach_exogenous(frame, ["wti", "vix"])
    oil = wti.load().iloc[:, 0]
    assert list(joined["date"]) == sorted(frame["date"])
    assert joined.loc[joined["date"] == "2011-01-03", "wti"].item() == oil.loc["2011-01-03"]
    assert joined.loc[joined["date"] == "2011-01-01", "wti"].item() == oil.loc["2010-12-31"], "the last value before"
    assert joined.loc[joined["date"] == "2030-01-02", "wti"].isna().all(), "stale values are not carried on"
    assert joined["vix"].isna().all(), "arch's VIX starts in 2014"


def test_exogenous_columns_reach_the_panel_and_its_source():
    panel = load_panel(Data(source="synthetic", exogenous=["wti"], synthetic=Synthetic(tickers=1, days=300)))
    assert panel.source.endswith("+wti") and panel.frame["wti"].notna().mean() > 0.9


def test_infinite_value(tmp_path):
    assert "column 'close', row 2: expected a number, got 'inf'" in error_for(tmp_path, GOOD.replace(",11,100", ",inf,100", 1))


def test_header_only(tmp_path):
    assert "no data rows" in error_for(tmp_path, GOOD.splitlines()[0] + "\n")


def test_close_outside_the_day_range(tmp_path):
    assert "row 1: close 12.0 is outside [low, high] = [9.0, 11.0]" in error_for(
        tmp_path, GOOD.replace("10,11,9,10.5", "10,11,9,12", 1))


def date_major(days: int = 5, tickers=("AAA", "BBB", "CCC")) -> list[str]:
    """The usual long format: every ticker on a day, then the next day."""
    dates = pd.bdate_range("2020-01-02", periods=days)
    return [f"{day.date()},{ticker},10,11,9,10.5,100" for day in dates for ticker in tickers]


@pytest.mark.parametrize(("row", "change", "message"), [
    (7, lambda line: line.replace(",11,9,", ",8,9,"), "row 7: high 8.0 is below low 9.0"),
    (8, lambda line: line.replace(",10,11,9,10.5,", ",0,11,9,10.5,"), "column 'open', row 8: prices must be positive"),
    (9, lambda line: line.replace(",10.5,100", ",12,100"), "row 9: close 12.0 is outside"),
])
def test_a_date_major_file_names_the_row_of_the_file_itself(tmp_path, row, change, message):
    """Rows are counted in the user's file (1 is the first line after the header), not in the ticker-sorted frame."""
    lines = date_major()
    lines[row - 1] = change(lines[row - 1])
    assert message in error_for(tmp_path, "date,ticker,open,high,low,close,volume\n" + "\n".join(lines) + "\n")


def test_a_date_major_file_names_the_row_of_a_repeated_date_and_of_a_gap(tmp_path):
    header = "date,ticker,open,high,low,close,volume\n"
    lines = date_major()
    lines[10] = lines[7]  # row 11 repeats row 8 (day 3 of BBB)
    message = error_for(tmp_path, header + "\n".join(lines) + "\n")
    assert "row 11" in message and "appears twice" in message
    lines = date_major()
    for index in (4, 7, 10, 13):  # BBB has no prices on days 2 to 5 (rows 5, 8, 11, 14): one more than is filled
        lines[index] = lines[index].replace(",10,11,9,10.5,", ",,,,,")
    assert "row 5: 4 consecutive rows" in error_for(tmp_path, header + "\n".join(lines) + "\n")


def test_a_parquet_file_with_a_saved_index_is_counted_by_its_rows(tmp_path):
    lines = date_major()
    lines[6] = lines[6].replace(",11,9,", ",8,9,")
    frame = pd.read_csv(io.StringIO("date,ticker,open,high,low,close,volume\n" + "\n".join(lines)))
    frame.index = range(100, 100 + len(frame))
    frame.to_parquet(tmp_path / "prices.parquet")
    with pytest.raises(UserError, match="row 7: high 8.0 is below low 9.0"):
        load_file(tmp_path / "prices.parquet", Data(source="file"))


def test_the_synthetic_panel_is_drawn_with_numpy_even_where_cupy_has_a_gpu(monkeypatch):
    """One seed, one panel and one data_sha256 on every device: a GPU's generator would draw other numbers."""
    import sys
    import types

    config = Synthetic(tickers=2, days=300, seed=3)
    expected = synthetic_panel(config)
    gpu_cupy = types.ModuleType("cupy")
    gpu_cupy.is_available = lambda: True
    gpu_cupy.random = types.SimpleNamespace(RandomState=lambda seed: pytest.fail("drew from CuPy's generator"))
    monkeypatch.setitem(sys.modules, "cupy", gpu_cupy)
    panel = synthetic_panel(config)
    assert panel.sha256 == expected.sha256
    pd.testing.assert_frame_equal(panel.frame, expected.frame)


def finance_config(preset: str):
    return load_config(finance.Config, finance.USECASE.presets_dir, preset, [])


def test_data_bytes_of_the_arch_series_are_the_files_arch_ships_and_samples_the_feature_rows():
    from arch.data import nasdaq, sp500

    prepared, tags = load_data(finance_config("default"), None)
    shipped = [path for module in (sp500, nasdaq) for path in Path(module.__file__).parent.glob("*.csv*")]
    assert tags["data_bytes"] == sum(path.stat().st_size for path in shipped) > 0
    assert tags["data_samples"] == len(prepared.frame) > 2 * 4000  # two series of 1999-2018 trading days


def test_data_bytes_of_a_user_file_is_its_size_and_of_the_synthetic_panel_its_frame(tmp_path):
    prepared, tags = load_data(finance_config("smoke"), None)
    assert tags["data_bytes"] == prepared.panel.frame.memory_usage(deep=True).sum()
    assert tags["data_samples"] == len(prepared.frame) == 3 * (1200 - 1)  # each ticker's first day has no return
    path = tmp_path / "prices.csv"
    prepared.panel.frame.drop(columns="true_variance").to_csv(path, index=False)
    prepared, tags = load_data(finance_config("smoke"), path)
    assert tags["data_bytes"] == path.stat().st_size and tags["data_samples"] == len(prepared.frame)
