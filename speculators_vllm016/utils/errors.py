"""The package's error base, and errors in one line.

`SpeculatorsError` is the base of every error the package raises for its user (a wrong flag,
setting or file, a run that cannot go on): the commands print those as one line, while any other
exception (a bug) keeps its traceback. Each subclass also keeps the built-in type the same failure
had before (and in 0.3.0), so an existing `except ValueError` still catches it.

torch, pickle, zip and transformers errors often carry several lines, and some carry none
(`EOFError()`); taking `str(error).splitlines()[0]` by hand raised an `IndexError` of its own on
the empty ones. Imports nothing heavy.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = [
    "InvalidInputError",
    "RunFailedError",
    "RunStopped",
    "SpeculatorsError",
    "UnsupportedError",
    "library_refusals_as_ours",
    "first_line",
    "type_and_first_line",
]


class SpeculatorsError(Exception):
    """A failure the package explains to its user in one line (no traceback needed)."""


class InvalidInputError(SpeculatorsError, ValueError):
    """An argument, flag, setting or input file is wrong; the message says which and why."""


class RunFailedError(SpeculatorsError, RuntimeError):
    """A run cannot go on (an engine, a worker, a process it needs failed); the message says what
    to do."""


class RunStopped(SpeculatorsError, RuntimeError):
    """The run stopped on a signal (SIGTERM, a first Ctrl-C) where the same command resumes it.

    The command prints `stopped: <message>` and ends with `exit_status`: 128 + the signal's number,
    as a shell reports a process the signal ended (143 after SIGTERM, 130 after Ctrl-C).
    """

    def __init__(self, message: str, signum: int = signal.SIGTERM) -> None:
        super().__init__(message)
        self.exit_status = 128 + int(signum)


class UnsupportedError(SpeculatorsError, NotImplementedError):
    """The request is valid but this package does not do it (a model kind, a decoding mode)."""


@contextmanager
def library_refusals_as_ours() -> Iterator[None]:
    """Around a call where another library (vLLM starting an engine) checks settings the user
    gave: its `ValueError`/`RuntimeError` becomes ours, same message, so the command prints it as
    one line. Elsewhere such errors are bugs and keep their traceback."""
    try:
        yield
    except SpeculatorsError:
        raise
    except ValueError as error:
        raise InvalidInputError(str(error)) from error
    except RuntimeError as error:
        raise RunFailedError(str(error)) from error


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
