"""SIGTERM and Ctrl-C: the first asks for a checkpoint, a second Ctrl-C stops at once."""

from __future__ import annotations

import os
import signal
import time

import pytest

from speculators_vllm016.train.graceful_shutdown import GracefulShutdown


def test_a_second_ctrl_c_stops_at_once_and_loader_processes_ignore_the_signals():
    """In-process: the first SIGINT asks for a checkpoint, the second raises KeyboardInterrupt;
    in a forked loader process (another pid) the handler leaves the flag alone."""
    shutdown = GracefulShutdown()
    replaced = shutdown.install()
    try:
        assert set(replaced) == {signal.SIGTERM, signal.SIGINT}
        shutdown.handler_pid = -1  # as a loader process sees it
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        assert not shutdown.requested
        shutdown.handler_pid = os.getpid()
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
        assert shutdown.requested and shutdown.reason == "Ctrl-C"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.5)
    finally:
        shutdown.restore(replaced)


def test_disabled_handlers_leave_the_signals_alone():
    before = signal.getsignal(signal.SIGTERM)
    shutdown = GracefulShutdown()
    with shutdown.installed(enabled=False):
        assert signal.getsignal(signal.SIGTERM) is before
    with shutdown.installed():
        assert signal.getsignal(signal.SIGTERM) == shutdown.on_signal
    assert signal.getsignal(signal.SIGTERM) is before
