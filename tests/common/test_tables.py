"""The table reader every use case reads a user's file with: encodings, byte-order marks, Parquet, and one line
naming the file, the first bad row (with its line) and the column."""

import codecs
import gzip

import pandas as pd
import pytest

from common.errors import UserError
from common.tables import Rows, read_csv_text, read_numbers, read_table, require_columns

TEXT = "date,price\n2020-01-02,1.5\n2020-01-03,2.5\n2020-01-06,3.5\n2020-01-07,4.5\n2020-01-08,5.5\n"
EXPECTED = "a .csv or .parquet table"


def written(tmp_path, content: bytes, name: str = "table.csv"):
    path = tmp_path / name
    path.write_bytes(content)
    return path


def one_line(call) -> str:
    with pytest.raises(UserError) as caught:
        call()
    message = str(caught.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(("encode", "name"), [
    pytest.param(lambda text: codecs.BOM_UTF8 + text.encode(), "table.csv", id="utf-8-with-bom"),
    pytest.param(lambda text: text.encode("utf-16"), "table.csv", id="utf-16-with-bom"),
    pytest.param(lambda text: codecs.BOM_UTF16_BE + text.encode("utf-16-be"), "table.csv", id="utf-16-big-endian"),
    pytest.param(lambda text: gzip.compress(codecs.BOM_UTF8 + text.replace("\n", "\r\n").encode()), "table.csv.gz",
                 id="gzip-bom-crlf"),
])
def test_a_text_in_any_known_encoding_reads_as_plain_utf8_does(tmp_path, encode, name):
    """A byte-order mark never sticks to the first column's name ('\\ufeffdate' would be a missing 'date')."""
    expected = read_table(written(tmp_path, TEXT.encode(), "plain.csv"), EXPECTED, dtype=str).frame
    table = read_table(written(tmp_path, encode(TEXT), name), EXPECTED, dtype=str)
    assert list(table.frame.columns) == ["date", "price"]
    pd.testing.assert_frame_equal(table.frame, expected)


def test_a_byte_order_mark_that_a_reader_leaves_on_the_first_name_is_dropped(tmp_path, monkeypatch):
    """pandas drops the mark itself; whatever reads the file in its place must not leave '\\ufeffdate'."""
    read_csv = pd.read_csv
    monkeypatch.setattr(pd, "read_csv", lambda source, **options: read_csv(source, **options).rename(
        columns=lambda name: "\ufeff" + name if name == "date" else name))
    assert list(read_table(written(tmp_path, codecs.BOM_UTF8 + TEXT.encode()), EXPECTED).frame.columns) == [
        "date", "price"]


def test_a_parquet_file_reads_with_its_rows_counted_from_1(tmp_path):
    frame = pd.read_csv(pd.io.common.StringIO(TEXT))
    frame.index = range(100, 105)  # a saved index is no column, and does not number the rows
    frame.to_parquet(tmp_path / "table.parquet")
    table = read_table(tmp_path / "table.parquet", EXPECTED)
    pd.testing.assert_frame_equal(table.frame, frame.reset_index(drop=True))
    bad = table.frame["price"] > 3
    message = str(table.rows.at("price", table.frame["price"], bad, "too high: {value}"))
    assert message.endswith("table.parquet: column 'price', row 3: too high: 3.5 (rows counted from 1)")


def test_the_first_bad_row_is_named_with_its_column_value_and_line(tmp_path):
    """Row 3 of 5 is line 4: the header is line 1."""
    path = written(tmp_path, TEXT.replace("3.5", "three").replace("4.5", "four").encode())
    table = read_table(path, EXPECTED, dtype=str)
    message = one_line(lambda: read_numbers(table.frame["price"], table.rows, "price"))
    assert message == (f"{path}: column 'price', row 3: expected a number, got 'three' (line 4 of the file; rows "
                       "counted from 1 at the line after the header)")


def test_the_line_counts_blank_lines_and_line_breaks_in_quoted_values(tmp_path):
    """pandas skips a blank line and reads a quoted value over two lines as one row: the row is no longer its
    line less one."""
    text = 'name,price\n"two\nlines",1\n\n   \nx,inf\n'
    table = read_table(written(tmp_path, text.encode("utf-16")), EXPECTED, dtype=str)
    assert len(table.frame) == 2
    message = one_line(lambda: read_numbers(table.frame["price"], table.rows, "price"))
    assert "column 'price', row 2: expected a number, got 'inf' (line 6 of the file;" in message


def test_a_part_of_a_file_names_the_row_of_the_whole_file(tmp_path):
    path = written(tmp_path, TEXT.encode())
    rows = Rows(path, first=3)
    assert "row 5: late (line 6 of the file;" in str(rows.error(1, "late"))


def test_a_missing_column_is_named_with_the_columns_the_file_has(tmp_path):
    table = read_table(written(tmp_path, TEXT.encode()), EXPECTED)
    message = one_line(lambda: require_columns(table.frame, table.rows.path, ["date", "ticker", "close"], "prices"))
    assert message.endswith("table.csv: missing columns 'ticker', 'close' (prices; found: 'date', 'price')")
    require_columns(table.frame, table.rows.path, ["price"], "prices")


@pytest.mark.parametrize(("content", "expected"), [
    (bytes(range(256)) * 4, "not UTF-8 text, nor UTF-16 with a byte-order mark (byte 0x00 at position 0)"),
    ("date,name\n2020-01-02,Société\n".encode("latin-1"),
     "not UTF-8 text, nor UTF-16 with a byte-order mark (byte 0xe9 at position 25)"),
    (b"PK\x03\x04rest of a workbook", "this is a zip archive or an Excel workbook (export it as CSV)"),
    (gzip.compress(TEXT.encode()), "this is gzip-compressed (name it .csv.gz)"),
    (b"PAR1\x00\x00", "this is a Parquet file (name it .parquet)"),
], ids=["binary", "latin-1", "workbook", "gzip", "parquet"])
def test_a_file_that_is_no_text_is_one_line_naming_it(tmp_path, content, expected):
    path = written(tmp_path, content)
    assert one_line(lambda: read_table(path, EXPECTED)).startswith(f"{path}: {expected}")


def test_a_byte_that_is_no_utf8_beyond_the_sniffed_start_is_one_line_too(tmp_path):
    path = written(tmp_path, TEXT.encode() + b"2020-01-09,1" * 10_000 + "\n2020-02-01,é\n".encode("latin-1"))
    assert "table.csv: not UTF-8 text, nor UTF-16 with a byte-order mark (byte 0xe9)" in one_line(
        lambda: read_table(path, EXPECTED))


@pytest.mark.parametrize(("name", "content", "expected"), [
    ("table.csv", b"", "empty file (no header line, no data rows); expected a comma-separated file with a header"),
    ("table.csv", b"date;price\n2020-01-02;1\n", "one column 'date;price', its fields separated by ';'"),
    ("table.tsv", b"date,price\n2020-01-02,1\n", "one column 'date,price', its fields separated by ','; expected tab"),
    ("table.csv", b"date,price\n1,2\n3,4,5\n", "Expected 2 fields in line 3, saw 3; line 1 is the header"),
    ("table.csv", b"date\n1,2\n3,4\n", "the rows hold more values than the header names columns"),
    ("table.csv.gz", TEXT.encode(), "cannot be read as a table (Not a gzipped file"),
    ("table.json", b"{}", f"expected {EXPECTED}"),
    ("table.parquet", b"not parquet", "cannot be read as Parquet ("),
])
def test_a_file_that_is_no_table_of_its_kind_is_one_line_naming_it(tmp_path, name, content, expected):
    path = written(tmp_path, content, name)
    message = one_line(lambda: read_table(path, EXPECTED))
    assert message.startswith(f"{path}: ") and expected in message


def test_a_part_read_on_its_own_counts_the_parsers_lines_on(tmp_path):
    path = tmp_path / "table.csv"
    message = one_line(lambda: read_csv_text(pd.io.common.BytesIO(b"a,b\n1,2\n3,4,5\n"), ",", path, first_line=100))
    assert "line 103" in message


def test_a_column_of_another_type_is_one_line_for_the_whole_column(tmp_path):
    rows = Rows(tmp_path / "table.parquet", header=False)
    message = one_line(lambda: read_numbers(pd.Series([True, False]), rows, "volume", "volumes"))
    assert message == f"{tmp_path / 'table.parquet'}: column 'volume': expected volumes, got true/false (bool) values"
