"""The one JSONL reader (``core.io``): located errors, blank lines, objects only, the caller's error type."""

from __future__ import annotations

import pytest

from composer_plugins.core.errors import ConfigError
from composer_plugins.core.io import iter_jsonl, read_jsonl


def test_rows_and_line_numbers_count_blank_lines(tmp_path):
    p = tmp_path / "rows.jsonl"
    p.write_text('{"a": 1}\n\n  \n{"a": 2}\n')
    assert list(iter_jsonl(p)) == [(1, {"a": 1}), (4, {"a": 2})]
    assert read_jsonl(str(p)) == [{"a": 1}, {"a": 2}]


def test_bad_json_names_file_line_and_column(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"a": 1}\n\n{"a": }\n')
    with pytest.raises(ConfigError, match=rf"^{p}:3: invalid JSON at column 7: Expecting value"):
        read_jsonl(p)


def test_objects_only_unless_asked(tmp_path):
    p = tmp_path / "list.jsonl"
    p.write_text('{"a": 1}\n[1, 2]\n')
    with pytest.raises(ConfigError, match=r"list.jsonl:2: each line must be a JSON object, got list"):
        read_jsonl(p)
    assert read_jsonl(p, objects=False) == [{"a": 1}, [1, 2]]


def test_lines_with_a_name_and_the_callers_error_type(tmp_path):
    class MyError(Exception):
        def __init__(self, file, line, message):
            super().__init__(f"{file}@{line}: {message}")

    with pytest.raises(MyError, match=r"^mem.jsonl@2: invalid JSON"):
        read_jsonl(['{"a": 1}', "{oops"], "mem.jsonl", error=MyError)
    with pytest.raises(MyError, match=r"missing.jsonl@None: cannot read JSONL file"):
        read_jsonl(tmp_path / "missing.jsonl", error=MyError)
