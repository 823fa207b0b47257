"""Errors in one line: what a report, a skipped-file list or a wrapped error shows of a failure.

torch, pickle, zip and transformers errors often carry several lines, and some carry none
(`EOFError()`); taking `str(error).splitlines()[0]` by hand raised an `IndexError` of its own on
the empty ones. Imports nothing heavy.
"""

from __future__ import annotations

__all__ = ["first_line", "type_and_first_line"]


def first_line(error: BaseException) -> str:
    """The first non-blank line of the error's message; its class name when the message is empty."""
    for line in str(error).strip().splitlines():
        if line.strip():
            return line.strip()
    return type(error).__name__


def type_and_first_line(error: BaseException) -> str:
    """`"ClassName: first line"` (just the class name when the message is empty)."""
    line = first_line(error)
    name = type(error).__name__
    return name if line == name else f"{name}: {line}"
