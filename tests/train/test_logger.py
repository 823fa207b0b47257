"""Console logging of `speculators train` when the command runs in-process."""

from __future__ import annotations

import io
import logging
import sys

from speculators_vllm016.train.logger import setup_root_logger


def test_console_logging_follows_stderr_after_the_caller_swapped_it(monkeypatch) -> None:
    """A caller (a test's capture, a notebook) set sys.stderr, ran `train`, then closed its
    stream: later records go to the current stderr instead of a 'Logging error' traceback."""
    first, second = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    root = logging.getLogger()
    before = (list(root.handlers), root.level)
    try:
        setup_root_logger("INFO")
        first.close()
        monkeypatch.setattr(sys, "stderr", second)
        logging.getLogger("speculators_vllm016.test").info("after the swap")
    finally:
        root.handlers[:] = before[0]
        root.setLevel(before[1])
    assert "after the swap" in second.getvalue() and "Logging error" not in second.getvalue()
