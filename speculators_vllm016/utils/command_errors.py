"""How every command (the CLI's and the demo's) reports a failure it expects: one line on
stderr and an exit status.

`--debug` re-raises instead, for the traceback. Imports nothing heavy (no vLLM, no torch; pydantic
is loaded by every command anyway).
"""

from __future__ import annotations

import errno
import sys
from collections.abc import Callable

from pydantic import ValidationError

from speculators_vllm016.utils.errors import RunStopped, SpeculatorsError, first_line

__all__ = [
    "DEBUG_HINT",
    "EXPECTED_ERRORS",
    "describe_error",
    "error_line",
    "report_errors",
    "validation_line",
]

# The package's own errors; the file system's (a missing file, a full disk, no permission);
# pydantic's, which 0.3.0's configs raise for a value that does not validate (`--algorithm-kwargs`).
# Any other exception is a bug: it keeps its traceback.
EXPECTED_ERRORS: tuple[type[BaseException], ...] = (SpeculatorsError, OSError, ValidationError)
EXIT_ERROR = 2
EXIT_INTERRUPTED = 130  # Ctrl-C
EXIT_STOPPED = 143  # stopped by a signal (SIGTERM, a first Ctrl-C) after saving what resumes it
DEBUG_HINT = "(--debug shows the traceback)"


def error_line(message: str) -> str:
    """The line every command prints for a mistake or an expected failure: one wording, one
    ending, whichever command (and parser: argparse, typer, a job file) found it."""
    return f"error: {message} {DEBUG_HINT}"


def describe_error(error: BaseException) -> str:
    """One line for an expected failure."""
    if isinstance(error, OSError) and error.errno == errno.ENOSPC:
        where = f" writing {error.filename}" if error.filename else ""
        return f"the disk is full{where}; free space or choose another place, then run again"
    if isinstance(error, OSError) and error.errno in (errno.EACCES, errno.EROFS, errno.EPERM):
        return f"permission denied: {error.filename or error}; choose a writable place"
    validation = _validation_error_in(error)
    if validation is not None:
        return validation_line(validation)
    if "Original Traceback" in str(error):
        # A DataLoader worker's error arrives wrapped with the worker's traceback; the original
        # message is its last line.
        return str(error).strip().splitlines()[-1]
    return first_line(error)


def _validation_error_in(error: BaseException) -> ValidationError | None:
    """The pydantic error itself, or the one another error wraps (`library_refusals_as_ours`
    turns vLLM's into ours, keeping it as the cause)."""
    if isinstance(error, ValidationError):
        return error
    cause = error.__cause__
    return cause if isinstance(cause, ValidationError) else None


def validation_line(error: ValidationError) -> str:
    """Pydantic's message on one line: its first line ("1 validation error for ModelConfig")
    says only that something is wrong, the lines under it say what; each finding's field (where
    it names one) and message are kept, joined by "; "."""
    findings = []
    for finding in error.errors(include_url=False):
        where = ".".join(str(part) for part in finding.get("loc", ()))
        message = " ".join(str(finding.get("msg", "")).split())
        findings.append(f"{where}: {message}" if where else message)
    return f"{error.title}: {'; '.join(findings)}" if findings else first_line(error)


def report_errors(
    run: Callable[[], int],
    debug: bool,
    expected: tuple[type[BaseException], ...] = EXPECTED_ERRORS,
    stopped: tuple[type[BaseException], ...] = (),
) -> int:
    """Run; an `expected` failure becomes one line on stderr and exit status 2.

    `stopped` (and every `RunStopped`) are the exceptions of a run that stopped on request
    after saving its state ("stopped: why", status 143, or the `exit_status` the exception
    carries); Ctrl-C that nothing caught gives 130.
    """
    try:
        return run()
    except KeyboardInterrupt:
        print(
            "stopped: Ctrl-C: stopped at once; run the same command again to resume",
            file=sys.stderr,
        )
        return EXIT_INTERRUPTED
    except (RunStopped, *stopped) as stop:
        print(f"stopped: {stop}", file=sys.stderr)
        return getattr(stop, "exit_status", EXIT_STOPPED)
    except expected as error:
        if debug:
            raise
        print(error_line(describe_error(error)), file=sys.stderr)
        # An error that lists several findings (each a line of `details`) prints them all.
        for line in getattr(error, "details", None) or ():
            print(f"  {line}", file=sys.stderr)
        return EXIT_ERROR
