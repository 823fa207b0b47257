"""How every command reports a failure it expects; defined in `utils.command_errors` (the demo,
above the CLI, reports errors the same way)."""

from speculators_vllm016.utils.command_errors import (
    DEBUG_HINT,
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_STOPPED,
    EXPECTED_ERRORS,
    describe_error,
    error_line,
    report_errors,
)

__all__ = [
    "DEBUG_HINT",
    "EXIT_ERROR",
    "EXIT_INTERRUPTED",
    "EXIT_STOPPED",
    "EXPECTED_ERRORS",
    "describe_error",
    "error_line",
    "report_errors",
]
