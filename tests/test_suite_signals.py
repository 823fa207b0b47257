"""The suite's own guarantee (tests/conftest.py): every test starts with Python's Ctrl-C and
SIGTERM handlers, however pytest itself was started, so the Ctrl-C tests test the trainer."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_a_test_starts_with_pythons_own_ctrl_c_and_sigterm_handlers():
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_a_test_gets_them_when_pytest_was_started_with_ctrl_c_ignored():
    """A script's background job (`pytest &`, as CI wrappers start the suite) starts with SIGINT
    ignored; the shell's `trap "" INT` does the same here, and exec keeps it ignored."""
    first = f"{Path(__file__).relative_to(REPO)}::test_a_test_starts_with_pythons_own_ctrl_c_and_sigterm_handlers"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", first]
    started = subprocess.run(
        ["sh", "-c", 'trap "" INT; exec "$@"', "sh", *command],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert started.returncode == 0, started.stdout[-3000:] + started.stderr[-3000:]
    assert "1 passed" in started.stdout
