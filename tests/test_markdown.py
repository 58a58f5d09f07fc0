"""qdq.markdown: the one Markdown table writer (hand-written expected tables)."""

import pytest

from qdq.errors import QdqConfigError
from qdq.markdown import escape_markdown, markdown_table


def test_columns_are_padded_and_none_is_a_dash():
    table = markdown_table(["model", "ms"], [["resnet18", 1.5], ["x", None]])
    assert table.splitlines() == [
        "| model    | ms  |",
        "| -------- | --- |",
        "| resnet18 | 1.5 |",
        "| x        | —   |",
    ]


def test_pipes_and_line_breaks_are_escaped_names_kept_as_written():
    table = markdown_table(["a|b"], [["conv_1\nweight"]])
    assert table.splitlines() == ["| a\\|b          |", "| ------------- |", "| conv_1 weight |"]


def test_escape_all_escapes_markdown_specials():
    table = markdown_table(["layer"], [["blocks.0._q<1>"]], escape_all=True)
    assert table.splitlines()[2] == r"| blocks.0.\_q\<1\> |"
    assert escape_markdown("*a* | #b") == r"\*a\* \| \#b"


def test_a_row_of_the_wrong_length_is_a_config_error():
    with pytest.raises(QdqConfigError, match="2 cells but the header has 1"):
        markdown_table(["only"], [["a", "b"]])
