"""`one_line`: how a library's reason is quoted inside a one-line `UserError`."""
from common.errors import one_line


def test_the_first_line_is_kept_and_the_rest_dropped():
    assert one_line(ValueError("  Error tokenizing data\nC error: Expected 3 fields\n")) == "Error tokenizing data"


def test_a_long_line_is_cut_to_the_limit_and_says_so():
    quoted = one_line(OSError("x" * 500), limit=40)
    assert len(quoted) == 40 and quoted.endswith("...")
    assert one_line(OSError("y" * 120)) == "y" * 120


def test_an_empty_message_falls_back_to_the_type_name():
    assert one_line(KeyboardInterrupt()) == "KeyboardInterrupt"
    assert one_line(ValueError(" \n ")) == "ValueError"
