"""One-line summaries of errors (pure logic)."""

from __future__ import annotations

import pytest

from speculators_vllm016.utils.errors import first_line, type_and_first_line


@pytest.mark.parametrize(
    ("error", "line", "typed"),
    [
        (ValueError("bad value\nmore detail"), "bad value", "ValueError: bad value"),
        (
            RuntimeError("\n\n  Error(s) in loading:\n\tsize mismatch"),
            "Error(s) in loading:",
            "RuntimeError: Error(s) in loading:",
        ),
        (EOFError(), "EOFError", "EOFError"),
        (OSError("   \n  "), "OSError", "OSError"),
    ],
)
def test_one_line_of_any_message(error: BaseException, line: str, typed: str) -> None:
    assert first_line(error) == line
    assert type_and_first_line(error) == typed
