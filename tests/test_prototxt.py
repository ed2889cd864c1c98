"""The text-format reader's limits: deep nesting is a clear error, not a RecursionError."""

from __future__ import annotations

import pytest

from jfleet.training.prototxt import MAX_DEPTH, PrototxtError, parse


def test_deep_nesting_is_a_clear_error_naming_the_line():
    text = "\n".join(f"a{i} {{" for i in range(3000)) + "\n" + "}\n" * 3000
    with pytest.raises(PrototxtError, match=rf"line {MAX_DEPTH + 1}: blocks nested more than"):
        parse(text)


def test_nesting_up_to_the_limit_reads():
    text = "a { " * MAX_DEPTH + "x: 1 " + "} " * MAX_DEPTH
    entry = parse(text)[0]
    for _ in range(MAX_DEPTH - 1):
        entry = entry.value[0]
    assert entry.value[0].value.text == "1"
